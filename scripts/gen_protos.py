"""Regenerate the committed gRPC stubs from protos/ (run after editing a .proto)."""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTO = "infemeral/v1/infemeral.proto"
OUT_DIR = ROOT / "infemeral" / "protocol" / "generated"
STUBS = ("infemeral_pb2.py", "infemeral_pb2.pyi", "infemeral_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    """Write the stubs into out_dir, with imports made package-relative."""
    with tempfile.TemporaryDirectory() as tmp:
        include = Path(protoc.__file__).parent / "_proto"
        rc = protoc.main([
            "grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}",
            f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", PROTO,
        ])
        if rc != 0:
            raise SystemExit(f"protoc failed with exit code {rc}")
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in STUBS:
            text = (Path(tmp) / "infemeral" / "v1" / name).read_text()
            text = re.sub(r"^from infemeral\.v1 import", "from . import", text, flags=re.M)
            (out_dir / name).write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed stubs are stale")
    args = parser.parse_args()
    if not args.check:
        generate(OUT_DIR)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = [n for n in STUBS if (Path(tmp) / n).read_text() != (OUT_DIR / n).read_text()]
    if stale:
        print("stale generated stubs: " + ", ".join(stale) + "; run scripts/gen_protos.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`make demo`: prepare the default bundles (once), start a real server on localhost,
stream a real answer through it with the real CLI, report speed, stop the server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from infemeral.client.health import wait_until_serving

ROOT = Path(__file__).resolve().parent.parent
BUNDLES = ROOT / ".bundles" / "default"
QUESTION = os.environ.get("DEMO_QUESTION", "What are three good reasons to learn to cook at home?")
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    if not (BUNDLES / "server" / "manifest.json").exists() or not (BUNDLES / "client" / "manifest.json").exists():
        print("==> preparing the default model bundles (once; cached in .bundles/)", flush=True)
        subprocess.run([BIN / "infemeral-client", "prepare", "--output", BUNDLES], check=True)
    else:
        print(f"==> using cached bundles in {BUNDLES.relative_to(ROOT)}", flush=True)

    port = free_port()
    address = f"127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="infemeral-demo-store-") as store:
        env = dict(os.environ, INFEMERAL_BUNDLE=str(BUNDLES / "server"), INFEMERAL_STORE=store,
                   INFEMERAL_LISTEN=address, INFEMERAL_METRICS_PORT="0")
        print(f"==> starting infemeral-server on {address}", flush=True)
        server = subprocess.Popen([BIN / "infemeral-server", "--log-level", "WARNING"], env=env)
        try:
            wait_until_serving(address, server, timeout=180)
            print(f"==> infemeral-client generate {QUESTION!r}\n", flush=True)
            rc = subprocess.run([BIN / "infemeral-client", "generate", QUESTION, "--server", address,
                                 "--client-bundle", BUNDLES / "client", "--max-new-tokens", "160", "--verbose"],
                                env=env).returncode
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=30)
        print(f"\n==> server stopped (exit code {server.returncode})")
    return rc


if __name__ == "__main__":
    sys.exit(main())

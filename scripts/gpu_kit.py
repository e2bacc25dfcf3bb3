"""Build a wheel kit for a GPU machine without network: what infemeral's server imports and a CUDA PyTorch
image lacks, as wheels for its Python, with FlashInfer repacked small enough to carry.

    python scripts/gpu_kit.py                      # writes .gpukit/ (ignored by git), for Python 3.12
    python scripts/gpu_kit.py --python-version 3.11 --out /some/dir

Run it where pip reaches PyPI; carry the folder (with the checkout) to the GPU machine and there:

    sh .gpukit/install.sh /tmp/site && export PYTHONPATH=/tmp/site:$PWD
    python scripts/gpu_env.py                      # the preflight: exit 0 when ready

The image is taken to hold IMAGE (torch among them, a CUDA build: the kit never carries torch) and nvcc.
grpcio and protobuf are carried all the same: the generated gRPC stubs refuse to import under versions older
than they were made with, and the image's are not known in advance. FlashInfer's wheel is a zip of sources and
headers it compiles at first use, which xz packs several times tighter than the zip. The kit must stay within
LIMIT_BYTES so that it travels with the working tree in one call to such a machine.
"""

from __future__ import annotations

import argparse
import email.parser
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / ".gpukit"
LIMIT_BYTES = 45 * 2**20
# one version of each, within pyproject.toml's ranges (tests/project/test_gpu_kit.py); build() checks that they
# satisfy one another's requirements
PINS = {
    "cryptography": "50.0.2",          # the KV cache's AES-256-GCM
    "cffi": "2.1.1",                   # cryptography's _cffi_backend
    "pydantic": "2.14.4",              # server settings and flags
    "pydantic-core": "2.50.5",
    "pydantic-settings": "2.16.3",
    "python-dotenv": "1.2.4",
    "annotated-types": "0.8.0",
    "typing-inspection": "0.4.5",
    "typing-extensions": "4.16.0",     # pydantic-core needs a newer one than torch does
    "grpcio": "1.85.3",
    "protobuf": "7.36.2",
    "grpcio-health-checking": "1.85.1",
    "grpcio-reflection": "1.85.1",
    "flashinfer-python": "0.7.2.post1",  # the paged-attention kernels (pyproject's `cuda` extra)
    "apache-tvm-ffi": "0.1.15.post2",    # FlashInfer's kernel loader
    "gguf": "0.19.0",                  # reading the packaged model (the lease's speculation stage, head training)
}
REPACK = {"flashinfer-python"}  # carried as the wheel's files in a .tar.xz
# what the kit's packages and the server need from the image
IMAGE = {"torch", "transformers", "safetensors", "tokenizers", "numpy", "jinja2", "tqdm", "prometheus-client",
         "packaging", "filelock", "requests", "pyyaml", "click", "einops", "tabulate", "ninja", "nvidia-ml-py"}
# requirements of the kit's packages that the server never imports: cffi's parser (cryptography's bindings are
# compiled) and FlashInfer's for kernels other than its paged attention
NOT_NEEDED = {"pycparser", "cuda-python", "cuda-tile", "nccl-extensions", "nccl4py", "nvidia-cudnn-frontend",
              "nvidia-cutlass-dsl"}
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64")
INSTALL = """#!/bin/sh
# Install this kit into a folder for PYTHONPATH, without network:
#   sh install.sh [FOLDER, default /tmp/site] && export PYTHONPATH=FOLDER:$PYTHONPATH
# Made by infemeral's scripts/gpu_kit.py for Python {python_version}; the Python that runs is $PYTHON or python3.
set -eu
kit=$(cd "$(dirname "$0")" && pwd)
site=${{1:-/tmp/site}}
python=${{PYTHON:-python3}}
"$python" -c 'import sys; sys.exit(sys.version_info[:2] != ({major}, {minor}))' || {{
    echo "install.sh: this kit holds wheels for Python {python_version}, not $("$python" -V 2>&1); build one for it:" \\
         "python scripts/gpu_kit.py --python-version X.Y" >&2
    exit 2
}}
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$kit"/*.whl
for archive in "$kit"/*.tar.xz; do  # with Python's tarfile: no xz binary needed
    "$python" - "$archive" "$site" <<'UNPACK'
import sys, tarfile
safe = {{"filter": "data"}} if hasattr(tarfile, "data_filter") else {{}}
tarfile.open(sys.argv[1]).extractall(sys.argv[2], **safe)
UNPACK
done
echo "installed into $site: export PYTHONPATH=$site\\${{PYTHONPATH:+:\\$PYTHONPATH}}"
"""


def say(msg: str) -> None:
    print(msg, flush=True)


def download(specs: list[str], dest: Path, python_version: str) -> None:
    """Exactly these wheels for CPython `python_version` on x86-64 Linux, none of their dependencies."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", python_version, "--implementation", "cp",
               *(arg for p in PLATFORMS for arg in ("--platform", p)), "-d", str(dest), *specs]
    if subprocess.run(command).returncode != 0:
        raise SystemExit(f"gpu_kit: pip could not download {' '.join(specs)} (command: {shlex.join(command)})")


def repack(wheel: Path, archive: Path) -> None:
    """The wheel's files as a .tar.xz that unpacks into site-packages as pip would install them (no .pyc);
    files grouped by extension, which packs the headers and sources tighter."""
    partial = archive.with_name(archive.name + ".partial")
    with zipfile.ZipFile(wheel) as zf, tarfile.open(partial, "w:xz", preset=6) as tar:
        for info in sorted(zf.infolist(), key=lambda i: (Path(i.filename).suffix, i.filename)):
            if info.is_dir():
                continue
            member = tarfile.TarInfo(info.filename)
            member.size, member.mtime = info.file_size, time.mktime(info.date_time + (0, 0, -1))
            member.mode = (info.external_attr >> 16) & 0o777 or 0o644
            with zf.open(info) as data:
                tar.addfile(member, data)
    partial.replace(archive)


def metadata(package: Path) -> str:
    """The METADATA of a wheel, or of a wheel repacked by repack() (where it comes early: no suffix)."""
    if package.name.endswith(".whl"):
        with zipfile.ZipFile(package) as zf:
            return zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    with tarfile.open(package, "r|xz") as tar:
        for member in tar:
            if member.name.endswith(".dist-info/METADATA"):
                return tar.extractfile(member).read().decode()
    raise ValueError(f"{package} holds no .dist-info/METADATA")


def unmet_requirements(metadata_by_package: dict[str, str], python_version: str) -> list[str]:
    """What the kit's packages require, on the GPU machine, that neither the pins satisfy nor IMAGE holds
    (NOT_NEEDED aside): a line for each."""
    environment = {"python_version": python_version, "python_full_version": f"{python_version}.0",
                   "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
                   "os_name": "posix", "implementation_name": "cpython", "platform_python_implementation": "CPython",
                   "extra": ""}
    pins = {canonicalize_name(n): v for n, v in PINS.items()}
    unmet = []
    for package, text in metadata_by_package.items():
        for line in email.parser.Parser().parsestr(text).get_all("Requires-Dist") or []:
            requirement = Requirement(line)
            if requirement.marker and not requirement.marker.evaluate(environment):
                continue
            name = canonicalize_name(requirement.name)
            if name in pins:
                if not requirement.specifier.contains(pins[name], prereleases=True):
                    unmet.append(f"{package} requires {requirement}, the kit pins {name}=={pins[name]}")
            elif name not in IMAGE and name not in NOT_NEEDED:
                unmet.append(f"{package} requires {requirement}, which neither the kit nor the image has: "
                             "pin it in PINS, or say why it is not needed (NOT_NEEDED)")
    return unmet


def wheel_key(path: Path) -> tuple[str, str]:
    name, version, _, _ = parse_wheel_filename(path.name)
    return canonicalize_name(name), str(version)


def archive_name(name: str, version: str) -> str:
    return f"{canonicalize_name(name)}-{version}.tar.xz"


def build(out: Path, python_version: str) -> list[Path]:
    """Download and repack into `out`, leaving nothing else there that the install would pick up; returns the
    kit's files. An archive already built for its pinned version is kept (repacking takes minutes)."""
    out.mkdir(parents=True, exist_ok=True)
    wanted = sorted((canonicalize_name(n), v) for n, v in PINS.items() if n not in REPACK)
    archives = {name: out / archive_name(name, PINS[name]) for name in REPACK}
    with tempfile.TemporaryDirectory(prefix="infemeral-gpukit-") as tmp:
        download([f"{n}=={v}" for n, v in PINS.items() if n not in REPACK], Path(tmp), python_version)
        found = sorted(wheel_key(w) for w in Path(tmp).glob("*.whl"))
        if found != wanted:
            raise SystemExit(f"gpu_kit: pip brought {found}, expected one wheel of each of {wanted}")
        for old in [*out.glob("*.whl"), *out.glob("*.partial"),
                    *(a for a in out.glob("*.tar.xz") if a not in archives.values())]:
            old.unlink()  # another version or another Python's: two versions of a package stop the install
        for wheel in Path(tmp).glob("*.whl"):
            shutil.move(wheel, out / wheel.name)
    for name, archive in sorted(archives.items()):
        if archive.exists():
            say(f"gpu_kit: {archive.name} already built")
            continue
        with tempfile.TemporaryDirectory(prefix="infemeral-gpukit-") as tmp:
            download([f"{name}=={PINS[name]}"], Path(tmp), python_version)
            (wheel,) = Path(tmp).glob("*.whl")
            say(f"gpu_kit: repacking {wheel.name} ({wheel.stat().st_size / 2**20:.1f} MiB) as {archive.name} "
                "(minutes)")
            started = time.perf_counter()
            repack(wheel, archive)
            say(f"gpu_kit: {archive.stat().st_size / 2**20:.1f} MiB in {time.perf_counter() - started:.0f} s")
    files = sorted(out.glob("*.whl")) + sorted(archives.values())
    unmet = unmet_requirements({f.name: metadata(f) for f in files}, python_version)
    if unmet:
        raise SystemExit("gpu_kit: the pins do not hold together:\n  " + "\n  ".join(unmet))
    return files + [write_install_script(out, python_version)]


def write_install_script(out: Path, python_version: str) -> Path:
    major, minor = python_version.split(".")
    script = out / "install.sh"
    script.write_text(INSTALL.format(python_version=python_version, major=int(major), minor=int(minor)))
    script.chmod(0o755)
    return script


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the kit's folder (default {DEFAULT_OUT})")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    args = parser.parse_args(argv)
    files = build(args.out, args.python_version)
    total = sum(f.stat().st_size for f in files)
    for f in files:
        say(f"  {f.stat().st_size / 2**20:7.2f} MiB  {f.name}")
    say(f"gpu_kit: {len(files)} files, {total / 2**20:.1f} MiB in {args.out} (limit {LIMIT_BYTES / 2**20:.0f} MiB)")
    if total > LIMIT_BYTES:
        say(f"gpu_kit: the kit is {total / 2**20:.1f} MiB, over its {LIMIT_BYTES / 2**20:.0f} MiB: with the working "
            "tree it would not travel in one call to a GPU machine; carry fewer packages or pack them tighter")
        return 1
    say(f"on the GPU machine, in the checkout that holds {args.out.name}/: sh {args.out.name}/install.sh /tmp/site "
        "&& export PYTHONPATH=/tmp/site:$PWD")
    return 0


if __name__ == "__main__":
    sys.exit(main())

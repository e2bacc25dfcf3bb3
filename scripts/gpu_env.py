"""Preflight of a GPU machine: can it serve infemeral's layers, and with which attention backend?

    python scripts/gpu_env.py

Prints Python, torch, CUDA, driver, GPU, nvcc and FlashInfer versions, how long each import takes (on a
short lease every second of them counts), and whether grpcio and protobuf are as new as the generated gRPC
code in infemeral/protocol/generated demands. Nothing compiles here: FlashInfer builds its kernels at first
use, which scripts/gpu_check.py does.

Exit status: 0 ready; 2 no usable CUDA torch; 3 CUDA works but FlashInfer does not (serve with
`--attention-backend torch`); 4 CUDA works but a package the server imports is missing or too old.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

READY, NO_CUDA, NO_FLASHINFER, SERVER_PACKAGES = 0, 2, 3, 4
GENERATED = ROOT / "infemeral" / "protocol" / "generated"
# (distribution, module the server imports); the last two are the server itself (with the generated gRPC code,
# which checks grpcio's and protobuf's versions as it loads) and its command line
SERVER_IMPORTS = (
    ("transformers", "transformers"),
    ("safetensors", "safetensors.torch"),
    ("grpcio", "grpc"),
    ("protobuf", "google.protobuf"),
    ("grpcio-health-checking", "grpc_health.v1.health"),
    ("grpcio-reflection", "grpc_reflection.v1alpha.reflection"),
    ("cryptography", "cryptography.hazmat.primitives.ciphers.aead"),
    ("pydantic", "pydantic"),
    ("pydantic-settings", "pydantic_settings"),
    ("prometheus-client", "prometheus_client"),
    ("jinja2", "jinja2"),
    ("infemeral", "infemeral.server.app"),
    ("infemeral", "infemeral.server.main"),
)


@dataclass
class Import:
    """One module's import: how long it took (on a lease, time is the budget) and what it found."""
    module: str
    seconds: float
    version: str | None = None
    error: str | None = None
    already_loaded: bool = False

    def line(self) -> str:
        took = "already imported" if self.already_loaded else f"{self.seconds:5.2f} s"
        found = f"FAILED: {self.error}" if self.error else (self.version or "")
        return f"  import {self.module:44s} {took:>16s}  {found}"


@dataclass
class Environment:
    """What report() found. `status` is the exit status of main(); `problems` are lines that say what is wrong
    and how to fix it, `notes` lines worth reading that change nothing."""
    status: int
    python: str
    torch: str | None = None
    torch_cuda: str | None = None  # the CUDA version torch was built for
    driver: str | None = None
    gpus: list[str] = field(default_factory=list)
    nvcc: str | None = None
    flashinfer: str | None = None
    kernel_cache: str | None = None
    imports: list[Import] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return self.status == READY

    def summary(self) -> str:
        """One line: the GPU and the versions that decide the CUDA path."""
        gpus = "; ".join(self.gpus) or "no GPU"
        return (f"{gpus}, driver {self.driver or '?'}, torch {self.torch or '-'} (CUDA {self.torch_cuda or '-'}), "
                f"nvcc {self.nvcc or '-'}, flashinfer {self.flashinfer or '-'}, "
                f"kernel cache {self.kernel_cache or '-'}")

    def lines(self) -> list[str]:
        verdict = {READY: "ready: FlashInfer and the server's packages import (gpu_check.py proves the kernels)",
                   NO_CUDA: "NOT READY: no usable CUDA torch",
                   NO_FLASHINFER: "CUDA works, FlashInfer does not: serve with `--attention-backend torch`",
                   SERVER_PACKAGES: "NOT READY: a package the server imports is missing or too old"}[self.status]
        out = [f"gpu_env: Python {self.python}, {self.summary()}"]
        out += [i.line() for i in self.imports]
        out += [f"note: {n}" for n in self.notes]
        out += [f"problem: {p}" for p in self.problems]
        out.append(f"gpu_env: {verdict} (exit {self.status})")
        return out


def timed_import(module: str, distribution: str | None = None) -> tuple[object | None, Import]:
    """Import `module`, timing it; the version is the distribution's where it has one."""
    loaded = module in sys.modules
    start = time.perf_counter()
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - an import that fails is what this reports
        return None, Import(module, time.perf_counter() - start, error=f"{type(e).__name__}: {e}",
                            already_loaded=loaded)
    seconds = time.perf_counter() - start
    version = getattr(mod, "__version__", None)
    if distribution:
        try:
            version = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            pass
    return mod, Import(module, seconds, str(version) if version else None, already_loaded=loaded)


# -- grpcio and protobuf against the generated code -----------------------------------------------------
def generated_versions(directory: Path = GENERATED) -> dict[str, str]:
    """The oldest grpcio and protobuf the generated stubs accept: they refuse to import under older ones."""
    pb2 = (directory / "infemeral_pb2.py").read_text()
    grpc_stub = (directory / "infemeral_pb2_grpc.py").read_text()
    protobuf = re.search(r"ValidateProtobufRuntimeVersion\(\s*[\w.]+,\s*(\d+),\s*(\d+),\s*(\d+),\s*'([^']*)'", pb2)
    grpcio = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", grpc_stub)
    if not (protobuf and grpcio):
        raise ValueError(f"cannot read the versions the stubs in {directory} check; regenerate them with "
                         "scripts/gen_protos.py")
    return {"grpcio": grpcio.group(1), "protobuf": ".".join(protobuf.group(1, 2, 3)) + protobuf.group(4)}


def version_tuple(version: str) -> tuple[int, ...]:
    """Release numbers of a version string ('1.85.1' -> (1, 85, 1); '7.35.1rc2' -> (7, 35, 1)), compared the
    way both checks compare them: number by number."""
    match = re.match(r"\d+(\.\d+)*", version.strip())
    if not match:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(x) for x in match.group(0).split("."))


def protocol_problems(installed: dict[str, str | None], required: dict[str, str]) -> list[str]:
    """A line for each of grpcio and protobuf that is missing or older than the generated code accepts."""
    problems = []
    for name, needed in required.items():
        have = installed.get(name)
        if have is None:
            problems.append(f"{name} is not installed; the server needs {name}>={needed} "
                            f"(`pip install '{name}>={needed}'`)")
        elif version_tuple(have) < version_tuple(needed):
            problems.append(f"{name} {have} is older than the generated gRPC code accepts ({name}>={needed}): "
                            f"`pip install '{name}>={needed}'`, or regenerate the stubs with an older grpcio-tools "
                            "(scripts/gen_protos.py)")
    return problems


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


# -- the machine --------------------------------------------------------------------------------------
def run_quietly(command: list[str], timeout: float = 30) -> str | None:
    """A command's output, or None when it is absent or fails."""
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def driver_version() -> str | None:
    out = run_quietly(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out and out.strip() else None


def find_nvcc() -> str | None:
    """nvcc where FlashInfer looks for it: $CUDA_HOME (or $CUDA_PATH), then PATH, then /usr/local/cuda."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [Path(home) / "bin" / "nvcc"] if home else []
    on_path = shutil.which("nvcc")
    candidates += [Path(on_path)] if on_path else []
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    return next((str(c) for c in candidates if c.is_file()), None)


def nvcc_version(nvcc: str) -> str | None:
    out = run_quietly([nvcc, "--version"])
    match = re.search(r"release ([\d.]+)", out or "")
    return match.group(1) if match else None


def cuda_probe(torch) -> str | None:
    """None when a bfloat16 matmul runs on the first GPU, else why not (an error a user can act on)."""
    if torch.version.cuda is None:
        return (f"torch sees no CUDA device (torch {torch.__version__} is a build without CUDA). Run this on the "
                "GPU pod, with a CUDA build of torch: see README, \"Deploying on RunPod\".")
    if not torch.cuda.is_available():
        return (f"torch sees no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda}): "
                "check nvidia-smi, the driver (it must support that CUDA version) and CUDA_VISIBLE_DEVICES; "
                "see README, \"Deploying on RunPod\".")
    try:
        a = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
        (a @ a).sum().item()
    except Exception as e:  # noqa: BLE001 - why CUDA is not usable, reported
        return f"CUDA is visible but a bfloat16 matmul failed on it ({type(e).__name__}: {e})"
    return None


def flashinfer_problems(env: Environment) -> list[str]:
    """FlashInfer imports and can compile its kernels (nvcc and ninja present); fills env's fields."""
    module, imported = timed_import("flashinfer", "flashinfer-python")
    env.imports.append(imported)
    if module is None:
        return [f"FlashInfer is not importable ({imported.error}): install it with `pip install 'infemeral[cuda]'` "
                "(the Docker image has it; a machine without network: scripts/gpu_kit.py)"]
    env.flashinfer = imported.version
    base = os.environ.get("FLASHINFER_WORKSPACE_BASE", str(Path.home()))
    env.kernel_cache = str(Path(base) / ".cache" / "flashinfer")
    nvcc = find_nvcc()
    env.nvcc = nvcc_version(nvcc) if nvcc else None
    problems = []
    if nvcc is None:
        problems.append("nvcc not found ($CUDA_HOME/bin, PATH, /usr/local/cuda/bin): FlashInfer compiles its "
                        "kernels at first use; use a CUDA `devel` image or set CUDA_HOME")
    if shutil.which("ninja") is None:
        problems.append("ninja is not on PATH: FlashInfer builds its kernels with it (`pip install ninja`)")
    if env.nvcc and env.torch_cuda and version_tuple(env.nvcc)[0] != version_tuple(env.torch_cuda)[0]:
        env.notes.append(f"nvcc {env.nvcc} and torch built for CUDA {env.torch_cuda}: kernels compiled by one "
                         "major CUDA version may not load under the other")
    return problems


def report() -> Environment:
    """Look at this machine; main() prints the result. Imports torch (and the server) into this process."""
    env = Environment(status=READY, python=platform.python_version())
    torch, imported = timed_import("torch")
    env.imports.append(imported)
    if torch is None:
        env.problems.append(f"torch is not importable ({imported.error}): install a CUDA build of torch")
        env.status = NO_CUDA
        return env
    env.torch, env.torch_cuda = torch.__version__, torch.version.cuda
    start = time.perf_counter()
    failure = cuda_probe(torch)
    if failure:
        env.problems.append(failure)
        env.status = NO_CUDA
        return env
    env.notes.append(f"CUDA's first use (context and a matmul) took {time.perf_counter() - start:.2f} s")
    env.driver = driver_version()
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        env.gpus.append(f"{p.name} ({p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor})")
    attention = flashinfer_problems(env)
    required = generated_versions()
    server = protocol_problems({name: installed_version(name) for name in required}, required)
    for distribution, module in SERVER_IMPORTS:
        mod, imported = timed_import(module, distribution)
        env.imports.append(imported)
        if mod is None:
            fix = (f"`pip install {distribution}`" if distribution != "infemeral"
                   else "`pip install -e .` in the checkout")
            server.append(f"the server cannot import {module} ({imported.error}): {fix} (a machine without network: "
                          "scripts/gpu_kit.py)")
    env.problems += server + attention
    env.status = SERVER_PACKAGES if server else NO_FLASHINFER if attention else READY
    return env


def main(argv: list[str] | None = None) -> int:
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    env = report()
    for line in env.lines():
        print(line, flush=True)
    return env.status


if __name__ == "__main__":
    sys.exit(main())

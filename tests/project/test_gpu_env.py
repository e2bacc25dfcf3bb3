"""scripts/gpu_env.py, the GPU machine's preflight: what it says without CUDA and, on a made-up CUDA torch,
without FlashInfer; grpcio/protobuf against the versions the generated gRPC code accepts (pyproject.toml's
floors included)."""

from __future__ import annotations

import sys
import tomllib

import pytest
import torch
from packaging.requirements import Requirement

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))

import gpu_env  # noqa: E402


def older(version: str) -> str:
    """A release just below `version` (one less in its last non-zero number)."""
    numbers = list(gpu_env.version_tuple(version))
    last = max(i for i, n in enumerate(numbers) if n)
    numbers[last] -= 1
    return ".".join(map(str, numbers))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: run scripts/gpu_env.py itself")
def test_without_cuda_it_exits_2_and_says_why(capsys):
    assert gpu_env.main([]) == gpu_env.NO_CUDA == 2
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"gpu_env: Python {sys.version.split()[0]}, no GPU")
    assert any(line.split()[:2] == ["import", "torch"] and torch.__version__ in line for line in lines)
    problem = next(line for line in lines if line.startswith("problem: "))
    assert "no CUDA device" in problem and "RunPod" in problem
    assert lines[-1] == "gpu_env: NOT READY: no usable CUDA torch (exit 2)"


def test_generated_versions_are_the_ones_the_stubs_check(tmp_path):
    from infemeral.protocol.generated import infemeral_pb2_grpc

    versions = gpu_env.generated_versions()
    assert versions["grpcio"] == infemeral_pb2_grpc.GRPC_GENERATED_VERSION
    header = (gpu_env.GENERATED / "infemeral_pb2.py").read_text()
    assert f"# Protobuf Python Version: {versions['protobuf']}\n" in header
    # the same reading of other stubs: another version in each
    for name in ("infemeral_pb2.py", "infemeral_pb2_grpc.py"):
        text = (gpu_env.GENERATED / name).read_text()
        text = text.replace(versions["grpcio"], "1.2.3").replace(
            ",\n    " + ",\n    ".join(versions["protobuf"].split(".")) + ",\n", ",\n    4,\n    5,\n    6,\n")
        (tmp_path / name).write_text(text)
    assert gpu_env.generated_versions(tmp_path) == {"grpcio": "1.2.3", "protobuf": "4.5.6"}


def test_old_or_missing_grpcio_and_protobuf_are_reported():
    required = gpu_env.generated_versions()
    old = {name: older(v) for name, v in required.items()}
    problems = gpu_env.protocol_problems(old, required)
    assert len(problems) == 2
    for problem, (name, needed) in zip(problems, required.items()):
        assert problem.startswith(f"{name} {old[name]} is older than the generated gRPC code accepts")
        assert f"pip install '{name}>={needed}'" in problem
    assert gpu_env.protocol_problems(required, required) == []
    # compared number by number, not as text: 1.100 is newer than 1.85
    newer = {name: f"{gpu_env.version_tuple(v)[0]}.100.0" for name, v in required.items()}
    assert gpu_env.protocol_problems(newer, required) == []
    missing = gpu_env.protocol_problems({"grpcio": None, "protobuf": required["protobuf"]}, required)
    assert len(missing) == 1 and missing[0].startswith("grpcio is not installed")


def test_pyproject_floors_are_what_the_generated_code_accepts():
    """pip must not install a grpcio or protobuf that the committed stubs refuse at import."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = {r.name: r for r in map(Requirement, project["dependencies"])}
    for name, needed in gpu_env.generated_versions().items():
        floors = [s.version for s in requirements[name].specifier if s.operator in (">=", "==", "~=")]
        assert floors, f"pyproject.toml gives {name} no lower bound"
        assert gpu_env.version_tuple(max(floors, key=gpu_env.version_tuple)) >= gpu_env.version_tuple(needed), (
            f"pyproject.toml allows {requirements[name]}, the generated code needs {name}>={needed}")


def fake_cuda_torch():
    """torch as a CUDA machine shows it: one GPU, a CUDA build; its tensors are this machine's."""
    from types import SimpleNamespace

    props = SimpleNamespace(name="Fake GPU", total_memory=80 * 2**30, major=9, minor=0)
    cuda = SimpleNamespace(is_available=lambda: True, device_count=lambda: 1, get_device_properties=lambda i: props)
    return SimpleNamespace(__version__="2.11.0+cu130", version=SimpleNamespace(cuda="13.0"), cuda=cuda,
                           bfloat16=torch.bfloat16, ones=lambda *shape, device, dtype: torch.ones(*shape, dtype=dtype))


@pytest.fixture
def on_a_cuda_machine(monkeypatch):
    real = gpu_env.timed_import

    def timed_import(module, distribution=None):
        if module == "torch":
            return fake_cuda_torch(), gpu_env.Import("torch", 0.5, "2.11.0+cu130")
        if module == "flashinfer":  # absent here; made absent wherever the test runs
            return None, gpu_env.Import("flashinfer", 0.1, error="ModuleNotFoundError: No module named 'flashinfer'")
        return real(module, distribution)

    monkeypatch.setattr(gpu_env, "timed_import", timed_import)
    monkeypatch.setattr(gpu_env, "driver_version", lambda: "580.1")


def test_cuda_without_flashinfer_exits_3_and_says_serve_with_torch(on_a_cuda_machine, capsys):
    assert gpu_env.main([]) == gpu_env.NO_FLASHINFER == 3
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (f"gpu_env: Python {sys.version.split()[0]}, Fake GPU (80 GiB, sm_90), driver 580.1, torch "
                        "2.11.0+cu130 (CUDA 13.0), nvcc -, flashinfer -, kernel cache -")
    imported = [line.split()[1] for line in lines if line.startswith("  import ")]
    assert imported == ["torch", "flashinfer"] + [module for _, module in gpu_env.SERVER_IMPORTS]
    assert [line for line in lines if line.startswith("problem: ")] == [
        "problem: FlashInfer is not importable (ModuleNotFoundError: No module named 'flashinfer'): install it with "
        "`pip install 'infemeral[cuda]'` (the Docker image has it; a machine without network: scripts/gpu_kit.py)"]
    assert lines[-1] == "gpu_env: CUDA works, FlashInfer does not: serve with `--attention-backend torch` (exit 3)"


def test_an_old_grpcio_outranks_a_missing_flashinfer(on_a_cuda_machine, monkeypatch):
    needed = gpu_env.generated_versions()["grpcio"]
    real = gpu_env.installed_version
    monkeypatch.setattr(gpu_env, "installed_version", lambda name: older(needed) if name == "grpcio" else real(name))
    env = gpu_env.report()
    assert env.status == gpu_env.SERVER_PACKAGES == 4 and not env.ready
    assert env.problems[0].startswith(f"grpcio {older(needed)} is older than the generated gRPC code accepts")
    assert env.problems[-1].startswith("FlashInfer is not importable")

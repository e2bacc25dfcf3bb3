"""scripts/gpu_env.py, the GPU machine's preflight: what it says without CUDA, and grpcio/protobuf against the
versions the generated gRPC code accepts (pyproject.toml's floors included)."""

from __future__ import annotations

import sys
import tomllib

import pytest
import torch
from packaging.requirements import Requirement

from conftest import REPO

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

"""scripts/gpu_kit.py, the wheel kit for a GPU machine without network: its pins, its requirement check, the
repacked archive and the install script (on tiny made-up packages; the real kit is built by hand)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tomllib
import zipfile

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))

import gpu_kit  # noqa: E402

PYTHON_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


def tiny_wheel(directory, name="tiny", version="1.0", requires=()):
    """A wheel pip installs: a package with an executable file, and its dist-info."""
    dist = f"{name}-{version}.dist-info"
    path = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}/__init__.py", f"VERSION = {version!r}\n")
        tool = zipfile.ZipInfo(f"{name}/data/tool.sh")
        tool.external_attr = 0o755 << 16
        zf.writestr(tool, "#!/bin/sh\necho tool\n")
        zf.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                    + "".join(f"Requires-Dist: {r}\n" for r in requires))
        zf.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}/RECORD", "")
    return path


def test_pins_are_within_pyproject_and_leave_torch_to_the_image():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    declared = {}
    for requirement in map(Requirement, lines):
        declared.setdefault(canonicalize_name(requirement.name), []).append(requirement.specifier)
    for name, version in gpu_kit.PINS.items():
        for specifier in declared.get(canonicalize_name(name), []):
            assert specifier.contains(version, prereleases=True), f"kit pins {name}=={version}, pyproject: {specifier}"
    assert "torch" not in gpu_kit.PINS and "torch" in gpu_kit.IMAGE
    assert gpu_kit.REPACK <= set(gpu_kit.PINS)
    assert {"cryptography", "pydantic", "pydantic-settings", "grpcio-health-checking", "flashinfer-python"} <= set(
        gpu_kit.PINS), "packages the server imports that the image lacks"


def test_unmet_requirements_name_a_wrong_pin_and_a_package_nobody_carries():
    pinned = gpu_kit.PINS["pydantic-core"]
    metadata = {"a.whl": "Metadata-Version: 2.1\nName: a\nVersion: 1\n"
                f"Requires-Dist: pydantic-core=={pinned}\n"
                f"Requires-Dist: grpcio!={gpu_kit.PINS['grpcio']}\n"           # the pin is wrong
                "Requires-Dist: torch\n"                                          # the image's
                "Requires-Dist: pycparser; implementation_name != 'PyPy'\n"      # not needed
                "Requires-Dist: left-behind>=1\n"                                 # nobody has it
                "Requires-Dist: rich>=13; extra == 'b12x'\n"                      # an extra not asked for
                "Requires-Dist: other-for-old-pythons; python_version < '3.0'\n"}
    unmet = gpu_kit.unmet_requirements(metadata, "3.12")
    assert len(unmet) == 2, unmet
    assert unmet[0].startswith(f"a.whl requires grpcio!={gpu_kit.PINS['grpcio']}, the kit pins grpcio==")
    assert unmet[1].startswith("a.whl requires left-behind>=1, which neither the kit nor the image has")


def test_repacked_archive_unpacks_to_the_wheels_files(tmp_path):
    wheel = tiny_wheel(tmp_path, requires=["numpy"])
    archive = tmp_path / gpu_kit.archive_name("tiny", "1.0")
    gpu_kit.repack(wheel, archive)
    assert not list(tmp_path.glob("*.partial"))
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "out")
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            assert (tmp_path / "out" / name).read_bytes() == zf.read(name)
    assert os.access(tmp_path / "out" / "tiny" / "data" / "tool.sh", os.X_OK)
    assert gpu_kit.metadata(archive) == gpu_kit.metadata(wheel) and "Requires-Dist: numpy" in gpu_kit.metadata(wheel)


def test_install_script_installs_wheels_and_archives_offline(tmp_path):
    kit = tmp_path / "kit"
    kit.mkdir()
    tiny_wheel(kit, "tinywheel")
    gpu_kit.repack(tiny_wheel(tmp_path, "tinyarchive"), kit / gpu_kit.archive_name("tinyarchive", "1.0"))
    script = gpu_kit.write_install_script(kit, PYTHON_VERSION)
    env = {**os.environ, "PYTHON": sys.executable, "PIP_NO_INDEX": "1"}
    out = subprocess.run(["sh", str(script), str(tmp_path / "site")], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"export PYTHONPATH={tmp_path / 'site'}" in out.stdout
    check = subprocess.run([sys.executable, "-c", "import tinywheel, tinyarchive; print(tinyarchive.__file__)"],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert check.stdout.startswith(str(tmp_path / "site")), check.stderr


def test_install_script_refuses_another_python(tmp_path):
    script = gpu_kit.write_install_script(tmp_path, "3.1")
    out = subprocess.run(["sh", str(script), str(tmp_path / "site")], capture_output=True, text=True,
                         env={**os.environ, "PYTHON": sys.executable}, timeout=60)
    assert out.returncode == 2 and "holds wheels for Python 3.1, not Python" in out.stderr
    assert "--python-version" in out.stderr and not (tmp_path / "site").exists()


def test_a_kit_over_its_limit_fails_loudly(tmp_path, monkeypatch, capsys):
    big = tmp_path / "big.whl"
    big.write_bytes(b"x" * 2048)
    monkeypatch.setattr(gpu_kit, "build", lambda out, python_version: [big])
    monkeypatch.setattr(gpu_kit, "LIMIT_BYTES", 1024)
    assert gpu_kit.main(["--out", str(tmp_path)]) == 1
    assert "over its" in capsys.readouterr().out
    monkeypatch.setattr(gpu_kit, "LIMIT_BYTES", 4096)
    assert gpu_kit.main(["--out", str(tmp_path)]) == 0

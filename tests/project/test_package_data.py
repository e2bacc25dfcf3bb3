"""The data files the package reads with importlib.resources ship with it: each is declared as package data (as
setuptools' own build step reads pyproject.toml), so an installed copy has them; and `eval server-quant`'s
default held text is one of them, not a file of the repository's tests."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from setuptools.config.pyprojecttoml import apply_configuration
from setuptools.dist import Distribution

import infemeral
from infemeral.cloak import sources
from infemeral.eval import server_quant, systems
from infemeral.eval.metrics import DEFAULT_TEXT
from infemeral.quant.calibration import conversations

PACKAGE = Path(infemeral.__file__).resolve().parent
REPO = PACKAGE.parent


def shipped_data() -> set[Path]:
    """The non-Python files a wheel built from pyproject.toml holds, by setuptools' build_py (nothing is built)."""
    dist = apply_configuration(Distribution(), REPO / "pyproject.toml")
    dist.include_package_data = False  # only what is declared: a MANIFEST or version control would add the rest
    build_py = dist.get_command_obj("build_py")
    build_py.ensure_finalized()
    return {(REPO / source / name).resolve() for _, source, _, names in build_py.data_files for name in names}


def test_every_data_file_the_package_reads_is_declared():
    data = {p.resolve() for folder in ("data", "static") for p in PACKAGE.rglob(f"{folder}/*")
            if p.is_file() and p.name != "README.md"}
    read_by_the_package = {PACKAGE / "eval" / "data" / "kjv_genesis_37-40.txt",
                           PACKAGE / "quant" / "data" / "calibration.json",
                           PACKAGE / "endpoint" / "static" / "index.html"}  # static/: the chat page's files
    assert read_by_the_package <= data
    missing = sorted(str(p.relative_to(REPO)) for p in data - shipped_data())
    assert not missing, f"not declared in pyproject.toml's [tool.setuptools.package-data]: {missing}"
    assert len(conversations()) > 3  # the calibration text reads back from its data file


def test_eval_server_quant_reads_its_default_text_from_the_package(monkeypatch, tmp_path):
    assert Path(str(DEFAULT_TEXT)).resolve() in shipped_data()
    read = {}
    config = SimpleNamespace(eos_token_id=2)
    bundles = SimpleNamespace(quant=SimpleNamespace(describe=lambda: "int4"),
                              client=SimpleNamespace(bundle=SimpleNamespace(generation_config=lambda: config)))
    monkeypatch.setattr(sources, "load_model", lambda spec, **options: (None, config))
    monkeypatch.setattr(systems, "BundleSplit", lambda *args: bundles)
    monkeypatch.setattr(server_quant, "measure_bundle", lambda reference, candidate, tokenizer, text, *rest:
                        read.setdefault("text", text))
    server_quant.run_bundle(None, tmp_path / "client", tmp_path / "server")  # no text: the default
    assert read["text"] == DEFAULT_TEXT.read_text(encoding="utf-8") and len(read["text"]) > 10_000

"""scripts/gpu_train_head.py in its dry run: every phase on this CPU with a random tiny model, as a borrowed GPU
would run them, so the prepared command cannot rot between draws."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import gpu_train_head  # noqa: E402
from studies.compare_heads import SHAPES  # noqa: E402


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out, work = tmp_path_factory.mktemp("head-out"), tmp_path_factory.mktemp("head-work")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = gpu_train_head.main(["--dry-run", "--out", str(out), "--work", str(work)])
    return status, out, printed.getvalue()


def test_the_dry_run_runs_every_phase_and_reports_each(dry_run):
    status, out, printed = dry_run
    data = json.loads((out / "gpu-train-head.json").read_text())
    assert status == 0 and data["run"]["finished"] and data["run"]["dry_run"]
    assert list(data["phases"]) == [name for name, _ in gpu_train_head.PHASES]
    assert all(p["status"] == "ok" and p["seconds"] >= 0 for p in data["phases"].values()), data["phases"]
    assert data["phases"]["train"]["figures"]["steps"] == gpu_train_head.dry_run_plan().settings.max_steps
    assert data["phases"]["answers"]["figures"]["answer tokens"] > 0
    rows = data["comparison"]  # both heads, both shapes, on the whole comparison set
    assert {(r["head"], r["shape"]) for r in rows} == {(h, s) for h in ("trained here", "float32 copy (dry run)")
                                                       for s, _, _ in SHAPES}
    assert all(r["prompts"] == 20 and 1.0 <= r["tokens_per_round_trip"] <= 6.0 for r in rows)
    assert "| trained here | chain of 5 |" in (out / "gpu-train-head.md").read_text() and "| trained here |" in printed


def test_the_head_comes_back_in_bfloat16_loadable_and_within_a_returned_file(dry_run):
    from safetensors import safe_open

    _, out, _ = dry_run
    with safe_open(str(out / "head" / "model.safetensors"), framework="pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes["fc.weight"] == "BF16" and dtypes["d2t"] == "I64"
    assert json.loads((out / "head" / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(p.stat().st_size <= gpu_train_head.RETURNED_FILE_BYTES for p in (out / "head").iterdir())


def test_a_failed_phase_is_recorded_and_the_run_stops(tmp_path, monkeypatch):
    def broken(*args):
        raise RuntimeError("no answers today")

    phases = tuple((name, broken if name == "answers" else phase) for name, phase in gpu_train_head.PHASES)
    monkeypatch.setattr(gpu_train_head, "PHASES", phases)
    monkeypatch.setattr(gpu_train_head, "tiny_model", lambda: (None, None))
    assert gpu_train_head.main(["--dry-run", "--out", str(tmp_path), "--work", str(tmp_path / "work")]) == 1
    data = json.loads((tmp_path / "gpu-train-head.json").read_text())
    assert list(data["phases"]) == ["load", "answers"] and "no answers today" in data["phases"]["answers"]["error"]
    assert data["run"]["finished"] is None


def test_more_prompts_than_there_are_is_refused_before_anything_loads(capsys):
    from infemeral.speculation.head.prompts import chat_prompts

    with pytest.raises(SystemExit):
        gpu_train_head.parse_args(["--prompts", str(len(chat_prompts()))])
    assert f"there are {len(chat_prompts())}" in capsys.readouterr().err
    assert gpu_train_head.parse_args([]).prompts >= 10 * 512

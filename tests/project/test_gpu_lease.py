"""scripts/gpu_lease.py in its dry run: every stage on this CPU with tiny shapes, as a borrowed GPU would run them.

The GPU run itself needs a lent machine; what CI holds is that the script runs, writes its report as it goes,
survives a stage that raises or hangs, and ends with TARGET lines in the project's format.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import gpu_lease  # noqa: E402

TARGET_LINE = re.compile(r"TARGET gpu [a-z0-9_]+: (PASS|MISS) \(.+\)")


def report(out: Path) -> dict:
    return json.loads((out / "gpu-lease.json").read_text())


def target_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("TARGET ")]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """The whole dry run, once: exit status, report, printed lines."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("lease")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = gpu_lease.main(["--dry-run", "--out", str(out), "--work", str(tmp_path_factory.mktemp("work"))])
    return status, out, printed.getvalue()


def test_dry_run_runs_every_stage_and_skips_only_what_needs_cuda(dry_run):
    status, out, _ = dry_run
    stages = report(out)["stages"]
    assert status == 0
    assert list(stages) == list(gpu_lease.STAGES)
    for name, stage in stages.items():
        assert stage["status"] == "ok", (name, stage["reason"], stage["error"])
    for name in ("attention", "self_check", "exactness", "throughput"):  # the parts that need FlashInfer
        assert "CUDA" in stages[name]["skipped"]["flashinfer"], name
    # each stage measured what it is there for
    assert {row["M"] for row in stages["kernels"]["figures"]["linears"]} == set(gpu_lease.dry_plan().kernel_rows)
    assert all(row["int4 rel err"] < 0.05 for row in stages["kernels"]["figures"]["linears"])
    assert {row["backend"] for row in stages["attention"]["figures"]["cases"]} == {"torch"}
    assert all(c["failure"] == "none" for c in stages["self_check"]["figures"]["checks"])
    for shape in ("default", "8b"):
        assert stages["exactness"]["figures"][shape]["torch"]["batched"]["positions"] > 0
    rates = stages["throughput"]["figures"]["tokens_per_second"]
    assert set(rates) == {"torch", "transformers"} and all(r > 0 for r in rates["transformers"].values())
    assert stages["memory"]["figures"]["memory"]["KV GB per session (measured)"] > 0
    assert stages["e2e"]["figures"]["generation"]["generated"] == gpu_lease.dry_plan().e2e_tokens
    tree_cases = {row["case"] for row in stages["attention"]["figures"]["cases"]} & set(gpu_lease.dry_plan().tree_cases)
    assert tree_cases and stages["attention"]["figures"]["worst with draft trees"]["torch"] < 2e-2
    assert any(c["check"].startswith("attention, draft tree") for c in stages["self_check"]["figures"]["checks"])
    speculation = stages["speculation"]["figures"]
    assert speculation["server verifies draft trees"] and len(speculation["chat"]) == gpu_lease.dry_plan().spec_prompts
    assert all(row["identical"] and row["tokens"] == gpu_lease.dry_plan().spec_tokens for row in speculation["chat"])


def test_dry_run_reports_in_json_markdown_and_target_lines(dry_run):
    status, out, printed = dry_run
    data = report(out)
    assert data["run"]["finished"] and data["run"]["dry_run"]
    lines = target_lines(printed)
    assert lines and all(TARGET_LINE.fullmatch(line) for line in lines), lines
    assert [line.split(":")[0].split()[-1] for line in lines] == list(gpu_lease.goals(gpu_lease.dry_plan()))
    assert [t["verdict"] for t in data["targets"]] == [line.split(": ")[1].split()[0] for line in lines]
    flashinfer = next(line for line in lines if "flashinfer_vs_torch" in line)
    assert "MISS (not measured: flashinfer skipped" in flashinfer  # never a PASS without FlashInfer
    markdown = (out / "gpu-lease.md").read_text()
    for name in gpu_lease.STAGES:
        assert f"| {name} | ok |" in markdown
    assert target_lines(markdown.replace("```", "")) == lines


def test_a_stage_that_raises_or_hangs_is_recorded_and_the_next_stage_runs(tmp_path, capsys):
    """env raises, kernels hangs without looking at its deadline (the watchdog interrupts it), memory still runs."""
    started = time.monotonic()
    status = gpu_lease.main(["--dry-run", "--out", str(tmp_path), "--work", str(tmp_path / "work"), "--stages",
                             "env,kernels,memory", "--budget", "6", "--inject", "raise:env",
                             "--inject", "stall:kernels"])
    took = time.monotonic() - started
    stages = report(tmp_path)["stages"]
    assert status == 1
    assert stages["env"]["status"] == "failed" and "injected" in stages["env"]["reason"]
    assert "RuntimeError" in stages["env"]["error"]
    assert stages["kernels"]["status"] == "overran" and "watchdog" in stages["kernels"]["reason"]
    assert stages["kernels"]["seconds"] < gpu_lease.STALL_SECONDS / 2
    assert stages["memory"]["status"] == "ok"
    assert took < 15
    lines = target_lines(capsys.readouterr().out)
    kernels = next(line for line in lines if "int4_decode_step" in line)
    assert kernels.startswith("TARGET gpu int4_decode_step_8b: MISS (not measured: stage kernels overran")


def test_a_stage_checks_its_deadline_between_steps(tmp_path):
    lease = gpu_lease.Lease(gpu_lease.dry_plan(), ["memory"], 10, tmp_path, tmp_path, {}, [])
    stage = gpu_lease.Stage(lease, lease.results["memory"], time.monotonic() + 60)
    stage.check("a step in time")
    stage.deadline = time.monotonic() - 1
    with pytest.raises(gpu_lease.StageOverrun, match="before the next step"):
        stage.check("the next step")


def test_compiled_kernels_come_back_within_limits_and_install_where_flashinfer_loads_prebuilt_ones(tmp_path,
                                                                                                   monkeypatch):
    """FlashInfer's JIT modules (<jit>/<name>/<name>.so) leave as at most KERNEL_FILES .so.xz files, bfloat16 ones
    first, none too big or oddly named, and install as <aot>/<name>/<name>.so, byte for byte."""
    jit, aot, out = tmp_path / "jit", tmp_path / "aot", tmp_path / "out"
    monkeypatch.setattr(gpu_lease, "flashinfer_dirs", lambda: (jit, aot))
    monkeypatch.setattr(gpu_lease, "KERNEL_FILE_BYTES", 4096)
    names = [f"batch_decode_dtype_q_fp16_head_dim_{d}" for d in (64, 128)] + \
            [f"batch_prefill_dtype_q_bf16_head_dim_{d}_use_swa_{w}" for d in (64, 128) for w in (False, True)] + \
            [f"page_{i}" for i in range(5)] + ["bad name", "too_big_bf16"]
    for name in names:
        (jit / name).mkdir(parents=True)
        size = 200_000 if name == "too_big_bf16" else 3000
        (jit / name / f"{name}.so").write_bytes(bytes(range(256)) * 4 + os.urandom(size))
    found = gpu_lease.collect_kernels(out)
    kept = [k["file"] for k in found["kept"]]
    assert found["built here"] == len(names) and len(kept) == gpu_lease.KERNEL_FILES
    assert [f for f in kept if "bf16" in f] == kept[:4]
    assert all(gpu_lease.SAFE_NAME.fullmatch(f) and f.endswith(".so.xz") for f in kept)
    assert sorted(p.name for p in out.iterdir()) == sorted(kept)
    assert any("too_big_bf16" in why for why in found["left out"]) and any("bad name" in w for w in found["left out"])
    installed = gpu_lease.install_kernels(out)
    assert sorted(installed["installed"]) == sorted(f.removesuffix(".so.xz") for f in kept)
    for name in installed["installed"]:
        assert (aot / name / f"{name}.so").read_bytes() == (jit / name / f"{name}.so").read_bytes()

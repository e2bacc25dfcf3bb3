"""The studies that write docs/ tables (scripts/studies/): each puts its table between its own markers and leaves
the rest of the page alone, so rerunning one never duplicates or clobbers a hand-written page. No model runs."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from infemeral.eval.perplexity import DENSE, SINKS, Result, policies
from infemeral.quant.agreement import Agreement

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from studies import client_precision, perplexity  # noqa: E402


def window_results(ppl_dense: float, ppl_sinks: float) -> dict[str, Result]:
    chosen = policies(64, length=100)
    return {DENSE: Result(DENSE, chosen[DENSE], 99, math.log(ppl_dense), 0, 1.0),
            SINKS: Result(SINKS, chosen[SINKS], 99, math.log(ppl_sinks), 3, 1.0)}


def test_the_window_table_goes_between_its_markers_and_nowhere_else(tmp_path):
    page = tmp_path / "window_perplexity.md"
    page.write_text("# Title\n\nprose before\n\n" + perplexity.TABLE_START + "\nold\n" + perplexity.TABLE_END
                    + "\n\nprose after\n")
    table = perplexity.markdown_table({64: window_results(10.0, 11.0)})
    assert "| 64 | 10.00 | 11.00 (×1.10) |" in table
    for _ in range(2):  # a rerun replaces the block it wrote
        perplexity.write_table(page, table, "settings")
        text = page.read_text()
        assert text.count(perplexity.TABLE_START) == 1 and "old" not in text
        assert text.startswith("# Title\n\nprose before\n\n") and text.endswith("\n\nprose after\n")
        assert f"{perplexity.TABLE_START}\nsettings\n\n{table}\n{perplexity.TABLE_END}" in text


def test_each_client_agreement_block_is_replaced_on_its_own(tmp_path):
    page = tmp_path / "client_agreement.md"
    result = client_precision.ClientComparison("int8", Agreement.from_matches([torch.tensor([True, False, True])]), 0.5, 0.01, 1.0)
    table = client_precision.table([result])
    assert "| int8 | 3 | 0.6667 | 1 | 0.500 | 0.0100 | 1.000 |" in table
    client_precision.write_section(page, "default", "default v1\n\n" + table)
    client_precision.write_section(page, "random-8b", "random v1")
    client_precision.write_section(page, "default", "default v2")
    text = page.read_text()
    assert "default v1" not in text and "default v2" in text and "random v1" in text
    assert text.count(client_precision.MARKER.format("start", "default")) == 1
    assert text.index("default v2") < text.index("random v1")  # the block stays where it was


@pytest.mark.parametrize("study", [perplexity, client_precision])
def test_the_studies_answer_help_without_loading_a_model(study, capsys):
    with pytest.raises(SystemExit) as exit_:
        study.main(["--help"])
    assert exit_.value.code == 0 and "--write" in capsys.readouterr().out

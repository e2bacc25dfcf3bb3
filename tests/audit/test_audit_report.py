"""The audit's printed report fits the terminal it is printed to: cells wrapped into narrower columns, one block
per attack where even those do not fit, and no word of it lost. Built from rows, without a model."""

from __future__ import annotations

import pytest

from infemeral.audit.report import AuditReport, Row

GRAM = ("AUC 1.000 within, 1.000 across sessions; 612/628 repeat pairs linked, 0 false; your text: 58/58 tokens "
        "linked to their repeat in another session")


def report() -> AuditReport:
    rows = [Row("norms", "norm matching, had the client not run layer 0", "public embedding table; no Q",
                "100.0 % (88/88)", "100.0 % (58/58)", "0.59 s"),
            Row("gram", "Gram linking (cosine >= 0.95 links)", "only the traffic: no weights, no Q", GRAM, "", "0.2 s"),
            Row("vocabulary", "vocabulary matching after un-rotation", "public weights + Q (simulated)",
                "100.0 % (88/88)", "100.0 % (58/58)", "27 s tables (once) + 7.63 s")]
    return AuditReport(88, 58, 1, "float32", "simulated from the client bundle", rows, notes=["a note " * 30])


@pytest.mark.parametrize("width", [200, 100, 80, 60, 40])
def test_the_report_fits_the_terminal_and_keeps_every_word(width):
    wide = report().text(width=1000)
    assert max(map(len, wide.splitlines())) > 200  # what it was before: the table as wide as its longest cell
    text = report().text(width=width)
    assert max(map(len, text.splitlines())) <= width, text
    table = report().table(width)
    for row in report().rows:  # every cell's words are there (a narrow terminal names the columns in each block)
        for cell in (row.attack, row.observer, row.overall, row.user_text, row.time):
            assert set(cell.split()) <= set(table.split()), (cell, table)


def test_the_table_keeps_its_columns_while_they_fit_and_becomes_blocks_when_they_do_not():
    assert report().table(100).splitlines()[0].split("  ")[0] == "attack"
    narrow = report().table(40)
    assert "observer knows:" in narrow and narrow.splitlines()[0] == "norm matching, had the client not run"


def test_the_width_comes_from_the_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "72")
    assert max(map(len, report().text().splitlines())) <= 72

"""The README's tables of settings name every flag there is, so a new setting cannot go undocumented."""

from __future__ import annotations

import re
from pathlib import Path

from infemeral.server.main import build_parser

README = Path(__file__).resolve().parents[2] / "README.md"


def table_after(heading: str) -> str:
    """The markdown table that follows `heading` in the README."""
    text = README.read_text()
    rows = text[text.index(heading):].split("\n\n", 2)[1]
    assert rows.startswith("|"), rows[:80]
    return rows


def test_the_server_table_names_every_server_flag():
    table = table_after("Every flag is also an `INFEMERAL_*` variable")
    documented = {flag for flag in re.findall(r"`(--[a-z0-9-]+)`", table) if not flag.startswith("--no-")}
    flags = {option for action in build_parser()._actions for option in action.option_strings
             if option.startswith("--") and option not in ("--help",) and not option.startswith("--no-")}
    assert flags - documented == set(), "flags missing from the README's server table"
    assert documented - flags == set(), "the README's server table names flags the server does not have"


def test_the_int4_size_is_one_figure_from_the_benchmarks():
    from infemeral.cli.main import INT4_OF_BF16, build_parser

    benchmarks = (README.parent / "docs" / "benchmarks" / "server_quant.md").read_text()
    measured = float(re.search(r"8b-shape: int4 server bundle [^|]*\| ([\d.]+)x", benchmarks).group(1))
    assert INT4_OF_BF16 == f"{measured:.2f}x"
    readme = README.read_text()
    helps = build_parser().format_help() + build_parser()._subparsers._group_actions[0].choices["prepare"].format_help()
    fig = INT4_OF_BF16.removesuffix("x")
    assert f"int4  # ~{fig}x of bf16" in readme and f"int4 (g=64)\nbundle and resident weights are {fig}× of bf16" in readme
    assert helps.count(f"~{fig}x") == 2, helps

"""One module per benchmark section, in the order a full run takes them.

A section module defines:

    NAME = "decode"                       # what --only takes, and the <section> of its TARGET lines
    TITLE = "Decode throughput ..."       # the report's heading
    def run(wb: Workbench) -> Result      # set up, timed loop, rows and targets
    def report(result: Result) -> list[str]          # markdown lines under the heading
    def plot(result: Result, out: Path) -> list[str]  # optional: PNG files it wrote into `out`

Rows are dataclasses (typed: a misspelt field fails at once); `Result.facts` holds the few scalars
a section derives from its rows.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType

from bench.harness import MachineLoad, Target

ORDER = ("prepare", "decode", "context", "wire", "store", "concurrency", "agreement", "profile", "speculation",
         "client", "startup", "tensor_parallel", "server_quant", "prepare_big", "upload")


@dataclass
class Result:
    name: str
    method: str                          # how it was measured, one paragraph for the report
    rows: list = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    facts: dict = field(default_factory=dict)
    load: MachineLoad | None = None      # filled in by the runner
    seconds: float = float("nan")        # likewise


def load(name: str) -> ModuleType:
    return importlib.import_module(f"bench.sections.{name}")

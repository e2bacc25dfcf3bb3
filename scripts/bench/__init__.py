"""infemeral's benchmarks: the split system against its baselines, each pair measured side by side in one run.

    .venv/bin/python scripts/bench.py                  # every section; writes docs/benchmarks/ (2-core CPU: ~10 min)
    .venv/bin/python scripts/bench.py --quick          # smoke run: fewer lengths, tokens and repeats
    .venv/bin/python scripts/bench.py --only context   # one section (or a comma-separated few)
    .venv/bin/python scripts/bench.py --device cuda --model random-8b   # GPU: a random-weight Llama of 8B shape

Layout:

    harness.py      clock, medians, `interleave` (baseline and subject alternate), `MachineLoad`, `Target`
    instruments.py  wire recorder (gRPC interceptor), layer timer, store meter, token stamps, subprocess meter
    systems.py      `Workbench`: the model and bundles, `wb.split(dtype)` (server + client) and `wb.plain(dtype)`
    sections/       one module per section (see sections/__init__.py for the contract)
    workloads.py    the speculation section's prompts (copy, document, code, open chat); it reaches the
                    server through `scripts/delay_proxy.py` to emulate 0, 20 and 80 ms round trips
    report.py       results.json and REPORT.md
    cli.py          the command line; `scripts/bench.py` calls it

Adding a section: write `sections/<name>.py` with NAME, TITLE, a row dataclass, `run(wb) -> Result`
and `report(result) -> list[str]` (and `plot` if a picture helps); add the name to `sections.ORDER`.
Measure against a baseline from the same run with `interleave`, and state goals only as `Target`s
(`at_least`/`at_most`): the runner prints each as `TARGET <section> <name>: PASS|MISS (<figure>)`.
Never assert absolute times. Everything runs on this machine against 127.0.0.1; nothing is downloaded.
"""

"""Benchmarks of the split system against its baselines: see scripts/bench/__init__.py.

    .venv/bin/python scripts/bench.py [--quick] [--only SECTION[,SECTION]] [--device cuda] [--model random-8b]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the `bench` package beside this file

from bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

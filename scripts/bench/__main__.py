"""`python -m bench` (with scripts/ on the path) runs the benchmarks, as `scripts/bench.py` does."""

import sys

from bench.cli import main

sys.exit(main())

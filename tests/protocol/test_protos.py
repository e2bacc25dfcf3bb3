"""The committed gRPC stubs are what scripts/gen_protos.py makes from protos/ today."""

import subprocess
import sys

from tests.conftest import REPO


def test_generated_stubs_are_current():
    proc = subprocess.run([sys.executable, "scripts/gen_protos.py", "--check"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr

"""Commands load only what they need: `--help` answers without torch (the bench's `startup` section times them)."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "transformers")


def modules_loaded_by(*argv: str) -> set[str]:
    """The heavy modules in sys.modules after `infemeral-client ARGV` ran in a fresh interpreter."""
    code = ("import sys\nfrom infemeral.cli.main import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n"
            "    pass\nprint('loaded:', *(m for m in %r if m in sys.modules))" % (HEAVY,))
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.splitlines()[-1]
    assert last.startswith("loaded:"), proc.stdout[-300:]
    return set(last.split()[1:])


def test_help_loads_neither_torch_nor_transformers():
    assert modules_loaded_by("--help") == set()
    assert modules_loaded_by("generate", "--help") == set()
    assert modules_loaded_by("serve", "--help") == set()

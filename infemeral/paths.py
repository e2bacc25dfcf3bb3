"""Where infemeral keeps its files on this machine by default: bundles, sessions, the answer index, history."""

from __future__ import annotations

from pathlib import Path

DATA_HOME = Path.home() / ".local" / "share" / "infemeral"

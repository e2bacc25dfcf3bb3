"""Loading without the cyclic garbage collector.

Importing torch and transformers and building the laptop's half make millions of objects that live as long as
the process; the collector's passes over them while they are being made were about a fifth of that start-up on a
loaded 2-core machine, and find nothing to free. Reference counting frees everything else as usual, and the
collector runs again once the client is open (a chat or an endpoint runs for hours).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()

"""End a command's process without the interpreter's teardown.

Once torch and transformers are loaded, Python's finalization frees their modules one by one: 0.7 s after
`import torch` alone and 2-3 s after transformers' modeling code, on a 2-core machine, after every `generate`,
`chat` or `serve`, for nothing (the process's memory goes back to the OS at once anyway). Everything a command
writes is written and closed when it returns; what the interpreter would still do that matters is done here
first: other non-daemon threads finish, exit handlers run (logging's flush among them), output is flushed.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`) or a closed stream: nothing left to say there
            pass
    os._exit(code)

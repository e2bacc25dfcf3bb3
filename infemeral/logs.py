"""Logging set-up: plain text or one JSON object per line. Messages carry sizes and timings only."""

from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + "Z",
                 "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if record.exc_info and record.exc_info[0] is not None:
            entry["error"] = record.exc_info[0].__name__  # the type only: exception text may hold data
        return json.dumps(entry)


class StderrHandler(logging.StreamHandler):
    """Writes to `sys.stderr` as it is when a record is emitted, not as it was when logging was set up: a process
    that swaps stderr (a host embedding the command line, a test capturing it) never logs into a closed stream."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure(level: str = "INFO", fmt: str = "text") -> None:
    handler = StderrHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    elif fmt == "text":
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    else:
        raise ValueError(f"log format must be text or json, not {fmt!r}")
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)

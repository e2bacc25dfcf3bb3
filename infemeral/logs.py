"""Logging set-up: plain text or one JSON object per line. Messages carry sizes and timings only."""

from __future__ import annotations

import json
import logging
import os
import sys
import time


LIBRARY_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")  # what TRANSFORMERS_VERBOSITY takes


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


def route_library_messages() -> None:
    """Send what libraries print where infemeral's own log lines go (stderr, at the configured level), so that a
    command's stdout holds its answer alone: Python warnings become log records, transformers' logger drops its
    own stderr handler ('[transformers] …' lines landed inside streamed answers) for the root's, and the progress
    bars of loading weights (transformers', huggingface_hub's, GGUF's) are off. Importing transformers costs a second,
    so one not yet imported is set up through the environment it reads when it is."""
    logging.captureWarnings(True)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' own bars follow this too
    os.environ.setdefault("TQDM_DISABLE", "1")  # read as tqdm is imported; infemeral's own bars pass disable=
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", level.lower() if level in LIBRARY_LEVELS else "warning")
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_default_handler()
        transformers_logging.enable_propagation()
        transformers_logging.disable_progress_bar()
        logging.getLogger("transformers").setLevel(logging.NOTSET)


def configure(level: str = "INFO", fmt: str = "text") -> None:
    handler = StderrHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    elif fmt == "text":
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    else:
        raise ValueError(f"log format must be text or json, not {fmt!r}")
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    route_library_messages()

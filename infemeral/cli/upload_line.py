"""The progress line of a long prompt's upload, for `generate` and `chat`.

On a home uplink a long prompt takes seconds to go up before the first token
comes back. Once an upload has taken `SHOW_AFTER_SECONDS` and is not done, a
line on stderr shows it (MB and tokens sent, rate, time left), and it is
cleared as the upload ends, before the answer is written: the answer's text on
stdout never has the line in it. Nothing is drawn unless both stdout and
stderr are terminals (piped output, logs and scripts see no progress).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:  # the SDK's modules load torch
    from infemeral.client.upload import UploadProgress

SHOW_AFTER_SECONDS = 1.0


class UploadStopped(Exception):
    """The person asked to stop while the prompt was going up (Ctrl-C in `chat`)."""


def is_shown(progress: UploadProgress, is_terminal: bool) -> bool:
    """Whether an upload at `progress` has a line: on a terminal, past `SHOW_AFTER_SECONDS`, not yet done."""
    return is_terminal and not progress.is_done and progress.seconds >= SHOW_AFTER_SECONDS


def on_terminal() -> bool:
    return sys.stdout.isatty() and sys.stderr.isatty()


class UploadLine:
    """An SDK `on_progress` callback that draws the line (tqdm, on `stream`) while `is_shown` says so, and clears it
    when the upload is done. `should_stop` (checked at every report) stops the upload with `UploadStopped`."""

    def __init__(self, stream: TextIO | None = None, is_terminal: bool | None = None,
                 should_stop: Callable[[], bool] | None = None):
        self.stream = stream or sys.stderr
        self.is_terminal = on_terminal() if is_terminal is None else is_terminal
        self.should_stop = should_stop
        self._bar = None

    @property
    def is_drawn(self) -> bool:
        return self._bar is not None

    def __call__(self, progress: UploadProgress) -> None:
        if self.should_stop is not None and self.should_stop():
            self.close()
            raise UploadStopped
        if progress.is_done:
            self.close()
            return
        if self._bar is None:
            if not is_shown(progress, self.is_terminal):
                return
            from tqdm import tqdm

            self._bar = tqdm(total=progress.bytes_total, unit="B", unit_scale=True, desc="uploading the prompt",
                             file=self.stream, leave=False, dynamic_ncols=True)
        self._bar.update(progress.bytes_sent - self._bar.n)
        self._bar.set_postfix_str(f"{progress.tokens_sent}/{progress.tokens_total} tokens")

    def close(self) -> None:
        """Clear the line (a turn that ends early, as well as one whose upload is done)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

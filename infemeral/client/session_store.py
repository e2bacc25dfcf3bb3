"""Named sessions saved in one directory (`--sessions-dir`): what `chat --session NAME`, `delete --session NAME`
and the chat page of `infemeral-client serve` list, resume, rename and delete.

A name is a file name: `NAME.session`, written by `Session.save`. Listing reads
each file's header only (no torch, no cache); deleting also deletes what the
server stores for the session, which only that file's key can read.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from infemeral.client import session_file
from infemeral.errors import FailedPrecondition, InfemeralError, NotFound

SUFFIX = ".session"
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def check_name(name: str) -> str:
    """`name` if it can name a saved session (a plain file name); otherwise an error saying what can."""
    if not NAME.fullmatch(name) or name.startswith("."):
        raise InfemeralError("session names may use letters, digits, '.', '_' and '-' (at most 64, not starting "
                             "with '.')")
    return name


@dataclass
class SavedSummary:
    """One saved session as a list shows it: no key, no cache."""

    name: str
    messages: list[dict]  # the transcript (text: for this machine's eyes only)
    modified: float       # seconds since the epoch


class SessionStore:
    """The saved sessions of one client bundle in `directory`; files of other bundles are left out."""

    def __init__(self, directory: str | Path, server_fingerprint: str):
        self.directory = Path(directory).expanduser()
        self.server_fingerprint = server_fingerprint

    def path(self, name: str) -> Path:
        return self.directory / f"{check_name(name)}{SUFFIX}"

    def exists(self, name: str) -> bool:
        return self.path(name).exists()

    def list(self) -> list[SavedSummary]:
        """The sessions saved for this bundle, most recently changed first."""
        found = []
        for path in self.directory.glob(f"*{SUFFIX}") if self.directory.is_dir() else ():
            name = path.name.removesuffix(SUFFIX)
            if not NAME.fullmatch(name):
                continue
            try:
                messages = session_file.transcript(path, self.server_fingerprint)
                modified = path.stat().st_mtime
            except (InfemeralError, OSError):
                continue  # another bundle's session, or a file that is no session
            found.append(SavedSummary(name, messages, modified))
        return sorted(found, key=lambda s: s.modified, reverse=True)

    def messages(self, name: str) -> list[dict]:
        """The transcript of the session saved as `name`."""
        return session_file.transcript(self._existing(name), self.server_fingerprint)

    def rename(self, name: str, new_name: str) -> None:
        """Save the session under `new_name` instead; refused if that name is taken."""
        os.rename(self._existing(name), self.new_path(new_name))

    def new_path(self, name: str) -> Path:
        """Where a new session `name` is to be saved; refused if that name is taken."""
        path = self.path(name)
        if path.exists():
            raise FailedPrecondition(f"a saved session named {name!r} exists already: pick another name")
        return path

    def delete(self, name: str, link) -> None:
        """Delete the session saved as `name`: what the server stores for it (through `link`, a ServerLink), then
        its file here. The server's copy goes first: without the file's key nothing could delete it."""
        path = self._existing(name)
        session_id, key, version = session_file.identity(path, self.server_fingerprint)
        if version:
            link.delete_session(session_id, key)
        path.unlink()

    def _existing(self, name: str) -> Path:
        path = self.path(name)
        if not path.exists():
            raise NotFound(f"no saved session named {name!r} in {self.directory}")
        return path

"""The chat page's conversations: the sessions saved in --sessions-dir (`SessionStore`, the same ones
`chat --session NAME` keeps), listed, shown, renamed, forked on the pod and deleted for the page, and saved after
every answer to a chat request that names one (`conversation`).

A named conversation's session is its own in the pool (`SessionPool.acquire`):
reused whatever the page resends, loaded from its file when the pool holds none
(after a restart), and left on the server when it leaves the pool, since its
file holds its key. Deleting one deletes both.
"""

from __future__ import annotations

import contextlib
import logging
import secrets

from infemeral.client.session_store import SessionStore
from infemeral.endpoint.schema import RequestError
from infemeral.endpoint.session_pool import SessionPool
from infemeral.errors import Aborted, FailedPrecondition, InfemeralError, NotFound

log = logging.getLogger(__name__)


class Conversations:
    """The saved sessions of the endpoint's client bundle, for the chat page's routes (blocking: run in a
    worker thread)."""

    def __init__(self, store: SessionStore, pool: SessionPool):
        self.store, self.pool = store, pool

    def list(self) -> dict:
        return {"object": "list", "data": [
            {"name": s.name, "title": _title(s.messages), "messages": len(s.messages), "modified": int(s.modified)}
            for s in self._refused_as_http(self.store.list)]}

    def show(self, name: str) -> dict:
        return {"name": name, "messages": self._refused_as_http(self.store.messages, name)}

    def rename(self, name: str, new_name: str) -> dict:
        def rename():
            self.pool.rename(name, new_name)  # refused while it answers
            try:
                self.store.rename(name, new_name)
            except BaseException:
                self.pool.rename(new_name, name)
                raise

        self._refused_as_http(rename)
        return {"name": new_name}

    def delete(self, name: str) -> dict:
        """Delete the conversation here and what the server stores for it."""
        def delete():
            self.pool.forget(name)  # refused while it answers
            self.store.delete(name, self.pool.client.link)

        self._refused_as_http(delete)
        return {"name": name, "deleted": True}

    def fork(self, name: str, at_turn: int | None = None, new_name: str | None = None) -> dict:
        """A new saved conversation holding `name`'s first `at_turn` turns (None: all of them), made on the pod from
        its stored cache (`SessionPool.fork`): nothing is uploaded again and `name` stays as it was. Saved as
        `new_name` (None: a name made from `name`) before this returns; its name and messages."""
        new_name = new_name or f"{name[:50]}-fork-{secrets.token_hex(3)}"

        def fork():
            path = self.store.new_path(new_name)
            self.store.messages(name)  # NotFound before anything is loaded
            source = self.pool.acquire([], conversation=name, resume=lambda: self._resume(name))
            self.pool.release(source)
            forked = self.pool.fork(source, at_turn=at_turn, conversation=new_name)
            try:
                forked.save(path)
            except (InfemeralError, OSError) as e:
                self.pool.release(forked)
                self.pool.forget(new_name)
                with contextlib.suppress(InfemeralError):
                    forked.delete()  # without its file nothing could delete it later
                raise RequestError(500, f"could not save the new conversation in {self.store.directory} "
                                        f"({type(e).__name__}); nothing was kept", type="server_error") from None
            self.pool.release(forked)
            return forked.messages

        messages = self._refused_as_http(fork)
        return {"name": new_name, "messages": messages}

    def first_message(self, name: str) -> tuple[str, str | None]:
        """The conversation's first user message and its system prompt (None if it has none)."""
        messages = self._refused_as_http(self.store.messages, name)
        first = next((m["content"] for m in messages if m["role"] == "user"), None)
        if first is None:
            raise RequestError(400, f"conversation {name!r} has no message of yours yet", param="name")
        system = next((m["content"] for m in messages if m["role"] == "system"), None)
        return first, system

    def lease(self, name: str) -> dict:
        """How a chat request that names conversation `name` gets its session and saves it (`Answer`)."""
        return {"conversation": name, "resume": lambda: self._resume(name),
                "finished": lambda session: self._save(name, session)}

    def _resume(self, name: str):
        """The conversation's saved session, or None (a new conversation)."""
        path = self.store.path(name)
        return self.pool.client.load_session(path) if path.exists() else None

    def _save(self, name: str, session) -> None:
        try:
            session.save(self.store.path(name))
        except (InfemeralError, OSError) as e:  # the answer stands; the conversation lives on in the pool
            log.warning("could not save a conversation to %s: %s", self.store.directory, type(e).__name__)

    @staticmethod
    def _refused_as_http(call, *args):
        try:
            return call(*args)
        except NotFound as e:
            raise RequestError(404, str(e), param="name", code="conversation_not_found") from None
        except Aborted as e:
            raise RequestError(409, str(e), type="conflict_error", code="conversation_busy") from None
        except FailedPrecondition as e:
            raise RequestError(409, str(e), type="conflict_error", code="conversation_conflict") from None
        except InfemeralError as e:
            if type(e) is InfemeralError:  # a name that cannot be a file name
                raise RequestError(400, str(e), param="name") from None
            raise


def _title(messages: list[dict]) -> str:
    """What a list shows of a conversation: the start of its first user message."""
    first = next((m["content"] for m in messages if m["role"] == "user"), "")
    return first if len(first) <= 60 else first[:59] + "…"

"""A turn whose commit reply is lost: the client asks the server, and adopts or drops the turn."""

from __future__ import annotations

import pytest
from tests.support.faults import TurnFault

from infemeral.client.client import Client
from infemeral.client.sampling import SamplingParams
from infemeral.errors import StatusError

pytestmark = pytest.mark.slow
PARAMS = SamplingParams(max_new_tokens=6)
QUESTIONS = ("Name a river.", "How long is it?", "Name another one.")


class Fault(TurnFault):
    mode: str | None = None  # "reply": the server commits, the client never hears; "request": commit never sent

    def on_request(self, request) -> bool:
        if request.WhichOneof("kind") == "commit" and self.mode == "request":
            self.mode = None
            return True  # the stream breaks before the commit leaves
        return False

    def on_response(self, response) -> bool:
        if response.WhichOneof("kind") == "committed" and self.mode == "reply":
            self.mode = None
            return True
        return False


@pytest.fixture
def faulty(server, bundles):
    fault = Fault()
    client = Client(f"127.0.0.1:{server.port}", bundles.client_dir, timeout=120, interceptors=[fault])
    yield client, fault
    client.close()


def reference_answers(client) -> list[list[int]]:
    session = client.new_session()
    return [session.chat(q, PARAMS).token_ids for q in QUESTIONS]


def second_reply_lost(c, fault):
    """A session whose first turn committed and whose second one committed on the server unheard."""
    session = c.new_session()
    session.chat(QUESTIONS[0], PARAMS)
    fault.mode = "reply"
    with pytest.raises(StatusError):
        session.chat(QUESTIONS[1], PARAMS)
    return session


@pytest.mark.parametrize("mode", ["reply", "request"])
def test_lost_commit_is_settled_on_the_next_turn(faulty, client, mode):
    c, fault = faulty
    expected = reference_answers(client)
    session = c.new_session()
    assert session.chat(QUESTIONS[0], PARAMS).token_ids == expected[0]
    fault.mode = mode
    with pytest.raises(StatusError):
        session.chat(QUESTIONS[1], PARAMS)
    assert session.version == 1 and len(session.messages) == 2  # nothing assumed yet
    result = session.chat(QUESTIONS[2], PARAMS)
    if mode == "reply":  # the second turn did land: it is adopted and the third continues from it
        assert session.version == 3 and len(session.messages) == 6
        assert result.token_ids == expected[2]
    else:  # it never committed: dropped, and the third question continues from the first turn
        assert session.version == 2 and len(session.messages) == 4
        other = client.new_session()
        other.chat(QUESTIONS[0], PARAMS)
        assert result.token_ids == other.chat(QUESTIONS[2], PARAMS).token_ids


def test_lost_reply_is_kept_in_the_session_file(faulty, client, tmp_path):
    """The client process may exit before the next turn: the unconfirmed turn is saved with the session,
    and the resumed session settles it (here: adopts it) instead of being stuck one version behind."""
    c, fault = faulty
    expected = reference_answers(client)
    session = second_reply_lost(c, fault)
    path = session.save(tmp_path / "chat.session")
    resumed = client.load_session(path)  # another process
    assert resumed.version == 1 and resumed.pending_commit is not None
    assert resumed.pending_commit.version == 2 and resumed.pending_commit.turn_id == session.pending_commit.turn_id
    result = resumed.chat(QUESTIONS[2], PARAMS)
    assert resumed.version == 3 and len(resumed.messages) == 6 and resumed.pending_commit is None
    assert result.token_ids == expected[2]


def test_adopted_turn_stays_committed_when_the_next_turn_fails(faulty, client):
    c, fault = faulty
    expected = reference_answers(client)
    session = second_reply_lost(c, fault)
    fault.mode = "request"  # the next turn adopts the lost one, then fails itself before its commit leaves
    with pytest.raises(StatusError):
        session.chat(QUESTIONS[2], PARAMS)
    assert session.version == 2 and len(session.messages) == 4  # the adopted turn is the committed state...
    assert session.cache.length == session.cache.committed_length == len(session.history_ids)  # ...all of it
    assert session.chat(QUESTIONS[2], PARAMS).token_ids == expected[2]
    assert session.version == 3


def test_version_1_session_files_still_load(client, tmp_path):
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    session = client.new_session()
    first = session.chat(QUESTIONS[0], PARAMS)
    path = session.save(tmp_path / "old.session")
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["session"])
    meta["format_version"] = 1
    del meta["pending"]
    save_file(load_file(str(path)), str(path), metadata={"session": json.dumps(meta)})
    resumed = client.load_session(path)
    assert resumed.version == 1 and resumed.pending_commit is None and resumed.history_ids == session.history_ids
    other = client.new_session()
    assert other.chat(QUESTIONS[0], PARAMS).token_ids == first.token_ids
    assert resumed.chat(QUESTIONS[1], PARAMS).token_ids == other.chat(QUESTIONS[1], PARAMS).token_ids

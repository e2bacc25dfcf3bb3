"""The OpenAI endpoint as its tests run it: a TurnLog interceptor records every TurnRequest on the wire, so a
test can see which session each request used and how many tokens each turn sent; the answers the SDK gives
for comparison; the error body's fields; the sessions a server stores. The `endpoint` fixture (uvicorn on a
free port, in front of the shared real server) is in conftest.py."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai

from infemeral.client.client import Client
from infemeral.client.sampling import SamplingParams
from infemeral.endpoint.session_pool import SessionPool
from infemeral.protocol import pb



MODEL = "tiny-test-model"
TOKENS = 10
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


class TurnLog(grpc.StreamStreamClientInterceptor):
    """Every Turn call's requests, with when the call opened and ended."""

    def __init__(self):
        self.turns: list[dict] = []
        self._lock = threading.Lock()

    def intercept_stream_stream(self, continuation, details, request_iterator):
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        if not method.endswith("/Turn"):
            return continuation(details, request_iterator)
        turn = {"requests": [], "opened": time.monotonic(), "ended": None}
        with self._lock:
            self.turns.append(turn)

        def tap():
            for request in request_iterator:
                turn["requests"].append(pb.TurnRequest.FromString(request.SerializeToString()))
                yield request
            turn["ended"] = time.monotonic()

        return continuation(details, tap())

    def committed(self) -> list[dict]:
        return [t for t in self.turns if any(r.WhichOneof("kind") == "commit" for r in t["requests"])]

    def opens(self, since: int) -> list:
        """The OpenTurn of every Turn call from the `since`-th on."""
        return [t["requests"][0].open for t in self.turns[since:]]


@dataclass
class Endpoint:
    url: str
    client: Client
    pool: SessionPool
    log: TurnLog

    def openai(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


def sdk_answer(client, messages: list[dict], tokens: int = TOKENS):
    session = client.new_session()
    session.messages = messages[:-1]
    result = session.chat(messages[-1]["content"], SamplingParams(max_new_tokens=tokens))
    session.delete()
    return result


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]



def error_of(body: dict) -> dict:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def stored_sessions(server) -> set[str]:
    return {p.name for p in Path(server.settings.store).iterdir() if (p / "manifest").exists()}


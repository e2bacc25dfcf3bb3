"""The response bodies: one builder for chat and completion, which differ only in names and where text goes.

A chat answer is a `message` (streamed as `delta`s), a completion answer is
`text`; the envelope — id, object, created, model, choices, usage — and the
finish reasons are the same.
"""

from __future__ import annotations

import secrets
import time
from typing import Literal

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}
ID_PREFIX = {"chat": "chatcmpl", "completion": "cmpl"}
OBJECT = {"chat": "chat.completion", "completion": "text_completion"}
CHUNK_OBJECT = {"chat": "chat.completion.chunk", "completion": "text_completion"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, figures: dict | None = None) -> dict:
    """OpenAI's token counts; `figures` (`answer_figures`) ride along as `usage.infemeral`, an extra field that
    OpenAI clients keep and ignore."""
    counts = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
              "total_tokens": prompt_tokens + completion_tokens}
    return {**counts, "infemeral": figures} if figures is not None else counts


def answer_figures(result, wire) -> dict:
    """What one answer cost, as the chat page shows it: decode speed, tokens per round trip (above 1 when drafts
    were accepted), the time from opening the turn to the first token (the prompt's upload and prefill), and
    the bytes the turn sent to the pod and received (`WireBytes`)."""
    return {"tokens_per_second": round(result.tokens_per_second, 2),
            "tokens_per_round_trip": round(result.tokens_per_round_trip, 2),
            "round_trips": result.round_trips, "time_to_first_token": round(result.time_to_first_token, 3),
            "prompt_tokens_sent": result.prompt_tokens, "bytes_sent": wire.sent, "bytes_received": wire.received}


def finish_reason(result) -> str:
    """OpenAI's finish reason for a turn's (`TurnResult.finish_reason`)."""
    return FINISH_REASONS.get(result.finish_reason, "stop")


def model_list(name: str, created: int) -> dict:
    return {"object": "list", "data": [model_card(name, created)]}


def model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "infemeral"}


class ResponseBuilder:
    """The bodies of one answer, whole or as stream chunks, under one id and creation time."""

    def __init__(self, kind: Literal["chat", "completion"], model: str):
        self.kind, self.model = kind, model
        self.id, self.created = new_id(ID_PREFIX[kind]), now()

    def response(self, text: str, finish: str, usage_: dict) -> dict:
        """The whole answer."""
        return {**self._envelope(OBJECT), "choices": [self._choice(text, finish, is_chunk=False)], "usage": usage_}

    def chunk(self, text: str | None, finish: str | None = None) -> dict:
        """One piece of a streamed answer: its text (None: none, as in the chunk that ends it)."""
        return {**self._envelope(CHUNK_OBJECT), "choices": [self._choice(text, finish, is_chunk=True)]}

    def opening(self, echo: str = "") -> list[dict]:
        """The chunks before the answer's own: a chat's assistant role; a completion's echoed prompt, if any."""
        if self.kind == "chat":
            first = self.chunk("")
            first["choices"][0]["delta"]["role"] = "assistant"
            return [first]
        return [self.chunk(echo)] if echo else []

    def usage_chunk(self, usage_: dict) -> dict:
        """The last chunk of a stream that asked for usage: no choices, the token counts."""
        return {**self._envelope(CHUNK_OBJECT), "choices": [], "usage": usage_}

    def _envelope(self, objects: dict) -> dict:
        return {"id": self.id, "object": objects[self.kind], "created": self.created, "model": self.model}

    def _choice(self, text: str | None, finish: str | None, *, is_chunk: bool) -> dict:
        if self.kind == "completion":
            body = {"text": text or ""}
        elif is_chunk:
            body = {"delta": {} if text is None else {"content": text}}
        else:
            body = {"message": {"role": "assistant", "content": text}}
        return {"index": 0, **body, "logprobs": None, "finish_reason": finish}

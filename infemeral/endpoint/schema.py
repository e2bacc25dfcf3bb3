"""The part of OpenAI's HTTP API the laptop endpoint speaks: request bodies, and the error it answers with.

Requests accept the fields tools commonly send; fields that would change the
answer in ways this endpoint cannot honour (several choices, log
probabilities, tools, structured output, images) are refused with a 400 that
names them rather than silently ignored. Unknown fields are ignored, as
OpenAI-compatible servers usually do.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from infemeral.client.sampling import SEED_MAX, SEED_MIN, SPECULATE
from infemeral.client.session_store import check_name
from infemeral.errors import InfemeralError


class RequestError(Exception):
    """A request the endpoint refuses, with the HTTP status and OpenAI error fields to answer."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# -- requests -----------------------------------------------------------------------------------------
MAX_TOKENS = 2**63 - 1  # any answer length a tool may send for "no limit"; the turn declares it as a uint64


def lone_surrogate(value, path: str = "") -> str | None:
    """Where in a JSON value a string holds a lone surrogate (JSON may escape one, `"\\udcff"`, but it is no
    text: nothing can encode it), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = lone_surrogate(key, path) or lone_surrogate(item, f"{path}.{key}" if path else str(key))
        if found:
            return found
    return None


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    n: int | None = Field(None, ge=1)
    stream: bool | None = False
    stream_options: dict | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    # not in OpenAI's API, but sent by tools written for vLLM / llama.cpp servers
    top_k: int | None = Field(None, ge=0)
    repetition_penalty: float | None = Field(None, gt=0)
    # infemeral's own: where drafts come from (SamplingParams.speculate); the output is the same
    speculate: Literal[SPECULATE] | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data):
        where = lone_surrogate(data)
        if where:
            raise RequestError(400, f"{where}: not valid Unicode text (a lone surrogate such as \\udcff)",
                               param=where)
        return data

    def refuse_unsupported(self) -> None:
        if self.n not in (None, 1):
            raise RequestError(400, "n > 1 is not supported: this endpoint generates one choice per request",
                               param="n", code="unsupported_parameter")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise RequestError(400, f"{name} is not supported; use repetition_penalty (e.g. 1.1) instead",
                                   param=name, code="unsupported_parameter")
        if self.logit_bias:
            raise RequestError(400, "logit_bias is not supported", param="logit_bias", code="unsupported_parameter")

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None

    def to_template(self, index: int) -> dict:
        """The message as a chat template takes it: a role and plain text."""
        if self.role in ("tool", "function") or self.tool_calls:
            raise RequestError(400, "tool calls are not supported by this endpoint", param=f"messages.{index}",
                               code="unsupported_parameter")
        if isinstance(self.content, list):
            for part in self.content:
                if part.type != "text":
                    raise RequestError(400, f"content of type {part.type!r} is not supported: this model reads "
                                            "text only", param=f"messages.{index}.content",
                                       code="unsupported_content")
            text = "".join(part.text or "" for part in self.content)
        else:
            text = self.content or ""
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict | None = None
    # infemeral's own: the saved conversation this request continues (the chat page's), saved after its answer
    conversation: str | None = None

    @field_validator("conversation")
    @classmethod
    def _a_session_name(cls, name: str | None) -> str | None:
        return _session_name(name)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs or self.top_logprobs:
            raise RequestError(400, "logprobs are not supported", param="logprobs", code="unsupported_parameter")
        if self.tools or self.functions:
            raise RequestError(400, "tools (function calling) are not supported", param="tools",
                               code="unsupported_parameter")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise RequestError(400, "only response_format {\"type\": \"text\"} is supported",
                               param="response_format", code="unsupported_parameter")

    def template_messages(self) -> list[dict]:
        return [m.to_template(i) for i, m in enumerate(self.messages)]

    @property
    def answer_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs:
            raise RequestError(400, "logprobs are not supported", param="logprobs", code="unsupported_parameter")
        if self.best_of not in (None, 1):
            raise RequestError(400, "best_of > 1 is not supported", param="best_of", code="unsupported_parameter")
        if self.suffix:
            raise RequestError(400, "suffix (insertion) is not supported", param="suffix",
                               code="unsupported_parameter")

    def single_prompt(self) -> str | list[int]:
        """The one prompt, as text or token ids; a batch of prompts is refused."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise RequestError(400, "one prompt per request: send several prompts as separate (concurrent) "
                                        "requests", param="prompt", code="unsupported_parameter")
            p = p[0]
        if isinstance(p, list) and not p:
            raise RequestError(400, "the prompt is empty", param="prompt")
        return p

    @property
    def answer_tokens(self) -> int | None:
        return self.max_tokens


class ForkRequest(BaseModel):
    """A new saved conversation from a stored one (the chat page's POST /v1/conversations/NAME/fork): the turns
    it keeps (None: all) and its name (None: one made from NAME)."""

    model_config = ConfigDict(extra="ignore")
    at_turn: int | None = Field(None, ge=1)
    name: str | None = None

    @field_validator("name")
    @classmethod
    def _a_session_name(cls, name: str | None) -> str | None:
        return _session_name(name)


def _session_name(name: str | None) -> str | None:
    """`name` if it can name a saved conversation (a file name), for a field validator."""
    try:
        return name if name is None else check_name(name)
    except InfemeralError as e:
        raise ValueError(str(e)) from None

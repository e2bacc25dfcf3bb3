"""What the chat and completion endpoints share: sampling from the request, the context check, and the
answer, whole or as server-sent events.

Each endpoint is a subclass that reads the prompt from its request body
(`prompt`); everything else is the same. Logs carry counts and timings only, never
prompts or answers.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator

import anyio
from starlette.concurrency import run_in_threadpool

from infemeral.client.sampling import SPECULATE, SamplingParams
from infemeral.client.session import Session
from infemeral.endpoint.answer import Answer, AnswerStream, sse
from infemeral.endpoint.errors import to_request_error
from infemeral.endpoint.responses import ResponseBuilder, answer_figures, finish_reason, usage
from infemeral.endpoint.schema import RequestError
from infemeral.endpoint.serving_models import ServingModels
from infemeral.endpoint.session_pool import SessionPool
from infemeral.errors import InfemeralError

log = logging.getLogger(__name__)


def speculate_modes(client) -> list[str]:
    """The speculation modes a request may ask for: those whose draft sources the endpoint's Client holds."""
    return [mode for mode in SPECULATE if (mode != "draft" or client.draft_model is not None)
            and (mode != "head" or client.draft_head is not None)]


class OpenAIServing:
    """One endpoint that answers with a turn; `kind` names its response bodies, `name` its log lines."""

    kind = ""
    name = ""

    def __init__(self, pool: SessionPool, models: ServingModels, defaults: SamplingParams):
        self.pool, self.client, self.models, self.defaults = pool, pool.client, models, defaults

    async def create(self, body):
        """Answer a request: the whole answer, or with `stream` its server-sent events."""
        started = time.perf_counter()
        answer, echo = await run_in_threadpool(self.prepare, body)
        if not body.stream:
            result = await run_in_threadpool(self.run_whole, answer, started)
            return ResponseBuilder(self.kind, self.models.name).response(
                echo + result.text, finish_reason(result), self.usage(answer, result))
        return await self.open_stream(answer, ResponseBuilder(self.kind, self.models.name), echo,
                                      body.include_usage, started)

    def prepare(self, body) -> tuple[Answer, str]:
        """The request's turn, not started yet, and the text shown before its answer (blocking: it tokenizes)."""
        body.refuse_unsupported()
        self.models.check(body.model)
        params = self.sampling(body)
        lease = self.lease(body)
        prompt_ids, start, echo = self.prompt(body, params)
        self.check_context(prompt_ids)
        return Answer(self.pool, prompt_ids, start, **lease), echo

    def prompt(self, body, params: SamplingParams) -> tuple[list[int], Callable[[Session], Iterator[str]], str]:
        """What the endpoint reads from its request: the prompt's token ids, how a session answers it, and the
        text shown before the answer."""
        raise NotImplementedError

    def lease(self, body) -> dict:
        """How the request's session is leased, beyond its prompt (`Answer`'s keywords): by default, from the pool
        by prefix alone."""
        return {}

    # -- the request ----------------------------------------------------------------------------------
    def sampling(self, body) -> SamplingParams:
        """The request's sampling on top of the endpoint's defaults (flags, env, the model's generation config)."""
        given = {"temperature": body.temperature, "top_p": body.top_p, "seed": body.seed, "top_k": body.top_k,
                 "repetition_penalty": body.repetition_penalty, "max_new_tokens": body.answer_tokens,
                 "speculate": body.speculate}
        params = {k: v for k, v in given.items() if v is not None}
        if params.get("top_p") == 0:  # a nucleus of mass 0 keeps only the most likely token
            params["temperature"], params["top_p"] = 0.0, 1.0
        if body.stop is not None:
            params["stop"] = body.stop_strings
        if body.speculate is not None and body.speculate not in speculate_modes(self.client):
            raise RequestError(400, f"speculate {body.speculate!r} needs a draft source this endpoint was not started "
                                    f"with; it offers {', '.join(speculate_modes(self.client))}", param="speculate")
        try:
            return dataclasses.replace(self.defaults, **params)
        except ValueError as e:
            raise RequestError(400, str(e)) from None

    def check_context(self, prompt_ids: list[int]) -> None:
        """A prompt the server's context cannot hold with room for an answer is refused, window or not:
        with the window on, the server would silently drop the start of the conversation."""
        max_context = self.client.server_info().max_context
        if len(prompt_ids) >= max_context:
            raise RequestError(400, f"This model's maximum context length is {max_context} tokens. However, your "
                                    f"prompt is {len(prompt_ids)} tokens. Please reduce the length of the prompt.",
                               param="messages", code="context_length_exceeded")

    # -- the answer -----------------------------------------------------------------------------------
    def run_whole(self, answer: Answer, started: float):
        """Generate the whole answer (blocking); its TurnResult."""
        try:
            answer.first()
            answer.rest()
            result = answer.result
        finally:
            answer.close()
        self._log(answer, result, started)
        return result

    async def open_stream(self, answer: Answer, builder: ResponseBuilder, echo: str, include_usage: bool,
                          started: float) -> AnswerStream:
        """Open the turn before answering, so that a request that fails at once (server unreachable, stale
        session) gets an HTTP error status rather than a stream that breaks off."""
        try:
            first = await run_in_threadpool(answer.first)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await run_in_threadpool(answer.close)
            raise
        return AnswerStream(self.events(answer, first, builder, builder.opening(echo), include_usage, started),
                            answer)

    def events(self, answer: Answer, first: str | None, builder: ResponseBuilder, opening: list[dict],
               include_usage: bool, started: float) -> Iterator[str]:
        """The answer as server-sent events (run in worker threads by the response); an error after the
        first event is sent as an error event, as OpenAI does."""
        for payload in opening:
            yield sse(payload)
        try:
            delta = first
            while delta is not None:
                yield sse(builder.chunk(delta))
                delta = answer.next()
            result = answer.result
        except InfemeralError as e:
            failure = to_request_error(e)
            log.warning("%s failed mid-stream: %s", self.name, failure.code or failure.type)
            yield sse(failure.body())
            yield sse("[DONE]")
            return
        self._log(answer, result, started)
        yield sse(builder.chunk(None, finish_reason(result)))
        if include_usage:
            yield sse(builder.usage_chunk(self.usage(answer, result)))
        yield sse("[DONE]")

    @staticmethod
    def usage(answer: Answer, result) -> dict:
        return usage(len(answer.prompt_ids), result.generated_tokens, answer_figures(result, answer.wire))

    def _log(self, answer: Answer, result, started: float) -> None:
        log.info("%s: %d prompt tokens (%d sent, %d dropped), %d generated, finish=%s, %.2f s", self.name,
                 len(answer.prompt_ids), result.prompt_tokens, result.truncated_tokens, result.generated_tokens,
                 result.finish_reason, time.perf_counter() - started)

"""An OpenAI-compatible HTTP endpoint on the laptop (`infemeral-client serve`), DESIGN.md §12.

Chat UIs, editors and agent frameworks speak OpenAI's API; this endpoint lets
them use a private model unchanged while the privacy boundary stays on the
laptop: text reaches this process only, and what goes on to the pod is what
every infemeral turn sends (hidden states in the secret basis).

Requests are stateless and carry the whole conversation; a `SessionPool`
keeps live sessions keyed by token prefix, so a growing conversation sends
only its new tokens. The SDK is synchronous, so each request's turn runs in a
worker thread: concurrent requests run in parallel sessions and the server
batches them. A client that goes away mid-stream stops its turn (nothing is
committed; the session stays usable). Logs carry counts and timings only,
never prompts or answers.

    GET  /v1/models              the one model, named after the client bundle
    POST /v1/chat/completions    chat, streaming (server-sent events) or not
    POST /v1/completions         raw text completion, no chat template

Before any route, a request must be addressed to an allowed host name and carry
a body within the cap (`RequestGuard`).
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from infemeral.endpoint.schema import (
    FINISH_REASONS,
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    model_card,
    model_list,
    new_id,
    now,
    usage,
)
from infemeral.client.sampling import SamplingParams
from infemeral.endpoint.session_pool import SessionPool
from infemeral.errors import Aborted, DataLoss, InfemeralError, NoChatTemplate, NotFound, StatusError
from infemeral.transport import is_loopback, split_host_port

log = logging.getLogger(__name__)

# How the server refuses a session whose stored version is not the one the client holds (kvcache/persistence.py):
# it moved on, or an older copy was restored. The pooled copy can never continue that state again.
OUT_OF_DATE = "but the client expects version"

HTTP_STATUS = {  # gRPC status of an infemeral error -> (HTTP status, OpenAI error type)
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "OUT_OF_RANGE": (400, "invalid_request_error"),
    "ABORTED": (409, "conflict_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "UNAVAILABLE": (503, "server_error"),
    "DEADLINE_EXCEEDED": (504, "server_error"),
}


def session_is_gone(e: Exception) -> bool:
    """Whether a turn failed because the session's stored state is gone (expired, deleted: NOT_FOUND), damaged
    (DATA_LOSS) or out of date (the server holds another version). Only then is a pooled session dropped and
    the request started over on a new one. Any other refusal (ABORTED for a session still in a turn, a busy
    lock, a disagreement about the cache) leaves the committed state as it was: the session stays pooled and
    the request fails with 409, since dropping the session would delete a conversation the server still holds."""
    if isinstance(e, (NotFound, DataLoss)):
        return True
    return isinstance(e, Aborted) and OUT_OF_DATE in str(e)


def bundle_model_name(client_bundle: str | Path) -> str:
    """The model's name: the client bundle's directory, or its parent's when it is the `client` half that
    `prepare` writes (~/bundles/qwen7b/client -> qwen7b)."""
    path = Path(client_bundle).expanduser().resolve()
    return path.parent.name if path.name == "client" and path.parent.name else path.name


class Answer:
    """One request's turn: a session leased from the pool and its answer's text as it is sampled.

    Blocking (the SDK is synchronous): run its methods in a worker thread, one at a time."""

    def __init__(self, pool: SessionPool, prompt_ids: list[int], start: Callable[[object], Iterator[str]]):
        self.pool, self.prompt_ids, self.start = pool, prompt_ids, start
        self.session = None
        self._deltas: Iterator[str] | None = None

    def first(self) -> str | None:
        """Open the turn; its first text (None if the answer is empty). A reused session whose stored state
        is gone (`session_is_gone`) is dropped and the request starts over, once, on a new one."""
        for attempt in range(2):
            self.session = self.pool.acquire(self.prompt_ids)
            had_state = bool(self.session.version)
            self._deltas = self.start(self.session)
            try:
                return next(self._deltas, None)
            except StatusError as e:
                if not session_is_gone(e):
                    raise  # the session keeps its committed state; close() gives it back to the pool
                self.pool.discard(self.session)
                self.session = self._deltas = None
                if attempt or not had_state:
                    raise
                log.info("a pooled session was refused by the server (%s); starting a new one", e.code.name)
        raise AssertionError("unreachable")

    def next(self) -> str | None:
        return next(self._deltas, None)

    def rest(self) -> None:
        for _ in self._deltas:
            pass

    @property
    def result(self):
        return self.session.last_result

    def close(self) -> None:
        """Stop the turn if it is still running (it rolls back) and give the session back. Idempotent."""
        if self._deltas is not None:
            self._deltas.close()
            self._deltas = None
        if self.session is not None:
            self.pool.release(self.session)
            self.session = None


class _AnswerStream(StreamingResponse):
    """Server-sent events of one answer; the turn is stopped and the session given back however the
    response ends (finished, client gone, or never started)."""

    def __init__(self, events: Iterator[str], answer: Answer):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.answer = answer

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await run_in_threadpool(self.answer.close)


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class OpenAIEndpoint:
    """The routes' logic, apart from FastAPI's wiring."""

    def __init__(self, pool: SessionPool, model_name: str, defaults: SamplingParams):
        self.pool, self.client = pool, pool.client
        self.model_name, self.defaults = model_name, defaults
        self.created = now()

    # -- requests -------------------------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise RequestError(404, f"The model `{name}` does not exist: this endpoint serves `{self.model_name}`.",
                               param="model", code="model_not_found")

    def sampling(self, body) -> SamplingParams:
        """The request's sampling on top of the endpoint's defaults (flags, env, the model's generation config)."""
        given = {"temperature": body.temperature, "top_p": body.top_p, "seed": body.seed, "top_k": body.top_k,
                 "repetition_penalty": body.repetition_penalty, "max_new_tokens": body.answer_tokens}
        params = {k: v for k, v in given.items() if v is not None}
        if params.get("top_p") == 0:  # a nucleus of mass 0 keeps only the most likely token
            params["temperature"], params["top_p"] = 0.0, 1.0
        if body.stop is not None:
            params["stop"] = body.stop_strings
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

    def chat_answer(self, body: ChatCompletionRequest) -> tuple[Answer, SamplingParams]:
        body.refuse_unsupported()
        self.check_model(body.model)
        messages = body.template_messages()
        params = self.sampling(body)
        prompt_ids = self.client.chat_ids(messages)
        self.check_context(prompt_ids)
        return Answer(self.pool, prompt_ids, lambda s: s.stream_messages(messages, params)), params

    def completion_answer(self, body: CompletionRequest) -> tuple[Answer, str]:
        body.refuse_unsupported()
        self.check_model(body.model)
        params = self.sampling(body)
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            prompt_ids = self.client.text_ids(prompt)
            if not prompt_ids:
                raise RequestError(400, "the prompt is empty", param="prompt")
        else:
            vocab = self.client.model.config.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise RequestError(400, f"token ids must be in [0, {vocab})", param="prompt")
            prompt_ids = list(prompt)
        self.check_context(prompt_ids)
        echo = (prompt if isinstance(prompt, str) else self.client.tokenizer.decode(prompt_ids)) if body.echo else ""
        return Answer(self.pool, prompt_ids, lambda s: s.stream_raw(prompt_ids, params)), echo

    # -- answers --------------------------------------------------------------------------------------
    def run_whole(self, answer: Answer, started: float, kind: str):
        """Generate the whole answer (blocking); its TurnResult."""
        try:
            answer.first()
            answer.rest()
            result = answer.result
        finally:
            answer.close()
        self._log(kind, answer, result, started)
        return result

    def chat_response(self, answer: Answer, result) -> dict:
        return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": now(), "model": self.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                             "logprobs": None, "finish_reason": FINISH_REASONS.get(result.finish_reason, "stop")}],
                "usage": usage(len(answer.prompt_ids), result.generated_tokens)}

    def completion_response(self, answer: Answer, result, echo: str) -> dict:
        return {"id": new_id("cmpl"), "object": "text_completion", "created": now(), "model": self.model_name,
                "choices": [{"index": 0, "text": echo + result.text, "logprobs": None,
                             "finish_reason": FINISH_REASONS.get(result.finish_reason, "stop")}],
                "usage": usage(len(answer.prompt_ids), result.generated_tokens)}

    def events(self, answer: Answer, first: str | None, chunk: Callable[[str | None, str | None], dict],
               include_usage: bool, started: float, kind: str, opening: list[dict]) -> Iterator[str]:
        """The answer as server-sent events (run in worker threads by the response); an error after the
        first event is sent as an error event, as OpenAI does."""
        for payload in opening:
            yield sse(payload)
        try:
            delta = first
            while delta is not None:
                yield sse(chunk(delta, None))
                delta = answer.next()
            result = answer.result
        except InfemeralError as e:
            failure = to_request_error(e)
            log.warning("%s failed mid-stream: %s", kind, failure.code or failure.type)
            yield sse(failure.body())
            yield sse("[DONE]")
            return
        self._log(kind, answer, result, started)
        yield sse(chunk(None, FINISH_REASONS.get(result.finish_reason, "stop")))
        if include_usage:
            final = chunk(None, None)
            final["choices"] = []
            final["usage"] = usage(len(answer.prompt_ids), result.generated_tokens)
            yield sse(final)
        yield sse("[DONE]")

    def _log(self, kind: str, answer: Answer, result, started: float) -> None:
        log.info("%s: %d prompt tokens (%d sent, %d dropped), %d generated, finish=%s, %.2f s", kind,
                 len(answer.prompt_ids), result.prompt_tokens, result.truncated_tokens, result.generated_tokens,
                 result.finish_reason, time.perf_counter() - started)


def to_request_error(e: Exception) -> RequestError:
    """An infemeral error as the HTTP status and OpenAI error an API client can act on."""
    if isinstance(e, RequestError):
        return e
    if isinstance(e, NoChatTemplate):
        return RequestError(400, str(e), param="messages", code="no_chat_template")
    if isinstance(e, StatusError):
        name = e.code.name
        status, kind = HTTP_STATUS.get(name, (502, "server_error"))
        message = str(e)
        if name == "UNAVAILABLE":
            message = f"the infemeral server is unreachable or unavailable: {e}"
        elif name == "ABORTED":
            message = (f"the turn was aborted and nothing was committed; the conversation is as it was, so the "
                       f"request can be sent again: {e}")
        elif name in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
            message = f"the infemeral server refused this endpoint (check INFEMERAL_API_KEY and TLS settings): {e}"
        headers = {"Retry-After": "1"} if status in (409, 429, 503) else None
        return RequestError(status, message, type=kind, code=name.lower(), headers=headers)
    return RequestError(500, str(e), type="server_error", code="internal_error")


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
MAX_BODY_BYTES = 4 * 2**20


class RequestGuard:
    """What every request passes before a route sees it (DESIGN.md §12): it is addressed to an allowed host
    name, and its body fits the cap.

    A loopback endpoint without a key is still reachable from any web page the user opens: the page points
    its own name at 127.0.0.1 (DNS rebinding) and the browser then sends it requests here, with that name in
    `Host`. Answering only loopback names, and the names the user allowed, refuses them. The body is read
    here up to the cap and handed on whole: a declared length over it is refused before anything is read,
    and an undeclared (chunked) one as soon as the bytes received pass it."""

    def __init__(self, app, allowed_hosts: Iterable[str] = (), max_body_bytes: int = MAX_BODY_BYTES):
        self.app, self.max_body_bytes = app, max_body_bytes
        names = {split_host_port(h.strip())[0].rstrip(".").lower() for h in allowed_hosts if h.strip()}
        self.any_host = "*" in names
        self.suffixes = tuple(n[1:] for n in names if n.startswith("*."))  # "*.example.com" -> ".example.com"
        self.names = {n for n in names if not n.startswith("*")}

    def allows(self, host_header: str) -> bool:
        host, port = split_host_port(host_header)
        host = host.rstrip(".").lower()
        if not host or (port and not port.isdigit()):
            return False
        return self.any_host or is_loopback(host) or host in self.names or host.endswith(self.suffixes)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", ())}
        failure = self._check_host(headers.get(b"host", b"").decode("latin-1"))
        body = b""
        if failure is None:
            body, failure = await self._read_body(headers.get(b"content-length"), receive)
        if failure is not None:
            response = JSONResponse(failure.body(), status_code=failure.status, headers=failure.headers)
            await response(scope, receive, send)
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # the client going away, while the answer streams
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _check_host(self, host: str) -> RequestError | None:
        if self.allows(host):
            return None
        shown = f"Host {host[:100]!r}" if host else "A request without a Host header"
        name = split_host_port(host)[0] or "NAME"
        return RequestError(403, f"{shown} is not allowed: this endpoint answers only requests addressed to "
                                 f"{', '.join(LOOPBACK_NAMES)} or a name it was given, so that a web page cannot "
                                 f"reach it through DNS rebinding. To accept this name, start it with "
                                 f"`infemeral-client serve --allowed-hosts {name[:100]}` (or "
                                 "INFEMERAL_SERVE_ALLOWED_HOSTS; '*' accepts any).", code="host_not_allowed")

    async def _read_body(self, declared: bytes | None, receive) -> tuple[bytes, RequestError | None]:
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            return b"", self._too_large() if declared.isdigit() else RequestError(400, "invalid Content-Length")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending the whole body
                return b"", RequestError(400, "the request body was not received whole")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return b"", self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None

    def _too_large(self) -> RequestError:
        return RequestError(413, f"The request body is larger than this endpoint accepts ({self.max_body_bytes} "
                                 "bytes). Raise the cap with `infemeral-client serve --max-body-bytes N` (or "
                                 "INFEMERAL_SERVE_MAX_BODY_BYTES).", code="request_too_large")


def create_app(pool: SessionPool, model_name: str, *, api_key: str | None = None,
               defaults: SamplingParams | None = None, allowed_hosts: Iterable[str] = (),
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The endpoint as an ASGI app; serve it with uvicorn. `api_key`: the key HTTP clients must send;
    `allowed_hosts`: host names requests may be addressed to besides loopback ('*': any);
    `max_body_bytes`: the largest request body accepted (see `RequestGuard`)."""
    endpoint = OpenAIEndpoint(pool, model_name, defaults or SamplingParams())

    @asynccontextmanager
    async def lifespan(app):
        yield
        await run_in_threadpool(pool.close)  # the session keys live only here: delete what the server holds

    app = FastAPI(title="infemeral", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.endpoint = endpoint
    app.add_middleware(RequestGuard, allowed_hosts=allowed_hosts, max_body_bytes=max_body_bytes)

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise RequestError(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY' with the key "
                                    "given to `infemeral-client serve --api-key`.", code="invalid_api_key")

    @app.exception_handler(RequestError)
    async def request_error(request: Request, e: RequestError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(InfemeralError)
    async def infemeral_error(request: Request, e: InfemeralError):
        return await request_error(request, to_request_error(e))

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            failure = RequestError(400, "We could not parse the JSON body of your request: "
                                        f"{first.get('ctx', {}).get('error', 'invalid JSON')}.")
        else:
            loc = [str(part) for part in first.get("loc", ()) if part != "body"]
            failure = RequestError(400, f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}",
                                   param=".".join(loc) or None)
        return await request_error(request, failure)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return await request_error(request, RequestError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        log.error("request failed: %s", type(e).__name__)  # the type only: its text may hold a prompt
        return await request_error(request, RequestError(500, "internal error in the infemeral endpoint",
                                                         type="server_error", code="internal_error"))

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models():
        return model_list(model_name, endpoint.created)

    @app.get("/v1/models/{name:path}", dependencies=[Depends(authorize)])
    async def model(name: str):
        endpoint.check_model(name)
        return model_card(model_name, endpoint.created)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(body: ChatCompletionRequest):
        started = time.perf_counter()
        answer, _ = await run_in_threadpool(endpoint.chat_answer, body)
        if not body.stream:
            result = await run_in_threadpool(endpoint.run_whole, answer, started, "chat completion")
            return endpoint.chat_response(answer, result)
        rid, created = new_id("chatcmpl"), now()

        def chunk(delta: str | None, finish: str | None) -> dict:
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                    "choices": [{"index": 0, "delta": {} if delta is None else {"content": delta},
                                 "logprobs": None, "finish_reason": finish}]}

        opening = chunk("", None)
        opening["choices"][0]["delta"]["role"] = "assistant"
        return await _stream(endpoint, answer, chunk, body.include_usage, started, "chat completion", [opening])

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest):
        started = time.perf_counter()
        answer, echo = await run_in_threadpool(endpoint.completion_answer, body)
        if not body.stream:
            result = await run_in_threadpool(endpoint.run_whole, answer, started, "completion")
            return endpoint.completion_response(answer, result, echo)
        rid, created = new_id("cmpl"), now()

        def chunk(text: str | None, finish: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]}

        opening = [chunk(echo, None)] if echo else []
        return await _stream(endpoint, answer, chunk, body.include_usage, started, "completion", opening)

    return app


async def _stream(endpoint: OpenAIEndpoint, answer: Answer, chunk, include_usage: bool, started: float, kind: str,
                  opening: list[dict]):
    """Open the turn before answering, so that a request that fails at once (server unreachable, stale
    session) gets an HTTP error status rather than a stream that breaks off."""
    try:
        first = await run_in_threadpool(answer.first)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await run_in_threadpool(answer.close)
        raise
    return _AnswerStream(endpoint.events(answer, first, chunk, include_usage, started, kind, opening), answer)

"""The endpoint as an ASGI app: routes, the API key check and error bodies, wired to one serving object
per endpoint.

Chat UIs, editors and agent frameworks speak OpenAI's API; this endpoint lets
them use a private model unchanged while the privacy boundary stays on the
laptop: text reaches this process only, and what goes on to the pod is what
every infemeral turn sends (hidden states in the secret basis).

Requests are stateless and carry the whole conversation; a `SessionPool`
keeps live sessions keyed by token prefix, so a growing conversation sends
only its new tokens. Concurrent requests run in parallel sessions and the
server batches them.

    GET  /v1/models              the one model, named after the client bundle   (serving_models.py)
    POST /v1/chat/completions    chat, streaming (server-sent events) or not     (serving_chat.py)
    POST /v1/completions         raw text completion, no chat template           (serving_completion.py)

and infemeral's own, for the chat page:

    GET  /  and  /static/NAME    the chat page                                   (page.py)
    GET  /v1/conversations       saved conversations; GET, PATCH (rename) and
                                 DELETE /v1/conversations/NAME                   (conversations.py)
    POST /v1/conversations/NAME/fork    a copy of a saved one, made on the pod   (conversations.py)
    GET  /v1/pod                 the pod's address and the link's TLS            (serving_pod.py)
    POST /v1/conversations/NAME/audit   what a public-weights operator recovers  (serving_pod.py)

Before any route, a request must be addressed to an allowed host name and carry
a body within the cap (`RequestGuard`), and carry the API key if one is set
(the page's three files excepted: they hold no secret).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterable
from contextlib import asynccontextmanager

from fastapi import APIRouter, Body, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from infemeral.client.sampling import SamplingParams
from infemeral.endpoint.conversations import Conversations
from infemeral.endpoint.errors import to_request_error
from infemeral.endpoint.guard import MAX_BODY_BYTES, RequestGuard
from infemeral.endpoint.page import page_file
from infemeral.endpoint.schema import ChatCompletionRequest, CompletionRequest, ForkRequest, RequestError
from infemeral.endpoint.serving_chat import ServingChat
from infemeral.endpoint.serving_completion import ServingCompletion
from infemeral.endpoint.serving_models import ServingModels
from infemeral.endpoint.serving_pod import ServingPod
from infemeral.endpoint.session_pool import SessionPool
from infemeral.errors import InfemeralError

log = logging.getLogger(__name__)


def create_app(pool: SessionPool, model_name: str, *, api_key: str | None = None,
               defaults: SamplingParams | None = None, allowed_hosts: Iterable[str] = (),
               max_body_bytes: int = MAX_BODY_BYTES, conversations: Conversations | None = None) -> FastAPI:
    """The endpoint as an ASGI app; serve it with uvicorn. `api_key`: the key HTTP clients must send;
    `allowed_hosts`: host names requests may be addressed to besides loopback ('*': any);
    `max_body_bytes`: the largest request body accepted (see `RequestGuard`); `conversations`: the saved
    sessions the chat page lists and chat requests may name (None: none are kept)."""
    app = FastAPI(title="infemeral", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    defaults = defaults or SamplingParams()
    models = ServingModels(model_name)
    app.state.pool, app.state.api_key, app.state.models = pool, api_key, models
    app.state.chat = ServingChat(pool, models, defaults, conversations)
    app.state.completion = ServingCompletion(pool, models, defaults)
    app.state.conversations = conversations
    app.state.pod = ServingPod(pool, conversations)
    app.add_middleware(RequestGuard, allowed_hosts=allowed_hosts, max_body_bytes=max_body_bytes)
    for error, handler in ERROR_HANDLERS.items():
        app.add_exception_handler(error, handler)
    app.include_router(page)
    app.include_router(router)
    return app


@asynccontextmanager
async def lifespan(app: FastAPI):
    yield
    await run_in_threadpool(app.state.pool.close)  # the session keys live only here: delete what the server holds


def authorize(request: Request) -> None:
    api_key = request.app.state.api_key
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise RequestError(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY' with the key "
                                "given to `infemeral-client serve --api-key`.", code="invalid_api_key")


# -- routes ---------------------------------------------------------------------------------------------
page = APIRouter()  # the chat page's files: no key (see page.py)
router = APIRouter(dependencies=[Depends(authorize)])


@page.get("/")
async def chat_page():
    return page_file("index.html")


@page.get("/static/{name}")
async def chat_page_file(name: str):
    found = page_file(name)
    if found is None:
        raise RequestError(404, f"no page file named {name[:100]!r}")
    return found


@router.get("/v1/models")
async def list_models(request: Request):
    return request.app.state.models.list()


@router.get("/v1/models/{name:path}")
async def show_model(name: str, request: Request):
    return request.app.state.models.card(name)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    return await request.app.state.chat.create(body)


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request):
    return await request.app.state.completion.create(body)


def kept(request: Request) -> Conversations:
    conversations = request.app.state.conversations
    if conversations is None:
        raise RequestError(404, "this endpoint keeps no conversations", code="conversation_not_found")
    return conversations


@router.get("/v1/conversations")
async def list_conversations(request: Request):
    return await run_in_threadpool(kept(request).list)


@router.get("/v1/conversations/{name}")
async def show_conversation(name: str, request: Request):
    return await run_in_threadpool(kept(request).show, name)


@router.patch("/v1/conversations/{name}")
async def rename_conversation(name: str, request: Request, new_name: str = Body(embed=True, alias="name")):
    return await run_in_threadpool(kept(request).rename, name, new_name)


@router.delete("/v1/conversations/{name}")
async def delete_conversation(name: str, request: Request):
    return await run_in_threadpool(kept(request).delete, name)


@router.post("/v1/conversations/{name}/fork")
async def fork_conversation(name: str, request: Request, body: ForkRequest | None = None):
    body = body or ForkRequest()
    return await run_in_threadpool(kept(request).fork, name, body.at_turn, body.name)


@router.post("/v1/conversations/{name}/audit")
async def audit_conversation(name: str, request: Request):
    return await run_in_threadpool(request.app.state.pod.audit, name)


@router.get("/v1/pod")
async def describe_pod(request: Request):
    return await run_in_threadpool(request.app.state.pod.describe)


# -- errors: every failure is an OpenAI error body ----------------------------------------------------------
async def request_error(request: Request, e: RequestError):
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def infemeral_error(request: Request, e: InfemeralError):
    return await request_error(request, to_request_error(e))


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


async def http_error(request: Request, e: HTTPException):
    return await request_error(request, RequestError(e.status_code, str(e.detail)))


async def unexpected(request: Request, e: Exception):
    log.error("request failed: %s", type(e).__name__)  # the type only: its text may hold a prompt
    return await request_error(request, RequestError(500, "internal error in the infemeral endpoint",
                                                     type="server_error", code="internal_error"))


ERROR_HANDLERS = {RequestError: request_error, InfemeralError: infemeral_error,
                  RequestValidationError: invalid_request, HTTPException: http_error, Exception: unexpected}

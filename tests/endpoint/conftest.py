"""The endpoint's shared fixture: the OpenAI endpoint in uvicorn on a free port, in front of the shared real
server, its Client recording every Turn call (tests/endpoint/openai_endpoint.py)."""

from __future__ import annotations

import pytest

from infemeral.client.client import Client
from infemeral.client.sampling import SamplingParams
from infemeral.endpoint.app import create_app
from infemeral.endpoint.session_pool import SessionPool

from tests.endpoint.openai_endpoint import MODEL, TOKENS, Endpoint, TurnLog
from tests.support.http_endpoint import Uvicorn


@pytest.fixture(scope="module")
def endpoint(server, bundles):
    log = TurnLog()
    client = Client(f"127.0.0.1:{server.port}", bundles.client_dir, timeout=120, interceptors=[log])
    pool = SessionPool(client, max_sessions=3)
    http = Uvicorn(create_app(pool, MODEL, defaults=SamplingParams(max_new_tokens=TOKENS)))
    yield Endpoint(http.url, client, pool, log)
    http.stop()
    client.close()

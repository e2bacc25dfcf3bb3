"""`infemeral-client serve`: run the OpenAI-compatible endpoint with uvicorn.

The endpoint holds the conversations in plain text and the session keys, so it
listens on loopback by default. Anyone who can reach it can read and write
conversations through it: a non-loopback address is refused without an API
key, and even with one it is plain HTTP, so say so loudly.
"""

from __future__ import annotations

import ipaddress
import logging
import sys
from collections.abc import Callable

from infemeral.client.openai_api import bundle_model_name, create_app
from infemeral.client.session_pool import SessionPool
from infemeral.errors import FailedPrecondition, InfemeralError, StatusError


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: str | None) -> None:
    """Refuse to expose the endpoint without a key; warn when it leaves this machine at all."""
    if is_loopback(host):
        return
    if not api_key:
        raise InfemeralError(f"refusing to serve on {host} without --api-key: anyone who can reach that address "
                             "could read your conversations and use your session keys through this endpoint. "
                             "Set --api-key KEY (or INFEMERAL_SERVE_API_KEY), or keep the default 127.0.0.1.")
    print(f"WARNING: serving plain HTTP on {host}: the API key, prompts and answers cross the network "
          "unencrypted. Prefer 127.0.0.1 with an SSH tunnel, or put a TLS proxy in front.", file=sys.stderr)


def check_server(client) -> None:
    """Fail early on a server that serves another model; an unreachable one only gets a warning (requests
    answer 503 until it is up)."""
    try:
        info = client.server_info()
    except StatusError as e:
        print(f"warning: the infemeral server is not reachable yet ({e.code.name}); requests get 503 until it is",
              file=sys.stderr)
        return
    if info.bundle_fingerprint != client.bundle.server_fingerprint:
        raise FailedPrecondition("the infemeral server serves another bundle than this client bundle was prepared "
                                 "against; use the matching pair (`infemeral-client info`)")


def serve(settings, open_client: Callable[[], object], sampling: Callable[[object], object],
          server_address: str) -> int:
    """Serve until interrupted, then delete the pool's sessions on the server. `open_client()` makes the
    infemeral Client (after the exposure check, so a refused address costs nothing); `sampling(client)` gives
    the defaults for requests that leave values out."""
    import uvicorn

    check_exposure(settings.host, settings.api_key)
    with open_client() as client:
        check_server(client)
        name = settings.model_name or bundle_model_name(client.bundle.directory)
        pool = SessionPool(client, max_sessions=settings.max_sessions)
        app = create_app(pool, name, api_key=settings.api_key, defaults=sampling(client))
        logging.getLogger("infemeral").setLevel(logging.INFO)
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        print(f"OpenAI-compatible endpoint: http://{host}:{settings.port}/v1 (model {name!r}), forwarding to "
              f"{server_address}; API key {'required' if settings.api_key else 'not required (loopback only)'}",
              file=sys.stderr, flush=True)
        uvicorn.run(app, host=settings.host, port=settings.port, log_level="info", timeout_graceful_shutdown=30)
    return 0

"""`infemeral-client serve`: run the OpenAI-compatible endpoint with uvicorn.

The endpoint holds the conversations in plain text and the session keys, so it
listens on loopback by default. Anyone who can reach it can read and write
conversations through it: a non-loopback address is refused without an API
key, and even with one it is plain HTTP, so say so loudly. Whatever the
address, requests must name an allowed host (loopback names, the --host
itself, --allowed-hosts): a web page cannot drive it through DNS rebinding.
The chat page at / keeps its conversations in --sessions-dir, beside
`chat --session`'s; --open opens it in the default browser.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys
import threading
import time
import webbrowser
from collections.abc import Callable
from pathlib import Path

from infemeral.client.session_store import SessionStore
from infemeral.endpoint.app import create_app
from infemeral.endpoint.conversations import Conversations
from infemeral.endpoint.guard import LOOPBACK_NAMES
from infemeral.endpoint.serving_models import bundle_model_name
from infemeral.endpoint.session_pool import SessionPool
from infemeral.errors import FailedPrecondition, InfemeralError, StatusError
from infemeral.transport import is_loopback


def is_wildcard(host: str) -> bool:
    """Whether `host` listens on every interface (0.0.0.0, ::): it names no one host clients would use."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return host == ""


def allowed_hosts(host: str, allowed: list[str]) -> list[str]:
    """The host names requests may be addressed to besides loopback: `allowed` (--allowed-hosts), and the
    listen address itself when it is neither loopback nor a wildcard (clients then reach it by that name)."""
    names = list(allowed)
    if not is_loopback(host) and not is_wildcard(host) and host.strip("[]") not in names:
        names.append(host.strip("[]"))
    return names


def check_hosts(host: str, allowed: list[str]) -> None:
    """On a wildcard address only loopback names are answered until the machine's names are given: say so."""
    if is_wildcard(host) and not allowed:
        print(f"note: listening on every interface, but answering only requests addressed to "
              f"{', '.join(LOOPBACK_NAMES)}: name this machine as clients reach it with --allowed-hosts "
              "(e.g. --allowed-hosts 192.168.1.20,mybox.lan; '*' answers any name), or requests from other "
              "machines are refused with 403", file=sys.stderr)


def check_exposure(host: str, api_key: str | None) -> None:
    """Refuse to expose the endpoint without a key; warn when it leaves this machine at all."""
    if is_loopback(host):
        return
    if not api_key:
        raise InfemeralError(f"refusing to serve on {host} without --api-key: anyone who can reach that address "
                             "could read your conversations and use your session keys through this endpoint. "
                             "Set the key in INFEMERAL_SERVE_API_KEY (not --api-key on the command line, where "
                             "`ps` shows it to everyone on this machine), or keep the default 127.0.0.1.")
    print(f"WARNING: serving plain HTTP on {host}: the API key, prompts and answers cross the network "
          "unencrypted. Prefer 127.0.0.1 with an SSH tunnel, or put a TLS proxy in front.", file=sys.stderr)


def check_port(host: str, port: int) -> None:
    """Try the address before the client loads and the banner is printed, as the server does: uvicorn would
    report a taken port only afterwards, as a raw errno."""
    from infemeral.server.listen import CannotListen, ListenAddress, check_free

    try:
        check_free(ListenAddress(host.strip("[]"), port))
    except CannotListen as e:
        raise CannotListen(f"{e} (pick another --port)") from None


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


def page_host(host: str) -> str:
    """The listen address as a browser on this machine reaches it (a wildcard address through loopback)."""
    return "127.0.0.1" if is_wildcard(host) else host.strip("[]")


def page_url(host: str, port: int) -> str:
    """Where a browser on this machine finds the chat page."""
    host = page_host(host)
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/"


def open_when_listening(host: str, port: int, timeout: float = 60.0) -> None:
    """Open the chat page in the default browser once the endpoint accepts connections (a browser opened
    sooner finds nothing there); give up quietly if it never does."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((page_host(host), port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)
    url = page_url(host, port)
    if not webbrowser.open(url):
        print(f"could not open a web browser: the chat page is at {url}", file=sys.stderr, flush=True)


def serve(settings, open_client: Callable[[], object], sampling: Callable[[object], object],
          server_address: str, sessions_dir: str | Path | None = None) -> int:
    """Serve until interrupted, then delete the pool's sessions on the server. `open_client()` makes the
    infemeral Client (after the exposure check, so a refused address costs nothing); `sampling(client)` gives
    the defaults for requests that leave values out; `sessions_dir` keeps the chat page's conversations (None:
    the page keeps none)."""
    import uvicorn

    check_exposure(settings.host, settings.api_key)
    check_port(settings.host, settings.port)
    hosts = allowed_hosts(settings.host, settings.allowed_hosts)
    check_hosts(settings.host, hosts)
    with open_client() as client:
        check_server(client)
        name = settings.model_name or bundle_model_name(client.bundle.directory)
        pool = SessionPool(client, max_sessions=settings.max_sessions)
        conversations = None if sessions_dir is None else Conversations(
            SessionStore(sessions_dir, client.bundle.server_fingerprint), pool)
        app = create_app(pool, name, api_key=settings.api_key, defaults=sampling(client), allowed_hosts=hosts,
                         max_body_bytes=settings.max_body_bytes, conversations=conversations)
        logging.getLogger("infemeral").setLevel(logging.INFO)
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        print(f"OpenAI-compatible endpoint: http://{host}:{settings.port}/v1 (model {name!r}), forwarding to "
              f"{server_address}; API key {'required' if settings.api_key else 'not required (loopback only)'}"
              f"{'; also answers to Host ' + ', '.join(hosts) if hosts else ''}; chat page: "
              f"{page_url(settings.host, settings.port)}", file=sys.stderr, flush=True)
        if settings.open:
            threading.Thread(target=open_when_listening, args=(settings.host, settings.port), daemon=True).start()
        uvicorn.run(app, host=settings.host, port=settings.port, log_level="info", timeout_graceful_shutdown=30)
    return 0

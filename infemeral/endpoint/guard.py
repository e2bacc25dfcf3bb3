"""What every request passes before a route sees it: an allowed host name, and a body within the cap."""

from __future__ import annotations

from collections.abc import Iterable

from fastapi.responses import JSONResponse

from infemeral.endpoint.schema import RequestError
from infemeral.transport import is_loopback, split_host_port

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
MAX_BODY_BYTES = 4 * 2**20


class RequestGuard:
    """What every request passes before a route sees it (docs/design.md §12): it is addressed to an allowed host
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

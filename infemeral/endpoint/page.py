"""The chat page at `/`: three static files shipped in the package (static/), served with headers that keep
the page to this origin.

The page is plain HTML, one script and one stylesheet: no build step, and nothing
loaded from anywhere but this endpoint (its Content-Security-Policy forbids
other origins, inline script and plugins). It is served without the API key:
the page holds no secret. A key, when the endpoint has one, is typed into the
page, kept in this origin's sessionStorage and sent only to this origin's JSON
routes, which check it like every API route.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import Response

STATIC = files("infemeral.endpoint") / "static"
MEDIA_TYPES = {"index.html": "text/html; charset=utf-8", "chat.js": "text/javascript; charset=utf-8",
               "chat.css": "text/css; charset=utf-8"}

CONTENT_SECURITY_POLICY = "; ".join([
    "default-src 'self'", "script-src 'self'", "style-src 'self'", "img-src 'self'", "connect-src 'self'",
    "font-src 'none'", "object-src 'none'", "base-uri 'none'", "form-action 'none'", "frame-ancestors 'none'"])
PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def page_file(name: str) -> Response | None:
    """One of the page's files with its headers; None for any other name."""
    if name not in MEDIA_TYPES:
        return None
    return Response((STATIC / name).read_bytes(), media_type=MEDIA_TYPES[name], headers=PAGE_HEADERS)

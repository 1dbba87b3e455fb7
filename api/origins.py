"""Which web pages may use the API from a browser: same origin, plus an allow-list.

A browser attaches ``Origin`` to every websocket handshake and to every
request that changes state. Requests without it come from programs (curl, the
SDKs, the text client), which no web page can drive, and pass. With it, the
origin must be the API's own (its host and port, whatever the scheme: a TLS
proxy in front changes only that) or one of ``allowed_origins``; otherwise a
websocket handshake, or a POST/PUT/PATCH/DELETE, is refused with 403 before
any route runs — so a page on another site cannot make its visitors' browsers
submit jobs or read streams.

An API that listens on a loopback address (``make run``'s default) counts as
its own origin only under a loopback name (``localhost``, ``127.0.0.1``,
``[::1]``, ``*.localhost``): a page whose own name was re-pointed at
127.0.0.1 after it loaded (DNS rebinding) sends ``Host`` and ``Origin`` that
agree with each other, and would otherwise pass as the API's own page. An API
listening on other addresses serves whatever names its proxy or DNS give it,
so there ``Host`` is taken as it comes.

For the allowed other origins the answers carry CORS headers (with
preflights, which Flask answers for every route), so a web app served from
elsewhere can call the API with its token. Tokens travel in headers, never
cookies, so credentials are never allowed.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from flask import Flask, Response, request

from api.errors import Forbidden
from api.services import services

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
CORS_ALLOW_HEADERS = "Authorization, Content-Type, Idempotency-Key, Last-Event-ID, X-Request-ID"
CORS_ALLOW_METHODS = "GET, POST, PUT, PATCH, DELETE, OPTIONS"
CORS_EXPOSE_HEADERS = "Retry-After, Location, X-Request-ID"
CORS_MAX_AGE_S = 600


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def is_loopback(name: str) -> bool:
    """Whether a host name or address (no port, no brackets) is this machine's loopback."""
    name = name.lower().rstrip(".")
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _host_name(host: str) -> str:
    """``Host``'s name without its port (and an IPv6 address without brackets)."""
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def same_origin(origin: str) -> bool:
    """Whether ``origin`` names this API's own host and port (module docstring)."""
    try:
        netloc = urlsplit(origin).netloc
    except ValueError:
        return False
    if not netloc or netloc.lower() != request.host.lower():
        return False
    return not is_loopback(services().settings.api_host) or is_loopback(_host_name(request.host))


def allowed_other_origin(origin: str) -> bool:
    """Whether ``origin``, not the API's own, is on the allow-list (or the list is '*')."""
    origins = services().settings.origins()
    return "*" in origins or origin.strip().rstrip("/").lower() in origins


def _is_websocket() -> bool:
    return request.headers.get("Upgrade", "").lower() == "websocket"


def _check_origin() -> None:
    origin = request.headers.get("Origin")
    if origin is None:
        return
    if request.method in SAFE_METHODS and not _is_websocket():
        return  # the browser lets the page read the answer only with CORS headers
    if same_origin(origin) or allowed_other_origin(origin):
        return
    raise Forbidden(
        f"requests from the web origin {origin[:100]!r} are not allowed here "
        "(SWITCHYARD_ALLOWED_ORIGINS)"
    )


def _cors_headers(response: Response) -> Response:
    origin = request.headers.get("Origin")
    if origin is None or same_origin(origin):
        return response
    response.vary.add("Origin")
    if not allowed_other_origin(origin):
        return response
    response.headers["Access-Control-Allow-Origin"] = origin
    response.headers["Access-Control-Expose-Headers"] = CORS_EXPOSE_HEADERS
    if request.method == "OPTIONS":
        response.headers["Access-Control-Allow-Methods"] = CORS_ALLOW_METHODS
        response.headers["Access-Control-Allow-Headers"] = CORS_ALLOW_HEADERS
        response.headers["Access-Control-Max-Age"] = str(CORS_MAX_AGE_S)
    return response


def init_app(app: Flask) -> None:
    app.before_request(_check_origin)
    app.after_request(_cors_headers)

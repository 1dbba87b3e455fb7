"""The web app: plain HTML, CSS and JS files served as they are (no build step).

``/`` is the chat page, ``/ops`` the operator page; their scripts and styles
are under ``/assets/``. The pages hold no secret: the browser keeps the API
token in its own storage and sends it in headers (or in the websocket's
subprotocol), never in a URL.
"""

from __future__ import annotations

from pathlib import Path

from flask import Blueprint, Response, send_from_directory

STATIC = Path(__file__).resolve().parent / "static"

bp = Blueprint("web", __name__, static_folder=str(STATIC), static_url_path="/assets")

# Scripts and styles only from this origin, no inline code, no framing:
# a page that holds an API token must not run anyone else's script.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)


def _page(name: str) -> Response:
    response = send_from_directory(STATIC, name, max_age=0)
    response.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["Cache-Control"] = "no-cache"
    return response


@bp.get("/")
def chat_page() -> Response:
    return _page("index.html")


@bp.get("/ops")
def ops_page() -> Response:
    return _page("ops.html")

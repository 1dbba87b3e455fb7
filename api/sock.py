"""The flask-sock extension, created unbound and bound in the app factory.

:func:`init_app` also puts every websocket request's client socket behind a
:class:`api.wire.WireSocket` before flask-sock builds its server on it, so
that every frame, simple-websocket's pings included, is written whole and alone.
"""

from flask import Flask, request
from flask_sock import Sock

from api.wire import guard

sock = Sock()


def _guard_websocket() -> None:
    if request.environ.get("HTTP_UPGRADE", "").lower() == "websocket":
        guard(request.environ)


def init_app(app: Flask) -> None:
    app.before_request(_guard_websocket)
    sock.init_app(app)

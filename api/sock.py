"""The flask-sock extension, created unbound and bound in the app factory.

:func:`init_app` also puts every websocket request's client socket behind a
:class:`api.wire.WireSocket` before flask-sock builds its server on it, so
that every frame, simple-websocket's pings included, is written whole and alone.
"""

import contextlib
import socket

from flask import Flask, request
from flask_sock import Sock

from api.wire import WireSocket, guard

sock = Sock()


def _guard_websocket() -> None:
    if request.environ.get("HTTP_UPGRADE", "").lower() == "websocket":
        guard(request.environ)


def _end_websocket(_exc: BaseException | None) -> None:
    # Werkzeug's server (tests, `flask run`) writes the handler's HTTP response
    # after the websocket ended: bytes a client would parse as a broken frame.
    # Ending our half of the connection first makes that write fail instead.
    sock_ = request.environ.get("werkzeug.socket")
    if isinstance(sock_, WireSocket):
        with contextlib.suppress(OSError):
            sock_.raw.shutdown(socket.SHUT_WR)


def init_app(app: Flask) -> None:
    app.before_request(_guard_websocket)
    app.teardown_request(_end_websocket)
    sock.init_app(app)

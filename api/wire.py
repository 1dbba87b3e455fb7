"""A websocket's client socket with one writer at a time, and whole frames only.

Several writers share a websocket's socket: the relay sending events, a
multiplexed socket's relays, and simple-websocket's reader (pings, pongs, the
close handshake). A frame must reach the wire whole and alone. Under gevent a
write that does not fit in the socket's buffer yields half-way to other
greenlets (and simple-websocket's own ``sock.send`` writes only what fits), so
an unguarded writer can put a ping in the middle of an event frame: the client
then reads garbage headers ("rsv is not implemented") and closes. Under
threads the same race is only rarer.

:class:`WireSocket` wraps the socket: every write takes its lock, writes the
whole frame or gives up after a deadline, and a frame cut short marks the
socket broken so that nothing else follows it. Frames are also *encoded*
under the lock (wsproto's per-message deflate is stateful, so encoding order
must be sending order). :func:`guard` installs it on a websocket request's
environ before flask-sock builds its server.
"""

from __future__ import annotations

import _socket
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

# How long one of simple-websocket's own writes (handshake, ping, pong, close)
# may wait for a client that does not read, in seconds.
CONTROL_WRITE_S = 10.0
# How long a blocked write sleeps between two looks at its give-up condition, in seconds.
SEND_POLL_S = 0.1

ENVIRON_SOCKET_KEYS = ("gunicorn.socket", "werkzeug.socket")


class WriteTimeout(Exception):
    """A frame was not taken in time; ``partial`` when part of it was written."""

    def __init__(self, why: str, *, partial: bool) -> None:
        super().__init__(why)
        self.partial = partial


class WireSocket:
    """A client socket whose writes are serialised and whole (see the module's doc).

    Everything but writing is the wrapped socket's own (``recv``, ``fileno``,
    ``close``, ``shutdown`` ...), so simple-websocket's reader uses it as it is.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.raw = sock
        self.lock = threading.Lock()
        # A frame was cut short: any further byte would corrupt the stream.
        self.broken = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)

    def fileno(self) -> int:
        return self.raw.fileno()

    def send(self, data: bytes, flags: int = 0) -> int:
        """simple-websocket's writes: whole or not at all; a failure is an ``OSError``,
        which its reader takes as the connection's end."""
        try:
            self.write(lambda: bytes(data), CONTROL_WRITE_S)
        except WriteTimeout as exc:
            raise BrokenPipeError(str(exc)) from None
        return len(data)

    def sendall(self, data: bytes, flags: int = 0) -> None:
        self.send(data, flags)

    def write(
        self,
        encode: Callable[[], bytes],
        timeout_s: float,
        give_up: Callable[[], bool] | None = None,
    ) -> None:
        """Encode a frame and write all of it within ``timeout_s``, holding the lock throughout.

        Raises :class:`WriteTimeout` when the lock or the client took too long
        (or ``give_up()`` turned true while waiting), ``BrokenPipeError`` when
        the socket is broken or closed.
        """
        deadline = time.monotonic() + timeout_s
        if not self.lock.acquire(timeout=max(timeout_s, 0.001)):
            raise WriteTimeout(f"another frame held the socket over {timeout_s:g} s", partial=False)
        try:
            if self.broken:
                raise BrokenPipeError("a frame was cut short on this socket")
            payload = encode()
            self._write_all(memoryview(payload), deadline, timeout_s, give_up)
        finally:
            self.lock.release()

    def _write_all(
        self,
        view: memoryview,
        deadline: float,
        timeout_s: float,
        give_up: Callable[[], bool] | None,
    ) -> None:
        sent = 0
        while sent < len(view):
            try:
                sent += self._send_some(view[sent:])
                continue
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self.broken = sent > 0 or self.broken
                raise BrokenPipeError("the client's socket is closed") from None
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (give_up is not None and give_up()):
                self.broken = self.broken or sent > 0
                why = (
                    "the subscription is lagging"
                    if remaining > 0
                    else (f"a frame waited over {timeout_s:g} s")
                )
                raise WriteTimeout(why, partial=sent > 0)
            poller = select.poll()  # gevent's own under gevent: it yields
            poller.register(self.raw.fileno(), select.POLLOUT)
            poller.poll(min(remaining, SEND_POLL_S) * 1000)

    def _send_some(self, view: memoryview) -> int:
        # Never block in the write itself: gevent's socket wraps a non-blocking
        # one (its ``send`` would wait on the socket's single write watcher); a
        # plain blocking socket gets MSG_DONTWAIT, which leaves its mode alone for
        # the reader thread.
        inner = getattr(self.raw, "_sock", None)
        if isinstance(inner, _socket.socket):
            return int(inner.send(view))
        return int(self.raw.send(view, socket.MSG_DONTWAIT))


def guard(environ: dict[str, Any]) -> None:
    """Wrap a websocket request's client socket in a :class:`WireSocket` (once)."""
    for key in ENVIRON_SOCKET_KEYS:
        sock = environ.get(key)
        if sock is not None and not isinstance(sock, WireSocket):
            environ[key] = WireSocket(sock)


def wire_of(ws: Any) -> WireSocket:
    """The :class:`WireSocket` of a simple-websocket server ``ws`` (installed if missing)."""
    sock = ws.sock
    if not isinstance(sock, WireSocket):
        sock = WireSocket(sock)
        ws.sock = sock
    return sock

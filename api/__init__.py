"""The Switchyard HTTP API: a Flask app factory.

``gunicorn 'api:create_app()'`` serves it. The factory binds the extensions,
registers one blueprint per resource and the JSON error handlers; it connects
to nothing until a request needs it.
"""

from __future__ import annotations

import redis
from flask import Flask
from werkzeug.middleware.proxy_fix import ProxyFix

from api import (
    admin,
    catalog,
    chats,
    health,
    history,
    jobs,
    metrics,
    multiplex,
    openai,
    openapi,
    operations,
    origins,
    request_ids,
    scaling,
    sock,
    tgi,
    tokenizer,
    web,
)
from api.auth import SUBPROTOCOL
from api.errors import register_error_handlers
from api.services import EXTENSION, Services
from api.streamcaps import StreamCaps
from api.streams import RelayHub
from config import Settings, load_catalog, load_settings
from config.logs import configure_logging
from db.accounts import Accounts
from db.jobs import JobStore
from db.session import Database
from jobs.events import EventLog

# Redis connections per API process (redis-py's default bound), and the longest
# a request waits, in seconds, for one of them to be free.
REDIS_POOL_SIZE = 100
REDIS_POOL_WAIT_S = 10.0


def create_app(settings: Settings | None = None) -> Flask:
    """Build the API for ``settings`` (default: from the environment)."""
    settings = settings or load_settings()
    configure_logging(settings)
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.config["SOCK_SERVER_OPTIONS"] = {
        "ping_interval": 25,
        # simple-websocket counts a message as it arrives and closes the socket with 1009
        # once it passes this: a huge frame is never held whole.
        "max_message_size": settings.ws_max_message_bytes,
        # Offered with "bearer.<token>" by browsers (api/auth.py); never echo the token.
        "subprotocols": [SUBPROTOCOL],
    }
    app.json.sort_keys = False  # type: ignore[attr-defined]

    # A blocking pool: when every connection is busy (say, a thousand streams
    # reading their history at once) a request waits for one instead of
    # failing with "Too many connections".
    pool = redis.BlockingConnectionPool.from_url(
        settings.redis_url,
        max_connections=REDIS_POOL_SIZE,
        timeout=REDIS_POOL_WAIT_S,
        health_check_interval=30,
        socket_keepalive=True,
    )
    client = redis.Redis.from_pool(pool)
    # Streams hold no connection while they wait (each query takes one and gives it
    # back), so a small pool serves thousands of them; Postgres' own limit is shared
    # by every process of the farm.
    db = Database.for_process(settings)
    events = EventLog(client, settings)
    app.extensions[EXTENSION] = Services(
        settings=settings,
        catalog=load_catalog(settings.models_dir),
        db=db,
        jobs=JobStore(db),
        accounts=Accounts(
            db,
            touch_interval_s=settings.token_touch_interval_s,
            cache_s=settings.token_cache_s,
        ),
        redis=client,
        events=events,
        hub=RelayHub(client, events, settings),
        caps=StreamCaps(client, settings),
    )
    request_ids.init_app(app)
    origins.init_app(app)  # before any route: a refused origin runs nothing
    sock.init_app(app)  # websockets' sockets write whole frames, one writer at a time
    for blueprint in (health.bp, catalog.bp, jobs.bp):
        app.register_blueprint(blueprint)
    app.register_blueprint(chats.bp)
    for blueprint in (openai.bp, tgi.bp, multiplex.bp, tokenizer.bp, admin.bp, openapi.bp):
        app.register_blueprint(blueprint)
    app.register_blueprint(scaling.bp)
    app.register_blueprint(history.bp)
    app.register_blueprint(web.bp)
    metrics.init_app(app)
    operations.init_app(app, app.extensions[EXTENSION])
    register_error_handlers(app)
    if settings.api_trusted_proxies:
        # The client's address (limits, stream caps) and scheme come from the
        # last N hops of X-Forwarded-*: those the trusted proxies appended.
        hops = settings.api_trusted_proxies
        app.wsgi_app = ProxyFix(  # type: ignore[method-assign]
            app.wsgi_app, x_for=hops, x_proto=hops, x_host=hops, x_port=hops
        )
    return app

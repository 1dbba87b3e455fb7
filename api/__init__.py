"""The Switchyard HTTP API: a Flask app factory.

``gunicorn 'api:create_app()'`` serves it. The factory binds the extensions,
registers one blueprint per resource and the JSON error handlers; it connects
to nothing until a request needs it.
"""

from __future__ import annotations

import logging

import redis
from flask import Flask

from api import (
    admin,
    catalog,
    chats,
    health,
    jobs,
    metrics,
    multiplex,
    openai,
    openapi,
    operations,
    scaling,
    tgi,
    tokenizer,
    web,
)
from api.auth import SUBPROTOCOL
from api.errors import register_error_handlers
from api.services import EXTENSION, Services
from api.sock import sock
from api.streams import RelayHub
from config import Settings, load_catalog, load_settings
from db.accounts import Accounts
from db.jobs import JobStore
from db.session import Database
from tasks import configure
from tasks.events import EventLog


def create_app(settings: Settings | None = None) -> Flask:
    """Build the API for ``settings`` (default: from the environment)."""
    settings = settings or load_settings()
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.config["SOCK_SERVER_OPTIONS"] = {
        "ping_interval": 25,
        "max_message_size": settings.max_body_bytes,
        # Offered with "bearer.<token>" by browsers (api/auth.py); never echo the token.
        "subprotocols": [SUBPROTOCOL],
    }
    app.json.sort_keys = False  # type: ignore[attr-defined]

    client = redis.Redis.from_url(
        settings.redis_url, health_check_interval=30, socket_keepalive=True
    )
    db = Database(settings.database_url)
    events = EventLog(client, settings)
    app.extensions[EXTENSION] = Services(
        settings=settings,
        catalog=load_catalog(settings.models_dir),
        db=db,
        jobs=JobStore(db),
        accounts=Accounts(db, touch_interval_s=settings.token_touch_interval_s),
        redis=client,
        events=events,
        hub=RelayHub(client, events, settings),
        celery=configure(settings),
    )
    sock.init_app(app)
    for blueprint in (health.bp, catalog.bp, jobs.bp):
        app.register_blueprint(blueprint)
    app.register_blueprint(chats.bp)
    for blueprint in (openai.bp, tgi.bp, multiplex.bp, tokenizer.bp, admin.bp, openapi.bp):
        app.register_blueprint(blueprint)
    app.register_blueprint(scaling.bp)
    app.register_blueprint(web.bp)
    metrics.init_app(app)
    operations.init_app(app, app.extensions[EXTENSION])
    register_error_handlers(app)
    return app

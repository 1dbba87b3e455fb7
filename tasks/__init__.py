"""The Celery side: the one app, queue naming, the generate task, the event log.

``celery -A tasks`` finds :data:`app`. Importing this package reads no
environment and connects to nothing; the app is configured lazily from the
environment, or explicitly with :func:`configure`.
"""

from tasks.celery import app, configure

__all__ = ["app", "configure"]

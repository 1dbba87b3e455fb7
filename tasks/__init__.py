"""The Celery side: the one app and the generate task (thin); nothing else.

``celery -A tasks`` finds :data:`app`. Importing this package reads no
environment and connects to nothing; the app is configured lazily from the
environment, or explicitly with :func:`configure`.
"""

from tasks.celery import app, configure

__all__ = ["app", "configure"]

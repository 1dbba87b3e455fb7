"""Celery configuration read from the environment, for ``celery -A tasks`` commands.

Imported only by Celery when nobody called :func:`tasks.celery.configure`.
"""

from config import load_settings
from tasks.celery import celery_config

globals().update(celery_config(load_settings()))

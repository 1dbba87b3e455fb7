"""How every Switchyard process writes its log: plain text, or one JSON object a line.

:func:`configure_logging` is called once by each process's entry point (the
API factory, ``switchyard worker``, ``scaler``, ``reaper``), never at import.
With ``SWITCHYARD_LOG_FORMAT=json`` each line is an object with ``time``,
``level``, ``logger`` and ``message``, plus the fields a record carries in
its ``fields`` attribute (the job events of :mod:`jobs.joblog`: ``event``,
``job_id``, ``model``, ``worker``, ``attempt``, ``request_id`` …), so a log
pipeline can select every line of one job.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

from config.settings import Settings

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FIELDS_ATTRIBUTE = "fields"
"""The attribute of a log record (``extra={"fields": {...}}``) that holds its structured fields."""


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, FIELDS_ATTRIBUTE, None)
    return fields if isinstance(fields, dict) else {}


def _text_value(value: Any) -> str:
    text = str(value)
    return repr(text) if not text or any(c.isspace() or c in "'\"" for c in text) else text


class TextFormatter(logging.Formatter):
    """The classic line, then the record's fields as ``key=value`` (``None`` ones left out)."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        pairs = [f"{k}={_text_value(v)}" for k, v in _fields(record).items() if v is not None]
        return " ".join([line, *pairs])


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, fields."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update({k: v for k, v in _fields(record).items() if k not in line})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class _SwitchyardHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler :func:`configure_logging` installs (found again on a second call)."""


def formatter_for(settings: Settings) -> logging.Formatter:
    """The formatter of ``settings.log_format``."""
    if settings.log_format == "json":
        return JsonFormatter()
    return TextFormatter()


def configure_logging(settings: Settings) -> None:
    """Send the root logger's records to stderr in ``settings.log_format`` at ``log_level``.

    Idempotent: a second call (another app built in the same process) updates
    the one handler it installed instead of adding another.
    """
    root = logging.getLogger()
    root.setLevel(settings.log_level)
    handler = next((h for h in root.handlers if isinstance(h, _SwitchyardHandler)), None)
    if handler is None:
        handler = _SwitchyardHandler(sys.stderr)
        root.addHandler(handler)
    handler.setFormatter(formatter_for(settings))
    # Python's warnings (a library's DeprecationWarning) become records too, so a
    # JSON log holds no stray line.
    logging.captureWarnings(settings.log_format == "json")

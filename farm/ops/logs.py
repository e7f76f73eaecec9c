"""Logging for every farm process: one line per event on stderr, as text or JSON.

``text`` is for people: ``2026-11-23T10:04:05.123Z INFO farm.broker pid=42 job ... done``.
``json`` is for log shippers (Loki, Elasticsearch, journald): one object per
line with ``time``, ``level``, ``logger``, ``pid``, ``message`` and any
``extra=`` fields the call passed.
"""

from __future__ import annotations

import json
import logging
import sys
import time

from farm import defaults

#: LogRecord attributes that are not ``extra=`` fields.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


def timestamp(record: logging.LogRecord) -> str:
    """UTC, ISO 8601, milliseconds."""
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = (
            f"{timestamp(record)} {record.levelname} {record.name} pid={record.process} "
            f"{record.getMessage()}"
        )
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        entry.update(
            {
                key: value
                for key, value in vars(record).items()
                if key not in _STANDARD and not key.startswith("_")
            }
        )
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


FORMATTERS = {"text": TextFormatter, "json": JsonFormatter}


def setup_logging(level: str, style: str = defaults.LOG_FORMAT) -> None:
    """Send the farm's logs to stderr at ``level`` in ``style`` (text or json)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(FORMATTERS[style]())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())

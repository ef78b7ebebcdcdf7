"""The router's log lines: text or JSON, timestamps in UTC ISO-8601.

An access line carries its fields twice: as the message (`key=value ...`, for people and the
text format) and as `record.fields`, which the JSON format writes as keys of their own.
`Unforeseen` says once what a background loop did not expect to fail with.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import sys
from typing import Any, Literal

LogFormat = Literal["text", "json"]


def configure(level: str, fmt: LogFormat) -> None:
    """Log to stderr in the given format; uvicorn's loggers too (start it with log_config=None)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # httpx logs every request it sends at INFO: health probes and upstream calls are not news.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # python-multipart warns of each malformed upload, which the client's 400 already says: a
    # hostile client must not be able to fill the router's log.
    logging.getLogger("python_multipart").setLevel(logging.ERROR)


def _utc(record: logging.LogRecord) -> str:
    moment = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = f"{_utc(record)} {record.levelname} {record.name} {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] | None = getattr(record, "fields", None)
        entry: dict[str, Any] = {"time": _utc(record), "level": record.levelname, "logger": record.name}
        if fields is not None:
            entry["message"] = "request"
            entry.update(fields)
        else:
            entry["message"] = record.getMessage()
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, separators=(",", ":"))


def key_values(fields: dict[str, str | int | None]) -> str:
    """`key=value ...` on one line; a missing value is `-`."""
    return " ".join(f"{key}={_escape('-' if value is None else str(value))}" for key, value in fields.items())


def _escape(value: str) -> str:
    """Keep one request on one log line: control characters, spaces and quotes escaped."""
    if value.isprintable() and " " not in value and '"' not in value:
        return value
    return json.dumps(value)


def client_hash(client: str) -> str:
    """A client's identity as the logs show it: its kind and a hash, never an API key.

    The same client always gets the same hash, so its requests can be followed across lines.
    """
    kind, _, identity = client.partition(":")
    return f"{kind}:{hashlib.sha256(identity.encode()).hexdigest()[:12]}"


class Unforeseen:
    """What a background loop serving every backend (scrape, health checks, discovery, the model
    list) catches besides the failures it names: a bug of ours or of a library's, or an answer no
    check foresaw. Each is logged once with its traceback, by its type and the line that raised
    it, whatever the backends it happens on and however often: a broken engine scraped each
    second cannot fill the log. The backend's own lines (stale, unhealthy) say the rest."""

    MOST = 256  # distinct ones logged; past them, none (a bounded set, whatever is raised)

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._logged: set[tuple[type[BaseException], str, int]] = set()

    def log(self, exc: BaseException, message: str, *args: object) -> None:
        """`exc` and its traceback, unless one of its type from the same line was logged."""
        where = exc.__traceback__
        while where is not None and where.tb_next is not None:
            where = where.tb_next
        key = (type(exc), where.tb_frame.f_code.co_filename, where.tb_lineno) if where else (type(exc), "", 0)
        if key in self._logged or len(self._logged) >= self.MOST:
            return
        self._logged.add(key)
        self._logger.exception(message + " (said once for this failure)", *args, exc_info=exc)

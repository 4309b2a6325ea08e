"""Logging for every tandem service, one call: structlog renders and writes tandem's own lines; lines of
third-party libraries (stdlib `logging`) go through a handler that renders them with the same processors.

`configure_logging(level, json=None)` is called once by each CLI before anything logs:

- Lines go to stderr (stdout stays machine-readable: ready lines and endpoint lists that launchers
  parse). JSON lines (one object per line: timestamp, level, logger, event, the bound context and
  the call's fields) when stderr is not a terminal — files, pipes, docker — readable colored
  console lines when it is. `json=True/False` forces one.
- Third-party libraries that use `logging` (grpc, asyncio) come out in the same format.
- Context: `bind_service(...)` adds the service and worker id to every line of the process;
  `request_context(rid)` binds `request_id` (structlog contextvars) while one request's message is
  handled, so every line logged inside — errors included, with their exception — carries it.
- Prompt text is logged only when `log_prompts=True` (the CLIs' `--log-prompts`); code that could
  log a prompt asks `prompts_enabled()` first.
"""

from __future__ import annotations

import logging
import sys
from contextlib import AbstractContextManager, nullcontext
from typing import IO, Any

import structlog

LEVELS = ("debug", "info", "warning", "error", "critical")
_log_prompts = False
# Process-wide fields (service, worker_id). Not contextvars: threads (the KV receiver's I/O thread,
# the metrics server) start with an empty context, and their lines must say which process wrote them.
_static: dict[str, Any] = {}


def _add_static(logger: Any, method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    for key, value in _static.items():
        event_dict.setdefault(key, value)
    return event_dict


def _level_number(level: str | int) -> int:
    if isinstance(level, int):
        return level
    name = str(level).lower()
    if name not in LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LEVELS)}, got {level!r}")
    return getattr(logging, name.upper())


def configure_logging(level: str | int = "info", json: bool | None = None, *, log_prompts: bool = False,
                      stream: IO[str] | None = None) -> None:
    """Set up structlog + stdlib logging for this process (safe to call again: it replaces)."""
    global _log_prompts
    level_no = _level_number(level)
    stream = stream if stream is not None else sys.stderr
    if json is None:
        json = not _isatty(stream)
    _log_prompts = bool(log_prompts)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        _add_static,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if json:
        # format_exc_info turns exc_info into an "exception" string field (the traceback).
        final: list[Any] = [structlog.processors.format_exc_info, structlog.processors.JSONRenderer(default=str)]
    else:
        final = [structlog.dev.ConsoleRenderer(colors=_isatty(stream))]
    # Third-party lines (stdlib logging) are formatted by the same processors.
    handler = logging.StreamHandler(stream)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *final]))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level_no)
    _LineWriter.handler = handler
    structlog.configure(
        processors=[*shared, *final],
        # tandem's own lines skip the stdlib record and handler: ~3x cheaper a line (a request logs 4).
        logger_factory=_LineWriter,
        # Filtering in the bound logger makes a disabled debug call a no-op method (no event dict).
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        cache_logger_on_first_use=True,
    )


class _LineWriter:
    """What tandem's structlog loggers write through: one rendered line per call to the stream of the
    handler the last configure_logging made, under that handler's lock (stdlib lines take it too, so
    the two never interleave). Looked up per call, so a logger cached before a reconfiguration follows."""

    handler: logging.StreamHandler  # set by configure_logging before it makes this class the logger factory

    def __init__(self, name: str | None = None, *_: Any) -> None:
        self.name = name or "root"  # structlog.stdlib.add_logger_name reads it

    def msg(self, message: str) -> None:
        handler = self.handler
        try:
            with handler.lock:  # type: ignore[union-attr]  (a StreamHandler always makes one)
                handler.stream.write(message + "\n")
                handler.stream.flush()
        except (OSError, ValueError):  # a closed or broken stream (the reader gone): never fail the caller,
            pass  # as stdlib's handlers do not

    log = debug = info = warning = warn = error = err = critical = fatal = exception = msg


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def prompts_enabled() -> bool:
    """True only when the operator opted in with --log-prompts."""
    return _log_prompts


def bind_service(**fields: Any) -> None:
    """Context carried by every line of this process, from any thread (service="decode", worker_id="d1")."""
    _static.update({k: v for k, v in fields.items() if v is not None})


def request_context(request_id: Any) -> AbstractContextManager:
    """`with request_context(rid):` binds request_id for the lines logged inside (a no-op for None)."""
    if not isinstance(request_id, str) or not request_id:
        return nullcontext()
    return structlog.contextvars.bound_contextvars(request_id=request_id)


def bind_request(request_id: str) -> None:
    """Bind request_id for the rest of the current asyncio task (one task per HTTP request / RPC)."""
    structlog.contextvars.bind_contextvars(request_id=request_id)

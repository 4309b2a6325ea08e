"""Structured logging: JSON lines off a terminal, console lines on request, the request id bound to
every line inside a request's context, and a clear error for an unknown level."""

from __future__ import annotations

import io
import json

import pytest


def test_configure_logging_formats_and_context():
    import logging

    import structlog

    from tandem.observability.logging import configure_logging, request_context

    root = logging.getLogger()
    saved = list(root.handlers), root.level
    buf = io.StringIO()  # not a terminal: JSON lines
    configure_logging("info", stream=buf)
    log = structlog.get_logger("t")
    try:
        with request_context("rid-7"):
            log.debug("hidden")
            try:
                raise KeyError("boom")
            except KeyError:
                log.exception("failed")
        log.info("outside")
        rows = [json.loads(x) for x in buf.getvalue().splitlines()]
        assert [r["event"] for r in rows] == ["failed", "outside"]
        assert rows[0]["request_id"] == "rid-7" and "KeyError" in rows[0]["exception"] and rows[0]["level"] == "error"
        assert "request_id" not in rows[1]
        assert rows[1]["logger"] == "t" and rows[1]["level"] == "info" and rows[1]["timestamp"].endswith("Z")
        # A logger used before a reconfiguration (cached) writes where the new one says, and a third-party
        # (stdlib) line comes out in the same shape.
        buf3 = io.StringIO()
        configure_logging("info", stream=buf3)
        log.info("moved", k=2)
        logging.getLogger("grpc").warning("foreign %d", 3)
        moved, foreign = [json.loads(x) for x in buf3.getvalue().splitlines()]
        assert (moved["event"], moved["k"], moved["logger"]) == ("moved", 2, "t")
        assert (foreign["event"], foreign["logger"], foreign["level"]) == ("foreign 3", "grpc", "warning")
        assert buf.getvalue().count("\n") == 2
        buf3.close()  # the stream is gone (a closed pipe, pytest's capture): a line is dropped, the caller goes on
        log.warning("nobody reads this")
        buf2 = io.StringIO()
        configure_logging("debug", json=False, stream=buf2)
        structlog.get_logger("t").debug("shown", k=1)
        assert "shown" in buf2.getvalue() and not buf2.getvalue().startswith("{")
        with pytest.raises(ValueError, match="log-level"):
            configure_logging("loud")
    finally:  # leave this pytest process's logging as it was
        structlog.reset_defaults()
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])

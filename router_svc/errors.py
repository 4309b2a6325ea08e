"""Errors a client can see, each with its HTTP status, gRPC code and OpenAI error type, so both
front ends report the same failure the same way."""

from __future__ import annotations

import re

import grpc

# Names that a validation message may start with (SamplingParams' and the APIs' own fields); the
# OpenAI error's `param` is filled from it so clients can point at the offending field.
_PARAM_RE = re.compile(r"^([a-z_]+)(\[\])?\b")


class RouterError(Exception):
    http_status = 500
    grpc_code = grpc.StatusCode.INTERNAL
    error_type = "internal_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.code}}


class BadRequest(RouterError):
    http_status = 400
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    error_type = "invalid_request_error"

    @classmethod
    def from_exception(cls, exc: Exception, known: set[str] | frozenset[str] = frozenset(),
                       param: str | None = None) -> "BadRequest":
        """Wrap a ValueError/TypeError whose message names the parameter (SamplingParams does)."""
        message = str(exc)
        if param is None:
            m = _PARAM_RE.match(message)
            if m and (not known or m.group(1) in known):
                param = m.group(1)
        return cls(message, param)


class ModelNotFound(RouterError):
    http_status = 404
    grpc_code = grpc.StatusCode.NOT_FOUND
    error_type = "invalid_request_error"
    code = "model_not_found"


class Overloaded(RouterError):
    http_status = 429
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NoWorkers(RouterError):
    http_status = 503
    grpc_code = grpc.StatusCode.UNAVAILABLE
    error_type = "service_unavailable"
    code = "no_workers"


class WorkerLost(RouterError):
    """The decode worker went away after tokens had reached the client: the request cannot be
    replayed elsewhere without the client seeing a different continuation."""

    http_status = 503
    grpc_code = grpc.StatusCode.UNAVAILABLE
    error_type = "service_unavailable"
    code = "worker_lost"


class NotFound(RouterError):
    http_status = 404
    grpc_code = grpc.StatusCode.NOT_FOUND
    error_type = "invalid_request_error"
    code = "not_found"


class Conflict(RouterError):
    """The request is valid but the cluster's state forbids it now (e.g. draining the last worker of a role)."""

    http_status = 409
    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    error_type = "invalid_request_error"
    code = "conflict"

"""Errors the router returns, always in the OpenAI shape.

    {"error": {"message": str, "type": str, "param": str | null, "code": int | str | null}}

`ApiError` is raised anywhere in request handling and turned into a response by
the app's single exception handler. `UpstreamError` is a failure of one attempt
against a worker; the dispatcher decides whether it is retried.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: int | str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code if code is not None else status
        self.retry_after = retry_after  # seconds, sent as the Retry-After header

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def encode(self) -> bytes:
        return msgspec.json.encode(self.body())


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


class UpstreamError(Exception):
    """One attempt failed. `worker_url` is the side to blame (None: no worker was reached).

    `message` is for the log (it names the worker); a client sees `public`: the worker's own
    message for a 4xx or 503 (about the request or the worker's load), else a generic line,
    so no internal URL, path or exception text leaves the router."""

    def __init__(self, status: int, message: str, *, type: str, worker_url: str | None,
                 public: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.worker_url = worker_url
        if public is None:
            public = message if worker_url is None else f"a worker failed to serve the request ({type})"
        self.public = public

    @property
    def retryable(self) -> bool:
        return self.status in RETRYABLE_STATUS

    @property
    def worker_fault(self) -> bool:
        """4xx is the request's fault, not the worker's (except 408/429)."""
        return self.retryable

    def to_api_error(self) -> ApiError:
        return ApiError(self.status, self.public, type=_public_type(self.type))

    @classmethod
    def from_body(cls, status: int, raw: bytes, worker_url: str) -> UpstreamError:
        """Parse a worker's error body (contract shape, or anything else)."""
        message, type_ = raw[:500].decode("utf-8", "replace") or f"HTTP {status}", "upstream_error"
        try:
            err = msgspec.json.decode(raw).get("error")
            if isinstance(err, dict):
                message = str(err.get("message", message))
                type_ = str(err.get("type", type_))
        except (msgspec.DecodeError, AttributeError):
            pass
        return cls(status, f"{worker_url}: {message}", type=type_, worker_url=worker_url,
                   public=_public(status, message, type_))

    @classmethod
    def from_event(cls, err: Any, worker_url: str) -> UpstreamError:
        """An in-stream `{"error": {...}}` event from a worker."""
        if not isinstance(err, dict):
            err = {"message": str(err)}
        code = err.get("code")
        status = code if isinstance(code, int) and 400 <= code < 600 else 500
        message = str(err.get("message", "worker reported an error"))
        type_ = str(err.get("type", "upstream_error"))
        return cls(status, f"{worker_url}: {message}", type=type_, worker_url=worker_url,
                   public=_public(status, message, type_))


_TYPE = re.compile(r"[a-z_]{1,64}")


def _public_type(type_: str) -> str:
    return type_ if _TYPE.fullmatch(type_) else "upstream_error"


def _public(status: int, worker_message: str, type_: str) -> str:
    """What a client reads: a worker's 4xx validation text; for 5xx a fixed string (the worker's own
    words, which can name engine state, capacity or hosts, go to the router's log with the rid)."""
    if status < 500:
        return worker_message[:500]
    if status == 503:
        return "the service is temporarily unavailable; retry later"
    if status == 501:  # a feature the worker's install lacks: its fixed text names the package (optional_packages)
        return worker_message[:500]
    return f"a worker failed to serve the request ({_public_type(type_)})"

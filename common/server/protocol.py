"""HTTP-side records of the native /generate contract (docs/generate_api.md).

GenerateRequestBody (common/server/generate_request.py) is what a client may send (unknown
fields are rejected by msgspec); ApiError is the one exception type the HTTP layer turns into the
error shape {"error": {"message", "type", "code"}}.
"""

from __future__ import annotations

from typing import Any

import msgspec

from common.server.generate_request import GenerateRequestBody

__all__ = ["GenerateRequestBody", "AbortRequestBody", "ApiError", "decode_generate_body", "decode_abort_body"]

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_BOOTSTRAP_ROOM = 2**63 - 1


class AbortRequestBody(msgspec.Struct, forbid_unknown_fields=True):
    rid: str


class ApiError(Exception):
    """An error with its HTTP status and error type; the message is safe to show a client.
    `retry_after` (seconds) becomes a Retry-After header (503 when the instance is full)."""

    def __init__(self, status: int, message: str, err_type: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type or default_error_type(status)
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.err_type)


def default_error_type(status: int) -> str:
    if status == 503:
        return "unavailable"
    if status == 504:
        return "timeout"
    if status == 501:
        return "not_implemented_error"  # e.g. a feature whose package is missing (common/optional_packages.py)
    if 400 <= status < 500:
        return "invalid_request_error"
    return "internal_error"


def error_body(status: int, message: str, err_type: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type or default_error_type(status), "code": status}}


def bad_request(message: str) -> ApiError:
    return ApiError(400, message)


def decode_generate_body(raw: bytes) -> GenerateRequestBody:
    """Bytes -> typed body, or ApiError(400) naming what is wrong and where."""
    try:
        body = msgspec.json.decode(raw, type=GenerateRequestBody)
    except UnicodeDecodeError as e:
        raise bad_request(f"request body is not valid UTF-8: {e.reason} at byte {e.start}") from None
    except msgspec.ValidationError as e:
        text = str(e)
        if text.startswith("Object contains unknown field") and text.endswith("at `$.sampling_params`"):
            raise bad_request("unknown sampling parameter(s): " + text.split("`", 2)[1]) from None
        raise bad_request(f"invalid request: {text}") from None
    except msgspec.DecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    try:
        body.check_supported()
    except ValueError as e:
        raise bad_request(str(e)) from None
    return body


def decode_abort_body(raw: bytes) -> AbortRequestBody:
    try:
        return msgspec.json.decode(raw, type=AbortRequestBody)
    except (UnicodeDecodeError, msgspec.DecodeError) as e:
        raise bad_request(f"invalid abort request: {e}") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None

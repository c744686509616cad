"""HTTP-side records of the native /generate contract (docs/generate_api.md).

GenerateRequestBody is what a client may send (unknown fields are rejected by
msgspec); ApiError is the one exception type the HTTP layer turns into the
error shape {"error": {"message", "type", "code"}}.
"""

from __future__ import annotations

from typing import Any

import msgspec

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_BOOTSTRAP_ROOM = 2**63 - 1


class GenerateRequestBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    priority: int = 0


class AbortRequestBody(msgspec.Struct, forbid_unknown_fields=True):
    rid: str


class ApiError(Exception):
    """An error with its HTTP status and error type; the message is safe to show a client."""

    def __init__(self, status: int, message: str, err_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type or default_error_type(status)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.err_type)


def default_error_type(status: int) -> str:
    if status == 503:
        return "unavailable"
    if status == 504:
        return "timeout"
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
        return msgspec.json.decode(raw, type=GenerateRequestBody)
    except UnicodeDecodeError as e:
        raise bad_request(f"request body is not valid UTF-8: {e.reason} at byte {e.start}") from None
    except msgspec.ValidationError as e:
        raise bad_request(f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None


def decode_abort_body(raw: bytes) -> AbortRequestBody:
    try:
        return msgspec.json.decode(raw, type=AbortRequestBody)
    except (UnicodeDecodeError, msgspec.DecodeError) as e:
        raise bad_request(f"invalid abort request: {e}") from None

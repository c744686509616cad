"""Strict typed access to fields of a decoded JSON request body.

Every failure is an ApiError(400) that names the offending parameter, so a bad
request never reaches a worker. JSON `null` counts as "not given".
"""

from __future__ import annotations

from typing import Any

import msgspec

from router.errors import ApiError, bad_request


def check_json_content_type(content_type: str | None) -> None:
    """415 unless the body is declared JSON (a missing type too: a browser's simple request, sent
    cross-site without a preflight, cannot be application/json)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise ApiError(415, f"Content-Type must be application/json, got {media[:100]!r}",
                       code="unsupported_media_type")


def decode_json_object(raw: bytes, content_type: str | None) -> dict[str, Any]:
    """Body bytes -> dict, or 4xx (415 wrong content type, 400 broken JSON / not an object)."""
    check_json_content_type(content_type)
    if not raw.strip():
        raise bad_request("request body is empty; expected a JSON object")
    try:
        body = msgspec.json.decode(raw)
    except (msgspec.MsgspecError, UnicodeDecodeError) as e:
        raise bad_request(f"request body is not valid JSON (UTF-8): {e}") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def get_int(body: dict[str, Any], name: str, default: int | None = None, *, lo: int | None = None,
            hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"'{name}' must be an integer, got {_kind(v)}", name)
    if lo is not None and v < lo:
        raise bad_request(f"'{name}' must be >= {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise bad_request(f"'{name}' must be <= {hi}, got {v}", name)
    return v


def get_float(body: dict[str, Any], name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise bad_request(f"'{name}' must be a number, got {_kind(v)}", name)
    if v != v or v in (float("inf"), float("-inf")):
        raise bad_request(f"'{name}' must be finite", name)
    return float(v)


def get_bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be a boolean, got {_kind(v)}", name)
    return v


def get_str(body: dict[str, Any], name: str) -> str | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise bad_request(f"'{name}' must be a string, got {_kind(v)}", name)
    return v


def get_stop(body: dict[str, Any], name: str = "stop") -> list[str] | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad_request(f"'{name}' must be a string or a list of strings", name)
    return v


def get_token_ids(v: Any, name: str, vocab_size: int, *, allow_empty: bool = False) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise bad_request(f"'{name}' must be a list of integer token ids", name)
    if not v and not allow_empty:
        raise bad_request(f"'{name}' must not be empty", name)
    for t in v:
        if not 0 <= t < vocab_size:
            raise bad_request(f"'{name}' has token id {t} outside the vocabulary [0, {vocab_size})", name)
    return v


def _kind(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(v), type(v).__name__
    ) if v is not None else "null"

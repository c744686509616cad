"""The per-request MAC of router -> worker HTTP (common.request_mac), in process: every way a
captured or forged header could pass, refused; the spent-nonce memory stays bounded."""

from __future__ import annotations

import secrets

import pytest

from common.request_mac import WINDOW_S, RequestSigner, RequestVerifier

KEY = secrets.token_bytes(32)
BODY = b'{"input_ids": [1, 2, 3]}'


def _pass(v: RequestVerifier, header: str, method: str = "POST", target: str = "/generate", body: bytes = BODY,
          now: float | None = None) -> bool:
    claim = v.claim(header, now)
    return claim is not None and v.verify(claim, method, target, body, now)


def test_one_use_per_header_bound_to_method_target_and_body() -> None:
    signer, v = RequestSigner(KEY), RequestVerifier(KEY)
    for method, target, body in (("GET", "/generate", BODY), ("POST", "/abort_request", BODY),
                                 ("POST", "/generate?x=1", BODY), ("POST", "/generate", BODY + b" ")):
        assert not _pass(v, signer.sign("POST", "/generate", BODY), method, target, body)
    header = signer.sign("POST", "/generate", BODY)
    assert _pass(v, header)
    assert not _pass(v, header), "replayed"
    ts_nonce, _, sig = header.rpartition(",sig=")
    assert not _pass(v, ts_nonce.upper().replace("PDS-HMAC-SHA256 TS=", "PDS-HMAC-SHA256 ts=")
                     .replace(",NONCE=", ",nonce=") + ",sig=" + sig), "replayed under an upper-case nonce"
    assert not _pass(RequestVerifier(secrets.token_bytes(32)), signer.sign("POST", "/generate", BODY))


def test_the_time_window_and_malformed_headers() -> None:
    signer, v = RequestSigner(KEY), RequestVerifier(KEY)
    header = signer.sign("POST", "/generate", BODY)
    ts = int(header.split("ts=")[1].split(",")[0])
    assert v.claim(header, now=ts + WINDOW_S + 1) is None and v.claim(header, now=ts - WINDOW_S - 1) is None
    for bad in (None, "", "Bearer " + "0" * 64, header.replace("ts=", "t="), header + "0",
                header.replace(",nonce=", ",nonce=zz"), "PDS-HMAC-SHA256 ts=1,nonce=,sig=", header[:-1] + "g"):
        assert v.claim(bad) is None, bad
    assert _pass(v, header, now=ts + WINDOW_S)


def test_spent_nonces_expire_with_the_window_and_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    signer, v = RequestSigner(KEY), RequestVerifier(KEY, max_nonces=3)
    headers = [signer.sign("POST", "/generate", BODY) for _ in range(4)]
    ts = int(headers[0].split("ts=")[1].split(",")[0])
    assert [_pass(v, h, now=ts) for h in headers] == [True, True, True, False]  # full: refuse, never forget
    assert v.spent() == 3
    assert _pass(v, headers[3], now=ts + WINDOW_S) is False  # still full inside the window
    assert v.claim(headers[0], now=ts + WINDOW_S + 2) is None  # out of the window, so no replay
    later = ts + WINDOW_S + 2
    monkeypatch.setattr("common.request_mac.time.time", lambda: float(later))
    assert _pass(v, signer.sign("POST", "/generate", BODY), now=later)  # the old nonces were dropped
    assert v.spent() == 1

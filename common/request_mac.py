"""Router -> worker HTTP credentials: one MAC per request, valid once, within a time window.

    signer = RequestSigner(k_http)                        # the router (RouterKeys.signer())
    headers["Authorization"] = signer.sign("POST", "/generate", body)
    verifier = RequestVerifier(k_http)                    # a worker (ClusterAuth)
    claim = verifier.claim(authorization)                 # shape + time window: before the body
    ok = verifier.verify(claim, "POST", "/generate", body)  # MAC over method, target, time, nonce,
                                                          # sha256(body); then the nonce is spent

The header is `PDS-HMAC-SHA256 ts=<unix seconds>,nonce=<32 hex>,sig=<64 hex>` with
sig = HMAC-SHA256(k_http, "method\\ntarget\\nts\\nnonce\\n" + sha256(body)). A captured header is
useless: another method, path or body fails the MAC, a resend within WINDOW_S finds its nonce
spent, and later its time is out of the window. Clocks of router and workers must agree to
within WINDOW_S (NTP). The verifier is owned by one worker process (one event loop).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

SCHEME = "PDS-HMAC-SHA256"
WINDOW_S = 30
MAX_NONCES = 1 << 20  # spent nonces remembered; only valid MACs add one (35k requests/s over 2 windows)
_NONCE_HEX = 32
_SIG_HEX = 64


@dataclass(frozen=True)
class Claim:
    """A well-formed header inside the time window; not yet checked against the request."""

    ts: int
    nonce: str
    sig: bytes


def _message(method: str, target: str, ts: int, nonce: str, body: bytes) -> bytes:
    return f"{method}\n{target}\n{ts}\n{nonce}\n".encode("latin-1") + hashlib.sha256(body).digest()


class RequestSigner:
    def __init__(self, key: bytes) -> None:
        self._key = key

    def sign(self, method: str, target: str, body: bytes) -> str:
        """The Authorization value for one request (target: path plus ?query as sent)."""
        ts = int(time.time())
        nonce = secrets.token_hex(_NONCE_HEX // 2)
        sig = hmac.new(self._key, _message(method, target, ts, nonce, body), hashlib.sha256).hexdigest()
        return f"{SCHEME} ts={ts},nonce={nonce},sig={sig}"

    def __repr__(self) -> str:
        return "RequestSigner(<hidden>)"


class RequestVerifier:
    def __init__(self, key: bytes, window_s: int = WINDOW_S, max_nonces: int = MAX_NONCES) -> None:
        self._key = key
        self.window_s = window_s
        self.max_nonces = max_nonces
        self._spent: set[str] = set()
        self._expiry: collections.deque[tuple[float, str]] = collections.deque()

    def __repr__(self) -> str:
        return "RequestVerifier(<hidden>)"

    def claim(self, authorization: str | None, now: float | None = None) -> Claim | None:
        """The header parsed and inside the window, else None (cheap: no body needed)."""
        if authorization is None or not authorization.startswith(SCHEME + " "):
            return None
        fields = dict(p.partition("=")[::2] for p in authorization[len(SCHEME) + 1:].split(","))
        ts, nonce, sig = fields.get("ts", ""), fields.get("nonce", ""), fields.get("sig", "")
        if not (ts.isdigit() and len(ts) <= 12 and len(nonce) == _NONCE_HEX and len(sig) == _SIG_HEX):
            return None
        try:
            raw = bytes.fromhex(sig)
            int(nonce, 16)
        except ValueError:
            return None
        now = time.time() if now is None else now
        if abs(now - int(ts)) > self.window_s:
            return None
        return Claim(int(ts), nonce.lower(), raw)

    def verify(self, claim: Claim, method: str, target: str, body: bytes, now: float | None = None) -> bool:
        """The MAC matches this request and the nonce was not spent; spends it (constant-time MAC check)."""
        want = hmac.new(self._key, _message(method, target, claim.ts, claim.nonce, body), hashlib.sha256).digest()
        if not hmac.compare_digest(want, claim.sig):
            return False
        now = time.time() if now is None else now
        while self._expiry and self._expiry[0][0] < now:
            self._spent.discard(self._expiry.popleft()[1])
        if claim.nonce in self._spent or len(self._spent) >= self.max_nonces:
            return False
        self._spent.add(claim.nonce)
        self._expiry.append((claim.ts + self.window_s + 1, claim.nonce))
        return True

    def spent(self) -> int:
        return len(self._spent)

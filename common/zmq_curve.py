"""Who may talk on the cluster's ZMQ channels: CURVE keyed by the cluster secret.

    sec = CurveSecurity(ctx, keys, max_msg_bytes)     # keys (one channel's CurveKeys) None: plain ZMQ
    sec.serve(sock)      # the binding side (prefill's bootstrap ROUTER, an instance's KV events
                         # PUB): CURVE server; ZAP admits only the cluster's client key
    sec.connect(sock)    # the connecting side (decode's DEALER, the router's KV events SUB):
                         # CURVE client that knows the server key
    sec.close()

Each channel's key pairs derive from the secret (common.cluster_secret): the bootstrap's
from secret.curve(), the KV events' from secret.events_curve() (the router holds only their
client pair). A decode's DEALER sends
nothing, its queued Register included, until the CURVE handshake proved that the other
end holds the server's secret key: a fake prefill named by a request's bootstrap_host
completes no handshake and learns nothing. Prefill's ZAP handler admits only a client
that proved the client key; anyone else's connection never delivers a message. CURVE
also encrypts the channel (agent metadata, KV base addresses) and rejects replayed or
reordered messages (per-connection short-term keys and nonces).
"""

from __future__ import annotations

import hmac

import zmq
from zmq.auth.thread import ThreadAuthenticator

from common.cluster_secret import CurveKeys

RECV_HWM = 256  # messages ZMQ queues per peer before that peer's own sends back up (they never block: see send_nowait)


class _ClusterClients:
    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.client_public)


class CurveSecurity:
    def __init__(self, ctx: zmq.Context, keys: CurveKeys | None, max_msg_bytes: int) -> None:
        self.ctx = ctx
        self.keys = keys
        self.max_msg_bytes = max_msg_bytes
        self._auth: ThreadAuthenticator | None = None

    @property
    def authenticated(self) -> bool:
        return self.keys is not None

    def _limits(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_msg_bytes)
        sock.setsockopt(zmq.RCVHWM, RECV_HWM)

    def serve(self, sock: zmq.Socket) -> None:
        """Before bind: only the cluster's CURVE clients get through."""
        self._limits(sock)
        if self.keys is None:
            return
        assert self.keys.server_secret, "bug: serving a channel whose server key this process does not hold"
        if self._auth is None:
            self._auth = ThreadAuthenticator(self.ctx)
            self._auth.start()
            self._auth.configure_curve_callback("*", _ClusterClients(self.keys.client_public))
        sock.curve_server = True
        sock.curve_secretkey = self.keys.server_secret
        sock.curve_publickey = self.keys.server_public

    def connect(self, sock: zmq.Socket) -> None:
        """Before connect: talk only to a server holding the cluster's server key."""
        self._limits(sock)
        if self.keys is None:
            return
        sock.curve_secretkey = self.keys.client_secret
        sock.curve_publickey = self.keys.client_public
        sock.curve_serverkey = self.keys.server_public

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

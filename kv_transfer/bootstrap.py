"""The bootstrap service, client side: ask a prefill what it publishes.

The service itself is the prefill KVManager's ROUTER socket on `bootstrap_port`: it
answers InfoQuery (and every decode Register) with PrefillInfo (transfer endpoint,
NIXL agent name, KV layout, aux row size). Decode managers handshake on their own;
this helper is for tools, health checks and tests.
"""

from __future__ import annotations

import zmq

from common.cluster_secret import ClusterSecret
from common.zmq_curve import CurveSecurity
from kv_transfer.base import TransferConfig
from kv_transfer.messages import InfoQuery, PrefillInfo, RegisterAck, decode, encode


def query_bootstrap(host: str, port: int, timeout_s: float = 2.0, secret: ClusterSecret | None = None) -> PrefillInfo:
    """PrefillInfo of the prefill at host:port; TimeoutError when it does not answer in time
    (also when the prefill requires the cluster secret and `secret` is not it)."""
    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    CurveSecurity(ctx, secret.curve() if secret else None, TransferConfig.max_msg_bytes).connect(sock)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(encode(InfoQuery()), flags=zmq.NOBLOCK)
        if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise TimeoutError(f"no bootstrap answer from {host}:{port} within {timeout_s:.1f}s")
        msg = decode(sock.recv())
        if not isinstance(msg, RegisterAck):
            raise RuntimeError(f"unexpected bootstrap answer {type(msg).__name__}")
        return msg.info
    finally:
        sock.close(linger=0)

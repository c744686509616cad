"""A fake peer that only listens: records every byte the first connection to it sends."""

from __future__ import annotations

import socket
import threading
import time


class ByteCapture:
    """Accepts one TCP connection on 127.0.0.1 (within accept_timeout_s) and records what it sends
    for window_s seconds after it connected, or until it closes."""

    def __init__(self, accept_timeout_s: float, window_s: float) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(accept_timeout_s)
        self.port: int = self.listener.getsockname()[1]
        self.window_s = window_s
        self.captured = bytearray()
        self._thread = threading.Thread(target=self._capture, daemon=True)
        self._thread.start()

    def _capture(self) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(0.5)
        end = time.monotonic() + self.window_s
        while time.monotonic() < end:
            try:
                data = conn.recv(65536)
            except TimeoutError:
                continue
            if not data:
                break
            self.captured.extend(data)
        conn.close()

    def join(self, timeout_s: float) -> bytes:
        """What was captured, once the capture ended (bounded by timeout_s)."""
        self._thread.join(timeout_s)
        return bytes(self.captured)

    def close(self) -> None:
        self.listener.close()

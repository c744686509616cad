"""common.logs.configure_logging: every process's log set-up (router, frontends, engines)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.harness.process import REPO_ROOT

# A process that sets up logging as the router does, then makes real HTTP requests with httpx
# (as its load reports and health probes do) to a server on 127.0.0.1, and logs one line itself.
_PROGRAM = """
import http.server, logging, sys, threading
import httpx
from common.logs import configure_logging
configure_logging(sys.argv[1])
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", 0), Ok)
threading.Thread(target=server.serve_forever, daemon=True).start()
with httpx.Client() as client:
    for _ in range(3):
        client.get(f"http://127.0.0.1:{server.server_port}/get_load").raise_for_status()
logging.getLogger("router").info("our own line")
server.shutdown()
"""


def _log_of(level: str) -> str:
    done = subprocess.run([sys.executable, "-c", _PROGRAM, level], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_info_logs_ours_but_not_a_line_per_http_request() -> None:
    log = _log_of("info")
    assert "INFO MainProcess[" in log and "router: our own line" in log
    assert "HTTP Request" not in log, log


@pytest.mark.parametrize("level", ["debug", "DEBUG"])
def test_debug_keeps_the_per_request_lines(level: str) -> None:
    assert _log_of(level).count("HTTP Request: GET") == 3

"""Logging set-up shared by every process (router, instance frontends, engines, TP ranks).

`configure_logging(level)` is each process's one call: the root logger at `level` in our
format, and the libraries that log every call they make at INFO kept at WARNING unless the
level is debug. httpx writes one INFO line per request: the router's load reports and health
probes (4 per second per worker by default) would otherwise fill its log with
`HTTP Request: GET .../get_load` lines between the lines that matter.
"""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s[%(process)d] %(name)s: %(message)s"
# Loggers that speak at INFO for each request they make; quiet below debug.
PER_CALL_LIBRARY_LOGGERS = ("httpx", "httpcore")


def configure_logging(level: str, fmt: str = LOG_FORMAT) -> None:
    logging.basicConfig(level=level.upper(), format=fmt)
    if level.lower() != "debug":
        for name in PER_CALL_LIBRARY_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)

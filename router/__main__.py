"""`python -m router --model-path DIR --prefill URL [PORT] --decode URL` (see router.config; console script: pdserve-router)."""

from __future__ import annotations

import logging
import sys

import uvicorn

from common.cluster_secret import ClusterSecretError, is_loopback, load_router_keys, require_safe_bind
from common.logs import configure_logging
from common.server.conn_limits import CloseOnReject, header_timeout_protocol, raise_nofile_limit
from router.app import build_app
from router.config import RouterConfig

ROUTER_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def main(argv: list[str] | None = None) -> None:
    try:
        cfg = RouterConfig.from_args(argv)
    except ValueError as e:
        sys.exit(f"router: {e}")
    configure_logging(cfg.log_level, ROUTER_LOG_FORMAT)
    try:
        require_safe_bind("router", cfg.host, load_router_keys(cfg.cluster_secret_file), cfg.allow_unauthenticated)
    except ClusterSecretError as e:
        sys.exit(f"router: {e}")
    if cfg.api_key is None and not is_loopback(cfg.host) and not cfg.allow_unauthenticated_clients:
        sys.exit(f"router: --host {cfg.host} is not a loopback address and no --api-key is set, so anyone who "
                 "reaches it gets free inference; set --api-key-file (or $PDSERVE_API_KEY), or pass "
                 "--allow-unauthenticated-clients")
    app = build_app(cfg)
    nofile = raise_nofile_limit()
    logging.getLogger("router").info("open-file limit %d; api key %s; worker admin %s", nofile,
                                     "required" if cfg.api_key else "off (open)",
                                     "on" if cfg.admin_api_key else "off (/workers answers 403)")
    uvicorn.run(CloseOnReject(app), host=cfg.host, port=cfg.port, log_level=cfg.log_level, access_log=False,
                timeout_keep_alive=30, backlog=4096, http=header_timeout_protocol(cfg.header_timeout, cfg.body_limits))


if __name__ == "__main__":
    main()

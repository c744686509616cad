"""Start one instance: the engine process, then the HTTP frontend in this process.

    launch_server(args, engine_main)
      1. resolve args once (model path, tokenizer path, served name)
      2. spawn the engine: engine_main(args, ipc_addrs) in a child process
      3. load the tokenizer here while the engine loads the model
      4. wait (bounded by --engine-start-timeout) for the engine's ready message
         StatsResp(seq=READY_SEQ, stats={pool sizes...}); fail fast if it dies
      5. serve uvicorn until SIGINT/SIGTERM; then refuse new connections, let in-flight
         requests finish (bounded by --graceful-shutdown-timeout) and stop the engine
      6. or until the watchdog finds the engine hung (a step older than --watchdog-timeout
         on the step clock, liveness.py): /health says 503 for WATCHDOG_EXIT_DELAY_S, the
         engine's stacks go to the log, the engine is stopped and the process exits 1

Keys the ready stats may carry (all optional, logged and shown in
/server_info "pools"): context_length, vocab_size, max_total_tokens,
num_pages, page_size, kv_pool_bytes, weights_bytes, load_time_s.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from common.cluster_secret import ClusterSecret, ClusterSecretError, require_safe_bind
from common.cpu_runtime import active_runtime, confine_this_process, plan_engine, runs_on_cpu
from common.logs import configure_logging
from common.secret_file import SecretFileError, resolve_secret
from common.server.cluster_auth import ClusterAuth
from common.server.engine_handle import EngineHandle, EngineMain
from common.server.ipc import READY_SEQ, EngineIpcAddrs, FrontendChannel
from common.server.liveness import StepClock, step_clock_path
from common.server.server_args import ServerArgs, parse_server_args

if TYPE_CHECKING:
    from fastapi import FastAPI

    from common.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

AppHook = Callable[["FastAPI", ServerArgs], None]
WATCHDOG_EXIT_DELAY_S = 3.0  # a hung instance answers /health 503 this long before its port closes
ENGINE_STOP_TIMEOUT_S = 5.0


class InstanceFailed(RuntimeError):
    """The instance ended itself after it started (its engine hung). Logged where it is raised."""


class LaunchError(RuntimeError):
    """The instance could not start: bad model path, tokenizer, or the engine never got ready.

    Logged where it is raised, so the operator sees it before shutdown finishes."""


def _default_engine_main() -> EngineMain:
    from common.server.engine_process import engine_main

    return engine_main


def _sigterm_as_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def launch_server(
    server_args: ServerArgs,
    engine_main: EngineMain | None = None,
    *,
    configure_app: AppHook | None = None,
) -> None:
    """Run the instance until SIGINT/SIGTERM. Raises LaunchError if the engine never gets ready.

    `engine_main` runs in the spawned engine process (default:
    common.server.engine_process.engine_main); it must be importable by name.
    `configure_app` may add routes (e.g. prefill's bootstrap routes) before serving.
    """
    configure_logging(server_args.log_level)
    try:
        args = server_args.resolved()
    except Exception as e:
        logger.error("cannot resolve the model path %r: %s", server_args.model_path, e)
        raise LaunchError(f"cannot resolve the model path {server_args.model_path!r}: {e}") from e
    try:
        secret = ClusterSecret.load(args.cluster_secret_file)
        require_safe_bind(f"{args.disaggregation_mode} instance", args.host, secret, args.allow_unauthenticated)
        resolve_secret("--metrics-token", args.metrics_token, args.metrics_token_file, "PDSERVE_METRICS_TOKEN")
    except (ClusterSecretError, SecretFileError) as e:
        logger.error("%s", e)
        raise LaunchError(str(e)) from e
    _check_port_free(args.host, args.port)
    addrs = EngineIpcAddrs.new()
    step_clock = StepClock.create(step_clock_path(addrs))
    placement = plan_engine(args)
    for warning in placement.layout.warnings if placement.layout is not None else ():
        logger.warning("cpu layout: %s", warning)
    if placement.cpus is not None or placement.env:
        logger.info("engine runtime: %s", placement.describe())
    if placement.frontend_cpus is not None:
        confine_this_process(placement.frontend_cpus)
    engine = EngineHandle(args, addrs, engine_main or _default_engine_main(), placement)
    previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    failure: str | None = None
    try:
        engine.start()
        failure = asyncio.run(_serve(args, addrs, engine, step_clock, configure_app))
    except KeyboardInterrupt:
        logger.info("shutting down")
    finally:
        engine.stop()
        addrs.remove_files()
        step_clock.remove()
        signal.signal(signal.SIGTERM, previous)
    if failure is not None:
        logger.error("instance exits: %s", failure)
        raise InstanceFailed(failure)


def _check_port_free(host: str, port: int) -> None:
    """Fail before the engine spends minutes loading a model for a port we cannot serve on."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            logger.error("cannot serve on %s:%d: %s", host, port, e)
            raise LaunchError(f"cannot serve on {host}:{port}: {e}") from e


async def wait_for_engine_ready(
    channel: FrontendChannel, engine: EngineHandle, timeout_s: float
) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        reason = engine.dead_reason()
        if reason is not None:
            raise LaunchError(f"the engine process {reason} before it was ready (see its log above)")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise LaunchError(f"the engine did not report ready within {timeout_s}s")
        reply = await channel.recv(timeout_s=min(remaining, 0.25))
        if reply is not None and getattr(reply, "seq", None) == READY_SEQ:
            return dict(reply.stats)  # type: ignore[union-attr]


def load_tokenizer(args: ServerArgs) -> Any:
    """args: resolved (tokenizer_path set)."""
    from common.tokenizer_loading import load_tokenizer as load

    assert args.tokenizer_path is not None
    try:
        return load(args.tokenizer_path)
    except Exception as e:
        raise LaunchError(f"cannot load the tokenizer from {args.tokenizer_path}: {e}") from e


def _log_ready(stats: dict[str, float], started: float) -> None:
    logger.info("engine ready after %.1fs", time.monotonic() - started)
    if "weights_bytes" in stats:
        logger.info("weights loaded: %.2f GiB", stats["weights_bytes"] / 2**30)
    if "max_total_tokens" in stats:
        kv_bytes = stats.get("kv_pool_bytes", 0.0)
        logger.info("KV pool: %d tokens, %.2f GiB", stats["max_total_tokens"], kv_bytes / 2**30)


def server_info(args: ServerArgs, context_length: int, stats: dict[str, float]) -> dict[str, Any]:
    max_total = stats.get("max_total_tokens", args.max_total_tokens)
    return {
        "model_path": args.model_path,
        "served_model_name": args.served_model_name,
        "context_length": context_length,
        "page_size": args.page_size,
        "max_total_tokens": int(max_total) if max_total is not None else None,
        "disaggregation_mode": args.disaggregation_mode,
        "bootstrap_port": args.disaggregation_bootstrap_port if args.is_prefill else None,
        # as the engine built its role (decode never keeps a prefix cache), not as flagged
        "radix_cache": bool(stats.get("radix_cache_enabled", not args.disable_radix_cache)),
        # ZMQ PUB of this instance's prefix cache contents, on --host (common/cache/kv_events.py)
        "kv_events_port": int(stats["kv_events_port"]) if "kv_events_port" in stats else None,
        # decode: serves a request without bootstrap info from its prefix cache (the router sends
        # it alone when at most this many prompt tokens are not cached there)
        "local_prefill_max_tokens": args.disaggregation_local_prefill_max_tokens
        if args.is_decode and stats.get("radix_cache_enabled") else 0,
        "pools": stats,
    }


async def _serve(
    args: ServerArgs,
    addrs: EngineIpcAddrs,
    engine: EngineHandle,
    step_clock: StepClock,
    configure_app: AppHook | None,
) -> str | None:
    """Serve until stopped; returns why the instance must fail (its engine hung), else None."""
    import uvicorn

    from common.server.conn_limits import (
        BodyLimits,
        CloseOnReject,
        header_timeout_protocol,
        raise_nofile_limit,
    )
    from common.server.http_server import create_app
    from common.server.input_processor import InputProcessor, ModelInfo
    from common.server.metrics import FrontendMetrics
    from common.server.tokenizer_manager import TokenizerManager

    started = time.monotonic()
    channel = FrontendChannel(addrs)
    tokenizer_task = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, args))
    try:
        stats = await wait_for_engine_ready(channel, engine, args.engine_start_timeout)
        tokenizer = await tokenizer_task
    except LaunchError as e:
        logger.error("%s", e)  # now, not after the tokenizer thread has finished
        channel.close()
        raise
    except BaseException:
        channel.close()
        raise
    _log_ready(stats, started)
    info = ModelInfo.resolve(args, tokenizer, stats)
    manager = TokenizerManager(
        args, InputProcessor(tokenizer, info, args), channel, FrontendMetrics(), engine.dead_reason, step_clock
    )
    manager.start_background()
    cpu_runtime = active_runtime(engine.pid) if engine.pid is not None and runs_on_cpu(args) else None
    app = create_app(manager, {**server_info(args, info.context_length, stats), "engine_pid": engine.pid,
                               "cpu_runtime": cpu_runtime})
    if configure_app is not None:
        configure_app(app, args)
    nofile = raise_nofile_limit()
    config = uvicorn.Config(
        CloseOnReject(ClusterAuth(app, ClusterSecret.load(args.cluster_secret_file))),
        host=args.host,
        port=args.port,
        http=header_timeout_protocol(
            args.header_timeout, BodyLimits(args.body_timeout, args.min_body_rate, args.max_body_bytes_in_flight)),
        backlog=4096,
        log_level=args.log_level,
        access_log=args.log_level == "debug",
        timeout_graceful_shutdown=math.ceil(args.graceful_shutdown_timeout),  # uvicorn takes whole seconds
    )
    server = uvicorn.Server(config)
    logger.info("serving %s on %s (%s mode; open-file limit %d)", args.served_model_name, args.url(),
                args.disaggregation_mode, nofile)
    end_when_hung = asyncio.ensure_future(_end_when_hung(manager, engine, server))
    try:
        await server.serve()
    finally:
        end_when_hung.cancel()
        await asyncio.gather(end_when_hung, return_exceptions=True)
        await manager.close()
    return manager.engine_hung


async def _end_when_hung(manager: TokenizerManager, engine: EngineHandle, server: Any) -> None:
    """The watchdog found the engine hung: keep answering 503 a moment, then end the instance."""
    await manager.fatal.wait()
    engine.dump_stacks()
    logger.error(
        "the engine is hung (its thread stacks follow, from faulthandler); stopping it, exiting in %gs",
        WATCHDOG_EXIT_DELAY_S,
    )
    await asyncio.sleep(WATCHDOG_EXIT_DELAY_S)
    await asyncio.to_thread(engine.stop, ENGINE_STOP_TIMEOUT_S)
    server.should_exit = True


def main(argv: list[str] | None = None, engine_main: EngineMain | None = None, **defaults: Any) -> None:
    """CLI entry: parse flags (with role `defaults`), run the instance, exit 1 on a failed start."""
    args = parse_server_args(argv, **defaults)
    try:
        launch_server(args, engine_main)
    except (LaunchError, InstanceFailed):
        sys.exit(1)  # already logged where it happened

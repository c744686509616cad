"""`python -m prefill_server --model-path ... --port ... --disaggregation-bootstrap-port ...` (console script: pdserve-prefill)"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    from common.server.launch import main as launch_main
    from prefill_server.engine import prefill_engine_main
    from prefill_server.onednn_cache import limit_primitive_cache

    limit_primitive_cache()  # inherited by the engine process spawned below
    launch_main(argv, engine_main=prefill_engine_main, disaggregation_mode="prefill")


if __name__ == "__main__":
    main()

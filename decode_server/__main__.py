"""`python -m decode_server --model-path ... --port ...` (console script: pdserve-decode)"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    from common.server.launch import main as launch_main
    from decode_server.engine import decode_engine_main

    launch_main(argv, engine_main=decode_engine_main, disaggregation_mode="decode")


if __name__ == "__main__":
    main()

"""`python -m decode_server --model-path ... --port ...`"""

from __future__ import annotations


def _main() -> None:
    from common.server.launch import main
    from decode_server.engine import decode_engine_main

    main(engine_main=decode_engine_main, disaggregation_mode="decode")


if __name__ == "__main__":
    _main()

"""`python -m common.server --model-path ... --port ...`: one colocated instance."""

from __future__ import annotations


def _main() -> None:
    from common.server.launch import main

    main()


if __name__ == "__main__":
    _main()

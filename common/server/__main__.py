"""`python -m common.server --model-path ... --port ...`: one colocated instance (console script: pdserve-server)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    from common.server.launch import main as launch_main

    launch_main(argv)


if __name__ == "__main__":
    main()

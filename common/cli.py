"""`pdserve`: the package's umbrella command (console script, pyproject [project.scripts]).

    pdserve --version            pdserve 0.1.0
    pdserve ROLE [FLAGS...]      the same as pdserve-ROLE FLAGS... / python -m MODULE FLAGS...

Each role keeps its own entry point and flags (ROLES maps a role to its module's main); this only
dispatches, so `pdserve router --help` is the router's own help.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NamedTuple

from common.version import add_version_flag


class Role(NamedTuple):
    module: str  # `python -m module` runs it; module.__main__.main(argv) is the entry
    script: str  # its console script
    summary: str


ROLES: dict[str, Role] = {
    "router": Role("router", "pdserve-router", "OpenAI-compatible router in front of prefill/decode instances"),
    "prefill": Role("prefill_server", "pdserve-prefill", "prefill instance (sends KV to decode)"),
    "decode": Role("decode_server", "pdserve-decode", "decode instance (receives KV from prefill)"),
    "server": Role("common.server", "pdserve-server", "one colocated instance (no disaggregation)"),
}


def build_parser() -> argparse.ArgumentParser:
    roles = "\n".join(f"  {name:<9} {r.summary} (= {r.script}, python -m {r.module})" for name, r in ROLES.items())
    p = argparse.ArgumentParser(
        prog="pdserve", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Prefill/decode disaggregated LLM serving.",
        epilog=f"roles:\n{roles}\n\n`pdserve ROLE --help` lists a role's flags.")
    add_version_flag(p)
    p.add_argument("role", choices=ROLES, help="which process to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the role's own flags")
    return p


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse_args(argv)
    role = ROLES[ns.role]
    sys.argv[0] = role.script  # the role's argparse names itself in --help / errors as its console script
    entry = importlib.import_module(f"{role.module}.__main__").main
    entry(ns.args)


if __name__ == "__main__":
    main()

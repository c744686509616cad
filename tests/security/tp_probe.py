"""A TP 2 engine (rank 0 here, rank 1 spawned) that reports where its ranks meet and listen.

    python -m tests.security.tp_probe MODEL HOST
prints one JSON line, then waits (up to PROBE_S) to be stopped:
    dir, dir_mode, steps, kv_link      TPAddrs (M5)
    abstract                           this namespace's abstract unix sockets named pdserve_* (M5)
    listen                             {pid: [ip, ...]} TCP listeners of rank 0 and rank 1 (L10)
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time

PROBE_S = 120.0


def main(model: str, host: str) -> None:
    import psutil

    from common.engine import Engine

    engine = Engine(model, dtype="float32", page_size=4, max_total_tokens=512, tp_size=2, host=host)
    ranks = engine.core.tp_ranks
    assert ranks is not None
    pids = [os.getpid(), *(p.pid for p in ranks._procs)]
    listen = {str(pid): sorted({c.laddr.ip for c in psutil.Process(pid).net_connections("tcp")
                                if c.status == "LISTEN"}) for pid in pids}
    abstract = [ln.split()[-1] for ln in open("/proc/net/unix").read().splitlines()[1:]
                if ln.split()[-1].startswith("@pdserve")]
    print(json.dumps({"dir": ranks.addrs.dir, "dir_mode": stat.S_IMODE(os.stat(ranks.addrs.dir).st_mode),
                      "steps": list(ranks.addrs.steps), "kv_link": ranks.addrs.kv_link, "abstract": abstract,
                      "listen": listen}), flush=True)
    time.sleep(PROBE_S)
    engine.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

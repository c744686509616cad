"""On CPU, which thread owns torch's intra-op (OpenMP) thread pool.

libgomp (torch's OpenMP on Linux) keeps one thread pool per thread that starts a parallel
region, until that thread exits. When its pools hold more threads than the process may use
CPUs, it "throttles" every pool: a thread waiting for the next parallel region spins ~100
iterations instead of ~300,000 and then sleeps on a futex, so each of the hundreds of parallel
regions of a decode step wakes its threads through the kernel. The overlap loop hit exactly
this on a 2-core box: the scheduler thread's pool (it loaded the model) and the worker
thread's pool, 2 threads each:

    batch-32 decode step on the worker thread   ~540 futex sleeps per step (main: ~1)
                                                 quiet box: 93 vs 58 ms (1.6x slower)

So the overlap loop on CPU keeps one pool, the worker thread's: the engine is built on a
short-lived thread whose pool goes away with it, and the scheduler thread runs no parallel
kernels in steady state (its tensor work is small: slot rows, staged lists).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run_on_fresh_thread(fn: Callable[[], T], *, name: str = "engine-build") -> T:
    """fn() on a new thread, joined; its OpenMP pool (if it started one) ends with it.
    Exceptions propagate to the caller."""
    result: list[T] = []
    error: list[BaseException] = []

    def body() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # re-raised on the caller's thread
            error.append(e)

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


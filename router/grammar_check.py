"""The router's check of structured-output specs, so a bad schema / regex / grammar is a 400
before any worker is touched.

xgrammar imports torch (through tvm_ffi), which the router process never loads; the check runs
in one child process, started on the first constrained request and kept. Verdicts are cached
(LRU) by (kind, text). Owned by the GenerationHandler; every wait is bounded.

The child's first job is to import xgrammar: where that fails (a plain `pip install pdserve`
has no xgrammar), every constrained request, valid or not, is refused with 501 naming the
package and its install command (common/optional_packages.py), without asking again.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from common.grammar.spec import GrammarSpec, grammar_of
from common.grammar.syntax import grammar_problem
from common.optional_packages import MISSING_PACKAGE_CODE, MISSING_PACKAGE_STATUS, XGRAMMAR
from router.errors import ApiError, bad_request
from router.plan import GenerationPlan

logger = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 60.0  # the first check includes the child's start (imports torch: seconds)


class GrammarChecker:
    def __init__(self, timeout_s: float = CHECK_TIMEOUT_S, max_cached: int = 1024) -> None:
        self.timeout_s = timeout_s
        self._max_cached = max_cached
        self._verdicts: OrderedDict[GrammarSpec, str | None] = OrderedDict()
        self._pool: ProcessPoolExecutor | None = None
        self._lock = asyncio.Lock()  # one check at a time: the child is single-threaded anyway
        self._import_problem: str | None = None  # the child could not import xgrammar: why
        self._imported = False  # the child imported it once (then it stays importable)

    async def check(self, plan: GenerationPlan) -> None:
        """ApiError 400 naming the problem when plan's constraint does not parse."""
        spec = grammar_of(plan.sampling_params)
        if spec is None:
            return
        if not self._imported:
            self._import_problem = await self._run(XGRAMMAR.import_problem)
            self._imported = self._import_problem is None
            if self._import_problem is not None:
                logger.warning("structured output refused with %d: %s", MISSING_PACKAGE_STATUS, self._import_problem)
        if self._import_problem is not None:
            raise ApiError(MISSING_PACKAGE_STATUS, XGRAMMAR.refusal("router"),
                           type="not_implemented_error", code=MISSING_PACKAGE_CODE,
                           param="response_format" if plan.api != "generate" else f"sampling_params.{spec.kind}")
        if spec in self._verdicts:
            self._verdicts.move_to_end(spec)
            problem = self._verdicts[spec]
        else:
            problem = await self._run(grammar_problem, spec.kind, spec.text)
            self._verdicts[spec] = problem
            while len(self._verdicts) > self._max_cached:
                self._verdicts.popitem(last=False)
        if problem is not None:
            raise bad_request(problem, "response_format" if plan.api != "generate" else f"sampling_params.{spec.kind}")

    async def _run(self, fn: Callable[..., str | None], *args: str) -> str | None:
        """fn(*args) in the checker process (started here on first use), within timeout_s."""
        async with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
            loop = asyncio.get_running_loop()
            fut = loop.run_in_executor(self._pool, fn, *args)
            try:
                return await asyncio.wait_for(fut, self.timeout_s)
            except (TimeoutError, BrokenProcessPool) as e:
                logger.warning("grammar check process failed (%s); restarting it", type(e).__name__)
                self.close()
                raise ApiError(503, "the router could not check the request's grammar in time; retry",
                               code="grammar_check_unavailable") from None

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.kill()  # a check stuck in the parser must not outlive the router

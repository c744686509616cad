"""GrammarBackend: compiles grammars for one engine process (--grammar-backend xgrammar).

Owned by the scheduler. get(spec) returns a Future of the compiled grammar: compiles run one at
a time on the backend's own thread, so the scheduler never waits for one (a request whose grammar
is still compiling waits; the others run). Each (kind, text) compiles once and stays cached (LRU,
at most max_cached); a spec that does not parse gives a Future holding InvalidGrammar, cached as
well. The first compile also builds xgrammar's view of the tokenizer (its vocabulary as bytes).
Where xgrammar does not import (a plain `pip install pdserve`), every compile fails with
MissingPackage: the request is refused with 501 naming the package and its install command.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from common.grammar.matcher import RequestGrammar
from common.grammar.spec import GrammarSpec
from common.grammar.syntax import parse_grammar
from common.optional_packages import XGRAMMAR, MissingPackage

logger = logging.getLogger(__name__)



class GrammarBackend:
    def __init__(self, tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: list[int], *,
                 max_cached: int = 256) -> None:
        """tokenizer: loads the instance's tokenizer (FastTokenizer or transformers'), called on the
        compile thread at the first compile; vocab_size: the model's (the logits' width);
        stop_token_ids: the tokens that end a finished grammar."""
        self.vocab_size = vocab_size
        self._load_tokenizer = tokenizer
        self._stop_ids = list(stop_token_ids) or None  # none known: xgrammar detects them
        self._max_cached = max_cached
        self._cache: OrderedDict[GrammarSpec, Future[Any]] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._compiler: Any = None
        self._import_problem: str | None = None  # xgrammar did not import: why (then it never will)
        self._lock = threading.Lock()  # the counters: written by the compile thread too
        self.num_compiles = 0
        self.num_compile_errors = 0
        self.num_cache_hits = 0
        self.compile_seconds = 0.0

    def get(self, spec: GrammarSpec) -> Future[Any]:
        """The compiled grammar of spec (a Future: done at once on a cache hit)."""
        fut = self._cache.get(spec)
        if fut is not None:
            self._cache.move_to_end(spec)
            self.num_cache_hits += 1
            return fut
        fut = self._pool.submit(self._compile, spec)
        self._cache[spec] = fut
        while len(self._cache) > self._max_cached:
            self._cache.popitem(last=False)
        return fut

    def matcher(self, spec: GrammarSpec, compiled: Any) -> RequestGrammar:
        return RequestGrammar(spec, compiled)

    def _compile(self, spec: GrammarSpec) -> Any:
        start = time.perf_counter()
        try:
            if self._compiler is None:
                if self._import_problem is None:
                    self._import_problem = XGRAMMAR.import_problem()
                    if self._import_problem is not None:
                        logger.warning("structured output refused with 501: %s", self._import_problem)
                if self._import_problem is not None:
                    raise MissingPackage(XGRAMMAR.refusal("instance"))
                self._compiler = self._make_compiler()
            compiled = self._compiler.compile_grammar(parse_grammar(spec))
        except Exception:
            with self._lock:
                self.num_compile_errors += 1
            raise
        finally:
            with self._lock:
                self.compile_seconds += time.perf_counter() - start
        with self._lock:
            self.num_compiles += 1
        return compiled

    def _make_compiler(self) -> Any:
        import xgrammar as xgr

        info = tokenizer_info(self._load_tokenizer(), self.vocab_size, self._stop_ids)
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {
                "grammar_compiles_total": float(self.num_compiles),
                "grammar_compile_errors_total": float(self.num_compile_errors),
                "grammar_compile_seconds_total": self.compile_seconds,
                "grammar_cache_hits_total": float(self.num_cache_hits),
            }

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int] | None) -> Any:
    """xgrammar's TokenizerInfo of our tokenizer: from the `tokenizers` backend's vocabulary and
    its serialized form (what xgrammar reads a transformers fast tokenizer's metadata from)."""
    import xgrammar as xgr

    backend = getattr(tokenizer, "_tok", None) or getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow transformers tokenizer (sentencepiece, tiktoken): xgrammar's own path
        return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    vocab = backend.get_vocab(with_added_tokens=True)
    encoded = [""] * vocab_size
    for token, idx in vocab.items():
        if idx < vocab_size:
            encoded[idx] = token
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(encoded, vocab_type=meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=stop_token_ids, add_prefix_space=meta["add_prefix_space"])

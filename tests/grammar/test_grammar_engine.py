"""The engine's grammar plumbing in this process: the mask kernel against xgrammar's, the compile
queue (a compiling request waits, the others run), bad specs, --grammar-backend none, and a
grammar that cannot finish within max_new_tokens."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from common.engine import Engine
from common.grammar.mask import unpack_bitmask
from common.grammar.spec import GrammarSpec
from common.sampling_params import SamplingParams
from common.scheduler.req import Req
from tests.grammar.reference import CONSTRAINTS, constrained_greedy


@pytest.fixture(scope="module")
def engine(tiny_llama_path: str):
    e = Engine(tiny_llama_path, dtype="float32", page_size=4, max_total_tokens=2048)
    yield e
    e.shutdown()


@pytest.mark.parametrize("vocab", [32, 100, 384])
def test_unpack_matches_xgrammar_kernel(vocab: int) -> None:
    import xgrammar as xgr

    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=gen)
    logits = torch.randn(3, vocab, generator=gen)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask)
    got = logits.masked_fill(~unpack_bitmask(bitmask, vocab), float("-inf"))
    assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_step_mask_on_cuda_matches_cpu(engine: Engine) -> None:
    """The worker's path on a GPU: the CPU-filled bitmask applied to CUDA logits, a subset of rows."""
    from common.grammar.mask import StepGrammarMask

    backend = engine.scheduler.grammar_queue.backend  # type: ignore[union-attr]
    spec = GrammarSpec("regex", CONSTRAINTS["regex"])
    grammars = [backend.matcher(spec, backend.get(spec).result(timeout=60)) for _ in range(2)]
    vocab = backend.vocab_size
    logits = torch.randn(4, vocab)
    on_gpu = logits.cuda()
    for target in (logits, on_gpu):
        mask = StepGrammarMask([1, 3], grammars, vocab)
        mask.fill()
        mask.apply(target)
    assert torch.equal(on_gpu.cpu(), logits)
    assert torch.isinf(logits[1]).sum() > 0 and not torch.isinf(logits[0]).any()


def _req(engine: Engine, rid: str, prompt: list[int], **params: object) -> Req:
    sp = SamplingParams(max_new_tokens=24, temperature=0.0, **params)  # type: ignore[arg-type]
    return Req(rid=rid, origin_input_ids=prompt, sampling_params=sp, eos_token_ids=engine.eos_token_ids)


def test_compiling_request_waits_and_others_run(engine: Engine, tiny_llama_path: str) -> None:
    """A compile held back (its Future planted in the cache, not done) keeps only its request
    waiting; once it completes the request runs and its tokens are exact."""
    sched = engine.scheduler
    assert sched.grammar_queue is not None
    backend = sched.grammar_queue.backend
    spec = GrammarSpec("regex", "(held|back)-[0-9]+")
    held: Future[object] = Future()
    backend._cache[spec] = held
    constrained = _req(engine, "held", [5, 6, 7], regex=spec.text)
    plain = _req(engine, "plain", [8, 9, 10], ignore_eos=True)
    sched.add_request(constrained)
    sched.add_request(plain)
    for _ in range(200):
        if plain.finished:
            break
        sched.step()
    assert plain.finished and len(plain.output_ids) == 24
    assert constrained.output_ids == [] and constrained in sched.grammar_queue
    assert sched.stats()["num_grammar_queue_reqs"] == 1
    real = backend._pool.submit(backend._compile, spec).result(timeout=60)
    held.set_result(real)
    sched.run_until_idle()
    assert constrained.output_ids == constrained_greedy(tiny_llama_path, [5, 6, 7], "regex", spec.text, 24)
    engine.check_integrity()


def test_bad_spec_ends_with_400_and_engine_goes_on(engine: Engine) -> None:
    before = engine.scheduler.stats()
    for _ in range(2):
        out = engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 4, "regex": "(ab"})
        reason = out["meta_info"]["finish_reason"]  # type: ignore[call-overload]
        assert reason["type"] == "abort" and "parenthesis" in reason["message"], reason
    after = engine.scheduler.stats()
    assert after["grammar_compile_errors_total"] - before["grammar_compile_errors_total"] == 1  # then cached
    assert after["grammar_cache_hits_total"] > before["grammar_cache_hits_total"]
    ok = engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 6, "temperature": 0,
                                                            "ebnf": CONSTRAINTS["ebnf"]})
    assert ok["meta_info"]["completion_tokens"] > 0  # type: ignore[call-overload]
    engine.check_integrity()


def test_grammar_cut_by_max_new_tokens_is_length(engine: Engine) -> None:
    out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3, "temperature": 0,
                                                                "json_schema": CONSTRAINTS["json_schema"]})
    assert out["meta_info"]["finish_reason"]["type"] == "length"  # type: ignore[call-overload]
    assert out["meta_info"]["completion_tokens"] == 3  # type: ignore[call-overload]


def test_backend_none_refuses(tiny_llama_path: str) -> None:
    e = Engine(tiny_llama_path, dtype="float32", page_size=4, max_total_tokens=1024, grammar_backend="none")
    try:
        with pytest.raises(ValueError, match="grammar-backend none"):
            e.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 4, "regex": "a+"})
    finally:
        e.shutdown()


def test_two_constraints_refused() -> None:
    with pytest.raises(ValueError, match="at most one"):
        SamplingParams.from_dict({"regex": "a+", "ebnf": 'root ::= "a"'})

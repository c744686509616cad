"""Sampler: greedy, seeds, top-k/top-p/min-p masks, penalties and logprobs on crafted logits."""

from __future__ import annotations

import math

import pytest
import torch

from common.model.sampler import Sampler, SamplingBatchInfo
from common.sampling_params import SamplingParams

V = 50


def info_for(
    params: list[SamplingParams], rows: list[int] | None = None, vocab: int = V, **kw
) -> SamplingBatchInfo:
    rows = rows if rows is not None else list(range(len(params)))
    return SamplingBatchInfo.from_params(params, rows, vocab_size=vocab, **kw)


def crafted(probs: list[float], rows: int) -> torch.Tensor:
    """Logits whose softmax puts `probs` on tokens 0.. and (almost) nothing elsewhere."""
    logits = torch.full((rows, V), -1e4)
    logits[:, : len(probs)] = torch.tensor(probs).log()
    return logits


def draw(params: SamplingParams, probs: list[float], n: int = 1024) -> torch.Tensor:
    sampler = Sampler(V, max_rows=n)
    return sampler.sample(crafted(probs, n), info_for([params] * n)).next_token_ids


def test_greedy_is_argmax_and_top_k_1_is_greedy() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, V) * 3
    sampler = Sampler(V, max_rows=8)
    greedy = sampler.sample(logits, info_for([SamplingParams(temperature=0.0)] * 6))
    assert torch.equal(greedy.next_token_ids, logits.argmax(-1))
    top1 = sampler.sample(logits, info_for([SamplingParams(temperature=1.5, top_k=1)] * 6))
    assert torch.equal(top1.next_token_ids, logits.argmax(-1))
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 3
    out = sampler.sample(logits, info_for(mixed)).next_token_ids
    assert torch.equal(out[::2], logits.argmax(-1)[::2])


def test_seed_reproducible_regardless_of_batch_mates() -> None:
    vocab = 4096  # > TOP_P_CANDIDATES, so top-p alone ranks candidates instead of sorting everything
    torch.manual_seed(1)
    steps = [torch.randn(vocab) * 4 for _ in range(12)]

    def run(row: int, mates: list[SamplingParams], mate_rows: list[int], seeded: SamplingParams) -> list[int]:
        sampler = Sampler(vocab, max_rows=16)
        sampler.reset_row(row, [1, 2, 3])
        params = mates + [seeded]
        info = info_for(params, mate_rows + [row], vocab=vocab)
        tokens = []
        for logit in steps:
            logits = torch.randn(len(params), vocab) * 4
            logits[-1] = logit
            tokens.append(int(sampler.sample(logits, info).next_token_ids[-1]))
        return tokens

    plain = SamplingParams(temperature=1.0, seed=1234)
    alone = run(0, [], [], plain)
    assert alone == run(9, [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, seed=7)], [3, 4], plain)
    assert run(0, [], [], SamplingParams(temperature=1.0, seed=4321)) != alone
    # a batch-mate without top-p forces a full sort instead of ranking candidates: same tokens
    nucleus = SamplingParams(temperature=1.0, top_p=0.9, seed=99)
    assert info_for([nucleus], vocab=vocab).candidate_k < vocab
    assert info_for([SamplingParams(), nucleus], vocab=vocab).candidate_k == vocab
    assert run(0, [], [], nucleus) == run(5, [SamplingParams(temperature=1.0)], [1], nucleus)


def test_top_p_candidates_fall_back_to_a_full_sort_when_too_flat() -> None:
    vocab, n = 4096, 512
    logits = torch.zeros(n, vocab)
    logits[:, :1024] = 1.0  # the 1024 candidates hold e*1024 / (e*1024 + 3072) = 47.5% < top_p
    out = Sampler(vocab, max_rows=n).sample(logits, info_for([SamplingParams(top_p=0.9)] * n, vocab=vocab))
    tail = (out.next_token_ids >= 1024).float().mean().item()
    assert 0.35 < tail < 0.6  # (0.9 - 0.475) / 0.9 of the kept mass lies beyond the candidates


def test_top_k_keeps_exactly_the_k_most_likely() -> None:
    probs = [0.3, 0.25, 0.2, 0.15, 0.1]
    got = set(draw(SamplingParams(top_k=3), probs).tolist())
    assert got == {0, 1, 2}


def test_top_p_and_min_p_masks() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    assert set(draw(SamplingParams(top_p=0.7), probs).tolist()) == {0, 1}  # 0.5 + 0.3 covers 0.7
    assert set(draw(SamplingParams(top_p=0.85), probs).tolist()) == {0, 1, 2}
    assert set(draw(SamplingParams(min_p=0.2), probs).tolist()) == {0, 1, 2}  # keep p >= 0.2 * 0.5
    assert set(draw(SamplingParams(min_p=0.5), probs).tolist()) == {0, 1}
    # top-p applies to the distribution renormalised after top-k: 0.5/0.95 + 0.3/0.95 > 0.8
    assert set(draw(SamplingParams(top_k=3, top_p=0.8), probs).tolist()) == {0, 1}


def test_frequencies_follow_temperature() -> None:
    probs = [0.6, 0.3, 0.1]
    n = 4000
    for temperature in (1.0, 2.0):
        counts = torch.bincount(draw(SamplingParams(temperature=temperature), probs, n), minlength=V)[:3]
        want = torch.tensor(probs).log().div(temperature).softmax(-1)
        assert (counts / n - want).abs().max().item() < 0.04, (temperature, counts)


def test_penalties_match_hand_computed_reference() -> None:
    sampler = Sampler(V, max_rows=4)
    sampler.reset_row(2, prompt_ids=[1, 2], output_ids=[3, 3, 5])
    sampler.reset_row(0, prompt_ids=[7], output_ids=[])
    logits = torch.zeros(2, V)
    logits[:, 1], logits[:, 2], logits[:, 3], logits[:, 5], logits[:, 7] = 2.0, -1.0, 3.0, -0.5, 4.0
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(temperature=0.0, repetition_penalty=1.0, frequency_penalty=1.0),
    ]
    info = info_for(params, rows=[2, 0])
    got = sampler.apply_penalties(logits, info)
    want = logits.clone()
    # row 2: repetition on prompt+output (divide positive, multiply negative), then freq/presence on output
    want[0, 1], want[0, 2] = 2.0 / 2, -1.0 * 2
    want[0, 3] = 3.0 / 2 - 0.5 * 2 - 0.25
    want[0, 5] = -0.5 * 2 - 0.5 * 1 - 0.25
    want[0, 7] = 4.0  # not seen by this request
    # row 0: prompt tokens get no frequency penalty, and nothing was generated yet
    torch.testing.assert_close(got, want)
    # the sampler counts what it samples: both rows pick token 7 (4.0), then pay for it
    assert sampler.sample(logits, info).next_token_ids.tolist() == [7, 7]
    after = sampler.apply_penalties(logits, info)
    assert after[0, 7].item() == pytest.approx(4.0 / 2 - 0.5 - 0.25)
    assert after[1, 7].item() == pytest.approx(3.0)
    # a new request on row 0 starts clean
    sampler.reset_row(0, prompt_ids=[9])
    assert sampler.apply_penalties(logits, info)[1, 7].item() == 4.0


def test_penalty_state_allocated_late_still_sees_earlier_resets() -> None:
    sampler = Sampler(V, max_rows=4)
    sampler.reset_row(1, prompt_ids=[4], output_ids=[6])
    plain = info_for([SamplingParams(temperature=0.0)], rows=[1])
    logits = torch.zeros(1, V)
    logits[0, 4], logits[0, 6], logits[0, 8] = 1.0, 1.2, 0.9
    assert sampler.sample(logits, plain).next_token_ids.tolist() == [6]  # no penalties, no state yet
    penalised = info_for([SamplingParams(temperature=0.0, repetition_penalty=2.0)], rows=[1])
    assert sampler.sample(logits, penalised).next_token_ids.tolist() == [8]  # 4 and 6 are both penalised


def test_logprobs_are_log_softmax_of_the_logits() -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, V) * 2
    sampler = Sampler(V, max_rows=4)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9), SamplingParams()]
    out = sampler.sample(logits, info_for(params, return_logprob=True, top_logprobs_nums=[0, 5, 2]))
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs is not None and out.top_logprobs is not None
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.next_token_ids[:, None]).squeeze(1))
    values, ids = ref.topk(5, dim=-1)
    torch.testing.assert_close(out.top_logprobs.values, values)
    assert torch.equal(out.top_logprobs.token_ids, ids)
    assert math.isclose(out.top_logprobs.values[1].exp().sum().item(), values[1].exp().sum().item(), rel_tol=1e-6)
    plain = sampler.sample(logits, info_for(params))
    assert plain.logprobs is None and plain.top_logprobs is None


def test_bad_inputs_raise() -> None:
    sampler = Sampler(V, max_rows=2)
    with pytest.raises(ValueError, match="unique"):
        info_for([SamplingParams(), SamplingParams()], rows=[1, 1])
    with pytest.raises(ValueError, match="logits"):
        sampler.sample(torch.zeros(3, V), info_for([SamplingParams()]))
    with pytest.raises(IndexError, match="outside"):
        sampler.sample(torch.zeros(1, V), info_for([SamplingParams()], rows=[5]))
    with pytest.raises(IndexError, match="outside"):
        sampler.reset_row(2, [1])

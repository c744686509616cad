"""Workload generators of bench/serving.py with the tiny checkpoints' real (byte-level BPE) tokenizer."""

from __future__ import annotations

from typing import Any

import pytest
from serving_workloads import (
    Message,
    RequestInput,
    draw_len,
    multi_turn_workload,
    random_workload,
    shared_prefix_workload,
)


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def test_draw_len_bounds_and_validation() -> None:
    import random

    rng = random.Random(0)
    draws = [draw_len(rng, 100, 0.25) for _ in range(2000)]
    assert min(draws) == 75 and max(draws) == 125
    assert {draw_len(rng, 10, 0.0) for _ in range(50)} == {10}
    assert min(draw_len(rng, 2, 1.0) for _ in range(200)) == 1
    with pytest.raises(ValueError):
        draw_len(rng, 0, 0.5)
    with pytest.raises(ValueError):
        draw_len(rng, 10, 1.5)


def test_random_lengths_within_bounds_and_seeded(tok: Any) -> None:
    w = random_workload(tok, 40, 64, 16, 0.5, seed=3)
    assert w.num_requests == 40 and not w.conversations
    special = set(tok.all_special_ids)
    for r in w.requests:
        assert 32 <= r.input_len <= 96 and 8 <= r.output_len <= 24
        assert r.input_ids is not None and len(r.input_ids) == r.input_len
        assert not special & set(r.input_ids)
        assert r.text == tok.decode(list(r.input_ids))
        assert abs(len(tok.encode(r.text, add_special_tokens=False)) - r.input_len) <= 2
        assert r.chat_messages() == [{"role": "user", "content": r.text}]
    assert len({r.input_len for r in w.requests}) > 5 and len({r.output_len for r in w.requests}) > 5
    again = random_workload(tok, 40, 64, 16, 0.5, seed=3)
    other = random_workload(tok, 40, 64, 16, 0.5, seed=4)
    assert again.requests == w.requests
    assert other.requests != w.requests


def test_shared_prefix_really_shared(tok: Any) -> None:
    w = shared_prefix_workload(tok, 3, 4, 50, 8, 12, seed=1)
    assert w.num_requests == 12
    groups: dict[int, list[RequestInput]] = {}
    for r in w.requests:
        groups.setdefault(r.group, []).append(r)
        assert r.output_len == 12
    assert sorted(groups) == [0, 1, 2] and all(len(g) == 4 for g in groups.values())
    assert [r.group for r in w.requests] != sorted(r.group for r in w.requests)  # interleaved groups
    systems = set()
    for g in groups.values():
        system = g[0].messages[0]
        assert system.role == "system" and len({r.messages[0] for r in g}) == 1
        assert len({r.messages[1] for r in g}) == 4  # distinct questions
        prefix = g[0].input_ids[:50]  # type: ignore[index]
        assert all(r.input_ids is not None and r.input_ids[:50] == prefix for r in g)
        assert all(r.text.startswith(f"System: {system.content}\n\nUser: ") for r in g)
        systems.add(system.content)
    assert len(systems) == 3


def test_multi_turn_grows_with_answers(tok: Any) -> None:
    w = multi_turn_workload(tok, 2, 3, 10, 6, 0.0, seed=5)
    assert not w.requests and w.num_requests == 6
    conv = w.conversations[0]
    assert conv.output_lens == (6, 6, 6) and conv.question_lens == (10, 10, 10)
    t0 = conv.turn(0, [])
    assert t0.messages == (Message("user", conv.questions[0]),) and t0.input_len == 10
    t1 = conv.turn(1, [(" first answer", 2)])
    t2 = conv.turn(2, [(" first answer", 2), (" second", 1)])
    assert t1.messages[:1] == t0.messages and t1.messages[1] == Message("assistant", " first answer")
    assert t2.messages[:3] == t1.messages and t2.messages[3] == Message("assistant", " second")
    assert t0.input_len < t1.input_len < t2.input_len == 10 * 3 + 2 + 1
    # completion-style prompts extend each other, so a prefix cache can hit across turns
    assert t1.text.startswith(t0.text + " first answer\n\nUser: ")
    assert t2.text.startswith(t1.text + " second\n\nUser: ")
    assert t0.input_ids is None and t0.group == 0 and w.conversations[1].turn(0, []).group == 1
    assert w.warmup_inputs(5) == [t0, w.conversations[1].turn(0, [])]
    with pytest.raises(ValueError):
        conv.turn(2, [(" only one", 1)])
    with pytest.raises(ValueError):
        conv.turn(3, [("a", 1)] * 3)

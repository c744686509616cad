"""Incremental detokenization (UTF-8 safety, specials) and stop strings, on the tiny byte-level BPE."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.model.testing import build_tiny_tokenizer
from common.server.detokenizer import IncrementalDetokenizer, RequestDetokenizer, StopStringMatcher

NON_ASCII = "café 東京 🙂 München naïve"


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tiny_tokenizer()


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    deltas = [detok.step(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*deltas, detok.flush()]


def test_multibyte_characters_split_across_tokens_never_leak_replacement_chars(tok: Any) -> None:
    ids = tok.encode(NON_ASCII)
    assert any("\ufffd" in tok.decode([t]) for t in ids), "the test needs a character split across tokens"
    deltas = stream(IncrementalDetokenizer(tok, []), ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == NON_ASCII
    assert deltas[-1] == ""


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_prompt_context_does_not_change_the_output_text(tok: Any, chunk: int) -> None:
    prompt = tok.encode("Un deux trois, 東京")
    out = tok.encode(" naïve café 🙂 ok.")
    deltas = stream(IncrementalDetokenizer(tok, prompt), out, chunk)
    assert "".join(deltas) == tok.decode(prompt + out)[len(tok.decode(prompt)) :]


def test_incomplete_character_at_the_end_is_flushed_at_finish(tok: Any) -> None:
    ids = tok.encode("ok 🙂")
    split = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok, [])
    emitted = detok.step(ids[:split])
    assert "\ufffd" not in emitted
    assert emitted + detok.flush() == tok.decode(ids[:split])


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_deltas_concatenate_to_the_full_decode(tok: Any, data: st.DataObject) -> None:
    vocab = len(tok)
    ids = data.draw(st.lists(st.integers(3, vocab - 1), min_size=0, max_size=40))
    chunk = data.draw(st.integers(1, 5))
    assert "".join(stream(IncrementalDetokenizer(tok, []), ids, chunk)) == tok.decode(ids)


def test_skip_special_tokens(tok: Any) -> None:
    ids = tok.encode("Hello") + [tok.eos_token_id] + tok.encode(" world")
    skipped = "".join(stream(IncrementalDetokenizer(tok, [], skip_special_tokens=True), ids))
    kept = "".join(stream(IncrementalDetokenizer(tok, [], skip_special_tokens=False), ids))
    assert skipped == "Hello world"
    assert kept == "Hello<|im_end|> world"


def feed_all(matcher: StopStringMatcher, parts: list[str]) -> list[str]:
    out = []
    for i, part in enumerate(parts):
        check = matcher.feed(part, final=i == len(parts) - 1)
        out.append(check.emit)
        if check.matched is not None:
            break
    return out


def test_stop_string_is_trimmed_and_held_back_while_streaming() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abc S").emit == "abc "  # "S" could start "STOP": held back
    assert matcher.feed("T").emit == ""
    check = matcher.feed("OP and more")
    assert (check.emit, check.matched) == ("", "STOP")
    assert matcher.text == "abc "
    assert matcher.feed("late").emit == ""


def test_false_start_of_a_stop_string_is_released() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert feed_all(matcher, ["xST", "Ox", "y"]) == ["x", "STOx", "y"]
    assert matcher.matched is None


def test_held_back_tail_is_emitted_at_finish() -> None:
    matcher = StopStringMatcher(["</end>"])
    assert matcher.feed("answer </e").emit == "answer "
    assert matcher.feed("", final=True).emit == "</e"


def test_leftmost_of_several_stop_strings_wins() -> None:
    matcher = StopStringMatcher(["world", "lo w", "zzz"])
    assert feed_all(matcher, ["hel", "lo ", "world"]) == ["he", "l", ""]  # "l" could start "lo w"
    assert matcher.matched == "lo w"
    assert matcher.text == "hel"


def test_stop_at_the_very_start_gives_empty_text() -> None:
    matcher = StopStringMatcher(["ab"])
    check = matcher.feed("abc")
    assert check == ("", "ab")


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_stop_string_across_token_boundaries(tok: Any, chunk: int) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text)
    pieces = [tok.decode([t]) for t in ids]
    boundary = len(pieces[0]) + len(pieces[1])
    stop = text[boundary - 2 : boundary + 3]
    assert stop not in pieces[1] and stop not in pieces[2], "the stop must span tokens"
    detok = RequestDetokenizer(tok, [], stops=["nothing here", stop], skip_special_tokens=True)
    emitted, matched = "", None
    for i in range(0, len(ids), chunk):
        update = detok.step(ids[i : i + chunk], finished=i + chunk >= len(ids))
        emitted += update.delta
        assert text.startswith(emitted) and stop not in emitted
        if update.matched_stop:
            matched = update.matched_stop
            break
    assert matched == stop
    assert emitted == text[: text.find(stop)]

"""Workloads for bench/serving.py: what to send, built once per seed so every endpoint gets the same.

    random                   one user prompt per request, lengths uniform in [mean*(1-r), mean*(1+r)]
    generated-shared-prefix  G groups x P questions; every question of a group behind one long
                             system prompt (radix cache hits, cache-aware routing)
    skewed                   half the prompts behind one long shared prefix, half random
                             (a cache-aware router piles the shared half onto one worker)
    multi-turn               C conversations x T turns; turn k resends the whole history
                             (q0, a0, ..., q_k), so its prompt grows by the previous answer

A single-shot workload is a list of RequestInput. A multi-turn one is a list of
ConversationSpec: the answers come from the endpoint, so the runner builds turn k
with `spec.turn(k, answers)` once turn k-1 has finished.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

ROLE_LABEL = {"system": "System", "user": "User", "assistant": "Assistant"}


class Message(NamedTuple):
    role: str  # system | user | assistant
    content: str


@dataclass(frozen=True)
class RequestInput:
    """One request: the chat view (messages) and, for the native backend, exact token ids."""

    messages: tuple[Message, ...]
    input_len: int  # prompt tokens as generated (the endpoint's usage, when reported, wins)
    output_len: int  # sent as max_tokens with ignore_eos
    input_ids: tuple[int, ...] | None = None  # None: the native backend sends text
    group: int = -1  # shared-prefix group or conversation index; -1 for none
    transcript: bool = False  # render `text` as a transcript even for one user message (multi-turn)

    @property
    def text(self) -> str:
        """Completion-style prompt: the bare content of a lone user message, else a role-labelled transcript.

        The transcript of turn k+1 is the transcript of turn k + answer k + the next question.
        """
        if len(self.messages) == 1 and self.messages[0].role == "user" and not self.transcript:
            return self.messages[0].content
        # an answer follows "Assistant:" verbatim, as the model produced it after the previous prompt
        lines = [f"Assistant:{m.content}" if m.role == "assistant" else f"{ROLE_LABEL[m.role]}: {m.content}"
                 for m in self.messages]
        return "\n\n".join(lines) + "\n\nAssistant:"

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.content} for m in self.messages]


@dataclass(frozen=True)
class ConversationSpec:
    """A conversation's questions and answer lengths; answers are filled in at run time."""

    index: int
    questions: tuple[str, ...]
    question_lens: tuple[int, ...]
    output_lens: tuple[int, ...]

    @property
    def turns(self) -> int:
        return len(self.questions)

    def turn(self, k: int, answers: Sequence[tuple[str, int]]) -> RequestInput:
        """Turn k given the previous answers as (text, tokens); needs exactly k answers."""
        if len(answers) != k or not 0 <= k < self.turns:
            raise ValueError(f"turn {k} of {self.turns} needs {k} previous answers, got {len(answers)}")
        msgs: list[Message] = []
        for i in range(k):
            msgs += [Message("user", self.questions[i]), Message("assistant", answers[i][0])]
        msgs.append(Message("user", self.questions[k]))
        input_len = sum(self.question_lens[: k + 1]) + sum(n for _, n in answers)
        return RequestInput(tuple(msgs), input_len, self.output_lens[k], None, self.index, transcript=True)


@dataclass
class Workload:
    name: str
    requests: list[RequestInput] = field(default_factory=list)
    conversations: list[ConversationSpec] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return len(self.requests) + sum(c.turns for c in self.conversations)

    def warmup_inputs(self, n: int) -> list[RequestInput]:
        firsts = [c.turn(0, []) for c in self.conversations]
        return (self.requests + firsts)[:n]


class TokenSampler:
    """Random non-special token ids and text that re-tokenizes to (about) the same length."""

    def __init__(self, tokenizer: Any, rng: random.Random) -> None:
        self.tok = tokenizer
        self.rng = rng
        special = set(tokenizer.all_special_ids)
        self.vocab = [i for i in range(len(tokenizer)) if i not in special]
        if not self.vocab:
            raise ValueError("the tokenizer has no non-special tokens")

    def ids(self, n: int) -> list[int]:
        return [self.rng.choice(self.vocab) for _ in range(n)]

    def text(self, n: int) -> tuple[str, list[int]]:
        """n random tokens decoded to text; the ids are re-encoded from that text so both agree."""
        ids = self.ids(n)
        for _ in range(8):
            ids = self.tok.encode(self.tok.decode(ids), add_special_tokens=False)[:n]
            if len(ids) >= n:
                break
            ids += self.ids(n - len(ids))
        return self.tok.decode(ids), ids


def draw_len(rng: random.Random, mean: int, range_ratio: float) -> int:
    """Uniform integer in [mean*(1-r), mean*(1+r)], at least 1."""
    if mean < 1 or not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"need mean >= 1 and 0 <= range_ratio <= 1, got {mean}, {range_ratio}")
    lo = max(1, int(mean * (1.0 - range_ratio)))
    hi = max(lo, int(mean * (1.0 + range_ratio)))
    return rng.randint(lo, hi)


def random_workload(tokenizer: Any, num_prompts: int, input_len: int, output_len: int,
                    range_ratio: float, seed: int) -> Workload:
    rng = random.Random(seed)
    sampler = TokenSampler(tokenizer, rng)
    reqs = []
    for _ in range(num_prompts):
        text, ids = sampler.text(draw_len(rng, input_len, range_ratio))
        reqs.append(RequestInput((Message("user", text),), len(ids), draw_len(rng, output_len, range_ratio),
                                 tuple(ids)))
    return Workload("random", requests=reqs)


def shared_prefix_workload(tokenizer: Any, num_groups: int, prompts_per_group: int, system_len: int,
                           question_len: int, output_len: int, seed: int) -> Workload:
    """Prompts of one group share their system prompt (text and ids); the order is shuffled across groups."""
    rng = random.Random(seed)
    sampler = TokenSampler(tokenizer, rng)
    reqs = []
    for g in range(num_groups):
        system, sys_ids = sampler.text(system_len)
        for _ in range(prompts_per_group):
            question, q_ids = sampler.text(question_len)
            msgs = (Message("system", system), Message("user", question))
            reqs.append(RequestInput(msgs, len(sys_ids) + len(q_ids), output_len, tuple(sys_ids + q_ids), g))
    rng.shuffle(reqs)
    return Workload("generated-shared-prefix", requests=reqs)


def skewed_workload(tokenizer: Any, num_prompts: int, prefix_len: int, question_len: int, input_len: int,
                    output_len: int, range_ratio: float, seed: int) -> Workload:
    """num_prompts // 2 share one prefix (group 0) plus a question; the rest are random (group -1)."""
    rng = random.Random(seed)
    sampler = TokenSampler(tokenizer, rng)
    prefix, prefix_ids = sampler.text(prefix_len)
    reqs = []
    for i in range(num_prompts):
        if i % 2 == 0:
            question, q_ids = sampler.text(question_len)
            msgs = (Message("system", prefix), Message("user", question))
            reqs.append(RequestInput(msgs, len(prefix_ids) + len(q_ids), output_len, tuple(prefix_ids + q_ids), 0))
        else:
            text, ids = sampler.text(draw_len(rng, input_len, range_ratio))
            reqs.append(RequestInput((Message("user", text),), len(ids), output_len, tuple(ids)))
    rng.shuffle(reqs)
    return Workload("skewed", requests=reqs)


def multi_turn_workload(tokenizer: Any, num_conversations: int, turns: int, question_len: int,
                        output_len: int, range_ratio: float, seed: int) -> Workload:
    rng = random.Random(seed)
    sampler = TokenSampler(tokenizer, rng)
    convs = []
    for c in range(num_conversations):
        qs = [sampler.text(draw_len(rng, question_len, range_ratio)) for _ in range(turns)]
        outs = tuple(draw_len(rng, output_len, range_ratio) for _ in range(turns))
        convs.append(ConversationSpec(c, tuple(q for q, _ in qs), tuple(len(ids) for _, ids in qs), outs))
    return Workload("multi-turn", conversations=convs)

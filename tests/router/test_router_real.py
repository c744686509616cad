"""The router in front of REAL instances (tiny model, fp32): the unchanged `openai` client gets
the same text through 1P1D as through the colocated instance."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.compat.cluster import Cluster
from tests.router.router_procs import RouterProc

PROMPTS = ["The quick brown fox", "What is the capital of France?", "KV cache pages move", "Hello"]
MESSAGES = [[{"role": "user", "content": p}] for p in PROMPTS]


@pytest.fixture(scope="module")
def routers(tiny_cluster: Cluster) -> Iterator[tuple[RouterProc, RouterProc]]:
    """The session's shared tiny cluster: its PD router and a router in front of its colocated instance."""
    yield tiny_cluster.router, tiny_cluster.colocated_router()
    tiny_cluster.wait_whole()


def client(router: RouterProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def completions(router: RouterProc, *, stream: bool) -> list[tuple[str, str | None]]:
    c = client(router)
    model = c.models.list().data[0].id
    out = []
    for prompt in PROMPTS:
        kw: dict[str, Any] = dict(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
        if stream:
            text, finish = "", None
            for chunk in c.completions.create(stream=True, **kw):
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
            out.append((text, finish))
        else:
            r = c.completions.create(**kw)
            assert r.usage is not None and r.usage.completion_tokens == 12
            out.append((r.choices[0].text, r.choices[0].finish_reason))
    return out


def chats(router: RouterProc, *, stream: bool) -> list[str]:
    c = client(router)
    model = c.models.list().data[0].id
    out = []
    for messages in MESSAGES:
        kw: dict[str, Any] = dict(model=model, messages=messages, max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})
        if stream:
            text = ""
            for chunk in c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
            out.append(text)
        else:
            out.append(c.chat.completions.create(**kw).choices[0].message.content or "")
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_completions_pd_equal_colocated(routers: tuple[RouterProc, RouterProc], stream: bool) -> None:
    pd_router, co_router = routers
    pd, co = completions(pd_router, stream=stream), completions(co_router, stream=stream)
    assert pd == co
    assert all(finish == "length" for _, finish in pd) and any(text for text, _ in pd)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_pd_equal_colocated(routers: tuple[RouterProc, RouterProc], stream: bool) -> None:
    pd_router, co_router = routers
    assert chats(pd_router, stream=stream) == chats(co_router, stream=stream)

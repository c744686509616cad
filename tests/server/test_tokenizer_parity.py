"""FastTokenizer (tokenizers + sandboxed jinja2, no transformers) against transformers on the same
directory: identical ids, decoded text and rendered chat prompts.

Covers the four tiny layouts, the default model, and hand-made tokenizer configs that drive each
path transformers applies (added_tokens_decoder, special tokens missing from the vocabulary,
add_bos/eos_token beside tokenizer.json, clean-up spaces, several templates, a template in tokenizer_config.json), and
chat templates with system prompts, tools, multi-turn histories and raise_exception.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from common.chat_template import ChatTemplateError
from common.fast_tokenizer import FastTokenizer, UnsupportedTokenizer
from common.model.testing import ARCHS
from common.tokenizer_loading import load_tokenizer, load_with_transformers

TEXTS = ["Hello world", "", " leading space", "The capital of France is Paris.\n\nKV cache pages.",
         "<|im_start|>user\nhi<|im_end|>", "a <|im_start|> b\n<|im_start|>\nc", "a<|endoftext|>b <|im_end|> c",
         "Un deux, naïve café, 東京 🙂 ok",
         "tabs\tand  double  spaces ", "don't , isn't . what ? yes !"]

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city <b>now</b>",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]

CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is KV?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
         "name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "{\"temp\": 21}"}, {"role": "user", "content": "Thanks, 東京 too?"}],
    [{"role": "user", "content": "Think first"}, {"role": "assistant", "content": "Done.", "reasoning": "2+2"},
     {"role": "user", "content": "again"}],
]

# Qwen-style: tools as JSON, namespace, loop controls, raise_exception, reasoning, generation blocks.
TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You are helpful.' }}
# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
  {%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}
    {{- raise_exception('unknown role ' + message['role']) }}
  {%- endif %}
  {%- if message['role'] == 'system' %}{% continue %}{% endif %}
  {%- set ns.turns = ns.turns + 1 %}
<|im_start|>{{ message['role'] }}
{% if message.reasoning_content is defined %}<think>{{ message.reasoning_content }}</think>{% endif %}
{%- if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | default('') }}{% endgeneration %}
{%- else %}{{ message['content'] }}{% endif %}
{%- for call in message.tool_calls | default([]) %}
<tool_call>{{ dict(name=call.function.name, arguments=call.function.arguments) | tojson(sort_keys=True) }}</tool_call>
{%- endfor %}<|im_end|>
{%- endfor %}
{% if add_generation_prompt %}<|im_start|>assistant {{ ns.turns }} {{ bos_token }}{{ strftime_now('') }}
{% endif %}"""


def _pair(path: str) -> tuple[FastTokenizer, Any]:
    """FastTokenizer and the reference: the class tokenizer_config.json names (what pdserve loaded
    before); ids and prompts are also checked against AutoTokenizer, which may pick a model-type class."""
    fast = load_tokenizer(path)
    assert isinstance(fast, FastTokenizer)
    ref = load_with_transformers(path)
    auto = transformers.AutoTokenizer.from_pretrained(path)
    for text in TEXTS:
        assert fast.encode(text) == auto.encode(text), text
    for chat in CHATS if auto.chat_template else []:
        assert _render(fast, chat) == _render(auto, chat)
    return fast, ref


def _render(tok: Any, chat: list[dict[str, Any]], **kwargs: Any) -> str:
    """The prompt, or the refusal (a template that reads a key the message lacks fails in both)."""
    try:
        return str(tok.apply_chat_template(chat, tokenize=False, **kwargs))
    except Exception as e:
        return f"refused: {str(e).removeprefix('chat template refused: ')}"


def _assert_same(fast: FastTokenizer, ref: Any, chats: list[list[dict[str, Any]]] = CHATS) -> None:
    assert type(ref).__name__ == "TokenizersBackend"  # not a fallback that would compare transformers with itself
    for text in TEXTS:
        for special in (True, False):
            assert fast.encode(text, add_special_tokens=special) == ref.encode(text, add_special_tokens=special), text
    n = len(ref)
    assert len(fast) == n
    assert {i: repr(t) for i, t in fast.added_tokens_decoder.items()} == {
        i: repr(t) for i, t in ref.added_tokens_decoder.items()}
    ids = [*range(0, n, max(1, n // 2000)), *range(max(0, n - 40), n), *ref.all_special_ids]
    for skip in (True, False):
        assert fast.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
        for text in TEXTS:
            enc = ref.encode(text)
            assert fast.decode(enc, skip_special_tokens=skip) == ref.decode(enc, skip_special_tokens=skip)
    assert fast.special_tokens_map == ref.special_tokens_map
    assert fast.all_special_ids == ref.all_special_ids
    assert (fast.eos_token_id, fast.bos_token_id, fast.pad_token_id) == (ref.eos_token_id, ref.bos_token_id,
                                                                         ref.pad_token_id)
    assert fast.model_max_length == ref.model_max_length
    assert fast.chat_template == ref.chat_template
    if ref.chat_template is None:
        return
    for chat in chats:
        for gen in (True, False):
            text = _render(fast, chat, add_generation_prompt=gen)
            assert text == _render(ref, chat, add_generation_prompt=gen)
            assert _render(fast, chat, add_generation_prompt=gen, tools=TOOLS) == _render(
                ref, chat, add_generation_prompt=gen, tools=TOOLS)
            if not text.startswith("refused"):
                ids_ref = ref.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen, return_dict=False)
                assert fast.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen) == list(ids_ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_layouts_match_transformers(tiny_checkpoint: Callable[[str], str], arch: str) -> None:
    _assert_same(*_pair(tiny_checkpoint(arch)))


@pytest.mark.slow
def test_default_model_matches_transformers(default_model_path: str) -> None:
    fast, ref = _pair(default_model_path)
    _assert_same(fast, ref)
    assert "You are a helpful AI assistant named SmolLM" in str(fast.apply_chat_template(CHATS[0], tokenize=False))


def _variant(tiny_llama_path: str, tmp_path: Path, config: dict[str, Any], template: str | None = None) -> str:
    """The tiny tokenizer.json with a hand-made tokenizer_config.json (and template file)."""
    shutil.copy(Path(tiny_llama_path) / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend", **config}))
    if template is not None:
        (tmp_path / "chat_template.jinja").write_text(template)
    return str(tmp_path)


VARIANTS: dict[str, tuple[dict[str, Any], str | None]] = {
    "tool template, add_bos/eos_token ignored": ({"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
                                          "add_bos_token": True, "add_eos_token": True}, TOOL_TEMPLATE),
    "specials missing from the vocabulary": ({
        "bos_token": "<s>", "pad_token": {"__type": "AddedToken", "content": "<pad>", "lstrip": True},
        "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False, "rstrip": False, "normalized": False,
                                          "single_word": False, "special": True},
        "mask_token": "<mask>", "image_token": "<img>", "extra_special_tokens": ["<x1>", "<x2>"],
        "added_tokens_decoder": {"400": {"content": "<tool>", "special": False, "lstrip": False, "rstrip": False,
                                         "normalized": False, "single_word": False},
                                 "401": {"content": "<sp>", "special": True, "lstrip": False, "rstrip": False,
                                         "normalized": False, "single_word": False}},
        "model_max_length": 4096}, TOOL_TEMPLATE),
    "template in the config": ({"bos_token": "<|endoftext|>", "add_bos_token": True,
                                          "clean_up_tokenization_spaces": True,
                                          "chat_template": TOOL_TEMPLATE.replace("You are helpful.", "Config.")}, None),
    "an existing token's flags changed": ({"eos_token": "<|im_end|>", "added_tokens_decoder": {
        "1": {"content": "<|im_start|>", "special": False, "lstrip": True, "rstrip": True, "normalized": False,
              "single_word": False}}}, TOOL_TEMPLATE),
    "named templates": ({"eos_token": "<|im_end|>", "chat_template": [
        {"name": "default", "template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"},
        {"name": "tool_use", "template": TOOL_TEMPLATE}]}, None),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_config_variants_match_transformers(tiny_llama_path: str, tmp_path: Path, name: str) -> None:
    config, template = VARIANTS[name]
    _assert_same(*_pair(_variant(tiny_llama_path, tmp_path, config, template)))


def test_truncation_and_padding_saved_in_tokenizer_json_stay_off(tiny_llama_path: str, tmp_path: Path) -> None:
    backend = Tokenizer.from_file(str(Path(tiny_llama_path) / "tokenizer.json"))
    backend.enable_truncation(max_length=4)
    backend.enable_padding(length=40, pad_id=0, pad_token="<|endoftext|>")
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TokenizersBackend", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    fast, ref = _pair(str(tmp_path))
    _assert_same(fast, ref)
    assert len(fast.encode("The quick brown fox jumps")) == len(ref.encode("The quick brown fox jumps")) > 4


def test_cleanup_spaces_apply_to_wordlevel_models(tmp_path: Path) -> None:
    words = ["[UNK]", "[CLS]", "don", "'", "t", ",", "isn", ".", "what", "?", "yes", "!", "hello", "world"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": True,
        "unk_token": "[UNK]", "cls_token": "[CLS]"}))
    fast, ref = _pair(str(tmp_path))
    assert type(ref).__name__ == "TokenizersBackend"
    ids = ref.encode("don't , isn't . what ? yes ! hello world")
    assert fast.decode(ids) == ref.decode(ids) == "don't, isn't. what? yes! hello world"


def test_raise_exception_and_sandbox_refusals(tiny_llama_path: str, tmp_path: Path) -> None:
    fast, ref = _pair(_variant(tiny_llama_path, tmp_path, {"bos_token": "<|endoftext|>"}, TOOL_TEMPLATE))
    bad = [{"role": "wizard", "content": "x"}]
    with pytest.raises(ChatTemplateError, match="unknown role wizard"):
        fast.apply_chat_template(bad, tokenize=False)
    with pytest.raises(Exception, match="unknown role wizard"):
        ref.apply_chat_template(bad, tokenize=False)
    escape = "{{ messages.__class__.__mro__ }}{% set ns = namespace(_x=1) %}"
    (tmp_path / "chat_template.jinja").write_text(escape)
    with pytest.raises(ChatTemplateError):
        load_tokenizer(str(tmp_path)).apply_chat_template(CHATS[0], tokenize=False)
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        fast.apply_chat_template([], tokenize=False)
    with pytest.raises(NotImplementedError, match="continue_final_message"):
        fast.apply_chat_template(CHATS[0], tokenize=False, continue_final_message=True)


def test_other_tokenizer_classes_stay_with_transformers(tiny_llama_path: str, tmp_path: Path) -> None:
    path = _variant(tiny_llama_path, tmp_path, {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>"})
    with pytest.raises(UnsupportedTokenizer):
        FastTokenizer.load(path)
    assert not isinstance(load_tokenizer(path), FastTokenizer)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(UnsupportedTokenizer):
        FastTokenizer.load(path)

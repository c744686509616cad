"""A checkpoint's tokenizer on the `tokenizers` package alone: what the HTTP frontend, the router
and the engine's text path need (encode, decode, chat template), without importing transformers.

`FastTokenizer.load(dir)` rebuilds what transformers 5's TokenizersBackend.from_pretrained(dir)
builds from tokenizer.json and tokenizer_config.json:
- the named special tokens (bos/eos/unk/sep/pad/cls/mask, model-specific `*_token`s and
  extra_special_tokens) and the config's added_tokens_decoder become added tokens, special
  ones skipped by decode(skip_special_tokens=True);
- tokenizer.json's post-processor decides which special tokens encode() adds (transformers drops
  the config's add_bos_token / add_eos_token when tokenizer.json exists);
- clean_up_tokenization_spaces applies to non-BPE models only, as in transformers;
- truncation and padding saved in tokenizer.json are off (transformers' encode() turns them off);
- the chat template comes from chat_template.jinja and additional_chat_templates/*.jinja
  before tokenizer_config.json's `chat_template`.
Checkpoints it cannot promise to match (another tokenizer class, no tokenizer.json) stay
with transformers: common/tokenizer_loading.py decides.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from common.chat_template import ChatTemplate, ChatTemplateError

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
VERY_LARGE_INTEGER = int(1e30)  # transformers' model_max_length when the config names none
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# transformers' apply_chat_template options this renderer does not implement (refused, never ignored)
UNSUPPORTED_CHAT_KWARGS = frozenset({"continue_final_message", "return_assistant_tokens_mask", "chat_template",
                                     "sanitize_control_tokens", "return_dict", "tokenizer_kwargs"})


class UnsupportedTokenizer(Exception):
    """This checkpoint needs transformers' own tokenizer class."""


def _added_token(value: str | dict[str, Any], *, special: bool) -> AddedToken:
    if isinstance(value, str):
        return AddedToken(value, special=special, normalized=not special)
    flags: dict[str, bool] = {k: bool(value[k]) for k in ("single_word", "lstrip", "rstrip", "normalized") if k in value}
    flags["special"] = special
    return AddedToken(str(value["content"]), **flags)


def _content(value: str | dict[str, Any]) -> str:
    return value if isinstance(value, str) else str(value["content"])


def _cleanup(text: str) -> str:
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def read_chat_template(path: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """transformers' precedence: template files first, then the config's `chat_template`."""
    templates: dict[str, str] = {}
    if (path / CHAT_TEMPLATE_FILE).is_file():
        templates["default"] = (path / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (path / CHAT_TEMPLATE_DIR).is_dir():
        for f in sorted((path / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            templates[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if len(templates) == 1 and "default" in templates:
        return templates["default"]
    if templates:
        return templates
    value = config.get("chat_template")
    if isinstance(value, list):
        return {t["name"]: t["template"] for t in value}
    return value if isinstance(value, str | dict) else None


class FastTokenizer:
    """Immutable after load; encode/decode/apply_chat_template are safe from any thread (the
    Rust tokenizer releases the GIL). Attribute names follow transformers' so callers written
    for a PreTrainedTokenizer keep working."""

    def __init__(self, backend: Tokenizer, config: dict[str, Any], chat_template: str | dict[str, str] | None,
                 name_or_path: str = "") -> None:
        self._tok = backend
        # transformers' encode() turns off the truncation and padding a tokenizer.json may carry
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = False  # split_special_tokens (refused in load) would set it
        self.name_or_path = name_or_path
        self.model_max_length = int(config.get("model_max_length") or config.get("max_len") or VERY_LARGE_INTEGER)
        named = self._named_special_tokens(config)
        self.special_tokens_map: dict[str, str] = {k: _content(v) for k, v in named.items()}
        extras = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
        extras = list(extras) if isinstance(extras, list | tuple) else []
        self._add_config_tokens(config, [*named.values(), *extras])
        self._special_contents = list(dict.fromkeys(_content(v) for v in [*named.values(), *extras]))
        self._cleanup_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and (
            type(backend.model).__name__ != "BPE")
        self.chat_template = chat_template
        self._template = ChatTemplate(chat_template, self.special_tokens_map) if chat_template else None

    @classmethod
    def load(cls, path: str) -> FastTokenizer:
        root = Path(path)
        file = root / "tokenizer.json"
        if not file.is_file():
            raise UnsupportedTokenizer(f"{path} has no tokenizer.json")
        try:
            config = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
        except FileNotFoundError:
            config = {}
        if not isinstance(config, dict):
            raise UnsupportedTokenizer(f"{path}/tokenizer_config.json is not an object")
        if config.get("tokenizer_class") not in (None, "TokenizersBackend", "PreTrainedTokenizerFast"):
            raise UnsupportedTokenizer(f"tokenizer_class {config['tokenizer_class']} needs transformers")
        if config.get("tokenizer_class") is None and (root / "config.json").is_file():
            raise UnsupportedTokenizer("no tokenizer_class: transformers picks one from the model type")
        if config.get("split_special_tokens") or config.get("fix_mistral_regex"):
            raise UnsupportedTokenizer("split_special_tokens / fix_mistral_regex need transformers")
        return cls(Tokenizer.from_file(str(file)), config, read_chat_template(root, config), path)

    @staticmethod
    def _named_special_tokens(config: dict[str, Any]) -> dict[str, str | dict[str, Any]]:
        named = {k: config[k] for k in SPECIAL_TOKEN_NAMES if config.get(k) is not None}
        extra = config.get("extra_special_tokens")
        if isinstance(extra, dict):
            named.update({k: v for k, v in extra.items() if v is not None})
        named.update({k: v for k, v in config.items()
                      if k.endswith("_token") and k not in named and isinstance(v, str | dict)
                      and (isinstance(v, str) or "content" in v)})
        return named

    def _add_config_tokens(self, config: dict[str, Any], specials: list[str | dict[str, Any]]) -> None:
        """As transformers: config tokens that differ from the backend's (new, or other flags), then
        special tokens it lacks; adding an existing content again updates its flags."""
        added = self._tok.get_added_tokens_decoder().values()
        existing = {repr(t) for t in added}
        decoder = config.get("added_tokens_decoder") or {}
        new = [tok for _, v in sorted(decoder.items(), key=lambda kv: int(kv[0]))
               if repr(tok := _added_token(v, special=bool(v.get("special", False)))) not in existing]
        seen = {t.content for t in added} | {t.content for t in new}
        for value in specials:
            if _content(value) not in seen:
                new.append(_added_token(value, special=True))
                seen.add(_content(value))
        if new:
            self._tok.add_tokens(new)

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return dict(self._tok.get_added_tokens_decoder())

    def __len__(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def _id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self._tok.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    @property
    def all_special_ids(self) -> list[int]:
        """The ids of the named and extra special tokens (transformers' definition, not every special added token)."""
        ids = (self._tok.token_to_id(t) for t in self._special_contents)
        return list(dict.fromkeys(i for i in ids if i is not None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int] | int, skip_special_tokens: bool = False) -> str:
        text = str(self._tok.decode([ids] if isinstance(ids, int) else list(ids), skip_special_tokens=skip_special_tokens))
        return _cleanup(text) if self._cleanup_spaces else text

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self._tok.id_to_token(i) for i in ids]

    def apply_chat_template(self, messages: list[dict[str, Any]], *, tokenize: bool = True,
                            add_generation_prompt: bool = False, tools: list[dict[str, Any]] | None = None,
                            **kwargs: Any) -> str | list[int]:
        """As transformers': the rendered text, or its ids encoded without adding special tokens."""
        unsupported = UNSUPPORTED_CHAT_KWARGS.intersection(k for k, v in kwargs.items() if v)
        if unsupported:
            raise NotImplementedError(f"apply_chat_template({', '.join(sorted(unsupported))}) needs transformers")
        if self._template is None:
            raise ChatTemplateError("this tokenizer has no chat template")
        text = self._template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

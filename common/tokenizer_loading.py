"""Load a checkpoint's tokenizer for the processes that only tokenize, without importing transformers.

The HTTP frontend, the router and the engine's text path take `FastTokenizer` (the `tokenizers`
package and a sandboxed jinja2 chat template, ~0.1 s) whenever the checkpoint's tokenizer is
the generic tokenizers one (tokenizer.json with tokenizer_class TokenizersBackend or
PreTrainedTokenizerFast), where it is held equal to transformers by tests. Any other class
(sentencepiece-only, model-specific classes that rebuild the tokenizer) is loaded by
transformers, as AutoTokenizer would, with a log line saying so: ~1 s more per process start,
never a different tokenization.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from common.fast_tokenizer import FastTokenizer, UnsupportedTokenizer

logger = logging.getLogger(__name__)


def load_tokenizer(model_path: str) -> Any:
    """FastTokenizer.load(model_path), or what AutoTokenizer.from_pretrained(model_path) builds."""
    try:
        return FastTokenizer.load(model_path)
    except UnsupportedTokenizer as e:
        logger.info("tokenizer of %s loads through transformers: %s", model_path, e)
    return load_with_transformers(model_path)


def load_with_transformers(model_path: str) -> Any:
    """transformers' tokenizer, taking the class tokenizer_config.json names directly (AutoTokenizer
    would first resolve the model's config through AutoConfig, which imports torch). Only a tokenizer
    class is accepted: a checkpoint naming any other transformers class (a model, a config) is refused
    with ValueError before anything is instantiated."""
    import transformers

    try:
        name = json.loads((Path(model_path) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        name = None
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if cls is not None and not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase)):
        # AutoTokenizer would take it too (it looks the name up the same way)
        raise ValueError(f"{model_path}: tokenizer_config.json names tokenizer_class {name!r}, which is not a "
                         "transformers tokenizer class")
    if cls is not None:
        try:
            return cls.from_pretrained(model_path)
        except Exception:  # odd configs: let AutoTokenizer decide
            pass
    return transformers.AutoTokenizer.from_pretrained(model_path)

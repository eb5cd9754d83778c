"""The policy a new user writes for the vLLM of loadtest/vllm: the tiny model counted with the
tokenizer files and chat template in its own directory (the ones vLLM serves it with), its
shape as a custom architecture, and a `default` pool of `engine: vllm` backends (v0, v1, ...).

The pool's `block_size` is left at the gateway's default (16) as a new user would leave it,
though this vLLM's blocks are 128 tokens (`vllm:cache_config_info`); see docs/policy.md. Its
`gpu: cpu` says the engines run on CPUs: no GPU roofline for the planner (no planned KV capacity
or prefill and in-flight limits; the engines report their capacity, `loadtest calibrate` learns
the limits: docs/planner.md).
"""

from __future__ import annotations

from pathlib import Path

from loadtest.vllm.model import TinyModel
from loadtest.vllm.server import SERVED_NAME

DEFAULT_MODEL = TinyModel()


def vllm_policy(urls: list[str], model_dir: Path, *, max_model_len: int = 2048,
                spec: TinyModel = DEFAULT_MODEL, served_name: str = SERVED_NAME,
                pool_extra: str = "", extra: str = "") -> str:
    """`pool_extra`: lines indented into the pool; `extra`: YAML appended at the top level."""
    arch = ", ".join(f"{k}: {v}" for k, v in spec.architecture().items())
    backends = "\n".join(f'      - {{name: v{i}, url: "{u}"}}' for i, u in enumerate(urls))
    return f"""models:
  - name: {served_name}
    tokenizer: "{model_dir}"
    architecture: {{{arch}}}
pools:
  default:
    engine: vllm
    gpu: cpu
    models: [{served_name}]
    max_model_len: {max_model_len}
{pool_extra}    backends:
{backends}
{extra}"""

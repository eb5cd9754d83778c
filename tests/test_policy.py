"""`gateway check`: valid policies summarised; each kind of mistake named with its path."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gateway.policy import PolicyError, parse_policy
from tests.servers import ROOT, gateway_cmd

GOOD = """
models:
  - name: m
    tokenizer: none
    architecture: qwen2.5-72b
pools:
  default:
    models: [m]
    max_model_len: 32768
    backends:
      - {name: e0, url: "http://127.0.0.1:8001"}
  long:
    models: [m]
    max_model_len: 131072
    backends:
      - {name: l0, url: "http://127.0.0.1:8002"}
      - {name: l1, url: "http://127.0.0.1:8003"}
"""


def check(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    return subprocess.run([*gateway_cmd("check"), str(path)], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("name", ["demo.yaml", "example-70b-8xh100.yaml"])
def test_shipped_policies_pass_check(name: str) -> None:
    result = subprocess.run([*gateway_cmd("check"), str(ROOT / "policies" / name)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout
    assert "pools:" in result.stdout


def test_good_policy_summary(tmp_path: Path) -> None:
    result = check(tmp_path, GOOD)
    assert result.returncode == 0, result.stderr
    assert "default: vllm, models m, max_model_len 32768" in result.stdout
    assert "l1: http://127.0.0.1:8003" in result.stdout
    assert "KV 327,680 B/token" in result.stdout


@pytest.mark.parametrize(("edit", "path", "expected"), [
    (('url: "http://127.0.0.1:8003"', 'url: "127.0.0.1:8003"'),
     "pools.long.backends[1].url", "expected an http(s) URL"),
    (("max_model_len: 131072", "max_model_len: -5"),
     "pools.long.max_model_len", "greater than 0"),
    (("max_model_len: 32768", "max_model_lenn: 32768"),
     "pools.default.max_model_lenn", "unknown key"),
    (("models: [m]\n    max_model_len: 32768", "models: [x]\n    max_model_len: 32768"),
     "pools.default.models[0]", "unknown model 'x'"),
    (("architecture: qwen2.5-72b", "architecture: qwen9"),
     "models[0].architecture", "unknown model profile 'qwen9'"),
    (("architecture: qwen2.5-72b", "architecture: {num_layers: 0, hidden_size: 8192, "
      "num_attention_heads: 64, num_kv_heads: 8, head_dim: 128, params: 7.0e10}"),
     "models[0].architecture.num_layers", "must be a positive integer"),
    (("architecture: qwen2.5-72b", "architecture: {num_layers: 80, hidden_size: 8192, "
      "num_attention_heads: 60, num_kv_heads: 8, head_dim: 128, params: 7.0e10}"),
     "models[0].architecture.num_attention_heads", "divisible by num_kv_heads"),
    (("{name: l0,", "{name: l1,"), "pools.long.backends", "unique"),
    (("max_model_len: 32768", "max_model_len: 32768\n    admission: {prefill_tokens_max: 0}"),
     "pools.default.admission.prefill_tokens_max", "greater than 0"),
    (("  default:\n    models", "  default:\n    engine: tgi\n    models"),
     "pools.default.engine", "'vllm', 'sglang', 'llamacpp' or 'openai'"),
    (("pools:\n", "server: {gc_freeze_interval_s: -1}\npools:\n"),
     "server.gc_freeze_interval_s", "greater than or equal to 0"),
    (("pools:\n", "server: {gc_sweep_interval_s: 0}\npools:\n"),
     "server.gc_sweep_interval_s", "greater than 0"),
    (("pools:\n", "server: {gc_sweep_growth: -0.5}\npools:\n"),
     "server.gc_sweep_growth", "greater than or equal to 0"),
])
def test_bad_policy_names_path_and_rule(tmp_path: Path, edit: tuple[str, str], path: str,
                                        expected: str) -> None:
    old, new = edit
    assert old in GOOD
    result = check(tmp_path, GOOD.replace(old, new, 1))
    assert result.returncode == 1
    assert "policy.yaml: " + path + ": " in result.stderr, result.stderr
    assert expected in result.stderr


def test_yaml_syntax_and_duplicate_keys() -> None:
    with pytest.raises(PolicyError, match=r"p.yaml: not valid YAML: line 1"):
        parse_policy("models: [", "p.yaml")
    with pytest.raises(PolicyError, match=r"duplicate key 'pools'"):
        parse_policy(GOOD + "pools: {}\n", "p.yaml")


def test_missing_file(tmp_path: Path) -> None:
    result = subprocess.run([*gateway_cmd("check"), str(tmp_path / "nope.yaml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "nope.yaml: cannot read the file" in result.stderr


def test_an_architecture_resolves_once_and_a_copy_with_other_fields_anew() -> None:
    """The request path reads the profile per request: it is built at load, not each time."""
    model = parse_policy(GOOD).models[0]
    assert model.architecture is not None
    profile = model.architecture.resolve()
    assert profile is model.architecture.resolve() and profile.name == "qwen2.5-72b"
    changed = model.architecture.model_copy(update={"num_layers": 3})
    assert changed.resolve().num_layers == 3
    assert model.architecture.resolve().num_layers == profile.num_layers != 3

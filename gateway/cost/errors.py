"""Errors of the cost stage, counting a request's tokens (gateway/tokens/) and costing its work
(work.py) alike; the gateway maps each to an HTTP status at its boundary.

    CostError
     +-- TokenizerError        a tokenizer spec that cannot be loaded (startup error, names what
     |                         was tried)
     +-- RequestCostError      the request itself is bad (the gateway answers 400)
          +-- TemplateError    the chat template cannot render these messages
          +-- PromptTooLong    over the configured character limit; rejected before tokenizing
"""

from __future__ import annotations


class CostError(Exception):
    """Base of every error raised by `gateway.tokens` and `gateway.cost`."""


class TokenizerError(CostError):
    """A tokenizer could not be loaded or cannot do what was asked of it."""


class RequestCostError(CostError, ValueError):
    """The request cannot be costed as sent: a client error (400)."""

    param: str | None = None


class TemplateError(RequestCostError):
    """The chat template raised on these messages (bad roles, missing content, ...)."""

    param = "messages"


class PromptTooLong(RequestCostError):
    """The prompt has more characters than the configured limit."""

    def __init__(self, chars: int, limit: int, param: str = "messages") -> None:
        super().__init__(
            f"prompt has {chars} characters, over this gateway's limit of {limit}"
        )
        self.chars = chars
        self.limit = limit
        self.param = param

"""A prompt's tokens, counted as the engine will count them: tokenizers and chat templates.

    load_tokenizer(spec) -> Tokenizer    exact counts (chat template + Rust tokenizer) or `none`
    TokenCounter(tokenizer)              the same counts off the event loop, with a character limit
    openai_messages(messages)            chat messages as vLLM normalises them for the template

    loading.py    the tokenizer a policy names (hub.py: files of a Hugging Face hub id)
    tokenizer.py  `Tokenizer`, `HFTokenizer`: template, piece cache, encoder
    estimator.py  the `none` tokenizer: characters times a ratio learned online
    counter.py    counting off the event loop, the long-prompt lane
    templates.py  chat templates rendered as `transformers` renders them (Jinja);
                  chat_templates/ the built-in ones
    native.py     the common templates rendered in plain Python, to the same text
    turns.py      a conversation's next turn: only what is new is rendered and walked
    blocks.py     the block trie: a prompt's count and block hashes by its rendered pieces
    pieces.py     the piece cache
    rankbpe.py    tiktoken's rank encoder where it gives the Hugging Face encoder's ids
    images.py     image parts and the prompt tokens a vision encoder makes of them
    anthropic.py  an Anthropic Messages request as the chat the engine renders
    memory.py, threads.py  freed memory back to the system; counting threads below the loop

What goes wrong raises gateway/cost/errors.py's tree (a tokenizer that cannot load, a template
that cannot render, a prompt over the character limit). What the tokens cost on an engine is
gateway/cost/'s.
"""

from __future__ import annotations

from gateway.tokens.counter import TokenCount, TokenCounter
from gateway.tokens.estimator import CharRatioEstimator, chat_chars
from gateway.tokens.loading import load_tokenizer
from gateway.tokens.templates import openai_messages
from gateway.tokens.tokenizer import HFTokenizer, Tokenizer

__all__ = [
    "CharRatioEstimator",
    "HFTokenizer",
    "TokenCount",
    "TokenCounter",
    "Tokenizer",
    "chat_chars",
    "load_tokenizer",
    "openai_messages",
]

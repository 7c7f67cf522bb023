"""A stand-in tokenizer: UTF-8 bytes in, one lowercase letter per generated token out."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["decode_tokens", "encode_text"]


def encode_text(text: str) -> list[int]:
    """Token ids of a prompt: its UTF-8 bytes (an empty prompt is one BOS token, id 0)."""
    return list(text.encode("utf-8")) or [0]


def decode_tokens(token_ids: Sequence[int]) -> str:
    """Text of generated tokens: one letter each, deterministic."""
    return "".join(chr(ord("a") + t % 26) for t in token_ids)

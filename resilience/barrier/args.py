"""A transition's arguments, checked before anything is sent: the tags to release or resume, the pause mode."""

from __future__ import annotations

from collections.abc import Sequence

from resilience.engine_contract import ALL_TAGS

__all__ = ["offload_args", "tags_arg"]


def tags_arg(tags: Sequence[str] | None, transition: str) -> frozenset[str]:
    """``tags`` as a set (None or empty: every tag), refusing a bare string and unknown tags with a message naming them."""
    if isinstance(tags, str):
        raise TypeError(f"{transition} tags must be a sequence of tag names, but was the string {tags!r}")
    wanted = frozenset(tags) if tags else frozenset(ALL_TAGS)
    unknown = wanted - frozenset(ALL_TAGS)
    if unknown:
        raise ValueError(
            f"{transition} tags must be among {ALL_TAGS}, but got {sorted(unknown)} "
            "(SGLang ignores an unknown tag on release, then dies of a KeyError on its resume)"
        )
    return wanted


def offload_args(tags: Sequence[str] | None, mode: str) -> frozenset[str]:
    """Check an offload's arguments before anything is sent; return the tags to release."""
    if mode not in ("abort", "retract"):
        raise ValueError(
            f"offload pause mode must be 'abort' or 'retract', but was {mode!r}: 'in_place' keeps running requests' KV cache, "
            "so flush_cache fails and release would crash the engine"
        )
    return tags_arg(tags, "offload")

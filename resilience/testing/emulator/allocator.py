"""Bookkeeping of request slots and KV indices, plus the prefix cache that ``flush_cache`` empties.

Pure Python lists: nothing here touches a tensor, so it is safe while memory is released.
"""

from __future__ import annotations

from collections import deque

from .config import EngineConfig

__all__ = ["TokenAllocator"]


class TokenAllocator:
    """Free lists of ``req_to_token`` rows and KV pool rows, and the KV of finished requests kept as cache.

    A finished request's KV stays cached (as in SGLang's radix cache) until :meth:`reset` (a flush) or until an
    allocation needs the room (oldest first).
    """

    def __init__(self, config: EngineConfig) -> None:
        self._slots_total = config.max_req_slots
        self._kv_total = config.kv_pool_tokens
        self._free_slots: list[int] = []
        self._free_kv: deque[int] = deque()
        self._cache: deque[list[int]] = deque()
        self.reset()

    def reset(self) -> None:
        """Everything free, cache empty (what a flush does to SGLang's pools)."""
        self._free_slots = list(range(self._slots_total - 1, -1, -1))
        self._free_kv = deque(range(self._kv_total))
        self._cache.clear()

    @property
    def total_tokens(self) -> int:
        """Capacity of the KV pool in tokens."""
        return self._kv_total

    @property
    def cached_tokens(self) -> int:
        """Tokens held by the cache (evictable)."""
        return sum(len(block) for block in self._cache)

    @property
    def used_tokens(self) -> int:
        """Tokens held by requests and by the cache."""
        return self._kv_total - len(self._free_kv)

    def can_fit(self, n_tokens: int) -> bool:
        """Whether ``n_tokens`` KV rows and one slot can be had now (counting evictable cache)."""
        return bool(self._free_slots) and len(self._free_kv) + self.cached_tokens >= n_tokens

    def alloc_slot(self) -> int:
        """Take one ``req_to_token`` row; call :meth:`can_fit` first."""
        return self._free_slots.pop()

    def free_slot(self, slot: int) -> None:
        """Give a ``req_to_token`` row back."""
        self._free_slots.append(slot)

    def alloc_kv(self, n_tokens: int) -> list[int]:
        """Take ``n_tokens`` KV rows, evicting cache oldest first; call :meth:`can_fit` first."""
        while len(self._free_kv) < n_tokens and self._cache:
            self._free_kv.extend(self._cache.popleft())
        if len(self._free_kv) < n_tokens:
            raise RuntimeError(f"KV pool exhausted: need {n_tokens}, have {len(self._free_kv)}")
        return [self._free_kv.popleft() for _ in range(n_tokens)]

    def free_kv(self, indices: list[int]) -> None:
        """Give KV rows back at once (a retracted or aborted request)."""
        self._free_kv.extend(indices)

    def cache_kv(self, indices: list[int]) -> None:
        """Keep a finished request's KV rows as cache."""
        if indices:
            self._cache.append(indices)

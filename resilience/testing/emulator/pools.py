"""The engine's memory: tagged torch tensors whose storage release really frees.

Three tags, as SGLang's torch_memory_saver regions: ``kv_cache`` (the KV pool and the ``req_to_token`` table),
``weights`` and ``cuda_graph``. ``release(tag)`` frees the storage of every tensor of the tag
(``untyped_storage().resize_(0)``), ``resume(tag)`` grows it back (contents lost, as without a CPU backup). Every
write and read of the forward pass is *by index*, so one into a released tensor raises ``RuntimeError`` exactly where
SGLang's Triton kernel hit the unmapped ``req_to_token`` pool. No whole-tensor op (``fill_``, ``copy_``, ``zero_``,
reductions) is ever run on these tensors: on a freed storage that is a SIGSEGV, not an exception.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import crash
from .config import EngineConfig

__all__ = ["ALL_TAGS", "CUDA_GRAPH", "KV_CACHE", "WEIGHTS", "MemoryPools", "sample_next"]

KV_CACHE = "kv_cache"
WEIGHTS = "weights"
CUDA_GRAPH = "cuda_graph"
ALL_TAGS: tuple[str, ...] = (KV_CACHE, WEIGHTS, CUDA_GRAPH)
"""SGLang's memory tags, in the order ``release_memory_occupation`` handles them."""

_KV_DIM = 8
_WEIGHT_ROWS = 1024
_GRAPH_ROWS = 64


class MemoryPools:
    """The tensors of one engine, grouped by tag, with torch_memory_saver's pause/resume rules."""

    def __init__(self, config: EngineConfig) -> None:
        self.kv_pool = torch.zeros((config.kv_pool_tokens, _KV_DIM), dtype=torch.float32)
        self.req_to_token = torch.zeros((config.max_req_slots, config.context_length), dtype=torch.int32)
        self.weights = torch.zeros((_WEIGHT_ROWS,), dtype=torch.float32)
        self.cuda_graph = torch.zeros((_GRAPH_ROWS,), dtype=torch.float32)
        self._regions: dict[str, tuple[torch.Tensor, ...]] = {
            KV_CACHE: (self.kv_pool, self.req_to_token),
            WEIGHTS: (self.weights,),
            CUDA_GRAPH: (self.cuda_graph,),
        }
        self._nbytes: dict[str, tuple[int, ...]] = {
            tag: tuple(t.untyped_storage().nbytes() for t in tensors) for tag, tensors in self._regions.items()
        }
        self._paused: set[str] = set()

    def allocated_bytes(self) -> dict[str, int]:
        """Bytes each tag's storage holds right now (0 while released): proof the memory is really freed."""
        return {tag: sum(t.untyped_storage().nbytes() for t in self._regions[tag]) for tag in ALL_TAGS}

    def nbytes(self, tag: str) -> int:
        """Bytes the tag occupies when active (static, like SGLang's ``memory_usage``)."""
        return sum(self._nbytes[tag])

    def release(self, tag: str) -> None:
        """Free the tag's storage. A tag already released ends the process like torch_memory_saver's ``exit(1)``."""
        if tag in self._paused:
            crash.exit_like_memory_saver("Cannot pause allocation that is not active")
        for tensor in self._regions[tag]:
            tensor.untyped_storage().resize_(0)
        self._paused.add(tag)

    def resume(self, tag: str) -> None:
        """Grow the tag's storage back (contents undefined). A tag not released raises KeyError, as in SGLang."""
        if tag not in self._paused:
            raise KeyError(f"resume_memory_occupation: tag {tag!r} is not released")
        for tensor, nbytes in zip(self._regions[tag], self._nbytes[tag], strict=True):
            tensor.untyped_storage().resize_(nbytes)
        self._paused.discard(tag)

    def write_prefill(self, slot: int, kv_indices: Sequence[int], token_ids: Sequence[int]) -> None:
        """Prefill: write the request's KV indices into ``req_to_token[slot]`` and its KV rows, by index.

        Into a released pool this raises RuntimeError (SGLang: "Pointer argument (at 0)
        cannot be accessed from Triton (cpu tensor?)").
        """
        n = len(kv_indices)
        index = torch.tensor(list(kv_indices), dtype=torch.int64)
        self.req_to_token[slot, :n] = index.to(torch.int32)
        values = torch.tensor([[float(t % 997)] * _KV_DIM for t in token_ids], dtype=torch.float32)
        self.kv_pool[index] = values
        self._run_model(token_ids[-1] if token_ids else 0)

    def write_decode(self, slot: int, position: int, kv_index: int, token_id: int) -> None:
        """Decode one token: record its KV index in ``req_to_token`` and its KV row, by index, and run the model."""
        self.req_to_token[slot, position] = kv_index
        self.kv_pool[kv_index] = float(token_id % 997)
        self._run_model(token_id)

    def write_weights(self, seed: int) -> None:
        """Load new weights, by index (a weight update into released ``weights`` raises RuntimeError)."""
        for row in range(0, _WEIGHT_ROWS, 97):
            self.weights[row] = float((seed + row) % 101)

    def _run_model(self, token_id: int) -> None:
        # A forward pass reads the weights and replays a CUDA graph; both by index.
        self.weights[token_id % _WEIGHT_ROWS].item()
        self.cuda_graph[token_id % _GRAPH_ROWS].item()


def sample_next(token_id: int, position: int) -> int:
    """A deterministic, cheap stand-in for sampling: the token after ``token_id`` at ``position``."""
    return (token_id * 31 + position * 7 + 11) % 32000

"""What an emulated vLLM engine generates: tokens that depend on the prompt and on the weights it holds.

Each token is drawn from a small vocabulary by a hash of the weights' content, the prompt and the token's position, so
the same prompt on the same weights always gives the same text, and other weights give other text. Intact weights of
version ``V`` have the content ``"weights:V"``; after a level-2 sleep the woken weights are garbage (``"garbage:N"``)
until a weight update or a reload, and the text is then wrong while the answer is still a 200 (verl #7904, TRL #5312
in ``field-2026.md``). A test computes the text it expects from intact weights with :func:`expected_completion`.
Standard library only.
"""

from __future__ import annotations

import hashlib

__all__ = [
    "PARAMETERS", "VOCAB", "ZERO_CONTENT", "count_tokens", "expected_checksums", "expected_completion", "garbage_content", "token",
    "weight_checksums", "weights_content",
]  # fmt: skip

VOCAB = (
    " alpha", " bravo", " charlie", " delta", " echo", " foxtrot", " golf", " hotel",
    " india", " juliet", " kilo", " lima", " mike", " november", " oscar", " papa",
)  # fmt: skip
"""The words an emulated engine generates, one per token."""


ZERO_CONTENT = "zeros"
"""The content of weights zeroed by ``/weight_checker {"action": "reset"}`` (``collective_rpc("reset_weights")``)."""


def weights_content(version: str) -> str:
    """The content of intact weights that were loaded as ``version``."""
    return f"weights:{version}"


def garbage_content(generation: int) -> str:
    """The content of weights woken from a level-2 sleep without an update in between (the ``generation``-th such wake)."""
    return f"garbage:{generation}"


def token(content: str, prompt: str, position: int) -> str:
    """Token ``position`` of the completion of ``prompt`` by weights of ``content``."""
    digest = hashlib.sha256(f"{content}\x00{prompt}\x00{position}".encode()).digest()
    return VOCAB[digest[0] % len(VOCAB)]


def expected_completion(prompt: str, weight_version: str, max_tokens: int) -> str:
    """The text intact weights of ``weight_version`` answer to ``prompt`` with ``max_tokens`` tokens."""
    content = weights_content(weight_version)
    return "".join(token(content, prompt, i) for i in range(max_tokens))


PARAMETERS = ("model.embed_tokens.weight", "model.layers.0.mlp.weight", "lm_head.weight")
"""The parameters an emulated engine's ``/weight_checker`` reports a checksum for."""


def weight_checksums(content: str) -> dict[str, str]:
    """The ``/weight_checker`` checksums of weights holding ``content`` (one per parameter of ``PARAMETERS``)."""
    return {name: hashlib.sha256(f"{content}\x00{name}".encode()).hexdigest()[:16] for name in PARAMETERS}


def expected_checksums(weight_version: str) -> dict[str, str]:
    """The checksums intact weights of ``weight_version`` have: what a trainer that pushed them expects."""
    return weight_checksums(weights_content(weight_version))


def count_tokens(text: str) -> int:
    """Prompt tokens as the emulator counts them: whitespace-separated words, at least 1."""
    return max(1, len(text.split()))

"""Chained block hashes of a prompt, the one function the router's prefix-aware policies and the
workers' advertised caches agree on. PURE (stdlib only)."""
from __future__ import annotations

import hashlib
import struct
from typing import Sequence


def chain_block_hash(parent: int | None, block_tokens: Sequence[int]) -> int:
    """Hash of one full block chained on its parent's hash (None for the first block), so equal
    prefixes give equal leading hashes. blake2b, not hash(): stable across processes and hosts.
    Workers hash their cached blocks with this same function to publish ``cached_block_hashes``."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"\xff" * 8 if parent is None else parent.to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(block_tokens)}Q", *block_tokens))
    return int.from_bytes(h.digest(), "little")


def block_hashes(token_ids: Sequence[int], tokens_per_block: int) -> tuple[int, ...]:
    """Chain hashes of the prompt's full blocks over all but the last token: the last prompt
    token is always recomputed, so a block ending on it can never be reused."""
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, (len(token_ids) - 1) // tokens_per_block * tokens_per_block,
                       tokens_per_block):
        parent = chain_block_hash(parent, token_ids[start:start + tokens_per_block])
        hashes.append(parent)
    return tuple(hashes)

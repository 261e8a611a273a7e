"""The decode KV cache of one TSP rank: ITS OWN tokens, ALL heads (1/D of the whole cache).

Layout per layer: ``k[layer]``, ``v[layer]`` are [B, n_kv, capacity, head_dim] (all KV heads, Hugging Face head
order). Slot t of sequence b holds the (post-RoPE) key/value of the token at global position ``slot_pos[b, t]``;
``-1`` marks a slot without a token (right padding of a shorter prompt, or not yet filled). Slots are not in
position order (zigzag prefill chunks, then round-robin decode tokens): attention over a set of keys does not
care about their order, only the mask does.

The first ``prefill_slots`` slots are this rank's zigzag slice of the padded prompt batch; decode step i stores
its token on rank ``i % D``. The cache is a plain object returned to the caller: modules keep no state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def decode_slots(rank: int, size: int, n_steps: int) -> int:
    """How many of ``n_steps`` round-robin decode tokens rank ``rank`` stores."""
    return max(0, (n_steps - rank + size - 1) // size)


@dataclass
class KVCache:
    k: list[Tensor]  # per layer [B, n_kv, capacity, head_dim]
    v: list[Tensor]
    slot_pos: Tensor  # [B, capacity] global position of each slot, -1: empty
    prompt_lens: Tensor  # [B]
    prefill_slots: int
    length: int  # slots in use (prefill slots + decode slots stored here)
    step: int  # decode steps the GROUP has run (tokens appended over all ranks)
    rank: int
    size: int

    @classmethod
    def allocate(cls, *, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, prefill_slots: int,
                 decode_steps: int, rank: int, size: int, prompt_lens: Tensor, dtype, device) -> "KVCache":
        cap = prefill_slots + decode_slots(rank, size, decode_steps)
        shape = (batch, n_kv_heads, cap, head_dim)
        return cls(
            k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)],
            v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)],
            slot_pos=torch.full((batch, cap), -1, dtype=torch.long, device=device),
            prompt_lens=prompt_lens.to(device), prefill_slots=prefill_slots, length=prefill_slots, step=0,
            rank=rank, size=size,
        )

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def owner_of_next(self) -> int:
        """The rank that stores the token of the next decode step."""
        return self.step % self.size

    def next_positions(self) -> Tensor:
        """[B] global positions of the tokens the next decode step processes."""
        return self.prompt_lens + self.step

    def claim_slot(self) -> int | None:
        """Reserve this rank's slot for the next decode token (None if another rank stores it)."""
        if self.owner_of_next() != self.rank:
            return None
        if self.length >= self.capacity:
            raise RuntimeError(
                f"KV cache full ({self.capacity} slots on rank {self.rank}): it was allocated for fewer decode steps"
            )
        slot = self.length
        self.slot_pos[:, slot] = self.next_positions()
        self.length += 1
        return slot

    def valid(self) -> Tensor:
        """[B, length] True where a slot holds a token."""
        return self.slot_pos[:, : self.length] >= 0

    def nbytes(self, used_only: bool = True) -> int:
        """Bytes of the K/V tensors on this rank (``used_only``: the filled slots; else the allocation)."""
        n = sum(t.numel() * t.element_size() for t in self.k + self.v)
        return n * self.length // self.capacity if used_only else n

"""The decode KV cache of one TSP rank: ITS OWN tokens, ALL heads (1/D of the whole cache).

Layout per layer: ``k[layer]``, ``v[layer]`` are [B, n_kv, slots, head_dim] (all KV heads, Hugging Face head
order). Slot t of sequence b holds the (post-RoPE) key/value of the token at global position ``slot_pos[b, t]``;
``-1`` marks a slot without a token (right padding of a shorter prompt, not yet filled, or scratch). Slots are not
in position order (zigzag prefill chunks, then round-robin decode tokens): attention over a set of keys does not
care about their order, only the mask does.

The first ``prefill_slots`` slots are this rank's zigzag slice of the padded prompt batch; decode step i stores
its token on rank ``i % D``; after the ``capacity`` usable slots come scratch slots that stay empty. Shapes never
change during decoding and the step counter lives on the device as well as on the host, so a decode step is the
same sequence of kernels every time (it can be captured in a CUDA graph). The cache is a plain object returned to
the caller: modules keep no state.
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
    k: list[Tensor]  # per layer [B, n_kv, slots, head_dim]
    v: list[Tensor]
    slot_pos: Tensor  # [B, slots] global position of each slot, -1: empty
    prompt_lens: Tensor  # [B]
    prefill_slots: int
    capacity: int  # slots that can hold tokens (prefill + this rank's decode tokens)
    step: int  # decode steps the GROUP has run (tokens appended over all ranks)
    rank: int
    size: int
    step_t: Tensor  # [] long, on the cache's device: ``step`` as a tensor, advanced by the decode step itself

    @classmethod
    def allocate(cls, *, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, prefill_slots: int,
                 decode_steps: int, rank: int, size: int, prompt_lens: Tensor, dtype, device,
                 align: int = 1) -> "KVCache":
        """``capacity`` usable slots, then at least one scratch slot (always empty: a rank that does not store
        this step's token writes there, so every rank runs the same kernels) up to a multiple of ``align``."""
        cap = prefill_slots + decode_slots(rank, size, decode_steps)
        slots = -(-(cap + 1) // align) * align
        shape = (batch, n_kv_heads, slots, head_dim)
        return cls(
            k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)],
            v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)],
            slot_pos=torch.full((batch, slots), -1, dtype=torch.long, device=device),
            prompt_lens=prompt_lens.to(device, copy=True), prefill_slots=prefill_slots, capacity=cap, step=0,
            rank=rank, size=size, step_t=torch.zeros((), dtype=torch.long, device=device),
        )

    def reuse(self, *, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, prefill_slots: int,
              decode_steps: int, rank: int, size: int, prompt_lens: Tensor, dtype, device,
              align: int = 1) -> "KVCache":
        """This cache, emptied in place for a new prompt batch, if :meth:`allocate` with these arguments would give
        the same shapes (ValueError otherwise). The buffers keep their addresses (a captured CUDA graph keeps
        reading them) and end in the state of a new allocation, except for the first ``prefill_slots`` slots of
        ``k``/``v``, which the prefill overwrites whole: every slot empty (``slot_pos`` -1), the decode slots
        zeroed, step 0, the new prompt lengths. Nothing of the previous batch can leak into the next one."""
        cap = prefill_slots + decode_slots(rank, size, decode_steps)
        slots = -(-(cap + 1) // align) * align
        want = (n_layers, (batch, n_kv_heads, slots, head_dim), prefill_slots, cap, rank, size, dtype,
                torch.device(device))
        have = (len(self.k), tuple(self.k[0].shape), self.prefill_slots, self.capacity, self.rank, self.size,
                self.k[0].dtype, self.slot_pos.device)
        if want != have or tuple(prompt_lens.shape) != (batch,):
            raise ValueError(f"this KV cache (layers, shape, prefill slots, capacity, rank, size, dtype, device) = "
                             f"{have} cannot take a batch that needs {want}: allocate a new one")
        self.prompt_lens.copy_(prompt_lens)
        self.slot_pos.fill_(-1)
        for t in self.k + self.v:
            t[:, :, prefill_slots:].zero_()
        self.step = 0
        self.step_t.zero_()
        return self

    @property
    def length(self) -> int:
        """Slots in use: the prefill slots and the decode tokens this rank has stored so far."""
        return self.prefill_slots + decode_slots(self.rank, self.size, self.step)

    def next_positions(self) -> Tensor:
        """[B] global positions of the tokens the next decode step processes (a device computation)."""
        return self.prompt_lens + self.step_t

    def claim_slot(self) -> tuple[Tensor, Tensor]:
        """Device-side bookkeeping of the next decode token, without a host synchronisation (CUDA-graph safe):
        returns (slot [1], positions [B]). The rank that stores the token (``step % D``) gets its next free slot,
        marked with the token's positions; every other rank gets the scratch slot, which stays empty."""
        positions = self.next_positions()
        mine = torch.remainder(self.step_t, self.size) == self.rank
        used = self.prefill_slots + torch.div(self.step_t - self.rank + self.size - 1, self.size,
                                              rounding_mode="floor").clamp(min=0)
        slot = torch.where(mine, used, self.capacity).view(1)
        self.slot_pos.index_copy_(1, slot, torch.where(mine, positions, -1).view(-1, 1))
        return slot, positions

    def check_room(self) -> None:
        """Host-side check before a decode step (the step itself never looks at the host counters)."""
        if self.step % self.size == self.rank and self.length >= self.capacity:
            raise RuntimeError(
                f"KV cache full ({self.capacity} slots on rank {self.rank}): it was allocated for fewer decode steps"
            )

    def advance(self) -> None:
        """The device side of finishing a step (recorded in a CUDA graph); the host side is ``step += 1``."""
        self.step_t += 1

    def valid(self) -> Tensor:
        """[B, slots] True where a slot holds a token."""
        return self.slot_pos >= 0

    def nbytes(self, used_only: bool = True) -> int:
        """Bytes of the K/V tensors on this rank (``used_only``: the filled slots; else the allocation)."""
        n = sum(t.numel() * t.element_size() for t in self.k + self.v)
        return n * self.length // self.k[0].shape[2] if used_only else n

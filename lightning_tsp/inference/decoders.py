"""Decoders kept across ``generate`` calls, so that a call in a loop does not pay for a new KV cache, two eager
warm-up steps and a new CUDA-graph capture every time.

``generate`` keeps, per model, the :class:`~lightning_tsp.inference.decode.Decoder` (its KV cache buffers and,
on CUDA, its captured graph) of its last calls, keyed by everything that fixes the decode step's shapes and the
buffers it reads (:class:`DecoderKey`). A later call with the same key refills the same cache in place
(:meth:`~lightning_tsp.inference.cache.KVCache.reuse` empties it: positions, prompt lengths, step counter, decode
slots) and replays the same graph; its tokens are exactly those of a new decoder. Any other key gets a new decoder.

Memory: at most :attr:`DecoderPool.limit` decoders per model (default 1), least recently used evicted first, and
the eviction happens before the new cache is allocated, so a model never holds more than ``limit`` caches (a kept
cache is the size ``generate`` allocates anyway: the prompt batch plus ``max_new_tokens`` slots, 1/D per rank).
``release(model)`` drops them all now; deleting the model drops them too (the registry holds models weakly and a
decoder refers to its model weakly). A call that raises keeps nothing of its own decoder.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from lightning_tsp.inference.decode import Decoder
from lightning_tsp.schedules.comm import local_tensor

DEFAULT_LIMIT = 1


@dataclass(frozen=True)
class DecoderKey:
    """What a kept decoder must match. Sampling settings are not in it: the token choice runs after the graph."""

    batch: int
    padded_len: int  # the prompt batch right-padded to a multiple of 2D (or a bucket): prefill slots x D
    decode_steps: int  # max_new_tokens - 1: the cache's decode slots
    graphs: bool
    device: torch.device
    dtype: torch.dtype
    storage: tuple[int, ...]  # addresses of the parameters and buffers a captured graph reads

    @classmethod
    def of(cls, model, batch: int, padded_len: int, decode_steps: int, graphs: bool) -> "DecoderKey":
        tensors = [local_tensor(t) for t in (*model.parameters(), *model.buffers())]
        first = tensors[0]
        return cls(batch, padded_len, decode_steps, graphs, first.device, first.dtype,
                   tuple(t.data_ptr() for t in tensors))


class DecoderPool:
    """The decoders kept for one model, least recently used first."""

    def __init__(self, limit: int = DEFAULT_LIMIT):
        self._decoders: OrderedDict[DecoderKey, Decoder] = OrderedDict()
        self.limit = limit

    @property
    def limit(self) -> int:
        """At most this many decoders (KV caches, CUDA graphs) are kept; 0 keeps none."""
        return self._limit

    @limit.setter
    def limit(self, n: int) -> None:
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"DecoderPool.limit={n!r}: give the number of decoders to keep, an int >= 0")
        self._limit = n
        self._evict(n)

    def __len__(self) -> int:
        return len(self._decoders)

    def keys(self) -> list[DecoderKey]:
        """Kept keys, least recently used first."""
        return list(self._decoders)

    def decoders(self) -> list[Decoder]:
        """Kept decoders, least recently used first."""
        return list(self._decoders.values())

    def take(self, key: DecoderKey) -> Decoder | None:
        """The kept decoder for ``key``, removed from the pool while it is in use (None if there is none). On a
        miss, evicts down to ``limit - 1`` so the decoder about to be built fits within ``limit``."""
        decoder = self._decoders.pop(key, None)
        if decoder is None:
            self._evict(self.limit - 1)
        return decoder

    def put(self, key: DecoderKey, decoder: Decoder) -> None:
        """Keep ``decoder`` (after a complete call) as the most recently used."""
        self._decoders[key] = decoder
        self._decoders.move_to_end(key)
        self._evict(self.limit)

    def clear(self) -> None:
        self._decoders.clear()

    def _evict(self, n: int) -> None:
        while len(self._decoders) > max(n, 0):
            self._decoders.popitem(last=False)


_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> DecoderPool


def decoder_pool(model) -> DecoderPool:
    """The pool of decoders ``generate`` keeps for ``model`` (created empty on first use). Set
    ``decoder_pool(model).limit`` to keep more (or 0 to keep none)."""
    pool = _POOLS.get(model)
    if pool is None:
        pool = _POOLS[model] = DecoderPool()
    return pool


def release(model) -> int:
    """Drop every decoder kept for ``model`` (KV caches, CUDA graphs and their memory pools); returns how many.
    On CUDA the memory goes back to PyTorch's caching allocator (``torch.cuda.empty_cache()`` returns it to the
    device). The pool's limit is kept; the next ``generate`` call builds a new decoder."""
    pool = _POOLS.get(model)
    if pool is None:
        return 0
    n = len(pool)
    pool.clear()
    return n

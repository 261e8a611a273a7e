"""The two TSP runtime schedules: broadcast (attention) and ring (gated MLP, embedding, LM head)."""

from lightning_tsp.schedules.broadcast import broadcast_shards, reduce_to_owner
from lightning_tsp.schedules.comm import pack, unpack
from lightning_tsp.schedules.ring import RingGradPass, ring_shards

__all__ = ["broadcast_shards", "reduce_to_owner", "ring_shards", "RingGradPass", "pack", "unpack"]

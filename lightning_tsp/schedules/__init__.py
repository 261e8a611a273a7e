"""The two TSP runtime schedules: broadcast (attention) and ring (gated MLP, embedding, LM head)."""

from lightning_tsp.schedules.broadcast import GroupReduce, gather_shard_groups
from lightning_tsp.schedules.comm import pack, unpack
from lightning_tsp.schedules.ring import RingGradPass, ring_shards

__all__ = ["gather_shard_groups", "GroupReduce", "ring_shards", "RingGradPass", "pack", "unpack"]

"""The 2-D device mesh ("data_parallel", "tsp") and its topology checks.

The "tsp" axis is innermost: global ranks ``[k*D, (k+1)*D)`` form TSP group k, so with ``D`` dividing the devices
of a node every TSP group lives inside one node (fast intra-node links) and the data-parallel axis crosses nodes.
Every check here runs on plain integers and raises :class:`~lightning_tsp.checks.TSPConfigError` before any
process group or collective exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Union

import torch.distributed as dist

from lightning_tsp.checks import TSPConfigError
from lightning_tsp.group import TSPGroup
from lightning_tsp.teardown import destroy_process_groups_at_exit

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIM_NAMES = ("data_parallel", "tsp")
DP_DIM, TSP_DIM = MESH_DIM_NAMES

SizeArg = Union[int, Literal["auto"]]


@dataclass(frozen=True)
class Topology:
    """Resolved sizes: ``world_size == data_parallel_size * tsp_size``."""

    data_parallel_size: int
    tsp_size: int

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.tsp_size

    @property
    def mesh_shape(self) -> tuple[int, int]:
        return (self.data_parallel_size, self.tsp_size)


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TSPConfigError(f"{name}={value!r} must be a positive integer or 'auto'")
    if value < 1:
        raise TSPConfigError(f"{name}={value} must be >= 1 (1 means: no TSP sharding, pure data parallelism)")
    return value


def resolve_topology(
    world_size: int,
    devices_per_node: int,
    tsp_size: SizeArg = "auto",
    data_parallel_size: SizeArg = "auto",
) -> Topology:
    """Resolve ``"auto"`` sizes and check that the (dp, tsp) mesh fits the cluster.

    ``tsp_size="auto"`` is the number of devices per node (one TSP group per node); ``data_parallel_size="auto"`` is
    ``world_size // tsp_size``. Raises :class:`TSPConfigError` (naming the value and the fix) when:

    * a size is not a positive integer / "auto";
    * ``tsp_size`` does not divide ``world_size``;
    * ``tsp_size`` does not divide ``devices_per_node`` (a TSP group would straddle two nodes; TSP streams every
      weight shard and K/V over its group in every layer, which only pays off on intra-node links);
    * an explicit ``data_parallel_size`` disagrees with ``world_size // tsp_size``.
    """
    world_size = _check_int("world_size", world_size)
    devices_per_node = _check_int("devices per node", devices_per_node)
    if world_size % devices_per_node != 0:
        raise TSPConfigError(
            f"world size {world_size} is not a multiple of the devices per node ({devices_per_node}): every node "
            f"must run the same number of processes. Check Trainer(devices=..., num_nodes=...) and the launcher."
        )
    tsp = devices_per_node if tsp_size == "auto" else _check_int("tsp_size", tsp_size)
    if world_size % tsp != 0:
        raise TSPConfigError(
            f"tsp_size={tsp} does not divide the world size {world_size}: the world is cut into data-parallel "
            f"replicas of tsp_size ranks each. Choose a tsp_size that divides {world_size}, e.g. "
            f"{_divisors_hint(world_size)}."
        )
    if devices_per_node % tsp != 0:
        raise TSPConfigError(
            f"tsp_size={tsp} does not divide the {devices_per_node} devices per node: a TSP group would span two "
            f"nodes, and TSP moves weight shards and K/V over its group in every layer (intra-node links only). "
            f"Choose a tsp_size that divides {devices_per_node}, e.g. {_divisors_hint(devices_per_node)}, or "
            f"change Trainer(devices=...)."
        )
    dp = world_size // tsp
    if data_parallel_size != "auto":
        data_parallel_size = _check_int("data_parallel_size", data_parallel_size)
        if data_parallel_size != dp:
            raise TSPConfigError(
                f"data_parallel_size={data_parallel_size} times tsp_size={tsp} is "
                f"{data_parallel_size * tsp}, not the world size {world_size}. Use data_parallel_size='auto' "
                f"(= {dp}) or change tsp_size / the number of devices."
            )
    return Topology(dp, tsp)


def _divisors_hint(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def build_mesh(topology: Topology, device_type: str) -> "DeviceMesh":
    """The ("data_parallel", "tsp") mesh over the default process group (a collective: call on every rank)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs an initialised default process group")
    if dist.get_world_size() != topology.world_size:
        raise TSPConfigError(
            f"the process group has {dist.get_world_size()} ranks but data_parallel_size * tsp_size = "
            f"{topology.data_parallel_size} * {topology.tsp_size} = {topology.world_size}"
        )
    return init_device_mesh(device_type, topology.mesh_shape, mesh_dim_names=MESH_DIM_NAMES)


def tsp_group(mesh: "DeviceMesh") -> TSPGroup:
    """This rank's TSP group (the "tsp" axis), as the object every TSP layer takes."""
    sub = mesh[TSP_DIM]
    return TSPGroup(sub.get_group(), sub.get_local_rank(), sub.size())


def dp_group(mesh: "DeviceMesh") -> dist.ProcessGroup:
    """The data-parallel process group through this rank (same TSP rank in every replica)."""
    return mesh[DP_DIM].get_group()


def dp_rank_and_size(mesh: "DeviceMesh") -> tuple[int, int]:
    sub = mesh[DP_DIM]
    return sub.get_local_rank(), sub.size()


class TSPMeshMixin:
    """The ("data_parallel", "tsp") topology and groups of a Lightning strategy: one implementation for the Trainer's
    ``TSPStrategy`` and Fabric's ``TSPFabricStrategy``.

    The host (a subclass of Lightning's ``ModelParallelStrategy``) calls :meth:`_check_size_args` before and
    :meth:`_init_tsp_state` after its ``super().__init__``, and names its front end in ``_frontend`` ("Trainer" /
    "Fabric") for the messages; it provides ``num_processes``, ``num_nodes``, ``root_device`` and
    ``_setup_distributed``.
    """

    _frontend = "Trainer"
    _topology: "Topology | None" = None
    _tsp_group: "TSPGroup | None" = None
    _dp_group: "dist.ProcessGroup | None" = None

    @staticmethod
    def _check_size_args(tsp_size: SizeArg, data_parallel_size: SizeArg, grad_bucket_mb: float) -> None:
        for name, value in (("tsp_size", tsp_size), ("data_parallel_size", data_parallel_size)):
            if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise TSPConfigError(f"{name}={value!r} must be a positive integer or 'auto'")
        if grad_bucket_mb <= 0:
            raise TSPConfigError(f"grad_bucket_mb={grad_bucket_mb} must be > 0")

    def _init_tsp_state(self, tsp_size: SizeArg, data_parallel_size: SizeArg, grad_bucket_mb: float) -> None:
        """The constructor arguments and the state both strategies keep (gradient averaging, replicated KV heads)."""
        self._tsp_size_arg: SizeArg = tsp_size
        self._dp_size_arg: SizeArg = data_parallel_size
        self._grad_bucket_bytes = int(grad_bucket_mb * 2**20)
        self._averager = None  # sharding.GradientAverager, made in setup
        self._replicas: dict = {}  # parameters holding one copy of a replicated KV head -> copies

    def _resolve_topology(self) -> Topology:
        devices = self.num_processes
        if devices < 1:
            raise TSPConfigError(f"{type(self).__name__} has no devices: pass {self._frontend}(devices=N) with N >= 1")
        self._topology = resolve_topology(
            world_size=self.num_nodes * devices, devices_per_node=devices, tsp_size=self._tsp_size_arg,
            data_parallel_size=self._dp_size_arg,
        )
        self._data_parallel_size = self._topology.data_parallel_size  # ModelParallelStrategy's own fields
        self._tensor_parallel_size = self._topology.tsp_size
        return self._topology

    def _setup_tsp_mesh(self) -> Topology:
        """Check the topology (before any collective), start the process group, build the mesh and the groups."""
        topology = self._resolve_topology()
        self._setup_distributed()
        if dist.get_world_size() != topology.world_size:
            raise TSPConfigError(
                f"{dist.get_world_size()} processes joined, but {self._frontend}(num_nodes={self.num_nodes}, "
                f"devices={self.num_processes}) means {topology.world_size}: check the launcher settings"
            )
        self._device_mesh = build_mesh(topology, self.root_device.type)
        destroy_process_groups_at_exit(self._device_mesh)  # the groups live as long as the model; see teardown
        self._tsp_group = tsp_group(self._device_mesh)
        self._dp_group = dp_group(self._device_mesh)
        return topology

    @property
    def topology(self) -> Topology:
        return self._topology if self._topology is not None else self._resolve_topology()

    @property
    def tsp_size(self) -> int:
        return self.topology.tsp_size

    @property
    def data_parallel_size(self) -> int:
        return self.topology.data_parallel_size

    @property
    def tsp_group(self) -> TSPGroup:
        if self._tsp_group is None:
            raise RuntimeError("the TSP group exists once the strategy has set up its environment")
        return self._tsp_group

    @property
    def dp_group(self) -> "dist.ProcessGroup":
        if self._dp_group is None:
            raise RuntimeError("the data-parallel group exists once the strategy has set up its environment")
        return self._dp_group

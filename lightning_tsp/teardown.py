"""Ending a distributed run so that every process exits with status 0.

Why a run that succeeded could abort at exit ("terminate called without an active exception", SIGABRT):

* A gloo process group runs worker threads (``ProcessGroupGloo::runLoop``). The thread that finishes a collective
  also drops its work object and with it the collective's tensors; a tensor made in Python holds its Python object,
  so that drop takes the GIL.
* ``destroy_process_group`` unregisters the groups but does not stop these threads (gloo has no ``shutdown``):
  they end only in ``~ProcessGroupGloo``, which joins them, when the last reference to the group goes.
* If a group is still referenced when the interpreter finalises (``Py_FinalizeEx``), a worker thread that asks for
  the GIL then is ended by CPython inside ``take_gil`` (``pthread_exit``); the forced unwind meets the ``noexcept``
  destructor of the work and the C++ runtime calls ``std::terminate``.

So a clean exit drops the last reference to every group while the interpreter is whole: then ``~ProcessGroupGloo``
joins the threads (PyTorch releases the GIL in that destructor). The references come from the caller (a model's
:class:`~lightning_tsp.group.TSPGroup`, a DeviceMesh, a strategy) and from PyTorch itself:

* ``torch.distributed.nn.functional`` takes ``group=group.WORLD`` as default arguments, evaluated when it is
  imported; imported after ``init_process_group`` (Hugging Face ``transformers`` imports it lazily, through
  ``torch.distributed.fsdp``), it holds the default group until the interpreter ends. It is imported here, before
  any group exists, so that its defaults are ``None``; ``lightning_tsp.group`` imports this module.
* DTensor's caches (``functools.lru_cache`` of redistribution plans and mesh topologies) hold every DeviceMesh they
  saw, and a mesh holds its groups (``_pg_registry``, torch >= 2.12): meshes registered here
  (:func:`destroy_process_groups_at_exit`) let go of their groups once these are destroyed.
* ``torch.compile`` keeps the groups a compiled function saw (as example values of its graph inputs) in its caches
  and in the compiled functions Dynamo installs as globals of the traced modules (``__compiled_fn_*``,
  ``__resume_at_*``; ``torch._dynamo.reset`` leaves these). Code compiled against destroyed groups cannot run again:
  the caches are reset and those globals dropped.
"""

from __future__ import annotations

import atexit
import gc
import sys
import weakref
from typing import TYPE_CHECKING

import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401  (see the module docstring: before any process group exists)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# Meshes whose groups destroy_process_groups releases (held weakly): PyTorch's DTensor caches (redistribution plans,
# mesh topology: functools.lru_cache) keep a mesh for the interpreter's life, and a mesh keeps its groups in
# ``_pg_registry`` (torch >= 2.12).
_MESHES: "weakref.WeakSet[DeviceMesh]" = weakref.WeakSet()


def _live_groups() -> list[dist.ProcessGroup]:
    """The default group and every group made from it (``new_group``, DeviceMesh dimensions)."""
    return list(dist.distributed_c10d._world.pg_map)


def _meshes() -> list:
    """The registered meshes and every other DeviceMesh still alive (held by DTensor's caches, say: sharding
    propagation and redistribution plans keep the meshes of the specs they saw)."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # a torch without DeviceMesh holds none
        return list(_MESHES)
    found = {id(m): m for m in _MESHES}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, DeviceMesh):
                found.setdefault(id(obj), obj)
        except ReferenceError:  # a dead weak proxy (DeviceMesh's metaclass looks at the object)
            continue
    return list(found.values())


def destroy_process_groups(barrier: bool = True) -> int:
    """Destroy the default process group and every group made from it, and end their gloo worker threads.

    Call it on every rank, last, once the caller holds no model, mesh or :class:`~lightning_tsp.group.TSPGroup`
    any more (return from the function that held them first). ``barrier``: wait until every rank gets here (all
    collectives done everywhere); pass False on an error path, where a peer may never arrive. Without a default
    group it only releases the groups of the registered meshes (the caller destroyed them).

    Returns how many of the destroyed groups something still references (0 on a clean path): their worker threads
    outlive this call, and the interpreter's exit stays exposed to the abort described above.
    """
    groups = []
    if dist.is_available() and dist.is_initialized():
        if barrier:
            dist.barrier()
        groups = [weakref.ref(pg) for pg in _live_groups()]
        dist.destroy_process_group()
    for mesh in _meshes():  # also when the caller destroyed the groups itself
        getattr(mesh, "_pg_registry", {}).clear()
    if "torch._dynamo" in sys.modules:
        _forget_compiled_code(sys.modules["torch._dynamo"])
    gc.collect()  # groups held only by reference cycles (a Trainer and its strategy, a module and its hooks)
    return sum(ref() is not None for ref in groups)


_DYNAMO_GLOBALS = ("__compiled_fn", "__resume_at")


def _forget_compiled_code(dynamo) -> None:
    """Drop what ``torch.compile`` keeps of the code it compiled (see the module docstring)."""
    dynamo.reset()
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name in [n for n in namespace if isinstance(n, str) and n.startswith(_DYNAMO_GLOBALS)]:
            del namespace[name]


def _destroy_at_exit() -> None:
    destroy_process_groups(barrier=False)  # ranks may exit out of step (one of them raised)


def destroy_process_groups_at_exit(mesh: "DeviceMesh | None" = None) -> None:
    """Destroy the process groups (and release ``mesh``'s) when the interpreter exits, before it finalises (an
    ``atexit`` hook; registering twice keeps one).

    For Lightning's Trainer and Fabric, whose groups must live as long as the model sharded over them (a later
    ``trainer.validate`` reuses them): at exit the Trainer, its strategy and the model are garbage (unless a module
    global or a context variable still holds them), the collection joins the gloo threads, and the exit is clean.
    Lightning registers the same for NCCL only.
    """
    if mesh is not None:
        _MESHES.add(mesh)
    atexit.unregister(_destroy_at_exit)
    atexit.register(_destroy_at_exit)

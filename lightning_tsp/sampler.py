"""Training data that resumes at the exact sample: a global-batch sampler and a DataLoader that Lightning saves.

``ResumableDistributedSampler`` orders the whole dataset once per epoch, independently of the parallel layout:

* the global order of epoch ``e`` is ``torch.randperm(n)`` seeded with ``seed + e`` (``shuffle=True``, the same
  permutation as ``torch.utils.data.DistributedSampler``) or ``0 .. n-1``;
* global batch ``k`` is the ``G = batch_size * num_replicas`` samples ``order[k*G : (k+1)*G]``; data-parallel
  replica ``r`` reads ``order[k*G + r*batch_size : k*G + (r+1)*batch_size]`` (the ranks of one TSP group are one
  replica: they read the same samples);
* an epoch holds ``n // G`` global batches (the incomplete tail is dropped, so every step has full micro-batches;
  when ``n < G`` the order wraps around to fill one global batch).

So the sequence of global batches depends on the dataset, the seed, the epoch and ``G`` only: not on the tsp
size, and not on how ``G`` is split into micro-batch size x data-parallel size.

``ResumableDataLoader`` counts the batches it has **handed to the training loop** (not the indices the sampler
has produced: DataLoader workers fetch ahead) and implements ``state_dict`` / ``load_state_dict``, so Lightning
stores its position in the loop state of every checkpoint and restores it on ``fit(ckpt_path=...)``. The state is
global (``{"epoch", "samples_consumed", "global_batch_size", ...}``, the same on every rank), which is what
Lightning needs: it saves the loop state of rank 0 only.

Resuming in the middle of an epoch needs the same dataset size, shuffle, seed and global batch size ``G`` as the
checkpoint (the micro-batch size, the data-parallel size and the tsp size may change); anything else raises
:class:`~lightning_tsp.checks.TSPConfigError` naming the values and the fix. A checkpoint taken at an epoch
boundary carries no position, so it resumes with any layout (the next epoch starts at its first global batch).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_tsp.checks import TSPConfigError

STATE_VERSION = 1


class ResumableDistributedSampler(DistributedSampler):
    """This replica's slice of every global batch, from any global position.

    A ``DistributedSampler`` subclass, so Lightning does not replace it (``Trainer(use_distributed_sampler=True)``,
    the default, only injects a sampler into loaders whose sampler is not a ``DistributedSampler``); Lightning
    still calls :meth:`set_epoch` at the start of every epoch.

    Arguments:
        dataset: the training set (sized).
        batch_size: samples per micro-batch of ONE data-parallel replica.
        num_replicas: data-parallel size (``TSPStrategy.distributed_sampler_kwargs["num_replicas"]``).
        rank: data-parallel rank (``TSPStrategy.distributed_sampler_kwargs["rank"]``).
        shuffle: a new permutation every epoch (seed ``seed + epoch``), else the dataset order.
        seed: same on every rank.
    """

    def __init__(self, dataset: Dataset, batch_size: int, num_replicas: int = 1, rank: int = 0,
                 shuffle: bool = True, seed: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        # explicit num_replicas / rank: DistributedSampler then never queries torch.distributed
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        n = len(dataset)  # type: ignore[arg-type]
        if n == 0:
            raise ValueError("the training set is empty")
        self.batch_size = batch_size
        self.global_batch_size = batch_size * num_replicas
        self.dataset_size = n
        self.num_batches = max(1, n // self.global_batch_size)  # global batches per epoch
        self.num_samples = self.num_batches * batch_size  # this replica's samples per epoch
        self.total_size = self.num_batches * self.global_batch_size
        self._pending: Optional[tuple[int, int]] = None  # (epoch, global batch) to start at, from a checkpoint
        self._start: Optional[int] = None  # the start claimed for the next __iter__

    def __len__(self) -> int:
        return self.num_samples

    def global_order(self, epoch: int) -> list[int]:
        """The dataset indices of the whole epoch ``epoch``, global batch after global batch (all replicas)."""
        n = self.dataset_size
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        if self.total_size > n:  # fewer samples than one global batch: wrap around
            order = (order * math.ceil(self.total_size / n))[: self.total_size]
        return order[: self.total_size]

    def global_batch(self, epoch: int, k: int) -> list[int]:
        """Global batch ``k`` of ``epoch``: replica 0's micro-batch, then replica 1's, ..."""
        G = self.global_batch_size
        return self.global_order(epoch)[k * G:(k + 1) * G]

    def start_iteration(self) -> int:
        """Claim the global batch the next iteration starts at: the checkpoint's position when the checkpoint was
        taken in the middle of the current epoch (``set_epoch`` has run), else 0. Called at the first ``next()``."""
        start = 0
        if self._pending is not None:
            epoch, k = self._pending
            if epoch == self.epoch:
                start = k
            self._pending = None
        self._start = start
        return start

    def __iter__(self) -> Iterator[int]:
        start = self._start if self._start is not None else self.start_iteration()
        self._start = None
        order, B, G = self.global_order(self.epoch), self.batch_size, self.global_batch_size
        for k in range(start, self.num_batches):
            first = k * G + self.rank * B
            yield from order[first:first + B]

    # ---- state -------------------------------------------------------------------------------------------------

    def state(self, epoch: int, global_batches: int) -> dict[str, Any]:
        """The position after ``global_batches`` global batches of ``epoch`` (identical on every rank)."""
        return {
            "version": STATE_VERSION,
            "epoch": int(epoch),
            "samples_consumed": int(global_batches) * self.global_batch_size,  # global, all replicas together
            "global_batch_size": self.global_batch_size,
            "dataset_size": self.dataset_size,
            "shuffle": bool(self.shuffle),
            "seed": int(self.seed),
            "batch_size": self.batch_size,  # informational: the layout it was saved with
            "num_replicas": self.num_replicas,
        }

    def load_state(self, state: dict[str, Any]) -> tuple[int, int]:
        """Continue from ``state`` (see :meth:`state`): returns ``(epoch, global batch)``. Raises
        :class:`TSPConfigError` when the checkpoint was taken in the middle of an epoch whose order this sampler
        cannot reproduce."""
        epoch, consumed = int(state["epoch"]), int(state["samples_consumed"])
        saved_G = int(state["global_batch_size"])
        saved_batches = max(1, int(state["dataset_size"]) // saved_G)
        if consumed <= 0 or consumed >= saved_batches * saved_G:
            # an epoch boundary: nothing of the epoch to skip, any layout continues exactly
            k = 0 if consumed <= 0 else self.num_batches
            self._pending = (epoch, k)
            return self._pending
        problems = []
        if int(state["dataset_size"]) != self.dataset_size:
            problems.append(f"the training set has {self.dataset_size} sequences, the checkpoint's had "
                            f"{state['dataset_size']} (use the same data, seq_len, max_tokens and val_fraction)")
        if bool(state["shuffle"]) != bool(self.shuffle):
            problems.append(f"shuffle={self.shuffle}, the checkpoint's run had shuffle={state['shuffle']}")
        elif self.shuffle and int(state["seed"]) != self.seed:
            problems.append(f"the sampler seed is {self.seed}, the checkpoint's was {state['seed']} (use the same "
                            f"seed_everything / data seed)")
        if saved_G != self.global_batch_size:
            b_new = saved_G / self.num_replicas
            fix = (f"give each replica batch_size={int(b_new)}" if b_new == int(b_new) else
                   f"use a data-parallel size that divides {saved_G}")
            problems.append(
                f"the global batch is batch_size {self.batch_size} x {self.num_replicas} data-parallel replica(s) "
                f"= {self.global_batch_size} sequences, the checkpoint's was {state['batch_size']} x "
                f"{state['num_replicas']} = {saved_G}: to continue the epoch with the same global batches, {fix}")
        if problems:
            raise TSPConfigError(
                f"cannot resume the training data in the middle of epoch {epoch} (after {consumed} of "
                f"{saved_batches * saved_G} samples): " + "; ".join(problems) + ". Alternatively resume from a "
                f"checkpoint taken at an epoch boundary (e.g. ModelCheckpoint(every_n_epochs=1)), which accepts "
                f"any layout."
            )
        self._pending = (epoch, consumed // saved_G)
        return self._pending


class ResumableDataLoader(DataLoader):
    """A DataLoader over a :class:`ResumableDistributedSampler` whose position Lightning saves and restores.

    ``state_dict()`` is the position after the batches this loader has yielded (= the batches the training loop has
    taken: Lightning does not prefetch from a loader with a length); worker prefetching does not count. ``batch_size``
    is the sampler's. Iteration starts lazily (at the first ``next()``), after Lightning's ``set_epoch``.
    """

    def __init__(self, dataset: Dataset, sampler: ResumableDistributedSampler, **kwargs: Any) -> None:
        if not isinstance(sampler, ResumableDistributedSampler):
            raise TypeError(f"ResumableDataLoader needs a ResumableDistributedSampler, got {type(sampler).__name__}")
        kwargs.pop("batch_size", None)
        kwargs.pop("shuffle", None)
        kwargs.pop("drop_last", None)
        super().__init__(dataset, sampler=sampler, batch_size=sampler.batch_size, drop_last=False, **kwargs)
        self._position: Optional[tuple[int, int]] = None  # (epoch, global batches yielded or restored)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler: ResumableDistributedSampler = self.sampler  # type: ignore[assignment]
        start = sampler.start_iteration()
        epoch = sampler.epoch
        self._position = (epoch, start)
        for batch in super().__iter__():
            self._position = (epoch, self._position[1] + 1)  # counted before the loop gets it
            yield batch

    @property
    def position(self) -> tuple[int, int]:
        """``(epoch, global batches consumed in it)``: yielded by the current iteration, or restored."""
        return self._position if self._position is not None else (self.sampler.epoch, 0)  # type: ignore[union-attr]

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state(*self.position)  # type: ignore[union-attr]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sampler: ResumableDistributedSampler = self.sampler  # type: ignore[assignment]
        self._position = sampler.load_state(state_dict)

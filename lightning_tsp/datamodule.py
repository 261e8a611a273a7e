"""``TextDataModule``: text packed into fixed-length sequences, for ``lightning-tsp fit``.

Sources: ``stdlib`` (Python's own standard-library source, real text present offline on every machine), or
files and directories (``.txt``/``.md``/``.py``/... one document per file, ``.jsonl`` one document per line,
``.parquet`` a text column). Byte-level tokens (vocabulary 256) unless a local Hugging Face tokenizer directory is
given. Documents are joined with an end-of-text token and cut into ``seq_len`` windows; the last
``val_fraction`` of the windows is the validation set (a contiguous tail, so few documents straddle the split).

Batches are ``{"input_ids": [B, seq_len]}`` (plus ``"position_ids"`` [B, seq_len] with ``document_mask=True``):
the FULL sequences of one data-parallel replica. TSPStrategy cuts them into each rank's zigzag slice.

Training data resumes at the exact sample. The training loader is a
:class:`~lightning_tsp.sampler.ResumableDataLoader` over a :class:`~lightning_tsp.sampler.ResumableDistributedSampler`
built with ``trainer.distributed_sampler_kwargs`` (``num_replicas`` = data-parallel size, ``rank`` =
data-parallel rank; 1 and 0 without a parallel strategy): the ranks of one TSP group read the same samples, the
replicas read different ones, and global batch ``k`` of an epoch is the same ``batch_size * dp`` sequences for
every layout. Being a ``DistributedSampler``, Lightning keeps it (no flag to change). Its position (epoch and
global samples consumed, the same on every rank) is saved in every checkpoint twice: in the fit loop's state
(Lightning's stateful-loader support) and in this data module's ``state_dict`` (so that it is restored even when
the train loader was built before the checkpoint was loaded, as ``trainer.estimated_stepping_batches`` in
``configure_optimizers`` does; Lightning 2.6 then skips the loop's copy). ``fit(ckpt_path=...)`` from a checkpoint
taken in the middle of an epoch continues with the next global batch; that needs the same data, ``shuffle``, seed
and global batch size (``batch_size * dp``; the tsp size and the split into micro-batch x dp may change), else it
raises :class:`~lightning_tsp.checks.TSPConfigError`. See docs/checkpoints.md, "Resuming in the middle of an
epoch". Validation / test / predict loaders are plain; Lightning injects a ``DistributedSampler`` with the same
kwargs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch.utils.data import DataLoader, Dataset, Subset

from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_warn

from lightning_tsp.data import BYTE_VOCAB, PackedTextDataset, stdlib_text_files
from lightning_tsp.sampler import ResumableDataLoader, ResumableDistributedSampler

STDLIB = "stdlib"


class TextDataModule(LightningDataModule):
    """Packed causal-LM text data.

    Arguments:
        source: ``"stdlib"`` (Python's standard-library source), or a path / list of paths (files or
            directories; ``.jsonl`` and ``.parquet`` read the ``text_key`` field).
        seq_len: tokens per sequence (the global sequence length; a multiple of ``2 * tsp_size``).
        batch_size: sequences per micro-batch per data-parallel replica (all ranks of a TSP group share it).
        tokenizer: a local Hugging Face tokenizer directory (nothing is downloaded); default: UTF-8 bytes.
        text_key: the text field of ``.jsonl`` / ``.parquet`` records.
        val_fraction: fraction of the sequences held out for validation (at least one when > 0).
        max_tokens: stop reading text after this many tokens (default: read everything).
        stdlib_bytes: how much standard-library source to read for ``source="stdlib"``.
        shuffle: shuffle the training sequences every epoch: epoch ``e`` uses the permutation seeded with
            ``seed + e`` (the same on every rank).
        seed: the shuffle seed; default: the ``seed_everything`` seed (``PL_GLOBAL_SEED``), else 0.
        num_workers: DataLoader worker processes.
        document_mask: packed documents: every batch also holds ``position_ids`` [B, seq_len] that restart at 0
            at each document (the token after an end-of-text token) and at each window start (Hugging Face's
            packed convention). TSP then attends within documents only, applies RoPE to the positions inside each
            document and shifts the targets per document. Default: plain causal attention over the whole window.
    """

    def __init__(
        self,
        source: Union[str, list[str]] = STDLIB,
        seq_len: int = 256,
        batch_size: int = 8,
        tokenizer: Optional[str] = None,
        text_key: str = "text",
        val_fraction: float = 0.05,
        max_tokens: Optional[int] = None,
        stdlib_bytes: int = 4_000_000,
        shuffle: bool = True,
        num_workers: int = 0,
        document_mask: bool = False,
        seed: Optional[int] = None,
    ) -> None:
        super().__init__()
        if seq_len < 2:
            raise ValueError(f"seq_len={seq_len} must be >= 2")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be in [0, 1)")
        self.save_hyperparameters()
        self.source, self.seq_len, self.batch_size = source, seq_len, batch_size
        self.tokenizer, self.text_key, self.val_fraction = tokenizer, text_key, val_fraction
        self.max_tokens, self.stdlib_bytes = max_tokens, stdlib_bytes
        self.shuffle, self.num_workers = shuffle, num_workers
        self.document_mask = document_mask
        self.seed = seed
        self.dataset: Optional[PackedTextDataset] = None
        self.train_set: Optional[Dataset] = None
        self.val_set: Optional[Dataset] = None
        self._train_loader: Optional[ResumableDataLoader] = None
        self._train_state: Optional[dict[str, Any]] = None  # a checkpoint's position not yet given to a loader

    # ---- data --------------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Token ids are in ``[0, vocab_size)``; the model's vocabulary must be at least this large."""
        if self.dataset is not None:
            return self.dataset.vocab_size
        if self.tokenizer is None:
            return BYTE_VOCAB
        from transformers import AutoTokenizer

        return len(AutoTokenizer.from_pretrained(self.tokenizer, local_files_only=True))

    def paths(self) -> list[Path]:
        if isinstance(self.source, str) and self.source == STDLIB:
            return stdlib_text_files(self.stdlib_bytes)
        sources = [self.source] if isinstance(self.source, (str, os.PathLike)) else list(self.source)
        paths = [Path(os.path.expanduser(str(s))) for s in sources]
        missing = [str(p) for p in paths if not p.exists()]
        if missing:
            raise FileNotFoundError(f"data source(s) not found: {missing} (use source: stdlib for the built-in text)")
        return paths

    def setup(self, stage: Optional[str] = None) -> None:
        if self.dataset is not None:
            return
        # Every rank tokenizes the same text: deterministic, and no file is written (nothing to race on).
        self.dataset = PackedTextDataset(self.paths(), self.seq_len, tokenizer=self.tokenizer,
                                         text_key=self.text_key, max_tokens=self.max_tokens,
                                         document_mask=self.document_mask)
        self.train_set, self.val_set = split(self.dataset, self.val_fraction)

    # ---- loaders -----------------------------------------------------------------------------------------------

    def _loader(self, dataset: Optional[Dataset], shuffle: bool, drop_last: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("TextDataModule.setup() has not run")
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=shuffle, drop_last=drop_last,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def _replicas(self) -> tuple[int, int]:
        """(data-parallel size, data-parallel rank): ``trainer.distributed_sampler_kwargs`` (TSPStrategy: the
        ``"data_parallel"`` mesh axis), or (1, 0) without a trainer or a parallel strategy."""
        trainer = self.trainer
        kwargs = (trainer.distributed_sampler_kwargs if trainer is not None else None) or {}
        return int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))

    def _seed(self) -> int:
        return int(self.seed if self.seed is not None else os.environ.get("PL_GLOBAL_SEED", 0))

    def train_dataloader(self) -> ResumableDataLoader:
        """Full micro-batches of this data-parallel replica's slice of every global batch, resumable (see the
        module docstring). The incomplete last global batch of an epoch is dropped."""
        if self.train_set is None:
            raise RuntimeError("TextDataModule.setup() has not run")
        num_replicas, rank = self._replicas()
        sampler = ResumableDistributedSampler(self.train_set, self.batch_size, num_replicas=num_replicas, rank=rank,
                                              shuffle=self.shuffle, seed=self._seed())
        loader = ResumableDataLoader(self.train_set, sampler, num_workers=self.num_workers,
                                     persistent_workers=self.num_workers > 0)
        if self._train_state is not None:
            self._load_train_state(loader, self._train_state)
            self._train_state = None
        self._train_loader = loader
        return loader

    # ---- resuming ----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The training data position (also in the fit loop's state; see the module docstring)."""
        if self._train_loader is None:
            return {}
        return {"train_loader": self._train_loader.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict.get("train_loader")
        if state is None:
            return
        if self._train_loader is not None:  # built already (estimated_stepping_batches): it has not started yet
            self._load_train_state(self._train_loader, state)
        else:
            self._train_state = state

    def _load_train_state(self, loader: ResumableDataLoader, state: dict[str, Any]) -> None:
        loader.load_state_dict(state)
        epoch, k = loader.position
        trainer = self.trainer
        accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
        if 0 < k < loader.sampler.num_batches and k % accumulate != 0:  # type: ignore[union-attr]
            rank_zero_warn(
                f"the checkpoint was taken after {k} batches of epoch {epoch}, inside a gradient accumulation "
                f"window of accumulate_grad_batches={accumulate}: the data resumes at the next batch but the "
                f"gradients accumulated before the checkpoint are not in it (Lightning does not save them), so the "
                f"next optimizer step sees {accumulate - k % accumulate} batch(es) only. Save on optimizer steps "
                f"(ModelCheckpoint(every_n_train_steps=...)) to resume exactly."
            )

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, False, drop_last=False)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()


def split(dataset: Dataset, val_fraction: float) -> tuple[Subset, Subset]:
    """Train = the first windows, validation = the last ``max(1, round(val_fraction * n))`` (disjoint;
    together all ``n``)."""
    n = len(dataset)
    n_val = 0 if val_fraction <= 0 else max(1, int(round(val_fraction * n)))
    if n_val >= n:
        raise ValueError(f"the text gives only {n} sequences: too few for a validation fraction of {val_fraction}")
    indices = torch.arange(n).tolist()
    return Subset(dataset, indices[: n - n_val]), Subset(dataset, indices[n - n_val:])

"""``TSPThroughputMonitor``: tokens/s, model TFLOP/s and peak memory of a TSP training run.

Logged every ``log_every_n_steps`` optimizer steps (rank 0 logs; every rank takes part in one small all-gather
for the memory figures):

* ``throughput/tokens_per_sec``: tokens of the global batch (all data-parallel replicas) per second of wall time,
  averaged over the steps since the previous log; ``throughput/tokens_per_sec_per_device`` = that / world size.
* ``throughput/model_tflops_per_sec`` and ``..._per_device``: "model" FLOPs (forward + backward = 3x forward,
  causal attention counted exactly as S(S+1)/2 query-key pairs, recomputation NOT counted; the usual MFU
  numerator) from :mod:`lightning_tsp.planning.flops`. ``throughput/mfu`` when ``peak_tflops_per_device`` is set.
* ``memory/peak_allocated_gb/rank{r}`` and ``memory/peak_allocated_gb_max``: ``torch.cuda.max_memory_allocated``
  of every rank. On CPU: ``memory/peak_rss_gb/rank{r}`` (the process' peak resident set size) instead.

With ``print_every`` > 0 rank 0 also prints one line (step, loss, tokens/s, TFLOP/s) every that many steps: the
CPU quick start uses it to show the loss falling without a progress bar.

Also here: :class:`TSPModelSummary` (Lightning's ``ModelSummary`` with the TSP model's true FLOPs per batch) and
:class:`SequenceScoreWriter` (a ``BasePredictionWriter``: per-sequence scores to JSON lines).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from typing_extensions import override

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter, ModelSummary
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only

from lightning_tsp.models import named_tsp_models
from lightning_tsp.models.llama import ModelConfig


def model_flops_per_batch(cfg: ModelConfig, batch_size: int, seq_len: int, checkpointing: str = "none") -> dict[str, int]:
    """FLOPs of one training micro-batch of ``batch_size`` sequences of ``seq_len`` tokens (one model replica).

    ``model``: 3x forward (the MFU convention); ``hardware``: what runs (flash-style attention backward, full
    checkpointing's recomputation). Same numbers as ``lightning_tsp.planning.flops.training_flops``.
    """
    from lightning_tsp.planning.flops import training_flops
    from lightning_tsp.planning.model import from_config

    return training_flops(from_config(cfg), batch_size, seq_len, checkpointing=checkpointing)


def module_flops_per_batch(module: torch.nn.Module, batch_size: int, seq_len: int, kind: str = "model") -> int:
    """FLOPs of one training micro-batch ``[batch_size, seq_len]`` (global sequences) through every TSP model of
    ``module`` (each with its own ``activation_checkpointing``); 0 when there is none. ``kind``: ``"model"`` (3x
    forward), ``"hardware"`` or ``"forward"``."""
    total = 0
    for _, model in named_tsp_models(module):
        flops = model_flops_per_batch(model.cfg, batch_size, seq_len, model.activation_checkpointing)
        total += flops["model"] // 3 if kind == "forward" else flops[kind]
    return total


def _peak_rss_bytes() -> Optional[int]:
    try:
        import resource
    except ImportError:  # Windows
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


class TSPThroughputMonitor(Callback):
    """Tokens/s, model TFLOP/s and peak memory per rank, for TSPStrategy (and other data-parallel strategies).

    Why not Lightning's ``ThroughputMonitor`` (measured with lightning 2.6.6): its ``Throughput`` counts whole
    samples per device and multiplies by the world size for the global rates, but under TSP the D ranks of a group
    share every sample. One 128K-token sequence per step on D = 8 ranks at 1 step/s is reported as
    ``samples_per_sec = 8`` and ``batches_per_sec = 8`` (true: 1), and giving it the true per-device share (1/8
    sample) raises ``ValueError: Expected samples (0.125) to be greater or equal than batches (1)``. It also logs
    from rank 0 only (no per-rank peak memory) and has no console line for progress-bar-less runs. This callback
    counts the global batch behind each rank's slice instead (tokens, model FLOPs from the configuration).

    Arguments:
        log_every_n_steps: log every this many optimizer steps (default: the Trainer's ``log_every_n_steps``).
        print_every: rank 0 prints a one-line summary every this many optimizer steps (0: never).
        peak_tflops_per_device: the device's peak dense TFLOP/s at the training precision (e.g. 989 for an H100
            / H200 in bf16); when given, ``throughput/mfu`` is logged.
        warmup_steps: optimizer steps left out of the first rate (compilation, allocator warm-up).
    """

    def __init__(self, log_every_n_steps: Optional[int] = None, print_every: int = 0,
                 peak_tflops_per_device: Optional[float] = None, warmup_steps: int = 1) -> None:
        super().__init__()
        self.log_every_n_steps = log_every_n_steps
        self.print_every = print_every
        self.peak_tflops_per_device = peak_tflops_per_device
        self.warmup_steps = warmup_steps
        self._reset()

    def _reset(self) -> None:
        self._t0: Optional[float] = None
        self._tokens = 0
        self._flops = 0
        self._steps = 0
        self._last_step = -1
        self.last: dict[str, float] = {}  # the latest figures (also handy in tests)

    # ---- accounting --------------------------------------------------------------------------------------------

    def batch_stats(self, trainer: Trainer, pl_module: LightningModule, batch: Any) -> tuple[int, int]:
        """(tokens, model FLOPs) of the GLOBAL micro-batch (all replicas) behind this rank's ``batch``."""
        ids: Tensor = batch["input_ids"]
        b, local_len = ids.shape[0], ids.shape[-1]
        strategy = trainer.strategy
        tsp = int(getattr(strategy, "tsp_size", 1))
        dp = int(getattr(strategy, "data_parallel_size", trainer.world_size // tsp))
        seq_len = local_len * tsp  # the strategy handed this rank S/D tokens of every sequence
        tokens = b * seq_len * dp
        return tokens, module_flops_per_batch(pl_module, b, seq_len) * dp

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._reset()
        self._last_step = trainer.global_step

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._t0 is None and trainer.global_step >= self.warmup_steps:
            self._sync(trainer)
            self._t0 = time.perf_counter()
            self._tokens = self._flops = self._steps = 0

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._t0 is not None:
            tokens, flops = self.batch_stats(trainer, pl_module, batch)
            self._tokens += tokens
            self._flops += flops
        if trainer.global_step != self._last_step:  # an optimizer step just ran (not an accumulation micro-batch)
            self._last_step = trainer.global_step
            self._on_step(trainer, pl_module)

    def _on_step(self, trainer: Trainer, pl_module: LightningModule) -> None:
        step = trainer.global_step
        if self._t0 is not None:
            self._steps += 1
        every = self.log_every_n_steps or trainer.log_every_n_steps
        log_now = every > 0 and step % every == 0
        print_now = self.print_every > 0 and (step % self.print_every == 0 or step == 1 or step == trainer.max_steps)
        if not (log_now or print_now):
            return
        metrics = self.compute(trainer)
        metrics.update(self._memory(trainer, pl_module))  # a collective: every rank reaches it at the same steps
        self.last = metrics
        if log_now and trainer.logger is not None:
            self._log(trainer, metrics, step)
        if print_now:
            self._print(trainer, step, metrics)
        if self._t0 is not None and self._steps:
            self._sync(trainer)
            self._t0 = time.perf_counter()
            self._tokens = self._flops = self._steps = 0

    def compute(self, trainer: Trainer) -> dict[str, float]:
        if self._t0 is None or self._steps == 0:
            return {}
        self._sync(trainer)
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        world = max(trainer.world_size, 1)
        out = {
            "throughput/tokens_per_sec": self._tokens / elapsed,
            "throughput/tokens_per_sec_per_device": self._tokens / elapsed / world,
            "throughput/step_time_sec": elapsed / self._steps,
        }
        if self._flops:
            tflops = self._flops / elapsed / 1e12
            out["throughput/model_tflops_per_sec"] = tflops
            out["throughput/model_tflops_per_sec_per_device"] = tflops / world
            if self.peak_tflops_per_device:
                out["throughput/mfu"] = tflops / world / self.peak_tflops_per_device
        return out

    @staticmethod
    def _sync(trainer: Trainer) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def _memory(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, float]:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            key, value = "memory/peak_allocated_gb", torch.cuda.max_memory_allocated(device)
        else:
            rss = _peak_rss_bytes()
            if rss is None:
                return {}
            key, value = "memory/peak_rss_gb", rss
        local = torch.tensor([float(value)], dtype=torch.float64, device=device)
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            gathered = torch.empty(dist.get_world_size(), dtype=local.dtype, device=device)
            (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(gathered, local)
            local = gathered
        per_rank = local.tolist()
        out = {f"{key}/rank{r}": v / 2**30 for r, v in enumerate(per_rank)}
        out[f"{key}_max"] = max(per_rank) / 2**30
        return out

    @rank_zero_only
    def _log(self, trainer: Trainer, metrics: dict[str, float], step: int) -> None:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    @rank_zero_only
    def _print(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        parts = [f"step {step:5d}"]
        if trainer.max_steps and trainer.max_steps > 0:
            parts[0] += f"/{trainer.max_steps}"
        loss = trainer.callback_metrics.get("train_loss")
        if loss is not None:
            parts.append(f"loss {float(loss):.4f}")
        if "throughput/tokens_per_sec" in metrics:
            parts.append(f"{metrics['throughput/tokens_per_sec']:,.0f} tok/s")
        if "throughput/model_tflops_per_sec" in metrics:
            parts.append(f"{metrics['throughput/model_tflops_per_sec']:.3g} TFLOP/s")
        mem = metrics.get("memory/peak_allocated_gb_max", metrics.get("memory/peak_rss_gb_max"))
        if mem is not None:
            label = "peak mem" if "memory/peak_allocated_gb_max" in metrics else "peak RSS"
            parts.append(f"{label} {mem:.2f} GiB/rank")
        print("  ".join(parts), flush=True)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._t0 = None  # validation time is not training throughput: restart the window after it

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == "fit":
            rank_zero_only(self._print_val)(trainer)

    def _print_val(self, trainer: Trainer) -> None:
        loss = trainer.callback_metrics.get("val_loss")
        if self.print_every > 0 and loss is not None and not trainer.sanity_checking:
            print(f"step {trainer.global_step:5d}  val_loss {float(loss):.4f}", flush=True)


class TSPModelSummary(ModelSummary):
    """Lightning's ``ModelSummary`` that reports the TSP model's true FLOPs.

    Lightning 2.6.6's summary counts FLOPs by running ``example_input_array`` through the LightningModule under
    ``FlopCounterMode``; a TSP LightningModule has no such input (the strategy shards each batch), and a sharded
    forward would count only this rank's share. Without it Lightning shows 0 FLOPs. This callback reports, as
    ``Total Flops`` and on the TSP model's row, the FLOPs of ONE FORWARD pass (Lightning's meaning) of one
    micro-batch of one replica, ``[batch_size, seq_len]`` global sequences, computed from the model's configuration
    (:func:`module_flops_per_batch`: causal attention counted exactly). ``batch_size`` / ``seq_len`` default to the
    datamodule's attributes of those names (``TextDataModule`` has both); without them the FLOPs stay 0.

    ``TSPLanguageModel`` installs it in place of Lightning's default summary (``configure_callbacks``); with your
    own LightningModule pass ``Trainer(callbacks=[TSPModelSummary()])``.
    """

    def __init__(self, max_depth: int = 1, batch_size: Optional[int] = None, seq_len: Optional[int] = None,
                 **summarize_kwargs: Any) -> None:
        super().__init__(max_depth=max_depth, **summarize_kwargs)
        self.max_depth = max_depth
        self.summarize_kwargs = summarize_kwargs
        self.batch_size, self.seq_len = batch_size, seq_len
        self.total_flops: int = 0

    def batch_shape(self, trainer: Trainer) -> Optional[tuple[int, int]]:
        """``(batch_size, seq_len)`` of one replica's micro-batch: the arguments, else the datamodule's."""
        data = getattr(trainer, "datamodule", None)
        b = self.batch_size if self.batch_size is not None else getattr(data, "batch_size", None)
        s = self.seq_len if self.seq_len is not None else getattr(data, "seq_len", None)
        return (int(b), int(s)) if isinstance(b, int) and isinstance(s, int) else None

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.max_depth:
            return
        from lightning.pytorch.utilities.model_summary import get_human_readable_count, summarize

        summary = summarize(pl_module, max_depth=self.max_depth)  # public properties only below
        shape = self.batch_shape(trainer)
        per_model = {}
        if shape is not None:
            per_model = {name: module_flops_per_batch(m, *shape, kind="forward")
                         for name, m in named_tsp_models(pl_module)}
        self.total_flops = sum(per_model.values())
        names = summary.layer_names
        data = [
            (" ", [str(i) for i in range(len(names))]),
            ("Name", names),
            ("Type", summary.layer_types),
            ("Params", [get_human_readable_count(n) for n in summary.param_nums]),
            ("Mode", ["train" if mode else "eval" for mode in summary.training_modes]),
            ("FLOPs", [get_human_readable_count(per_model.get(name, 0)) for name in names]),
        ]
        if trainer.is_global_zero:
            if shape is None:
                rank_zero_info("TSPModelSummary: no batch_size / seq_len (argument or datamodule attribute): FLOPs 0")
            self.summarize(data, summary.total_parameters, summary.trainable_parameters, summary.model_size,
                           summary.total_training_modes, total_flops=self.total_flops, **self.summarize_kwargs)


class SequenceScoreWriter(BasePredictionWriter):
    """Writes ``TSPLanguageModel.predict_step``'s per-sequence scores to JSON lines (``lightning-tsp predict``).

    One file per data-parallel replica, ``{output_dir}/scores-dp{rank}.jsonl``, written by the first rank of each
    TSP group (every rank of a group holds the same numbers); one line per sequence: ``batch``, ``index`` (within
    the batch), ``nll_sum``, ``tokens``, ``perplexity``, and ``sample`` (the dataset index, when Lightning tracks
    it). Rank 0 prints the overall perplexity of its replica. A Lightning ``BasePredictionWriter`` (written at
    every batch).
    """

    def __init__(self, output_dir: str = "predictions") -> None:
        super().__init__(write_interval="batch")
        self.output_dir = output_dir
        self._file: Any = None
        self._nll = 0.0
        self._tokens = 0.0

    def _writes(self, trainer: Trainer) -> bool:
        try:
            return trainer.strategy.tsp_group.rank == 0  # TSPStrategy: the first rank of each TSP group
        except (AttributeError, RuntimeError):
            return True  # another strategy: every process writes its own replica's file

    @override
    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._nll = self._tokens = 0.0
        if self._writes(trainer):
            import os

            os.makedirs(self.output_dir, exist_ok=True)
            dp_rank = trainer.strategy.distributed_sampler_kwargs.get("rank", 0) if trainer.world_size > 1 else 0
            self._file = open(os.path.join(self.output_dir, f"scores-dp{dp_rank}.jsonl"), "w", encoding="utf-8")

    @override
    def write_on_batch_end(self, trainer: Trainer, pl_module: LightningModule, prediction: Any,
                           batch_indices: Any, batch: Any, batch_idx: int, dataloader_idx: int) -> None:
        if not isinstance(prediction, dict) or "nll_sum" not in prediction:
            return
        nll, tokens, ppl = (prediction[k].tolist() for k in ("nll_sum", "tokens", "perplexity"))
        self._nll += sum(nll)
        self._tokens += sum(tokens)
        if self._file is not None:
            import json

            samples = list(batch_indices) if batch_indices is not None and len(batch_indices) == len(nll) else None
            for i, (a, b, c) in enumerate(zip(nll, tokens, ppl)):
                line = {"batch": batch_idx, "index": i, "nll_sum": a, "tokens": b, "perplexity": c}
                if samples is not None:
                    line["sample"] = int(samples[i])
                self._file.write(json.dumps(line) + "\n")

    @override
    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if trainer.global_rank == 0 and self._tokens:
            import math

            print(f"predict: {self._tokens:.0f} tokens, perplexity {math.exp(self._nll / self._tokens):.4f} "
                  f"(scores in {self.output_dir}/)", flush=True)

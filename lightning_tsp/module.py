"""``TSPLanguageModel``: the LightningModule behind ``lightning-tsp fit``.

It builds the built-in :class:`~lightning_tsp.models.TSPLlama` unsharded (``tsp=None``) in ``configure_model``,
on the meta device by default, and lets :class:`~lightning_tsp.TSPStrategy` shard and materialise it. The steps
are single-device code: the strategy hands each rank its zigzag slice of the batch as the keyword arguments of
``TSPLlama.forward``, so ``loss = self.model(**batch)``.

YAML (``model:`` section of a LightningCLI config)::

    model:
      preset: tiny                  # tiny | paper-7b | llama3-8b | tiny-moe | mixtral-8x7b | qwen3-30b-a3b
      overrides: {n_layers: 4}      # any ModelConfig field
      activation_checkpointing: none
      lr: 3.0e-3
      warmup_steps: 20
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Union

import torch
from torch import Tensor

from lightning.pytorch import LightningModule

from lightning_tsp.checks import TSPConfigError
from lightning_tsp.metrics import Perplexity
from lightning_tsp.models.llama import CHECKPOINTING_MODES, CheckpointingMode, ModelConfig, TSPLlama, get_config
from lightning_tsp.zigzag import IGNORE_INDEX


class TokenNLL(Perplexity):
    """Mean negative log-likelihood per valid token over all ranks: the log of :class:`Perplexity`."""

    higher_is_better = False

    def compute(self) -> Tensor:
        return self.nll_sum / self.count.to(torch.float64)


def warmup_cosine(step: int, warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> float:
    """Learning-rate multiplier: linear warm-up from 1/(warmup+1) to 1, then cosine down to ``min_lr_ratio``
    at ``decay_steps`` (constant afterwards). ``decay_steps <= warmup_steps``: constant after warm-up."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if decay_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (decay_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class TSPLanguageModel(LightningModule):
    """Causal language model (built-in Llama-style decoder) trained with AdamW and a warm-up + cosine schedule.

    Arguments:
        preset: model preset name (``tiny``, ``paper-7b``, ``llama3-8b``).
        overrides: ``ModelConfig`` fields changed on top of the preset (e.g. ``{"n_layers": 4}``).
        config: a full ``ModelConfig`` instead of ``preset`` + ``overrides``.
        attention_kernel: ``auto`` | ``flash`` | ``cudnn`` | ``sdpa`` | ``math`` (see ``lightning_tsp.kernels``).
        activation_checkpointing: ``none``, ``selective`` (keep attention, recompute norm + MLP ring), ``full``
            (recompute each layer's forward in backward), ``keep-attention`` (``full`` that also keeps the
            attention outputs on the GPU: the recomputation skips the attention), ``offload`` (``full`` with the
            layer inputs and the attention outputs in pinned host memory; the recomputation skips the attention)
            or ``full-offload`` (``full`` with only the layer inputs in pinned host memory: the longest contexts).
        token_chunk: tokens per chunk of the vocab-sharded LM head (the full [L, V] logits never exist).
        kv_bucket_heads: KV heads whose full-sequence K/V are gathered at once (head bucketing; ``None``: all of
            a head group's). ``1`` keeps the gathered K/V smallest at very long contexts.
        shard_group: owners whose attention shards one broadcast-schedule step runs at once (a divisor of
            ``tsp_size``; ``auto``: all of them at short sequences, one at long ones; see docs/design.md).
        cuda_graphs: capture each checkpointed layer's forward and backward once as CUDA graphs and replay them
            (``full`` / ``keep-attention``, dense layers; the step stops being host-bound at short sequences; see
            docs/guide.md); ``"auto"``: only where the eager step is host-bound (at most 4096 local tokens).
        init_on_meta: build the unsharded model on the meta device (no memory); the strategy then initialises
            only this rank's shards, giving the same weights as a full initialisation whatever ``tsp_size``.
        lr: peak learning rate of AdamW.
        weight_decay: decoupled weight decay, applied to matrices only (not to norm weights or biases).
        betas, eps: AdamW.
        warmup_steps: linear warm-up (optimizer steps).
        decay_steps: end of the cosine decay (optimizer steps); default: the Trainer's total steps.
        min_lr_ratio: the learning rate at the end of the decay, as a fraction of ``lr``.
        fused_optimizer: pass ``fused=True`` to AdamW (CUDA only; ``None``: PyTorch's default).
    """

    def __init__(
        self,
        preset: str = "tiny",
        overrides: Optional[dict[str, Any]] = None,
        config: Optional[ModelConfig] = None,
        attention_kernel: str = "auto",
        activation_checkpointing: CheckpointingMode = "none",
        token_chunk: int = 4096,
        kv_bucket_heads: Optional[int] = None,
        shard_group: Union[int, str] = "auto",
        cuda_graphs: Union[bool, str] = False,
        init_on_meta: bool = True,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 0,
        decay_steps: Optional[int] = None,
        min_lr_ratio: float = 0.1,
        fused_optimizer: Optional[bool] = None,
    ) -> None:
        super().__init__()
        if config is not None and overrides:
            raise TSPConfigError("give either `config` (a full ModelConfig) or `preset` + `overrides`, not both")
        if isinstance(config, dict):
            config = ModelConfig(**config)
        self.cfg: ModelConfig = config if config is not None else get_config(preset, **(overrides or {}))
        if activation_checkpointing not in CHECKPOINTING_MODES:
            raise TSPConfigError(
                f"activation_checkpointing={activation_checkpointing!r}: choose one of {CHECKPOINTING_MODES}"
            )
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise TSPConfigError(f"min_lr_ratio={min_lr_ratio} must be in [0, 1]")
        self.save_hyperparameters(ignore=["config"])
        self.hparams["config"] = dataclasses.asdict(self.cfg)  # plain data: hparams.yaml and checkpoints stay readable
        self.model: Optional[TSPLlama] = None
        # world-summed token statistics (TSP ranks hold different tokens, replicas different sequences)
        self.eval_metrics = torch.nn.ModuleDict(
            {f"{stage}_{kind}": (TokenNLL() if kind == "nll" else Perplexity())
             for stage in ("val", "test") for kind in ("nll", "ppl")}
        )

    # ---- model -------------------------------------------------------------------------------------------------

    def configure_model(self) -> None:
        if self.model is not None:  # called again by validate/test after fit, or after a checkpoint load
            return
        hp = self.hparams
        self.model = TSPLlama(
            self.cfg,
            None,  # unsharded: TSPStrategy swaps in this rank's shard
            attention_kernel=hp.attention_kernel,
            activation_checkpointing=hp.activation_checkpointing,
            token_chunk=hp.token_chunk,
            kv_bucket_heads=hp.get("kv_bucket_heads"),
            shard_group=hp.get("shard_group", "auto"),
            cuda_graphs=hp.get("cuda_graphs", False),
            device="meta" if hp.init_on_meta else None,
        )

    def setup(self, stage: str) -> None:
        data = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        vocab = getattr(data, "vocab_size", None)
        if vocab is not None and vocab > self.cfg.vocab_size:
            raise TSPConfigError(
                f"the data's tokenizer has {vocab} tokens but the model's vocab_size is {self.cfg.vocab_size}: set "
                f"model.overrides.vocab_size to at least {vocab} (a multiple of tsp_size)"
            )

    def configure_callbacks(self) -> list:
        """Lightning's default ``ModelSummary`` -> :class:`~lightning_tsp.callbacks.TSPModelSummary` (the same table
        with the model's true FLOPs per batch; a summary the user configured otherwise is left alone)."""
        from lightning.pytorch.callbacks import ModelSummary

        from lightning_tsp.callbacks import TSPModelSummary

        callbacks = self.trainer.callbacks if self._trainer is not None else []
        return [TSPModelSummary()] if any(type(c) is ModelSummary for c in callbacks) else []

    # ---- steps -------------------------------------------------------------------------------------------------

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """``train_loss``: the loss optimised (a mixture of experts adds ``router_aux_loss_coef`` x
        ``train_aux_loss``, the load-balancing loss, also logged)."""
        if self.model is None:
            raise RuntimeError("TSPLanguageModel.configure_model has not run: train it through a Trainer")
        lm_loss, aux = self.model.loss_terms(**batch)
        loss = self.model.total_loss(lm_loss, aux)
        b = batch["input_ids"].shape[0]
        self.log("train_loss", loss, batch_size=b, sync_dist=True, prog_bar=True)
        if aux is not None:
            self.log("train_aux_loss", aux, batch_size=b, sync_dist=True)
        return loss

    def _evaluate(self, batch: dict[str, Tensor], stage: str) -> None:
        """``{stage}_loss`` = token-mean NLL over the whole evaluation set (all ranks, all batches: exact, not a mean
        of batch means) and ``{stage}_ppl`` = its exp, from one pass of per-token losses."""
        if self.model is None:
            raise RuntimeError("TSPLanguageModel.configure_model has not run: evaluate it through a Trainer")
        losses = self.model.token_losses(batch["input_ids"], batch["targets"], batch["position_ids"])
        nll, ppl = self.eval_metrics[f"{stage}_nll"], self.eval_metrics[f"{stage}_ppl"]
        nll.update(losses, batch["targets"])
        ppl.update(losses, batch["targets"])
        self.log(f"{stage}_loss", nll, prog_bar=stage == "val")
        self.log(f"{stage}_ppl", ppl)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> dict[str, Tensor]:
        """Score every sequence: summed negative log-likelihood, valid-token count and perplexity, each [B].

        Every rank of a TSP group returns the same numbers (one all-reduce over the group).
        """
        if self.model is None:
            raise RuntimeError("TSPLanguageModel.configure_model has not run: predict through a Trainer")
        losses = self.model.token_losses(batch["input_ids"], batch["targets"], batch["position_ids"])
        stats = torch.stack([losses.double().sum(-1), (batch["targets"] != IGNORE_INDEX).sum(-1).double()])
        tsp = self.model.tsp
        if tsp.size > 1:
            import torch.distributed as dist

            dist.all_reduce(stats, group=tsp.group)
        nll, tokens = stats[0], stats[1]
        return {"nll_sum": nll, "tokens": tokens, "perplexity": torch.exp(nll / tokens.clamp(min=1))}

    # ---- optimizer ---------------------------------------------------------------------------------------------

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        decay, no_decay = [], []
        for p in self.parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        kwargs: dict[str, Any] = {"lr": hp.lr, "betas": tuple(hp.betas), "eps": hp.eps}
        if hp.fused_optimizer is not None:
            kwargs["fused"] = hp.fused_optimizer
        optimizer = torch.optim.AdamW([g for g in groups if g["params"]], **kwargs)
        total = hp.decay_steps
        if total is None:
            total = int(self.trainer.estimated_stepping_batches) if self._trainer is not None else 0
            if not 0 < total < 2**62:  # infinite / unknown (max_steps=-1 and an iterable of unknown length)
                total = 0
        warmup, floor = hp.warmup_steps, hp.min_lr_ratio
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, warmup, total, floor)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

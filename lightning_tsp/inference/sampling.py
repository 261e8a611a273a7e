"""Choosing the next token from vocab-sharded logits with a small exchange; identical on every rank and for
every D.

* Greedy: each rank sends its local (max, argmax) per sequence: one all-gather of [B, 2] fp64. Ties go to the
  lowest token id (``torch.argmax``'s first occurrence, as in Hugging Face).
* Sampling (temperature, top-k, top-p, Hugging Face's order: temperature, then top-k, then top-p): the Gumbel-max
  trick. A generator seeded with ``seed`` draws Gumbel noise for the FULL vocabulary [B, V] at every step on
  every rank (the same draws whatever D), and the token is argmax(logits / T + noise) over the kept tokens: an
  exact sample of the renormalised softmax.
  - no top-k / top-p: the greedy exchange on (logits / T + noise).
  - top-k: each rank sends its local top-k (values and ids, [B, 2k]); the global top-k is among them.
  - top-p without top-k: each rank sends its local top-m candidates plus its (max, sum-exp) for the global
    normaliser. The gathered candidates contain every token above tau = max over ranks of the local m-th value;
    if those reach probability top_p the nucleus is exactly known, otherwise m doubles and the exchange repeats
    (usually one round).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_tsp.group import TSPGroup
from lightning_tsp.inference.collectives import all_gather_stack


@dataclass(frozen=True)
class SamplingConfig:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    top_p_candidates: int = 64  # first round of local candidates for top-p without top-k

    def validate(self, vocab_size: int) -> None:
        if not self.do_sample:
            return
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (use do_sample=False for greedy)")
        if self.top_k is not None and not 1 <= self.top_k <= vocab_size:
            raise ValueError(f"top_k={self.top_k} must be in [1, vocab_size={vocab_size}]")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")


def _global_argmax(values: Tensor, offset: int, tsp: TSPGroup) -> Tensor:
    """values [B, V/D] (this rank's vocab columns) -> the global argmax token id [B] (lowest id on ties)."""
    best, idx = values.max(dim=-1)
    mine = torch.stack([best.to(torch.float64), (idx + offset).to(torch.float64)], dim=-1)  # [B, 2]
    allr = all_gather_stack(mine, tsp)  # [D, B, 2]
    winner = allr[..., 0].argmax(dim=0)  # first maximum = lowest rank = lowest ids
    return allr[..., 1].gather(0, winner[None]).squeeze(0).long()


class TokenChooser:
    """Holds the seeded generator (one per generation, never in a module)."""

    def __init__(self, cfg: SamplingConfig, vocab_size: int, tsp: TSPGroup):
        cfg.validate(vocab_size)
        self.cfg, self.vocab_size, self.tsp = cfg, vocab_size, tsp
        self.gen = torch.Generator(device="cpu").manual_seed(cfg.seed) if cfg.do_sample else None

    def _gumbel(self, b: int, device) -> Tensor:
        u = torch.rand(b, self.vocab_size, generator=self.gen, dtype=torch.float64)
        u = u.clamp(min=torch.finfo(torch.float64).tiny, max=1 - torch.finfo(torch.float64).eps)
        return (-torch.log(-torch.log(u))).to(device)

    def __call__(self, logits: Tensor, offset: int) -> Tensor:
        """logits [B, V/D] of this rank's vocab slice starting at ``offset`` -> next tokens [B] (all ranks)."""
        cfg, tsp = self.cfg, self.tsp
        if not cfg.do_sample:
            return _global_argmax(logits, offset, tsp)
        b, v_loc = logits.shape
        scaled = logits.to(torch.float64) / cfg.temperature
        noise = self._gumbel(b, logits.device)  # [B, V], the same on every rank and for every D
        if cfg.top_k is None and cfg.top_p is None:
            return _global_argmax(scaled + noise[:, offset : offset + v_loc], offset, tsp)
        vals, ids, keep = self._filtered_candidates(scaled, offset)
        score = torch.where(keep, vals + noise.gather(1, ids), float("-inf"))
        return ids.gather(1, score.argmax(dim=1, keepdim=True)).squeeze(1)

    def _filtered_candidates(self, scaled: Tensor, offset: int):
        """(values, ids, keep) [B, M]: candidates sorted by value, those kept by top-k / top-p marked."""
        cfg, tsp = self.cfg, self.tsp
        b, v_loc = scaled.shape
        m = min(cfg.top_k if cfg.top_k is not None else cfg.top_p_candidates, v_loc)
        while True:
            top_v, top_i = scaled.topk(m, dim=-1)  # sorted descending
            mx = scaled.max(dim=-1).values
            sumexp = torch.exp(scaled - mx[:, None]).sum(-1)
            mine = torch.cat([top_v, (top_i + offset).to(torch.float64), mx[:, None], sumexp[:, None]], dim=1)
            allr = all_gather_stack(mine, tsp)  # [D, B, 2m + 2]
            vals = allr[..., :m].permute(1, 0, 2).reshape(b, -1)
            ids = allr[..., m : 2 * m].permute(1, 0, 2).reshape(b, -1).long()
            order = vals.argsort(dim=1, descending=True, stable=True)
            vals, ids = vals.gather(1, order), ids.gather(1, order)
            if cfg.top_k is not None:
                vals, ids = vals[:, : cfg.top_k], ids[:, : cfg.top_k]
                log_z = torch.logsumexp(vals, dim=1)
            else:  # the full-vocabulary normaliser from every rank's (max, sum-exp)
                gmx = allr[..., 2 * m].max(dim=0).values
                log_z = gmx + torch.log((allr[..., 2 * m + 1] * torch.exp(allr[..., 2 * m] - gmx)).sum(0))
            keep = torch.ones_like(vals, dtype=torch.bool)
            if cfg.top_p is None:
                return vals, ids, keep
            probs = torch.exp(vals - log_z[:, None])
            before = torch.cumsum(probs, dim=1) - probs  # mass of the tokens ranked above
            keep = before < cfg.top_p
            keep[:, 0] = True
            if cfg.top_k is not None or m == v_loc:
                return vals, ids, keep
            tau = allr[..., m - 1].max(dim=0).values  # every token above tau was gathered
            above = torch.where(vals > tau[:, None], probs, 0).sum(1)
            if bool((above >= cfg.top_p).all()):
                return vals, ids, keep
            m = min(2 * m, v_loc)

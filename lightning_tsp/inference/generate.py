"""``generate``: prefill once, then decode token by token with weights and KV cache both at 1/D per rank."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_tsp.checks import TSPConfigError
from lightning_tsp.inference.cache import KVCache
from lightning_tsp.inference.decode import decode_step
from lightning_tsp.inference.prefill import prefill
from lightning_tsp.inference.prompts import as_prompt_list, pad_right, validate_prompts
from lightning_tsp.inference.sampling import SamplingConfig, TokenChooser
from lightning_tsp.inference.vocab import local_logits, vocab_offset


@dataclass
class GenerationOutput:
    tokens: Tensor  # [B, n] new tokens; after a sequence's EOS, ``pad_token_id``
    lengths: list[int]  # new tokens per sequence (EOS included)
    prompts: list[list[int]]
    cache: KVCache  # this rank's KV cache (1/D), e.g. to measure it

    def sequences(self) -> list[list[int]]:
        """Prompt + generated tokens of every sequence (up to and including EOS)."""
        return [p + self.tokens[i, : self.lengths[i]].tolist() for i, p in enumerate(self.prompts)]


@torch.no_grad()
def generate(
    model,
    input_ids,
    max_new_tokens: int,
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
    max_seq_len: int | None = None,
    streamer: Callable[[int, Tensor], None] | None = None,
) -> GenerationOutput:
    """Generate up to ``max_new_tokens`` tokens for every prompt with a :class:`TSPLlama` (any D, or D = 1).

    Every rank of the TSP group must call this with the same arguments (the prompts are replicated; each rank
    keeps 1/D of the weights and 1/D of the KV cache). ``input_ids``: one prompt (list of ints / 1-D tensor), a
    [B, L] tensor or a list of prompts of different lengths. ``streamer(step, tokens[B])`` is called on every rank
    after each new token. Generation stops early once every sequence has produced ``eos_token_id``.
    Inputs are checked (``TSPConfigError``) before any collective is issued.
    """
    prompts = as_prompt_list(input_ids)
    cfg = model.cfg
    validate_prompts(prompts, cfg.vocab_size, max_new_tokens, max_seq_len)
    window, longest = getattr(cfg, "sliding_window", None), max(len(p) for p in prompts) + max_new_tokens - 1
    if window is not None and longest > window:  # Hugging Face Mistral / Qwen configs with a sliding window
        raise TSPConfigError(
            f"prompt + max_new_tokens reach {longest} tokens, more than the model's sliding_window={window}: Hugging "
            f"Face would attend to the last {window} tokens only, TSP to all of them. Generate at most "
            f"{window} tokens in all, or use a config without the window."
        )
    sampling = SamplingConfig(do_sample, temperature, top_k, top_p, seed)
    chooser = TokenChooser(sampling, cfg.vocab_size, model.tsp)  # validates the sampling arguments
    device = next(model.parameters()).device
    ids, lens = pad_right(prompts, model.tsp.size, pad_token_id, device)
    b = len(prompts)

    cache, hidden = prefill(model, ids, lens, decode_steps=max_new_tokens - 1)
    offset = vocab_offset(model)
    out = torch.full((b, max_new_tokens), pad_token_id, dtype=torch.long)
    done = torch.zeros(b, dtype=torch.bool)
    lengths = [0] * b
    for step in range(max_new_tokens):
        if step > 0:
            hidden = decode_step(model, cache, out[:, step - 1].to(device))
        nxt = chooser(local_logits(model, hidden), offset).cpu()
        nxt = torch.where(done, pad_token_id, nxt)
        out[:, step] = nxt
        for i in range(b):
            if not done[i]:
                lengths[i] += 1
        if eos_token_id is not None:
            done |= nxt == eos_token_id
        if streamer is not None:
            streamer(step, nxt)
        if bool(done.all()):  # identical on every rank: the tokens are
            out = out[:, : step + 1]
            break
    return GenerationOutput(out, lengths, prompts, cache)

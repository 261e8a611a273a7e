"""``generate``: prefill once, then decode token by token with weights and KV cache both at 1/D per rank."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_tsp.checks import TSPConfigError
from lightning_tsp.inference.cache import KVCache
from lightning_tsp.inference.decode import Decoder
from lightning_tsp.inference.decoders import DecoderKey, decoder_pool
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
    cuda_graphs: bool | None = None,
    keep_decoder: bool = True,
    pad_to_multiple_of: int | None = None,
) -> GenerationOutput:
    """Generate up to ``max_new_tokens`` tokens for every prompt with a :class:`TSPLlama` (any D, or D = 1).

    Every rank of the TSP group must call this with the same arguments (the prompts are replicated; each rank
    keeps 1/D of the weights and 1/D of the KV cache). ``input_ids``: one prompt (list of ints / 1-D tensor), a
    [B, L] tensor or a list of prompts of different lengths. ``streamer(step, tokens[B])`` is called on every rank
    after each new token. Generation stops early once every sequence has produced ``eos_token_id``.
    Inputs are checked (``TSPConfigError``) before any collective is issued.

    ``cuda_graphs`` (default: on for a CUDA model) replays each decode step as one CUDA graph (see
    :class:`~lightning_tsp.inference.decode.Decoder`). The host reads each token one step late, so when every
    sequence has ended the returned ``cache`` holds the K/V of one token more than the output shows.

    ``keep_decoder`` (default on): the decoder (KV cache buffers, CUDA graph) is kept for the model and reused by
    the next call with the same shapes (batch size, padded prompt length, ``max_new_tokens``, graphs, the model's
    dtype, device and parameter storage), which then skips the cache allocation, the eager warm-up steps and the
    graph capture and gives exactly the tokens a new decoder gives. At most ``decoder_pool(model).limit`` (default
    1) are kept per model; ``lightning_tsp.inference.release(model)`` frees them (see
    :mod:`lightning_tsp.inference.decoders`). The returned ``cache`` is then the kept one: the next call of the
    same shapes refills it. ``pad_to_multiple_of``: right-pad the prompt batch to a multiple of this many tokens
    (and of 2D) instead of 2D only, so that calls whose longest prompts differ a little share a kept decoder (the
    pad slots cost prefill compute and stay empty in the cache; the tokens do not change).
    """
    prompts = as_prompt_list(input_ids)
    cfg = model.cfg
    validate_prompts(prompts, cfg.vocab_size, max_new_tokens, max_seq_len)
    if pad_to_multiple_of is not None and (not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1):
        raise TSPConfigError(f"pad_to_multiple_of={pad_to_multiple_of!r} must be a positive int (a number of "
                             f"tokens) or None")
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
    if pad_to_multiple_of is not None:
        mult = math.lcm(pad_to_multiple_of, 2 * model.tsp.size)
        ids = F.pad(ids, (0, -(-ids.shape[1] // mult) * mult - ids.shape[1]), value=pad_token_id)
    b = len(prompts)

    graphs = device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
    pool = decoder_pool(model) if keep_decoder else None
    key = DecoderKey.of(model, b, ids.shape[1], max_new_tokens - 1, graphs) if pool is not None else None
    decoder = pool.take(key) if pool is not None else None  # out of the pool while in use: a failed call keeps nothing
    if decoder is None:
        cache, hidden = prefill(model, ids, lens, decode_steps=max_new_tokens - 1)
        decoder = Decoder(model, cache, graphs=graphs)
    else:  # the kept cache refilled in place; a short prompt batch from the decoder's captured prefill
        cache, hidden = decoder.cache, decoder.prefill(ids, lens, max_new_tokens - 1)
    offset = vocab_offset(model)
    pending = _HostTokens(b, max_new_tokens, device)
    done = torch.zeros(b, dtype=torch.bool)
    lengths = [0] * b
    logits = local_logits(model, hidden)
    finished = None
    for step in range(max_new_tokens + 1):
        if step < max_new_tokens:  # queue this step's work before looking at the previous step's token
            if step > 0:
                logits = decoder(nxt)
            nxt = chooser(logits, offset)  # on the device; every later use of it is queued behind it
            pending.put(step, nxt)
        if step == 0:
            continue
        prev = pending.get(step - 1)  # waits for step - 1 only: step's work is already queued
        prev = torch.where(done, pad_token_id, prev)
        pending.out[:, step - 1] = prev
        for i in range(b):
            if not done[i]:
                lengths[i] += 1
        if eos_token_id is not None:
            done |= prev == eos_token_id
        if streamer is not None:
            streamer(step - 1, prev)
        if bool(done.all()):  # identical on every rank: the tokens are
            finished = step
            break
    out = pending.out if finished is None else pending.out[:, :finished]
    if pool is not None:
        pool.put(key, decoder)
    return GenerationOutput(out, lengths, prompts, cache)


class _HostTokens:
    """Each step's chosen tokens copied to the host without stalling the device: the copy of step i is queued
    behind step i's work, and read once step i + 1's work is queued too (on CUDA a pinned buffer and an event per
    step), so the GPU never waits for the host's end-of-sequence check."""

    def __init__(self, b: int, n: int, device: torch.device):
        self.cuda = device.type == "cuda"
        self.out = torch.zeros((b, n), dtype=torch.long, pin_memory=self.cuda)
        self.events: dict[int, torch.cuda.Event] = {}

    def put(self, step: int, tokens: Tensor) -> None:
        if self.cuda:
            self.out[:, step].copy_(tokens, non_blocking=True)
            self.events[step] = torch.cuda.Event()
            self.events[step].record()
        else:
            self.out[:, step] = tokens

    def get(self, step: int) -> Tensor:
        if self.cuda:
            self.events.pop(step).synchronize()
        return self.out[:, step].clone()

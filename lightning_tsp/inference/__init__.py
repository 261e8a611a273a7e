"""Inference under TSP: prefill with the broadcast/ring schedules, then decoding with weights and KV cache both
at 1/D per rank. See docs/inference.md."""

from lightning_tsp.inference.cache import KVCache
from lightning_tsp.inference.decode import decode_step
from lightning_tsp.inference.decoders import DecoderPool, decoder_pool, release
from lightning_tsp.inference.generate import GenerationOutput, generate
from lightning_tsp.inference.loading import load_model
from lightning_tsp.inference.prefill import prefill
from lightning_tsp.inference.sampling import SamplingConfig, TokenChooser
from lightning_tsp.inference.vocab import full_log_probs, local_logits

__all__ = ["generate", "release", "decoder_pool", "DecoderPool", "load_model", "GenerationOutput", "prefill",
           "decode_step", "KVCache", "SamplingConfig", "TokenChooser", "full_log_probs", "local_logits"]

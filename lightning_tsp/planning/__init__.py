"""Analytical cost model and layout planner for TSP and its rivals (pure Python: no torch import).

See docs/cost-model.md for every formula and its assumptions.
"""

from .collectives import (
    CHECKPOINTING,
    G_BYTES,
    OPS,
    PHASES,
    add_tallies,
    scale_tally,
    tsp_attn_shard_numel,
    tsp_embedding_collectives,
    tsp_expert_shard_numel,
    tsp_final_norm_collectives,
    tsp_kv_gather_numel,
    tsp_layer_collectives,
    tsp_lm_head_collectives,
    tsp_local_heads,
    tsp_loss_collectives,
    tsp_mlp_shard_numel,
    tsp_moe_mlp_collectives,
    tsp_step_collectives,
    tsp_vocab_shard_numel,
    wire_bytes,
)
from .flops import attention_pairs, forward_flops, training_flops
from .hardware import HARDWARE_PRESETS, Hardware, get_hardware
from .model import MODEL_PRESETS, ModelShape, from_config, from_hf_config, get_model_shape
from .moe import choose_expert_schedule, crossover_tokens, expert_schedule_costs
from .planner import Plan, PlanError, candidate_layouts, make_plan, validate
from .precision import PRECISIONS, Precision, get_precision
from .strategies import STRATEGIES, CommEntry, Estimate, Layout, communication, estimate, memory_breakdown

__all__ = [
    "CHECKPOINTING", "G_BYTES", "OPS", "PHASES", "add_tallies", "scale_tally", "tsp_attn_shard_numel",
    "tsp_embedding_collectives", "tsp_final_norm_collectives", "tsp_kv_gather_numel", "tsp_layer_collectives",
    "tsp_lm_head_collectives", "tsp_local_heads", "tsp_loss_collectives", "tsp_mlp_shard_numel",
    "tsp_step_collectives", "tsp_vocab_shard_numel", "wire_bytes", "attention_pairs", "forward_flops",
    "training_flops", "HARDWARE_PRESETS", "Hardware", "get_hardware", "MODEL_PRESETS", "ModelShape", "from_config",
    "from_hf_config", "get_model_shape", "Plan", "PlanError", "candidate_layouts", "make_plan", "validate",
    "PRECISIONS", "Precision", "get_precision", "STRATEGIES", "CommEntry", "Estimate", "Layout", "communication",
    "estimate", "memory_breakdown", "tsp_expert_shard_numel", "tsp_moe_mlp_collectives", "expert_schedule_costs",
    "choose_expert_schedule", "crossover_tokens",
]

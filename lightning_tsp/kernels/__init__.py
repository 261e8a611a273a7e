from lightning_tsp.kernels.attention import (
    AttentionKernel,
    CudnnSplitAttention,
    FlashAttention,
    MathAttention,
    SDPAAttention,
    available_kernels,
    select_attention_kernel,
)

__all__ = [
    "AttentionKernel",
    "MathAttention",
    "SDPAAttention",
    "CudnnSplitAttention",
    "FlashAttention",
    "available_kernels",
    "select_attention_kernel",
]

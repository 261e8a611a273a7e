from lightning_tsp.kernels.attention import (
    AttentionKernel,
    CudnnSplitAttention,
    DocumentMask,
    FlexDocumentAttention,
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
    "FlexDocumentAttention",
    "DocumentMask",
    "available_kernels",
    "select_attention_kernel",
]

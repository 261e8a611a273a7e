"""Accelerator presets: plain data, sources named next to each number.

Bandwidths are per GPU and per direction (bytes/s). ``intra_bw`` is what one GPU can push into a collective that
talks to all its node peers at once (NVSwitch: the full NVLink bandwidth; a fully connected Infinity Fabric mesh:
the sum of its links). ``intra_p2p_bw`` is what one point-to-point stream to ONE peer gets (NVSwitch: the same;
Infinity Fabric: a single link). ``inter_bw`` is one GPU's share of the scale-out network (one NIC per GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Hardware", "HARDWARE_PRESETS", "get_hardware", "GiB", "GB", "INTRA_LATENCY_S", "INTER_LATENCY_S",
           "ALL_TO_ALL_LATENCY_S", "HOST_SYNC_S", "DISPATCH_PASS_S",
           "TSP_STEP_PASS_S"]

GiB = 2**30
GB = 10**9

# Fixed costs (the alpha of the alpha-beta model). ASSUMPTIONS, not measurements: calibrate them on the target
# machine (e.g. time a 1-element collective and a .tolist() between two GEMMs). Small next to the bandwidth terms
# at long context; they decide the expert schedule only at short sequences.
INTRA_LATENCY_S = 10e-6  # one collective call or ring send inside a node
INTER_LATENCY_S = 25e-6  # the same across nodes
ALL_TO_ALL_LATENCY_S = 25e-6  # one variable-size all_to_all_single (NCCL: grouped sends/recvs to D-1 peers)
HOST_SYNC_S = 50e-6  # one device-to-host read the host waits for (.tolist() of routing counts): the copy plus
#                      the bubble while the host, no longer ahead of the GPU, launches the next kernels
# MEASURED (H200, torch 2.11, fake process group, docs/benchmarks.md "Mixture of experts"): expert dispatch's
# compute-only step exceeded the expert ring's by 10.4 ms (Mixtral-8x7B) and 11.3 ms (Qwen3-30B-A3B, grouped GEMMs)
# per MoE layer at 32K with full checkpointing: forward + recomputed forward + backward = 4 units of the row
# sorting, gathers, count exchange and host syncs dispatch adds per pass (a backward pass counts twice).
DISPATCH_PASS_S = 2.7e-3
# MEASURED (H200, torch 2.11, fake process group, docs/cost-model.md "Step time", docs/results/compiled-rivals.jsonl
# rows "2026-12-07 session 41"): TSP's step exceeds its FLOP time by about 0.12 ms per broadcast-schedule step or
# ring hop of one layer (its forward, recomputed forward and backward together: the small per-shard elementwise
# kernels, copies and fp32 adds, the optimizer step) once the host no longer bounds it (cuda_graphs="auto"). Fitted
# to the paper 7B at D = 8, keep-attention, flash-attn 4, 8K-128K, for the smallest largest relative error (-14% at
# 8K, +14% at 128K; the residual per pass-unit falls from 0.05 ms at 8K-32K to below zero at 64K-128K, where the
# measured GEMM and attention rates beat the preset's). A backward pass counts twice: a quarter of it per pass.
# (Earlier fits: 0.134 ms to the 2026-12-04 steps, 0.25 ms to eager, host-bound ones.)
TSP_STEP_PASS_S = 0.031e-3


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_bf16_tflops: float  # dense (no sparsity) bf16 tensor-core peak, TFLOP/s
    hbm_bytes: int  # device memory
    intra_bw: float  # bytes/s per GPU per direction, collectives inside a node
    intra_p2p_bw: float  # bytes/s per GPU per direction, one send to one peer inside a node
    inter_bw: float  # bytes/s per GPU per direction across nodes
    measured_gemm_tflops: float | None = None  # a measured large bf16 GEMM rate, if we have one
    measured_attention_tflops: float | None = None  # measured causal attention fwd+bwd rate (bf16, hd 128)

    @property
    def gemm_efficiency(self) -> float:
        """Fraction of the peak a large bf16 GEMM reaches. Measured on H200 (773 / 989.5 = 0.78);
        the same fraction is assumed for GPUs we have not measured."""
        return (self.measured_gemm_tflops or self.peak_bf16_tflops * _H200_EFF) / self.peak_bf16_tflops

    @property
    def sustained_flops(self) -> float:
        """FLOP/s of the projections / MLP / LM-head matmuls in step-time estimates (bf16)."""
        return self.peak_bf16_tflops * self.gemm_efficiency * 1e12

    @property
    def attention_flops(self) -> float:
        """FLOP/s of the attention kernels (QK^T, PV and their backward) in step-time estimates (bf16).
        Measured on H200 for TSP's zigzag calls (cuDNN, split + log-sum-exp merge): 540-562 -> 550; the same
        fraction of the peak (0.556) is assumed elsewhere."""
        tflops = self.measured_attention_tflops or self.peak_bf16_tflops * _H200_ATTN / _H200_PEAK
        return tflops * 1e12


# Measured on one H200 (torch 2.11, large bf16 GEMM): 773 TFLOP/s. Source: /work/shared/reference/anchors.md.
_H200_MEASURED = 773.0
_H200_PEAK = 989.5
_H200_EFF = _H200_MEASURED / _H200_PEAK
# Measured on one H200: TSP's zigzag attention calls (c = 8192 queries vs a causal prefix, bf16, hd 128),
# fwd+bwd, cuDNN SDPA split into prefix + own chunk merged by log-sum-exp: 540-562 TFLOP/s (anchors.md).
_H200_ATTN = 550.0

HARDWARE_PRESETS: dict[str, Hardware] = {
    # NVIDIA H200 SXM datasheet: BF16 tensor core 1,979 TFLOP/s *with sparsity* -> 989.5 dense; 141 GB HBM3e;
    # NVLink 4 via NVSwitch 900 GB/s bidirectional per GPU -> 450 GB/s per direction.
    # DGX H200: 8 x ConnectX-7 400 Gb/s (one NIC per GPU) -> 50 GB/s per GPU per direction.
    "h200": Hardware("h200", _H200_PEAK, 141 * GiB, 450 * GB, 450 * GB, 50 * GB, measured_gemm_tflops=_H200_MEASURED,
                     measured_attention_tflops=_H200_ATTN),
    # NVIDIA H100 SXM5 datasheet: BF16 1,979 TFLOP/s with sparsity -> 989.4 dense; 80 GB HBM3;
    # NVLink 4 900 GB/s bidirectional; DGX H100: 8 x ConnectX-7 400 Gb/s NDR, one per GPU.
    "h100": Hardware("h100", 989.4, 80 * GiB, 450 * GB, 450 * GB, 50 * GB),
    # AMD Instinct MI300X datasheet: peak BF16 1,307.4 TFLOP/s dense; 192 GB HBM3; 7 Infinity Fabric links per
    # GPU, 128 GB/s bidirectional each (896 GB/s aggregate) -> 448 GB/s per direction to all peers, 64 GB/s to one.
    # Inter-node: the TSP paper's cluster used AMD Pollara 400 Gb/s NICs, one per GPU -> 50 GB/s.
    "mi300x": Hardware("mi300x", 1307.4, 192 * GiB, 448 * GB, 64 * GB, 50 * GB),
}


def get_hardware(name: str | Hardware) -> Hardware:
    if isinstance(name, Hardware):
        return name
    key = name.lower()
    if key not in HARDWARE_PRESETS:
        raise ValueError(f"unknown gpu {name!r}: use one of {', '.join(HARDWARE_PRESETS)}")
    return HARDWARE_PRESETS[key]

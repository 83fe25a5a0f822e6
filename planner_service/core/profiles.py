"""Named hardware profiles: attention-kernel and interconnect coefficients.

Every number here is an estimate with its source; ``planner fit-profile`` (FCP issue)
and the worker runtime's profiler re-fit them from measured timings. Nothing outside
this file hard-codes a hardware number.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelProfile:
    """Throughput model of a FlashAttention-style varlen kernel on one GPU."""

    name: str
    fwd_tflops: float
    """Sustained forward attention TFLOP/s on full tiles (bf16, head_dim 128)."""
    bwd_tflops: float
    """Sustained backward TFLOP/s; backward does 2.5x the forward FLOPs."""
    tile_q: int
    """Query rows per thread block: a shard's queries are processed in tiles of this size."""
    tile_k: int
    """Key columns per inner step: every started key tile costs a full tile."""
    call_overhead_us: float
    """Fixed cost of one forward+backward kernel launch sequence (launch, preprocess, dq convert)."""
    per_seq_us: float
    """Extra cost per varlen sequence (per shard): scheduling and partial-tile epilogues."""
    linear_tflops: float
    """Sustained dense GEMM TFLOP/s for the linear layers."""
    source: str


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkProfile:
    """Latency-bandwidth model of the CP interconnect: t = latency + bytes / bandwidth."""

    name: str
    bandwidth_gbps: float
    """Achieved per-GPU bus bandwidth in GB/s (1e9 bytes/s) for collectives."""
    latency_us: float
    """Fixed cost of one collective or P2P step."""
    source: str


KERNEL_PROFILES: dict[str, KernelProfile] = {
    # FlashAttention-3 on H100 SXM5, bf16, head_dim 128: ~650 TFLOP/s forward and ~450 TFLOP/s
    # backward at long sequence lengths (Shah et al., "FlashAttention-3", arXiv:2407.08608,
    # Figs. 5-6); tiles 128x128 for causal hdim 128 (hopper/tile_size.h in the FA3 sources).
    # Dense bf16 GEMM ~650 TFLOP/s of the 989 peak (NVIDIA H100 datasheet; cuBLAS at large shapes).
    "h100-fa3": KernelProfile(
        name="h100-fa3",
        fwd_tflops=650.0,
        bwd_tflops=450.0,
        tile_q=128,
        tile_k=128,
        call_overhead_us=25.0,
        per_seq_us=0.4,
        linear_tflops=650.0,
        source="FA3 paper arXiv:2407.08608 Figs. 5-6; H100 SXM datasheet",
    ),
    # FlashAttention-2 on H100 SXM5: ~335 TFLOP/s forward, ~300 TFLOP/s backward at hdim 128
    # (FA3 paper's FA2 baselines, Figs. 5-6); fwd tiles 128x64 for causal hdim 128 on sm80+
    # (flash_fwd_launch_template.h, run_mha_fwd_hdim128).
    "h100-fa2": KernelProfile(
        name="h100-fa2",
        fwd_tflops=335.0,
        bwd_tflops=300.0,
        tile_q=128,
        tile_k=64,
        call_overhead_us=30.0,
        per_seq_us=0.6,
        linear_tflops=650.0,
        source="FA3 paper arXiv:2407.08608 FA2 baselines; FA2 launch templates",
    ),
    # A reference CPU profile so estimates exist for the CPU runtime; re-fit with the profiler.
    "cpu-torch": KernelProfile(
        name="cpu-torch",
        fwd_tflops=0.2,
        bwd_tflops=0.1,
        tile_q=1,
        tile_k=1,
        call_overhead_us=50.0,
        per_seq_us=20.0,
        linear_tflops=0.5,
        source="order of magnitude for a 2-core x86 CPU in float32; re-fit before use",
    ),
}

LINK_PROFILES: dict[str, LinkProfile] = {
    # NVLink4 on H100 SXM: 450 GB/s per direction; nccl-tests all_gather bus bandwidth on
    # DGX H100 reaches ~370 GB/s at large messages (NVIDIA NCCL performance notes).
    "nvlink": LinkProfile(
        name="nvlink",
        bandwidth_gbps=370.0,
        latency_us=12.0,
        source="NVLink4 spec 450 GB/s/dir; nccl-tests DGX H100 busbw",
    ),
    # 400 Gb/s NDR InfiniBand (ConnectX-7) per GPU = 50 GB/s line rate; ~45 GB/s achieved
    # bus bandwidth across nodes in nccl-tests, ~25 us small-message latency.
    "infiniband": LinkProfile(
        name="infiniband",
        bandwidth_gbps=45.0,
        latency_us=25.0,
        source="ConnectX-7 NDR 400 Gb/s datasheet; nccl-tests inter-node busbw",
    ),
    # Loopback gloo on one CPU host, order of magnitude only.
    "gloo-local": LinkProfile(
        name="gloo-local",
        bandwidth_gbps=2.0,
        latency_us=100.0,
        source="order of magnitude for gloo over loopback TCP; re-fit before use",
    ),
}


def get_kernel_profile(name: str) -> KernelProfile:
    """Look up a kernel profile; raises ValueError listing the valid names."""
    try:
        return KERNEL_PROFILES[name]
    except KeyError:
        raise ValueError(
            f"kernel profile {name!r} is unknown; valid: {', '.join(sorted(KERNEL_PROFILES))}"
        ) from None


def get_link_profile(name: str) -> LinkProfile:
    """Look up a link profile; raises ValueError listing the valid names."""
    try:
        return LINK_PROFILES[name]
    except KeyError:
        raise ValueError(
            f"link profile {name!r} is unknown; valid: {', '.join(sorted(LINK_PROFILES))}"
        ) from None

"""Named hardware profiles: attention-kernel and interconnect coefficients.

Every number here is an estimate with its source; ``python -m bench.model_check`` fits
the step-time terms from runs of the worker runtime (``planner_service.core.profile_fit``)
and writes them as a profile JSON (:func:`kernel_profile_from_dict`). Nothing outside
this file hard-codes a hardware number.

The default kernel profile follows the kernel the runtime calls (:func:`default_kernel_profile`,
:func:`default_kernel_name`): a request without a kernel profile resolves it when it is built.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass, fields
from importlib import metadata
from typing import Any

TILINGS = ("segment", "packed")
"""How a kernel walks its work (core/step_time.py): per varlen segment (FlashAttention)
or in blocks over the packed rows (the runtime's PyTorch kernel)."""


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
    """Extra cost per varlen segment of a kernel call (a shard on the gathered path, a doc
    piece on the segments path): scheduling and partial-tile epilogues."""
    linear_tflops: float
    """Sustained dense GEMM TFLOP/s for the linear layers."""
    copy_gbps: float
    """Bytes written per second (1e9) by the runtime's gathers and concats around the kernel."""
    op_overhead_us: float
    """Fixed cost of one eager tensor op (launch and dispatch) around the kernel."""
    source: str
    tiling: str = "segment"
    """``segment`` or ``packed`` (TILINGS)."""
    per_tile_us: float = 0.0
    """Fixed cost per tile / block pair visited (the PyTorch kernel's Python loop)."""
    per_row_block_us: float = 0.0
    """Fixed cost per query tile / query block (the PyTorch kernel's outer loop)."""

    def __post_init__(self) -> None:
        if self.tiling not in TILINGS:
            raise ValueError(f"kernel.tiling must be one of {', '.join(TILINGS)}, got {self.tiling!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "source", "tiling"):
                if not isinstance(value, str):
                    raise ValueError(f"kernel.{f.name} must be a string, got {value!r}")
                continue
            low = 1 if f.name in ("tile_q", "tile_k") else 0.0
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= low \
                    or value == float("inf"):
                raise ValueError(f"kernel.{f.name} must be a finite number >= {low}, got {value!r}")
        for name in ("fwd_tflops", "bwd_tflops", "linear_tflops", "copy_gbps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"kernel.{name} must be > 0, got {getattr(self, name)!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkProfile:
    """Latency-bandwidth model of the CP interconnect: t = latency + bytes / bandwidth."""

    name: str
    bandwidth_gbps: float
    """Achieved per-GPU bus bandwidth in GB/s (1e9 bytes/s) for collectives."""
    latency_us: float
    """Fixed cost of one collective or P2P step."""
    source: str
    per_peer_us: float = 0.0
    """Extra fixed cost per peer of a collective (gloo sends to and receives from each of
    the N - 1 peers in turn); 0 where ``latency_us`` already covers a node's ranks."""

    def __post_init__(self) -> None:
        for name in ("bandwidth_gbps", "latency_us", "per_peer_us"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"link.{name} must be a finite number >= 0, got {value!r}")
        if self.bandwidth_gbps <= 0:
            raise ValueError(f"link.bandwidth_gbps must be > 0, got {self.bandwidth_gbps!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


H100_COPY_GBPS = 1500.0
"""H100 SXM HBM3 3.35 TB/s (datasheet); a copy reads and writes each byte, so ~1.5 TB/s
written at ~90% of peak."""
GPU_OP_US = 5.0
"""One small eager CUDA op: ~5 us launch latency (CUDA launch overhead, PyTorch dispatch)."""

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
        copy_gbps=H100_COPY_GBPS,
        op_overhead_us=GPU_OP_US,
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
        copy_gbps=H100_COPY_GBPS,
        op_overhead_us=GPU_OP_US,
        source="FA3 paper arXiv:2407.08608 FA2 baselines; FA2 launch templates",
    ),
    # The runtime's PyTorch kernel on CPU (worker_runtime/kernels.py: blocks of 256 queries
    # x 256 keys over the packed rows, a Python loop per block pair). Order of magnitude for
    # one x86 core in float32; fit it with bench/model_check.py before trusting a figure.
    "cpu-torch": KernelProfile(
        name="cpu-torch",
        fwd_tflops=0.2,
        bwd_tflops=0.1,
        tile_q=256,
        tile_k=256,
        call_overhead_us=50.0,
        per_seq_us=0.0,  # the kernel loops over block pairs, not segments
        linear_tflops=0.5,
        copy_gbps=5.0,
        op_overhead_us=10.0,
        tiling="packed",
        per_tile_us=200.0,
        per_row_block_us=100.0,
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


KERNEL_ENV = "PLANNER_KERNEL_PROFILE"
"""Environment variable declaring the kernel profile the runtime's kernel matches."""
RUNTIME_FLASH_ATTN = "2.8.3"
"""The flash-attn version the runtime is built against (pyproject ``gpu`` extra)."""
FLASH_ATTN_PROFILES = {2: "h100-fa2", 3: "h100-fa3"}
"""flash-attn major version -> the H100 profile of that kernel generation."""


@functools.cache
def flash_attn_version() -> str | None:
    """The installed flash-attn distribution's version, or None (no import of torch;
    looked up once per process: the installed packages do not change under it)."""
    try:
        return metadata.version("flash-attn")
    except metadata.PackageNotFoundError:
        return None


def default_kernel_profile(
    environ: dict[str, str] | None = None, installed: str | None | bool = False
) -> tuple[str, str]:
    """(profile name, why) for the kernel the runtime runs.

    1. Declared: ``PLANNER_KERNEL_PROFILE`` names a profile (ValueError if unknown).
    2. Installed: flash-attn 2.x -> ``h100-fa2``, 3.x -> ``h100-fa3``. The runtime calls
       ``flash_attn.flash_attn_varlen_func`` of whatever flash-attn is installed.
    3. Neither (a planner host without a GPU stack): ``h100-fa2``, because the runtime's
       GPU kernel is flash-attn's varlen function from the ``gpu`` extra, pinned to
       flash-attn 2.8.3 (FA2 kernels).

    ``environ`` and ``installed`` (a version string, None for "not installed") replace
    the process environment and the installed-package lookup in tests.
    """
    env = os.environ if environ is None else environ
    declared = env.get(KERNEL_ENV)
    if declared:
        try:
            get_kernel_profile(declared)
        except ValueError as exc:
            raise ValueError(f"{KERNEL_ENV}: {exc}") from None
        return declared, f"declared by {KERNEL_ENV}"
    version = flash_attn_version() if installed is False else installed
    if isinstance(version, str):
        major = version.split(".")[0]
        name = FLASH_ATTN_PROFILES.get(int(major) if major.isdigit() else -1)
        if name is not None:
            return name, f"flash-attn {version} installed"
    return (FLASH_ATTN_PROFILES[2], f"flash-attn not installed here; the runtime's GPU kernel is "
            f"flash-attn {RUNTIME_FLASH_ATTN} (pyproject gpu extra), FlashAttention-2 kernels")


def default_kernel_name() -> str:
    """The kernel profile of a request that names none: :func:`default_kernel_profile`'s
    choice under this process's environment, read at each call (requests resolve it at
    construction and record it, so a plan names the profile it was estimated with)."""
    return default_kernel_profile()[0]


def kernel_profile_from_dict(data: dict[str, Any]) -> KernelProfile:
    """A KernelProfile from its to_dict form; ValueError naming a missing or bad field."""
    names = {f.name for f in fields(KernelProfile)}
    required = {f.name for f in fields(KernelProfile)
                if f.name not in ("tiling", "per_tile_us", "per_row_block_us")}
    missing = required - set(data)
    if missing:
        raise ValueError(f"kernel profile is missing fields {sorted(missing)}")
    return KernelProfile(**{k: data[k] for k in names if k in data})


def link_profile_from_dict(data: dict[str, Any]) -> LinkProfile:
    """A LinkProfile from its to_dict form; ValueError naming a missing or bad field."""
    names = {f.name for f in fields(LinkProfile)}
    missing = names - set(data) - {"per_peer_us"}
    if missing:
        raise ValueError(f"link profile is missing fields {sorted(missing)}")
    return LinkProfile(**{k: data[k] for k in names if k in data})


def register_profiles(kernel: KernelProfile | None = None, link: LinkProfile | None = None) -> None:
    """Make fitted profiles available by name (replacing a profile of the same name)."""
    if kernel is not None:
        KERNEL_PROFILES[kernel.name] = kernel
    if link is not None:
        LINK_PROFILES[link.name] = link

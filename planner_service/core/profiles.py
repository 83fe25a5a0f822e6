"""Named hardware profiles: attention-kernel and interconnect coefficients.

Every number here is an estimate with its source; ``python -m bench.model_check`` fits
the step-time terms from runs of the worker runtime (``planner_service.core.profile_fit``)
and writes them as a profile JSON (:func:`kernel_profile_from_dict`). Nothing outside
this file hard-codes a hardware number.

The default kernel profile follows the kernel the runtime calls, PyTorch's own
FlashAttention-2 unless declared otherwise (:func:`default_kernel_profile`,
:func:`default_kernel_name`): a request without a kernel profile resolves it when it is built.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import asdict, dataclass, fields, replace
from importlib import metadata
from typing import Any

TILINGS = ("segment", "packed")
"""How a kernel walks its work (core/step_time/): per varlen segment (FlashAttention)
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
H200_COPY_GBPS = 2150.0
"""H200 SXM HBM3e 4.8 TB/s (datasheet); read and write per byte at ~90% of peak."""
GPU_OP_US = 5.0
"""One small eager CUDA op: ~5 us launch latency (CUDA launch overhead, PyTorch dispatch)."""

# FlashAttention-2 on H100 SXM5: ~335 TFLOP/s forward, ~300 TFLOP/s backward at hdim 128
# (FA3 paper's FA2 baselines, Figs. 5-6); fwd tiles 128x64 for causal hdim 128 on sm80+
# (flash_fwd_launch_template.h, run_mha_fwd_hdim128).
H100_FA2 = KernelProfile(
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
)
"""flash-attn's FA2 on H100 (``h100-fa2``); PyTorch's vendored FA2 shares its rates."""

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
    "h100-fa2": H100_FA2,  # flash-attn's FA2, the rates above
    # PyTorch's own FlashAttention-2 (torch.ops.aten._flash_attention_forward/_backward, the
    # runtime's default CUDA kernel, worker_runtime/aten_flash.py) on H100 SXM5. PyTorch
    # vendors flash-attn's FA2 kernels (torch.nn.attention._get_flash_version(): "2.5.7",
    # aten/src/ATen/native/transformers/cuda/flash_attn), so the FA2 figures above apply:
    # the coefficients are h100-fa2's, from the cited benchmarks, not measured here; a GPU
    # fit (bench/gpu_check.py, bench/model_check.py) replaces them.
    "h100-aten-fa2": replace(
        H100_FA2, name="h100-aten-fa2",
        source="PyTorch's vendored FA2 (flash-attn 2.5.7 kernels); rates of the FA3 paper "
               "arXiv:2407.08608 FA2 baselines (cited, not measured here); H100 SXM datasheet",
    ),
    # The same kernels on H200 SXM: the H100's compute (132 SMs, 989 dense bf16 TFLOP/s,
    # NVIDIA H200 datasheet), so the compute-bound attention and GEMM rates are H100's;
    # HBM3e 4.8 TB/s raises the copy rate (H200_COPY_GBPS). Cited, not measured here.
    "h200-aten-fa2": replace(
        H100_FA2, name="h200-aten-fa2", copy_gbps=H200_COPY_GBPS,
        source="PyTorch's vendored FA2 (flash-attn 2.5.7 kernels); rates of the FA3 paper "
               "arXiv:2407.08608 FA2 baselines (cited, not measured here); H200 SXM datasheet",
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
RUNTIME_DEFAULT_PROFILE = "h100-aten-fa2"
"""The profile of the runtime's default CUDA kernel, PyTorch's own FlashAttention-2, where
nothing tells which GPU or impl runs it."""
ATEN_PROFILES = {("FA2", "H100"): "h100-aten-fa2", ("FA2", "H200"): "h200-aten-fa2",
                 ("FA3", "H100"): "h100-fa3", ("FA3", "H200"): "h100-fa3"}
"""(FlashAttention impl behind PyTorch's ops, GPU) -> profile. FA3 through PyTorch runs the
flash_attn_3 package's kernels: the FA3 profile (H200: the H100's compute). FA4 has no
profile yet: declare one."""
FLASH_ATTN_PROFILES = {2: "h100-fa2", 3: "h100-fa3"}
"""flash-attn major version -> the H100 profile of that kernel generation (the opt-in
``flash`` kernel: declare it with PLANNER_KERNEL_PROFILE when the runtime runs it)."""


@functools.cache
def flash_attn_version() -> str | None:
    """The installed flash-attn distribution's version, or None (no import of torch;
    looked up once per process: the installed packages do not change under it)."""
    try:
        return metadata.version("flash-attn")
    except metadata.PackageNotFoundError:
        return None


def aten_profile(impl: str, device_name: str) -> tuple[str, str]:
    """(profile, why) for PyTorch's FlashAttention under ``impl`` (``FA2``, ``FA3``, ``FA4``)
    on the GPU named ``device_name`` (``torch.cuda.get_device_name``)."""
    gpu = next((g for g in ("H200", "H100") if g in device_name.upper()), None)
    if gpu is None:
        return (RUNTIME_DEFAULT_PROFILE, f"PyTorch's FlashAttention {impl} on {device_name}, a GPU "
                f"with no profile here; priced as H100 FA2 (declare one with {KERNEL_ENV})")
    name = ATEN_PROFILES.get((impl, gpu))
    if name is None:
        return (f"{gpu.lower()}-aten-fa2", f"PyTorch's FlashAttention runs {impl} on {device_name}, "
                f"which has no profile here; priced as FA2 (declare one with {KERNEL_ENV})")
    return name, f"PyTorch's FlashAttention {impl} on {device_name}"


def _this_process() -> tuple[str, str] | None:
    """(impl, GPU name) when this process already runs torch with CUDA initialised (a
    training job planning in-process); never imports torch or initialises CUDA."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return None
        import torch.nn.attention as tna

        current = getattr(tna, "current_flash_attention_impl", None)
        impl = (current() if current is not None else None) or "FA2"
        return impl, torch.cuda.get_device_name()
    except Exception:  # noqa: BLE001 - a half-initialised torch tells nothing
        return None


def default_kernel_profile(
    environ: dict[str, str] | None = None, runtime: tuple[str, str] | None | bool = False
) -> tuple[str, str]:
    """(profile name, why) for the kernel the runtime runs.

    1. Declared: ``PLANNER_KERNEL_PROFILE`` names a profile (ValueError if unknown); the
       way to plan for the opt-in flash-attn kernel (``h100-fa2``, ``h100-fa3``), a fitted
       profile or another GPU.
    2. This process runs CUDA (torch imported, CUDA initialised): PyTorch's FlashAttention
       impl and GPU here (:func:`aten_profile`).
    3. Otherwise ``h100-aten-fa2``: the runtime's default CUDA kernel is PyTorch's own
       FlashAttention-2, whatever else is installed (flash-attn is opt-in).

    ``environ`` and ``runtime`` ((impl, GPU name), None for "no CUDA here") replace the
    process environment and the in-process look-up in tests.
    """
    env = os.environ if environ is None else environ
    declared = env.get(KERNEL_ENV)
    if declared:
        try:
            get_kernel_profile(declared)
        except ValueError as exc:
            raise ValueError(f"{KERNEL_ENV}: {exc}") from None
        return declared, f"declared by {KERNEL_ENV}"
    here = _this_process() if runtime is False else runtime
    if isinstance(here, tuple):
        return aten_profile(*here)
    return (RUNTIME_DEFAULT_PROFILE, "the runtime's default CUDA kernel is PyTorch's own "
            "FlashAttention-2 (torch.ops.aten._flash_attention_*); no GPU here to tell H100 "
            f"from H200 (declare another with {KERNEL_ENV})")


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

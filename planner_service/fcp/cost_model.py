"""FCP cost model (FCP paper, arXiv:2602.21788, section 4.3, equations 7 to 10).

A CP group ``G`` of degree ``d`` holds sequences ``k`` (each a run of documents, causal
inside each document). With ``S = sum_k |s_k|`` its tokens and
``W = sum_k (1 + eta_k) sum_{doc in k} L_doc^2`` its attention units (eq. 8 with document
masks: a packed sequence attends only inside its documents, so ``|s_k|^2`` becomes the sum
of squared document lengths; ``eta_k = 0`` for causal attention, ``eta_full`` for full),
the per-layer forward+backward time of one rank of the group is::

    memory  M(G)   = S / d                    tokens per rank, must be <= E      (eq. 7)
    compute T_cp   = (alpha1 W + alpha2 S) / d + beta1                         (eq. 8)
    comm    T_cm   = alpha3 S (d - 1) / d / v(d) + beta2      (0 when d = 1)     (eq. 9)
    total   T      = T_cp + T_cm - H                                           (eq. 10)

``S (d - 1) / d`` is what a rank of a ring receives (every other rank's chunk); the paper
writes ``|s_k|``, which is the same up to that factor. ``v(d)`` is the group's P2P
bandwidth (the paper's ``v_p``): intra-node when the group fits in one node, inter-node
otherwise (groups are placed node-aligned when they fit).

``H``, the hidden part of the exchange, follows what the worker runtime hides on the path
a profile describes (the path model's ``hides``, core/step_time/), not the paper's
``min(T_cpa, T_cma)``. ``T_cma`` is three equal transfers (forward K/V, backward K/V,
backward dK/dV: ``alpha3 = 3`` K/V bytes per token, a ring's), ``T_cpa = alpha1 W / d``,
``phi`` the forward share of a call (``forward_share``):

- ``"local"`` (flash-attn's segments path, the gather modes): K/V forward and dK/dV back
  (the backward K/V third counts as hidden), hidden behind the forward and the backward
  share of the rank's attention on its own keys, taken as 1/d of the keys its queries
  see: ``H = T_cma / 3 + min(T_cma / 3, phi T_cpa / d) + min(T_cma / 3, (1 - phi) T_cpa / d)``;
- ``"none"`` (flash-attn's gathered path: blocking exchange): ``H = 0``;
- ``"ring"`` (the PyTorch kernel's ring, flash-attn's segment ring): the backward K/V
  travels beside the dK/dV accumulators (hidden), the forward K/V hides behind the forward
  attention of all but the last step, d - 2 of the d - 1 accumulators behind the next
  step's backward attention (the last is waited for after the loop):
  ``H = T_cma / 3 + min(T_cma / 3, phi T_cpa (d - 1) / d)
  + min(T_cma (d - 2) / (3 (d - 1)), (1 - phi) T_cpa (d - 2) / d)``.

All times are ms per transformer layer, forward plus backward (a step is this times the
layer count, which changes no decision).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import numpy as np

from planner_service.core.model import ModelSpec
from planner_service.core.paths import ExecutionPath
from planner_service.core.profiles import (
    KernelProfile,
    LinkProfile,
    default_kernel_name,
    get_kernel_profile,
    get_link_profile,
)
from planner_service.core.step_time import (
    BWD_FLOP_RATIO,
    PATH_MODELS,
    execution_path,
    forward_share,
    linear_ms,
)

PROFILE_FORMAT = "cp-planner-fcp-profile/v1"
OVERLAPS = ("none", "ring", "local")
"""What the runtime hides of a group's exchange (module docstring)."""
OPTIONAL = {"overlap": "none", "forward_share": 0.0}
"""Fields a profile dict may leave out, with their defaults (profiles written before them:
nothing hidden, as on the gathered flash path)."""
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class FcpProfile:
    """Coefficients of equations 8 to 10, per transformer layer, forward + backward.

    Raises ValueError naming the field for a negative, non-finite or missing value.
    """

    name: str
    alpha1: float
    """ms per attention unit (squared doc length, causal): quadratic attention compute."""
    eta_full: float
    """Extra attention compute of full over causal masking: full does (1 + eta) x."""
    alpha2: float
    """ms per token: linear layers and the per-token part of attention."""
    beta1: float
    """ms fixed per group step (kernel launches, scheduling)."""
    alpha3: float
    """Bytes on the wire per token a rank receives in the ring exchange (fwd KV, bwd KV + dKV)."""
    bandwidth_gbps: float
    """P2P bandwidth inside one node, GB/s (1e9 bytes/s)."""
    inter_node_bandwidth_gbps: float
    """P2P bandwidth of a group spanning nodes, GB/s."""
    ranks_per_node: int
    """Ranks (model replicas) per node: a group of at most this many stays intra-node."""
    beta2: float
    """ms fixed per ring exchange (link latency), only for degree > 1."""
    source: str
    """Where the numbers come from (derivation or fit)."""
    overlap: str = "none"
    """What the runtime hides of the exchange (OVERLAPS, module docstring; a path model's
    ``hides``): ``local`` (segments path), ``none`` (gathered) or ``ring`` (the rings)."""
    forward_share: float = 0.0
    """The forward pass's share of attention time (``ring``, ``local``;
    step_time.forward_share)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "source"):
                if not isinstance(value, str):
                    raise ValueError(f"profile.{f.name} must be a string, got {value!r}")
                continue
            if f.name == "overlap":
                if value not in OVERLAPS:
                    raise ValueError(f"profile.overlap must be one of {', '.join(OVERLAPS)}, "
                                     f"got {value!r}")
                continue
            if f.name == "ranks_per_node":
                if type(value) is not int or not 1 <= value <= 1 << 20:
                    raise ValueError(f"profile.ranks_per_node must be an integer >= 1, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"profile.{f.name} must be a number, got {value!r}")
            positive = f.name in ("bandwidth_gbps", "inter_node_bandwidth_gbps")
            if not math.isfinite(value) or value < 0 or (positive and value == 0) or (
                    f.name == "forward_share" and value > 1):
                need = "> 0" if positive else "in [0, 1]" if f.name == "forward_share" else ">= 0"
                raise ValueError(f"profile.{f.name} must be finite and {need}, got {value!r}")
            object.__setattr__(self, f.name, float(value))

    def bandwidth_for(self, degree: int) -> float:
        """v(d): intra-node bandwidth if a group of ``degree`` fits in a node, else inter-node."""
        return self.bandwidth_gbps if degree <= self.ranks_per_node else self.inter_node_bandwidth_gbps

    def to_dict(self) -> dict[str, Any]:
        return {"format": PROFILE_FORMAT, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FcpProfile:
        """Parse a profile dict (``to_dict`` form); raises ValueError naming a bad field."""
        if not isinstance(data, dict):
            raise ValueError("profile must be a JSON object")
        if data.get("format", PROFILE_FORMAT) != PROFILE_FORMAT:
            raise ValueError(f"profile.format must be {PROFILE_FORMAT!r}, got {data.get('format')!r}")
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names - {"format", "fit"}
        if unknown:
            raise ValueError(f"profile has unknown fields {sorted(unknown)}")
        missing = names - set(data) - set(OPTIONAL)
        if missing:
            raise ValueError(f"profile is missing fields {sorted(missing)}")
        return cls(**{k: data[k] for k in names if k in data})


def profile_path(kernel: KernelProfile) -> ExecutionPath:
    """The path whose overlap a derived profile takes: flash-attn's default flash path, where
    FCP's own (gather-mode) exchange runs, not the segment ring of a ``p2p_ring`` plan; the
    PyTorch kernel's ring (FCP's groups are rings)."""
    return execution_path(kernel, "p2p_ring" if kernel.tiling == "packed" else "alltoallv")


def derive_profile(
    name: str, *, kernel: KernelProfile, link: LinkProfile, inter_link: LinkProfile,
    model: ModelSpec, ranks_per_node: int,
) -> FcpProfile:
    """Coefficients from a kernel and link profile and a model shape (first principles).

    alpha1: a causal doc of length L has L(L+1)/2 ~ L^2/2 query-key pairs, 4 x heads x
    head_dim forward FLOPs each, backward 2.5x the forward FLOPs (FlashAttention-2 paper):
    ``0.5 * 4 H D (1/fwd + 2.5/bwd)`` seconds per L^2. eta_full = 1: full masking computes
    L^2 pairs, twice the causal count. alpha2: linear-layer FLOPs per token (6 x params,
    ModelSpec.linear_flops_per_token) at the dense GEMM rate. beta1: one kernel launch
    sequence. alpha3: ring attention moves each remote KV block once forward and KV plus
    dKV backward, 3 x the KV bytes of a token. beta2: one link latency per pass (fwd, bwd).
    overlap: what the runtime hides with this kernel on :func:`profile_path` (the path
    model's ``hides``, step_time.PATH_MODELS: ``ring`` for the PyTorch kernel's ring,
    ``local`` for flash-attn's segments path).
    """
    pair_flops = 4.0 * model.num_heads * model.head_dim
    per_flop_s = 1.0 / (kernel.fwd_tflops * 1e12) + BWD_FLOP_RATIO / (kernel.bwd_tflops * 1e12)
    return FcpProfile(
        name=name,
        alpha1=0.5 * pair_flops * per_flop_s * 1e3,
        eta_full=1.0,
        alpha2=linear_ms(1, model, kernel),
        beta1=kernel.call_overhead_us * 1e-3,
        alpha3=3.0 * model.kv_bytes_per_token,
        bandwidth_gbps=link.bandwidth_gbps,
        inter_node_bandwidth_gbps=inter_link.bandwidth_gbps,
        ranks_per_node=ranks_per_node,
        beta2=2.0 * link.latency_us * 1e-3,
        overlap=PATH_MODELS[profile_path(kernel)].hides,
        forward_share=forward_share(kernel),
        source=(
            f"derived (fcp/cost_model.py derive_profile) from kernel {kernel.name} ({kernel.source}), "
            f"link {link.name} ({link.source}), inter-node {inter_link.name}, model {model.to_dict()}"
        ),
    )


DEBUG_MODEL = ModelSpec(num_heads=4, num_kv_heads=2, head_dim=32, hidden_size=128, ffn_hidden_size=256)
"""A tiny model shape for CPU estimates (what a CPU runtime test might run)."""

PROFILES: dict[str, FcpProfile] = {
    # Llama-3-8B on H100 SXM with FlashAttention-3; 8 replicas per node on NVLink, NDR
    # InfiniBand across nodes. The default where flash-attn 3 is installed (KERNEL_DEFAULTS).
    "h100-llama3-8b": derive_profile(
        "h100-llama3-8b", kernel=get_kernel_profile("h100-fa3"), link=get_link_profile("nvlink"),
        inter_link=get_link_profile("infiniband"), model=ModelSpec(), ranks_per_node=8,
    ),
    # Same with FlashAttention-2 kernels (about half the attention throughput): the default
    # of the runtime's pinned flash-attn 2.
    "h100-llama3-8b-fa2": derive_profile(
        "h100-llama3-8b-fa2", kernel=get_kernel_profile("h100-fa2"), link=get_link_profile("nvlink"),
        inter_link=get_link_profile("infiniband"), model=ModelSpec(), ranks_per_node=8,
    ),
    # Same with PyTorch's own FlashAttention-2 (the runtime's default CUDA kernel), on H100
    # and on H200: the FA2 coefficients (cited, not measured here; core/profiles.py).
    "h100-llama3-8b-aten-fa2": derive_profile(
        "h100-llama3-8b-aten-fa2", kernel=get_kernel_profile("h100-aten-fa2"),
        link=get_link_profile("nvlink"), inter_link=get_link_profile("infiniband"),
        model=ModelSpec(), ranks_per_node=8,
    ),
    "h200-llama3-8b-aten-fa2": derive_profile(
        "h200-llama3-8b-aten-fa2", kernel=get_kernel_profile("h200-aten-fa2"),
        link=get_link_profile("nvlink"), inter_link=get_link_profile("infiniband"),
        model=ModelSpec(), ranks_per_node=8,
    ),
    # Every group crosses InfiniBand (one GPU per node, or a worst case).
    "h100-llama3-8b-ib": derive_profile(
        "h100-llama3-8b-ib", kernel=get_kernel_profile("h100-fa3"), link=get_link_profile("infiniband"),
        inter_link=get_link_profile("infiniband"), model=ModelSpec(), ranks_per_node=1,
    ),
    # CPU processes on gloo loopback with a tiny model; order of magnitude, re-fit first.
    "cpu-gloo": derive_profile(
        "cpu-gloo", kernel=get_kernel_profile("cpu-torch"), link=get_link_profile("gloo-local"),
        inter_link=get_link_profile("gloo-local"), model=DEBUG_MODEL, ranks_per_node=1 << 20,
    ),
}
KERNEL_DEFAULTS = {"h100-fa3": "h100-llama3-8b", "h100-fa2": "h100-llama3-8b-fa2",
                   "cpu-torch": "cpu-gloo", "h100-aten-fa2": "h100-llama3-8b-aten-fa2",
                   "h200-aten-fa2": "h200-llama3-8b-aten-fa2"}
"""The FCP profile derived from each kernel profile (the default follows the kernel)."""


def default_profile_name() -> str:
    """The FCP profile of the runtime's kernel (core.profiles.default_kernel_name); an
    unknown PLANNER_KERNEL_PROFILE gives the flash-attn 2 profile here (this runs at import)
    and fails every request that relies on it, naming the variable."""
    try:
        kernel = default_kernel_name()
    except ValueError:
        kernel = "h100-fa2"
    return KERNEL_DEFAULTS.get(kernel, "h100-llama3-8b")


DEFAULT_PROFILE = default_profile_name()
"""Resolved once at import (parameter defaults across fcp, solvers and cli use it)."""


def read_json_file(path: str | Path, what: str, parse: Callable[[Any], T]) -> T:
    """``parse(json of path)``; ValueError naming ``what`` and the path on any failure."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{what} file {path} is not readable JSON: {exc}") from None
    try:
        return parse(data)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{what} file {path}: {exc}") from None


def load_profile(path: str | Path) -> FcpProfile:
    """Read a profile JSON written by ``planner fit-profile``; ValueError naming the path."""
    return read_json_file(path, "profile", FcpProfile.from_dict)


_PROFILE_FILES_ALLOWED = True
"""Whether ``file:PATH`` specs may be opened in this process (see forbid_profile_files)."""


def forbid_profile_files() -> None:
    """Refuse ``file:PATH`` profile specs in this process from now on (the service's solver
    processes call this: a request must never make the server open a path)."""
    global _PROFILE_FILES_ALLOWED
    _PROFILE_FILES_ALLOWED = False


def get_profile(spec: str | dict[str, Any] | FcpProfile) -> FcpProfile:
    """A profile by name, by value (a dict in ``to_dict`` form), ``file:PATH`` (a fitted
    profile JSON; local use only, refused after forbid_profile_files), or the object itself.

    Raises ValueError listing the valid names for an unknown one.
    """
    if isinstance(spec, FcpProfile):
        return spec
    if isinstance(spec, dict):
        return FcpProfile.from_dict(spec)
    if not isinstance(spec, str):
        raise ValueError(f"profile must be a name, a profile object or 'file:PATH', got {spec!r}")
    if spec.startswith("file:"):
        if not _PROFILE_FILES_ALLOWED:
            raise ValueError("profile 'file:...' is not accepted here: send the profile by "
                             f"value (a JSON object) or by name ({', '.join(sorted(PROFILES))})")
        return load_profile(spec.removeprefix("file:"))
    try:
        return PROFILES[spec]
    except KeyError:
        raise ValueError(
            f"profile {spec[:64]!r} is unknown; valid: {', '.join(sorted(PROFILES))}, a profile "
            "object or 'file:PATH'"
        ) from None


# ---------------------------------------------------------------------------------------
# Evaluation: a readable scalar reference and the vectorised table the solvers use.


def attention_units(doc_lengths: Any, *, full: bool, profile: FcpProfile) -> float:
    """W of one sequence: ``(1 + eta) * sum L^2`` (eta = 0 causal, eta_full for full)."""
    squares = float(np.square(np.asarray(doc_lengths, dtype=np.float64)).sum())
    return (1.0 + (profile.eta_full if full else 0.0)) * squares


class GroupTime(NamedTuple):
    """The terms of eq. 10 for one group at one degree (ms)."""

    compute_ms: float
    comm_ms: float
    overlap_ms: float
    """H: the part of the exchange the runtime hides (module docstring)."""
    total_ms: float


def hidden_ms(attn: Any, wire: Any, degree: Any, profile: FcpProfile) -> Any:
    """H for attention ``attn`` (alpha1 W / d) and bandwidth time ``wire`` (arrays allowed)."""
    if profile.overlap == "none":
        return 0.0 * wire
    third = wire / 3.0
    phi = profile.forward_share
    if profile.overlap == "local":
        own = attn / degree  # the rank's attention on its own keys
        return third + np.minimum(third, phi * own) + np.minimum(third, (1 - phi) * own)
    late = np.maximum(degree - 2, 0)  # accumulators waited for behind a later step's call
    return (third + np.minimum(third, phi * attn * (degree - 1) / degree)
            + np.minimum(third * late / (degree - 1), (1 - phi) * attn * late / degree))


def group_time(tokens: float, units: float, degree: int, profile: FcpProfile) -> GroupTime:
    """Eq. 8-10 for one group, written out term by term (the reference for ``time_table``)."""
    attn = profile.alpha1 * units / degree
    compute = attn + profile.alpha2 * tokens / degree + profile.beta1
    if degree == 1:
        return GroupTime(compute, 0.0, 0.0, compute)
    wire = profile.alpha3 * tokens * (degree - 1) / degree / (profile.bandwidth_for(degree) * 1e6)
    comm = wire + profile.beta2
    overlap = float(hidden_ms(attn, wire, degree, profile))
    return GroupTime(compute, comm, overlap, compute + comm - overlap)


def time_table(
    tokens: np.ndarray, units: np.ndarray, num_ranks: int, memory_tokens: int, profile: FcpProfile
) -> np.ndarray:
    """T(G_i, d) for every group i and degree d in [0, num_ranks], shape (K, N + 1).

    Column 0 and every degree below the group's memory minimum ``ceil(S_i / E)`` are inf.
    """
    tokens = np.asarray(tokens, dtype=np.float64)[:, None]
    units = np.asarray(units, dtype=np.float64)[:, None]
    d = np.arange(num_ranks + 1, dtype=np.float64)[None, :]
    total = times_at(tokens, units, d, memory_tokens, profile)
    total[:, 0] = np.inf
    return total


def times_at(
    tokens: np.ndarray, units: np.ndarray, d: np.ndarray, memory_tokens: int, profile: FcpProfile
) -> np.ndarray:
    """T(G, d) elementwise for broadcastable float64 ``tokens``, ``units`` and degrees
    ``d`` >= 1 (``time_table``'s entries, bit for bit: the same operations on each
    element); inf below the memory minimum."""
    with np.errstate(divide="ignore", invalid="ignore"):
        attn = profile.alpha1 * units / d
        compute = attn + profile.alpha2 * tokens / d + profile.beta1
        bw = np.where(d <= profile.ranks_per_node, profile.bandwidth_gbps,
                      profile.inter_node_bandwidth_gbps) * 1e6
        wire = profile.alpha3 * tokens * (d - 1) / d / bw
        total = np.where(
            d > 1, compute + wire + profile.beta2 - hidden_ms(attn, wire, d, profile), compute
        )
        return np.where(tokens <= d * memory_tokens, total, np.inf)

"""Fit an FCP cost profile from measured timings (the paper's offline profiler, section 3).

Timings format (JSON; the worker runtime's profiler writes it)::

    {"format": "cp-planner-timings/v1", "device": "<text>", "dtype": "bfloat16",
     "model": {...ModelSpec fields...},
     "records": [
       {"op": "attention", "seq_tokens": 8192, "degree": 2, "causal": true,
        "num_docs": 4, "ms": 1.9},
       {"op": "comm", "seq_tokens": 8192, "degree": 2, "bytes": 8388608, "ms": 0.4},
       {"op": "linear", "tokens": 4096, "ms": 8.1}
     ]}

* ``attention``: forward+backward attention kernel time on one rank for a sequence of
  ``seq_tokens`` split over ``degree`` ranks, ``num_docs`` documents of equal length (the
  first ``seq_tokens % num_docs`` one token longer) unless ``doc_lengths`` lists them;
  ``causal`` false means full attention.
* ``comm``: one forward KV exchange of one rank (``bytes`` received in ``ms``), as
  worker_runtime/profiler.py measures it; optional ``"inter_node": true`` when the ranks
  are on different nodes. A training step moves that volume three times (forward KV,
  backward KV and dKV) and pays the latency twice (forward, backward pass), so the fit
  scales alpha3 by ``comm_volume_factor`` (3) and beta2 by ``comm_latency_factor`` (2).
* ``linear`` (optional): forward+backward time of one layer's linear layers for ``tokens``
  tokens on one rank.

Fitted terms (least squares on relative error, so short and long runs weigh alike):
``ms_attn = alpha1 U_causal / d + alpha1 (1 + eta) U_full / d + a2_attn S / d + beta1``,
``ms_linear = a2_lin tokens``, ``ms_comm = bytes / v + beta2 / 2`` and
``bytes = alpha3 / 3 * S (d - 1) / d``; then ``alpha2 = a2_attn + a2_lin``. Terms without
records keep the base profile's value and say so.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from planner_service.fcp.cost_model import FcpProfile, read_json_file

TIMINGS_FORMAT = "cp-planner-timings/v1"
OPS = ("attention", "comm", "linear")


class TermFit(NamedTuple):
    """One fitted coefficient and its relative standard error."""

    name: str
    value: float
    rel_error: float | None
    """Standard error / value from the least-squares covariance; None if not fitted."""
    how: str
    """``fitted (n records)`` or ``kept from <base profile>``."""


class FitReport(NamedTuple):
    profile: FcpProfile
    terms: tuple[TermFit, ...]
    residual_pct: dict[str, float]
    """RMS relative residual per op, in percent."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "terms": {t.name: {"value": t.value, "rel_error": t.rel_error, "how": t.how}
                      for t in self.terms},
            "residual_pct": self.residual_pct,
        }


def _num(record: dict[str, Any], key: str, where: str, lo: float = 0.0) -> float:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}.{key} must be a finite number, got {value!r}")
    if value < lo:
        raise ValueError(f"{where}.{key} must be >= {lo}, got {value}")
    return float(value)


def _int(record: dict[str, Any], key: str, where: str, lo: int = 1) -> int:
    value = record.get(key)
    if type(value) is not int or value < lo:
        raise ValueError(f"{where}.{key} must be an integer >= {lo}, got {value!r}")
    return value


def check_timings(data: Any) -> list[dict[str, Any]]:
    """Validate a timings document; return its records. ValueError names the bad field."""
    if not isinstance(data, dict):
        raise ValueError("timings must be a JSON object")
    if data.get("format") != TIMINGS_FORMAT:
        raise ValueError(f"timings.format must be {TIMINGS_FORMAT!r}, got {data.get('format')!r}")
    records = data.get("records")
    if not isinstance(records, list) or not records:
        raise ValueError("timings.records must be a non-empty list")
    for i, rec in enumerate(records):
        where = f"records[{i}]"
        if not isinstance(rec, dict) or rec.get("op") not in OPS:
            raise ValueError(f"{where}.op must be one of {', '.join(OPS)}")
        _num(rec, "ms", where)
        if rec["op"] == "linear":
            _int(rec, "tokens", where)
            continue
        _int(rec, "seq_tokens", where)
        _int(rec, "degree", where)
        if rec["op"] == "comm":
            _num(rec, "bytes", where)
            continue
        if not isinstance(rec.get("causal"), bool):
            raise ValueError(f"{where}.causal must be true or false")
        docs = rec.get("doc_lengths")
        if docs is not None:
            if not isinstance(docs, list) or sum(docs) != rec["seq_tokens"] or any(
                type(x) is not int or x < 1 for x in docs
            ):
                raise ValueError(f"{where}.doc_lengths must be positive integers summing to seq_tokens")
        else:
            _int(rec, "num_docs", where)
            if rec["num_docs"] > rec["seq_tokens"]:
                raise ValueError(f"{where}.num_docs must be <= seq_tokens")
    return records


def load_timings(path: str | Path) -> dict[str, Any]:
    """Read and validate a timings file; ValueError naming the path and the field."""
    def parse(data: Any) -> dict[str, Any]:
        check_timings(data)
        return data

    return read_json_file(path, "timings", parse)


def record_units(rec: dict[str, Any]) -> float:
    """Sum of squared doc lengths of an attention record (equal docs unless listed)."""
    if rec.get("doc_lengths") is not None:
        return float(sum(x * x for x in rec["doc_lengths"]))
    s, n = rec["seq_tokens"], rec["num_docs"]
    base, extra = divmod(s, n)
    return float(extra * (base + 1) ** 2 + (n - extra) * base**2)


def _lstsq(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Least squares on relative error: rows divided by y. Returns (coef, rel stderr, rms %)."""
    w = 1.0 / y
    xw, yw = x * w[:, None], y * w
    coef, *_ = np.linalg.lstsq(xw, yw, rcond=None)
    resid = yw - xw @ coef
    dof = max(1, len(y) - x.shape[1])
    sigma2 = float(resid @ resid) / dof
    cov = sigma2 * np.linalg.pinv(xw.T @ xw)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.sqrt(np.maximum(np.diag(cov), 0.0)) / np.abs(coef)
    return coef, rel, float(np.sqrt(np.mean(resid**2)) * 100)


def fit_profile(
    timings: dict[str, Any], *, name: str, base: FcpProfile, comm_volume_factor: float = 3.0,
    comm_latency_factor: float = 2.0,
) -> FitReport:
    """Fit every term that has records; the others come from ``base``.

    Raises ValueError if the timings are malformed or lack causal attention records.
    """
    records = check_timings(timings)
    attn = [r for r in records if r["op"] == "attention"]
    causal = [r for r in attn if r["causal"]]
    if len(causal) < 3:
        raise ValueError("timings need at least 3 causal attention records to fit alpha1 and beta1")
    terms: list[TermFit] = []
    residual: dict[str, float] = {}
    fields: dict[str, float] = {}

    # Attention: columns U_causal/d, U_full/d (if any full records), S/d, 1.
    has_full = any(not r["causal"] for r in attn)
    rows = []
    for r in attn:
        u, d, s = record_units(r), r["degree"], r["seq_tokens"]
        row = [u / d if r["causal"] else 0.0]
        if has_full:
            row.append(0.0 if r["causal"] else u / d)
        rows.append(row + [s / d, 1.0])
    coef, rel, residual["attention"] = _lstsq(np.array(rows), np.array([r["ms"] for r in attn]))
    how = f"fitted ({len(attn)} attention records)"
    fields["alpha1"] = float(coef[0])
    terms.append(TermFit("alpha1", fields["alpha1"], float(rel[0]), how))
    if has_full:
        fields["eta_full"] = float(coef[1] / coef[0] - 1.0)
        terms.append(TermFit("eta_full", fields["eta_full"], float(math.hypot(rel[0], rel[1])), how))
    else:
        terms.append(TermFit("eta_full", base.eta_full, None, f"kept from {base.name} (no full-attention records)"))
    a2_attn, beta1 = float(coef[-2]), float(coef[-1])
    terms.append(TermFit("alpha2_attn", a2_attn, float(rel[-2]), how))
    terms.append(TermFit("beta1", beta1, float(rel[-1]), how))

    linear = [r for r in records if r["op"] == "linear"]
    if len(linear) >= 2:
        # Through the origin: GEMM launch costs are small next to beta1's kernel launches.
        x = np.array([[r["tokens"]] for r in linear], dtype=np.float64)
        lc, lrel, residual["linear"] = _lstsq(x, np.array([r["ms"] for r in linear]))
        terms.append(TermFit("alpha2_linear", float(lc[0]), float(lrel[0]),
                             f"fitted ({len(linear)} linear records)"))
        fields["alpha2"] = a2_attn + float(lc[0])
    else:
        fields["alpha2"] = a2_attn
        terms.append(TermFit("alpha2_linear", 0.0, None,
                             "not fitted (no linear records): alpha2 covers attention only"))
    fields["beta1"] = beta1
    terms.append(TermFit("alpha2", fields["alpha2"], None, "alpha2_attn + alpha2_linear"))

    comm = [r for r in records if r["op"] == "comm" and r["degree"] > 1 and r["bytes"] > 0]
    for inter, key in ((False, "bandwidth_gbps"), (True, "inter_node_bandwidth_gbps")):
        part = [r for r in comm if bool(r.get("inter_node", False)) == inter]
        if len(part) < 2:
            terms.append(TermFit(key, getattr(base, key), None, f"kept from {base.name} (no records)"))
            continue
        x = np.array([[r["bytes"], 1.0] for r in part], dtype=np.float64)
        cc, crel, residual["comm_inter" if inter else "comm"] = _lstsq(x, np.array([r["ms"] for r in part]))
        chow = f"fitted ({len(part)} comm records)"
        fields[key] = 1.0 / (float(cc[0]) * 1e6)
        terms.append(TermFit(key, fields[key], float(crel[0]), chow))
        if not inter:
            fields["beta2"] = comm_latency_factor * float(cc[1])
            terms.append(TermFit("beta2", fields["beta2"], float(crel[1]), chow))
    if "beta2" not in fields:
        terms.append(TermFit("beta2", base.beta2, None, f"kept from {base.name} (no records)"))
    if len(comm) >= 1:
        xs = np.array([r["seq_tokens"] * (r["degree"] - 1) / r["degree"] for r in comm])
        ys = np.array([r["bytes"] for r in comm], dtype=np.float64)
        per_exchange = float(xs @ ys / (xs @ xs))
        fields["alpha3"] = comm_volume_factor * per_exchange
        spread = float(np.std(ys / xs) / np.sqrt(len(xs))) / per_exchange
        terms.append(TermFit("alpha3", fields["alpha3"], spread, f"fitted ({len(comm)} comm records)"))
    else:
        terms.append(TermFit("alpha3", base.alpha3, None, f"kept from {base.name} (no records)"))

    for key in fields:
        if fields[key] < 0:
            # A negative term is noise around zero: clamp it, and the report shows the fit.
            fields[key] = 0.0
    source = (
        f"fitted by planner fit-profile from {len(records)} records on "
        f"{timings.get('device', 'unknown device')!s}; other terms from {base.name}"
    )
    changes: dict[str, Any] = {**fields, "name": name, "source": source}
    profile = replace(base, **changes)
    return FitReport(profile, tuple(terms), residual)


def synthetic_timings(
    profile: FcpProfile, *, seed: int, noise: float = 0.05, attn_share: float = 0.05,
    repeats: int = 5,
) -> dict[str, Any]:
    """Timings generated from ``profile`` with multiplicative Gaussian noise (tests, docs).

    A grid of sizes (128 to 128K tokens), degrees 1-8, 1 or 4 docs, causal and full,
    each measured ``repeats`` times as a profiler would. ``attn_share`` of alpha2 goes to
    the attention records, the rest to linear records; comm records use the profile's
    alpha3 and intra-node bandwidth.
    """
    rng = np.random.default_rng(seed)
    records: list[dict[str, Any]] = []

    def jitter(ms: float) -> float:
        return float(ms * (1.0 + noise * rng.standard_normal()))

    for s in [128, 256, 512, 1024, 4096, 16384, 65536, 131072] * repeats:
        for d in (1, 2, 4, 8):
            for num_docs in (1, 4):
                for causal in (True, False):
                    rec = {"op": "attention", "seq_tokens": s, "degree": d, "causal": causal,
                           "num_docs": num_docs}
                    u = record_units(rec) * (1.0 if causal else 1.0 + profile.eta_full)
                    ms = (profile.alpha1 * u + attn_share * profile.alpha2 * s) / d + profile.beta1
                    records.append({**rec, "ms": jitter(ms)})
            if d > 1:
                # One forward exchange: a third of the step's volume, half its latency.
                num_bytes = int(round(profile.alpha3 / 3.0 * s * (d - 1) / d))
                ms = num_bytes / (profile.bandwidth_for(d) * 1e6) + profile.beta2 / 2.0
                records.append({"op": "comm", "seq_tokens": s, "degree": d, "bytes": num_bytes,
                                "ms": jitter(ms)})
        records.append({"op": "linear", "tokens": s,
                        "ms": jitter((1.0 - attn_share) * profile.alpha2 * s)})
    return {"format": TIMINGS_FORMAT, "device": f"synthetic from {profile.name}",
            "dtype": "bfloat16", "model": {}, "records": records}

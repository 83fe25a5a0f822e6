"""Every causal-LM family of the installed transformers either trains under the CP runtime
exactly as each document alone in one process, or is refused: no family trains with
silently wrong numbers.

The families come from transformers' own ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, so a new
transformers version shows a new family's behaviour at once. Each family is built from a
tiny float64 config (random weights, 2 layers, hidden 32, 4 heads over 2 KV heads, vocab
96). One spawned world of 2 gloo ranks runs them all: per family, the per-document eager
reference (docs split between the ranks, gradients summed), then ``enable_cp_attention``
and one forward/backward on a flashcp plan of ``DOC_LENGTHS`` (a split document), the
loss and every parameter gradient all-reduced and compared.

Outcomes: ``exact`` (within TOL of the reference), ``refused`` (``enable_cp_attention``
or transformers' ``set_attn_implementation`` raised; the reason is the message),
``refused at call`` (the CP attention raised its one-line refusal in the first forward,
before computing), ``skipped`` (no tiny model builds or runs on CPU from a generic
config, or the reference itself fails; the reason is the error). ``python -m
tests.test_hf_families`` prints the table (docs/training.md carries it).
"""

from __future__ import annotations

import copy
import importlib.util
import math
import os
import sys
import traceback
from typing import Any

import pytest
import torch
from hf_reference import KeepFloat64, lm_loss
from timing import scaled

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                       reason="transformers is not installed (pip install -e '.[hf]')"),
    pytest.mark.slow,
]

DOC_LENGTHS = [5, 17, 9, 30]
WORLD_SIZE = 2
VOCAB = 96
TOL = 1e-12
"""Largest allowed difference of the loss and of any gradient element, relative to the
reference's largest magnitude (at least 1). Under KeepFloat64 every family computes in
float64 and agrees to ~1e-14 or better; a dropped option shows as 1e-8 or (far) more."""

TINY = {
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "max_position_embeddings": 128, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    # MoE and MLA families
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 8, "rotary_dim": 8,
    # no randomness: dropout off everywhere
    "attention_dropout": 0.0, "hidden_dropout": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
    "attn_pdrop": 0.0, "dropout": 0.0, "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0, "router_jitter_noise": 0.0, "use_cache": False,
    "experts_implementation": "eager",  # grouped matmuls take no float64
}


VERBOSE = os.environ.get("CP_FAMILIES_VERBOSE") == "1"
"""Print each family's outcome and time (rank 0, stderr)."""
MAX_PARAMS = 2_000_000
"""A model this large did not take the tiny config (its fields have other names)."""


def families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


class TooLarge(ValueError):
    """The family ignored the tiny config's fields (its own names for them)."""


DROP = object()
VARIANTS: tuple[dict[str, Any], ...] = (
    {}, {"head_dim": DROP}, {"num_key_value_heads": 4}, {"head_dim": DROP, "num_key_value_heads": 4})
"""Changes to TINY tried in order (DROP: leave the family's default): families that derive
the head dim, or have as many KV heads as heads (latent attention); the first variant that
builds and runs 7 tokens wins."""


def build(family: str) -> Any:
    """The family's causal-LM model from a tiny float64 config (seeded), in eval mode, that
    runs a short forward (eager); raises the last variant's error if none does."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from worker_runtime.hf_check import inspect_model

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])
    error: Exception | None = None
    for change in VARIANTS:
        try:
            fields = {**TINY, **change}
            config = cls.config_class(**{k: v for k, v in fields.items() if v is not DROP})
            with torch.device("meta"):  # on a copy: building may write to its config
                size = sum(p.numel() for p in cls(copy.deepcopy(config)).parameters())
            if size > MAX_PARAMS:  # no variant shrinks a model that ignores the fields
                raise TooLarge(f"the generic tiny config is not honoured ({size:,} parameters)")
            torch.manual_seed(0)
            model = cls(config).to(torch.float64)
            model.eval()  # dropout off; gradients still flow
            try:
                inspect_model(model)
            except ValueError:
                return model  # refused: the caller says why, nothing needs to run
            model.set_attn_implementation("eager")
            with torch.no_grad():
                model(input_ids=torch.arange(3, 10)[None], position_ids=torch.arange(7)[None], use_cache=False)
            return model
        except TooLarge:
            raise
        except Exception as exc:  # noqa: BLE001 - try the next variant
            error = exc
    assert error is not None
    raise error


def input_ids() -> torch.Tensor:
    return torch.randint(3, VOCAB, (sum(DOC_LENGTHS),), generator=torch.Generator().manual_seed(1))


def grads(model: Any) -> dict[str, torch.Tensor]:
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in model.named_parameters()}


def reference(model: Any, rank: int, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """This rank's share of the per-document reference (docs ``rank::WORLD_SIZE``), each
    document alone through eager attention; the loss normalised by the global label count."""
    from worker_runtime.hf import next_token_labels

    labels = next_token_labels(ids, DOC_LENGTHS)
    total = int((labels != -100).sum())
    model.set_attn_implementation("eager")
    model.zero_grad(set_to_none=True)
    starts = [0, *torch.cumsum(torch.tensor(DOC_LENGTHS), 0).tolist()]
    loss_sum = 0.0
    for d in range(rank, len(DOC_LENGTHS), WORLD_SIZE):
        lo, hi = starts[d], starts[d + 1]
        logits = model(input_ids=ids[lo:hi][None], position_ids=torch.arange(hi - lo)[None],
                       use_cache=False).logits
        loss = lm_loss(logits, labels[lo:hi], total)
        loss.backward()
        loss_sum += loss.item()
    return loss_sum, grads(model)


def _ours(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by the CP integration (a refusal), not by the model."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and "worker_runtime" in frames[-1].filename


def one_family(family: str, rank: int, plan_json: str) -> dict[str, Any]:
    import torch.distributed as dist

    from planner_service.core.plan import Plan
    from worker_runtime import ContextParallelAttention
    from worker_runtime.hf import enable_cp_attention, prepare_batch, use_cp_attention
    from worker_runtime.hf_check import inspect_model

    try:
        model = build(family)
    except Exception as exc:  # noqa: BLE001 - any failure to build from a generic config
        return {"outcome": "skipped", "reason": f"no tiny model from a generic config: {type(exc).__name__}: {exc}"}
    try:
        inspect_model(model)
    except ValueError as exc:
        return {"outcome": "refused", "reason": str(exc)}
    ids = input_ids()
    try:
        ref_loss, ref_grads = reference(model, rank, ids)
    except Exception as exc:  # noqa: BLE001
        return {"outcome": "skipped", "reason": f"the eager reference fails: {type(exc).__name__}: {exc}"}
    try:
        enable_cp_attention(model)
    except ValueError as exc:
        return {"outcome": "refused", "reason": str(exc)}
    attn = ContextParallelAttention(Plan.from_json(plan_json))
    model.zero_grad(set_to_none=True)
    try:
        batch = prepare_batch(attn, ids)
        labels, total = batch.pop("labels")[0], batch.pop("num_items_in_batch")
        batch.pop("shift_labels")
        with use_cp_attention(attn):
            loss = lm_loss(model(**batch).logits, labels, total)
        loss.backward()
    except ValueError as exc:
        if _ours(exc):
            return {"outcome": "refused at call", "reason": str(exc)}
        return {"outcome": "skipped", "reason": f"the CP forward fails: {type(exc).__name__}: {exc}"}
    except Exception as exc:  # noqa: BLE001 - raised on every rank alike (same model, plan)
        return {"outcome": "skipped", "reason": f"the CP forward fails: {type(exc).__name__}: {exc}"}
    got = grads(model)
    values = torch.tensor([loss.item(), ref_loss], dtype=torch.float64)
    dist.all_reduce(values)
    worst, where = abs(values[0] - values[1]).item() / max(1.0, abs(values[1].item())), "loss"
    for name, g in got.items():
        dist.all_reduce(g)
        dist.all_reduce(ref_grads[name])
        want = ref_grads[name]
        err = (g - want).abs().max().item() / max(1.0, want.abs().max().item()) if g.numel() else 0.0
        if not err <= worst:  # NaN counts as worst
            worst, where = err, name
    if not math.isfinite(worst):
        worst = math.inf
    outcome = "exact" if worst <= TOL else "WRONG"
    return {"outcome": outcome, "reason": f"max error {worst:.1e} ({where})"}


def families_worker(rank: int, world_size: int, plan_json: str, names: list[str]) -> dict[str, dict]:
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    import time

    results = {}
    with KeepFloat64():
        for name in names:
            t0 = time.perf_counter()
            results[name] = one_family(name, rank, plan_json)
            if rank == 0 and VERBOSE:
                print(f"{name}: {results[name]['outcome']} {time.perf_counter() - t0:.2f} s",
                      file=sys.stderr, flush=True)
    if VERBOSE:
        print(f"rank {rank}: {time.process_time():.1f} s CPU", file=sys.stderr, flush=True)
    return results


def family_plan_json() -> str:
    from planner_service.core.model import ModelSpec
    from planner_service.core.request import PlanRequest
    from planner_service.solvers.registry import solve

    plan = solve(PlanRequest(doc_lengths=DOC_LENGTHS, cp_size=WORLD_SIZE, strategy="flashcp",
                             model=ModelSpec(num_heads=4, num_kv_heads=2, head_dim=8, dtype_bytes=8)))
    assert plan.metrics.num_split_docs > 0, "the test needs a document split across the ranks"
    return plan.to_json()


def run_families(names: list[str] | None = None) -> dict[str, dict]:
    from worker_runtime.testing import run_distributed

    names = families() if names is None else names
    per_rank = run_distributed(families_worker, WORLD_SIZE, family_plan_json(), names,
                               timeout_s=scaled(300.0), pg_timeout_s=120.0)
    return per_rank[0]


def table(results: dict[str, dict]) -> str:
    lines = ["| family | outcome | reason |", "|---|---|---|"]
    for name, res in sorted(results.items()):
        reason = res["reason"].replace("|", "/").replace("\n", " ")
        lines.append(f"| {name} | {res['outcome']} | {reason[:300]} |")
    return "\n".join(lines)


def short_reason(res: dict) -> str:
    """The refusal's option and cause (before the advice), or the error's first line."""
    text = res["reason"].replace("|", "/").splitlines()[0]
    return text.split("; ")[0][:160]


def summary(results: dict[str, dict]) -> str:
    """The markdown docs/training.md carries: families by outcome, with reasons."""
    by: dict[str, list[str]] = {}
    for name, res in sorted(results.items()):
        by.setdefault(res["outcome"], []).append(name)
    parts = [f"**Run exactly** ({len(by.get('exact', []))}): " + ", ".join(by.get("exact", [])) + "."]
    for outcome, title in (("refused", "Refused by `enable_cp_attention`"),
                           ("refused at call", "Refused by the attention function (first forward, "
                                               "before any attention runs)"),
                           ("skipped", "Not tested: no tiny model from a generic config on CPU"),
                           ("WRONG", "WRONG (a bug: numbers off the reference)")):
        names = by.get(outcome, [])
        if names:
            parts.append(f"**{title}** ({len(names)}):\n\n| family | why |\n|---|---|\n"
                         + "\n".join(f"| {n} | {short_reason(results[n])} |" for n in names))
    return "\n\n".join(parts)


def test_every_family_matches_the_reference_or_is_refused() -> None:
    results = run_families()
    wrong = {n: r for n, r in results.items() if r["outcome"] == "WRONG"}
    assert not wrong, "families with silently wrong numbers:\n" + table(wrong)
    exact = [n for n, r in results.items() if r["outcome"] == "exact"]
    assert "llama" in exact and "gpt_oss" in exact, table(results)


if __name__ == "__main__":
    # python tests/test_hf_families.py [--markdown] [family ...]
    args = sys.argv[1:]
    markdown = "--markdown" in args
    found = run_families([a for a in args if a != "--markdown"] or None)
    print(summary(found) if markdown else table(found))

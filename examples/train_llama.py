"""Train a tiny Llama with context parallelism, planning batch k+1 while batch k trains.

    torchrun --nproc-per-node 4 examples/train_llama.py --steps 20 --seq-len 8192

Runs unchanged on CPU (gloo, the exact torch kernel) and on GPUs (NCCL, PyTorch's
FlashAttention in bf16). Each step packs documents of a data set (the shared WLB-LLM lengths by default)
into one sequence per CP group with synthetic tokens, gets the step's plan (prefetched
one step earlier) through ``PlanAgreement`` (fetched on the group's first rank and
broadcast, so every rank runs the same plan, the service's or the fallback), applies it
to a Hugging Face Llama through ``worker_runtime.hf``, runs forward, backward and an
AdamW step. World size = data-parallel replicas x ``--cp-size``.

Per step, rank 0 prints loss, step time, plan wait, fallback, plan_id, imbalance and the
KV bytes it moved; ``--log-dir`` gets every rank's steps as JSON lines (``rank<R>.jsonl``)
and ``summary.json``. ``--planner-url http://...`` or ``grpc://...`` plans with a
running ``planner serve``; the default plans in-process (``embedded``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from planner_service.client import PlanClient
from planner_service.client.agreement import PlanAgreement
from planner_service.data import make_source, pack_sequences
from worker_runtime import CommCounter, ContextParallelAttention
from worker_runtime.hf import (
    enable_cp_attention,
    next_token_labels,
    prepare_batch,
    use_cp_attention,
)

START_TIMEOUT_S = 10.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=8192, help="tokens per packed sequence")
    p.add_argument("--cp-size", type=int, default=0, help="ranks per CP group (0: world size)")
    p.add_argument("--strategy", default="flashcp", help="planner strategy (flashcp, ilp, auto, ...)")
    p.add_argument("--planner-url", default="embedded",
                   help="embedded, http://HOST:PORT or grpc://HOST:PORT")
    p.add_argument("--plan-timeout", type=float, default=1.0,
                   help="seconds to wait for the service's plan before the local fallback")
    p.add_argument("--job", default="train-llama", help="job id at the planner service")
    p.add_argument("--dataset", default="wlbllm", help="doc-length source (wlbllm, code, pile, ...)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--log-dir", type=Path, default=None, help="write rank<R>.jsonl and summary.json")
    p.add_argument("--check-reference", action="store_true",
                   help="compare step 0's logits with one process running the whole sequence")
    args = p.parse_args(argv)
    for name in ("steps", "seq_len", "layers", "heads", "kv_heads", "vocab", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.heads % args.kv_heads or args.hidden % args.heads:
        p.error("--kv-heads must divide --heads, and --heads must divide --hidden")
    return args


def init_distributed(args: argparse.Namespace) -> tuple[int, int, torch.device]:
    """torchrun's environment -> (rank, world size, device); a plain run is a world of 1."""
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(args.threads)
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=120))
    return rank, world, device


def tiny_llama(args: argparse.Namespace, attn: str, dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)  # same weights on every rank
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq_len)
    model = LlamaForCausalLM(config)
    model.set_attn_implementation(attn)
    return model.bfloat16() if dtype == torch.bfloat16 else model.float()


def model_spec(args: argparse.Namespace, dtype: torch.dtype) -> dict[str, int]:
    """The planner's view of the model (its cost model weighs attention against comm)."""
    return {"num_heads": args.heads, "num_kv_heads": args.kv_heads,
            "head_dim": args.hidden // args.heads, "dtype_bytes": torch.finfo(dtype).bits // 8,
            "hidden_size": args.hidden, "ffn_hidden_size": 2 * args.hidden}


def token_ids(args: argparse.Namespace, index: int, length: int) -> torch.Tensor:
    """Synthetic tokens of packed sequence ``index`` (the same on every rank)."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + index)
    return torch.randint(0, args.vocab, (length,), generator=g)


def cp_groups(world: int, cp: int) -> tuple[Any, Any, int]:
    """(training group, agreement group, replica index) of this rank. The agreement group
    is a gloo group of its own: PlanAgreement broadcasts on it from a background thread.
    Every rank creates every group in the same order, as torch.distributed requires."""
    if world == 1:
        return None, None, 0
    if cp == world:
        return None, dist.new_group(backend="gloo"), 0
    rank = dist.get_rank()
    mine: tuple[Any, Any, int] = (None, None, 0)
    for d in range(world // cp):
        ranks = list(range(d * cp, (d + 1) * cp))
        train = dist.new_group(ranks)
        side = dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            mine = (train, side, d)
    return mine


def reference_logits(args: argparse.Namespace, dtype: torch.dtype, device: torch.device,
                     ids: torch.Tensor, doc_lengths: list[int]) -> tuple[torch.Tensor, float]:
    """One process, the whole packed sequence, transformers' own attention with position
    ids restarting at every doc (it builds the document mask from them)."""
    model = tiny_llama(args, "sdpa", dtype).to(device)
    labels = next_token_labels(ids, doc_lengths)[None]
    positions = torch.cat([torch.arange(n) for n in doc_lengths])[None].to(device)
    with torch.no_grad():
        out = model(input_ids=ids[None], position_ids=positions, labels=labels,
                    shift_labels=labels, num_items_in_batch=int((labels != -100).sum()),
                    use_cache=False)
    return out.logits[0].float(), float(out.loss)


def all_reduce_grads(model: torch.nn.Module, replicas: int) -> None:
    """Sum gradients over the world in one flat buffer; local losses are summands of
    their CP group's mean loss, so dividing by the replicas gives the mean over them."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= replicas
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99)) if values else 0.0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    rank, world, device = init_distributed(args)
    cp = args.cp_size or world
    if world % cp:
        raise SystemExit(f"--cp-size {cp} must divide the world size {world}")
    replicas = world // cp
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    train_group, agree_group, replica = cp_groups(world, cp)
    src = dist.get_rank(agree_group) == 0 if world > 1 else True

    sequences = pack_sequences(make_source(args.dataset), context_length=args.seq_len,
                               num_sequences=args.steps * replicas, seed=args.seed)

    def lengths(step: int) -> list[int]:
        return sequences[step * replicas + replica]

    client = PlanClient(args.planner_url, cp_size=cp, strategy=args.strategy,
                        request_defaults={"model": model_spec(args, dtype),
                                          "context_length": args.seq_len},
                        job=f"{args.job}-r{replica}", timeout_s=args.plan_timeout) if src else None
    planner = PlanAgreement(client, group=agree_group)
    # The first plan is made while the model is built; it may wait for a planner that
    # is still starting (START_TIMEOUT_S), later ones get --plan-timeout.
    planner.prefetch(0, lengths(0), timeout=max(START_TIMEOUT_S, args.plan_timeout))
    model = enable_cp_attention(tiny_llama(args, "sdpa", dtype)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    log_file = None
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        log_file = (args.log_dir / f"rank{rank}.jsonl").open("w")

    records: list[dict[str, Any]] = []
    for step in range(args.steps):
        start = time.perf_counter()
        got = planner.get(step)  # planned and agreed during the previous step
        wait_ms = (time.perf_counter() - start) * 1e3
        if step + 1 < args.steps:
            planner.prefetch(step + 1, lengths(step + 1))  # plans while this step trains
        counter = CommCounter()
        # agreed=True: PlanAgreement gave every rank this plan, no plan_id all-gather;
        # the inputs are checked once (first step), not on every new plan.
        attn = ContextParallelAttention(got.plan, group=train_group, agreed=True,
                                        verify="first" if step == 0 else "never", counter=counter)
        ids = token_ids(args, step * replicas + replica, args.seq_len).to(device)
        with use_cp_attention(attn):
            out = model(**prepare_batch(attn, ids))
        out.loss.backward()
        if world > 1:
            all_reduce_grads(model, replicas)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = out.loss.detach().float()
        if world > 1:
            dist.all_reduce(loss)
            loss /= replicas
        record: dict[str, Any] = {
            "step": step, "rank": rank, "replica": replica, "loss": float(loss),
            "step_ms": (time.perf_counter() - start) * 1e3, "plan_wait_ms": wait_ms,
            "fallback": got.fallback, "reason": got.reason, "source": got.source,
            "plan_id": got.plan_id, "imbalance": got.plan.metrics.imbalance,
            "kv_bytes": counter.forward_bytes + counter.backward_bytes,
            "num_docs": len(got.plan.doc_lengths),
        }
        if step == 0 and args.check_reference:
            logits = attn.undispatch(out.logits[0].detach().float(), gather=True)
            if world == 1 or dist.get_rank(train_group) == 0:
                want, ref_loss = reference_logits(args, dtype, device, ids, list(got.plan.doc_lengths))
                record["reference_max_abs_diff"] = float((logits - want).abs().max())
                if replicas == 1:  # the logged loss is then this sequence's mean loss
                    record["reference_loss_diff"] = abs(float(loss) - ref_loss)
        records.append(record)
        if log_file is not None:
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()
        if rank == 0:
            print(f"step {step:3d}  loss {record['loss']:.4f}  step {record['step_ms']:7.1f} ms  "
                  f"wait {wait_ms:6.3f} ms  fallback {got.reason or '-':11s}  "
                  f"plan {got.plan_id[:12]}  imbalance {record['imbalance']:.3f}  "
                  f"kv {record['kv_bytes'] / 2**20:.2f} MiB", flush=True)
        if rank == 0 and "reference_max_abs_diff" in record:
            loss_diff = record.get("reference_loss_diff")
            print(f"step {step:3d}  reference: max |logits - one process| "
                  f"{record['reference_max_abs_diff']:.2e}"
                  + (f", |loss - one process| {loss_diff:.2e}" if loss_diff is not None else ""),
                  flush=True)

    waits = [r["plan_wait_ms"] for r in records]
    summary = {"steps": args.steps, "world": world, "cp_size": cp, "strategy": args.strategy,
               "planner": args.planner_url, "seq_len": args.seq_len,
               "mean_wait_ms": float(np.mean(waits)), "p99_wait_ms": p99(waits),
               "fallbacks": sum(r["fallback"] for r in records),
               "mean_step_ms": float(np.mean([r["step_ms"] for r in records])),
               "final_loss": records[-1]["loss"]}
    if world > 1:  # the slowest rank's waits: the figure that stalls the job
        every: list[Any] = [None] * world
        dist.all_gather_object(every, waits)
        summary["mean_wait_ms_max_rank"] = max(float(np.mean(w)) for w in every)
        summary["p99_wait_ms_max_rank"] = max(p99(w) for w in every)
    if rank == 0:
        print("summary " + json.dumps(summary), flush=True)
        if args.log_dir is not None:
            (args.log_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if log_file is not None:
        log_file.close()
    planner.close()
    if client is not None:
        client.close()
    if world > 1:
        dist.destroy_process_group()
    if not all(math.isfinite(r["loss"]) for r in records):
        raise SystemExit("a loss was not finite")
    return summary


if __name__ == "__main__":
    main()

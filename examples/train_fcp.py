"""Train a tiny Llama on FCP-scheduled global batches: CP groups of mixed sizes.

    torchrun --nproc-per-node 4 examples/train_fcp.py --steps 10

Each step's global batch holds ``--batch-size`` sequences of varying length (documents
of a data set packed up to ``--max-seq-len`` tokens, synthetic tokens). FCP (Flexible
Context Parallelism) splits it into micro-batches and, in each, puts sequences into CP
groups whose degrees differ (a long sequence on many ranks, short ones on one rank
each); every micro-batch has one plan over all ranks with a group per CP group. The
schedule of batch k+1 is made while batch k trains (``ScheduleClient``, embedded or a
running ``planner serve``), fetched on rank 0 and broadcast (``schedule_agreement``), so
every rank runs the same schedule, the service's or the identical local fallback.

Runs on CPU (gloo) and on GPUs (NCCL, PyTorch's FlashAttention in bf16) like train_llama.py. Each
rank runs the micro-batches in order: forward and backward of its group's shards
(a rank in no group of a micro-batch skips it), gradients summed over the world, one
AdamW step per global batch. ``--log-dir`` gets every rank's steps as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_llama import (  # noqa: E402 - the sibling example's building blocks
    START_TIMEOUT_S,
    all_reduce_grads,
    init_distributed,
    model_spec,
    p99,
    reference_logits,
    tiny_llama,
    token_ids,
)

from planner_service.client.agreement import schedule_agreement  # noqa: E402
from planner_service.client.global_batch import ScheduleClient  # noqa: E402
from planner_service.core.plan import Plan  # noqa: E402
from planner_service.data import make_source, pack_sequences_variable  # noqa: E402
from worker_runtime import CommCounter, ContextParallelAttention  # noqa: E402
from worker_runtime.hf import enable_cp_attention, prepare_batch, use_cp_attention  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per global batch")
    p.add_argument("--max-seq-len", type=int, default=4096, help="longest packed sequence")
    p.add_argument("--memory-tokens", type=int, default=0,
                   help="activation memory per rank in tokens (0: half of --max-seq-len, so "
                   "the longest sequences need CP groups of 2 or more)")
    p.add_argument("--profile", default="h100-llama3-8b-ib",
                   help="FCP cost profile; with CP over InfiniBand (-ib) exchanges cost more, "
                   "and FCP mixes group sizes already at these small lengths")
    p.add_argument("--strategy", default="flashcp", help="intra-group shard strategy")
    p.add_argument("--planner-url", default="embedded",
                   help="embedded, http://HOST:PORT or grpc://HOST:PORT")
    p.add_argument("--plan-timeout", type=float, default=1.0,
                   help="seconds to wait for the service's schedule before the local one")
    p.add_argument("--job", default="train-fcp")
    p.add_argument("--dataset", default="wlbllm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--check-reference", action="store_true",
                   help="compare step 0's first micro-batch with one process")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "max_seq_len", "layers", "heads", "kv_heads", "vocab"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.seq_len = args.max_seq_len  # tiny_llama's position table
    return args


def micro_batch_ids(args: argparse.Namespace, step: int, seq_ids: list[int],
                    sequences: list[list[int]]) -> torch.Tensor:
    """Tokens of a micro-batch: its sequences' synthetic tokens, in the plan's order."""
    base = step * args.batch_size
    return torch.cat([token_ids(args, base + i, sum(sequences[i])) for i in seq_ids])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    rank, world, device = init_distributed(args)
    memory = args.memory_tokens or -(-args.max_seq_len // min(2, world))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    side = dist.new_group(backend="gloo") if world > 1 else None
    batches = [pack_sequences_variable(make_source(args.dataset), max_tokens=args.max_seq_len,
                                       num_sequences=args.batch_size, seed=args.seed + step)
               for step in range(args.steps)]
    client = ScheduleClient(
        args.planner_url, num_ranks=world, memory_tokens=memory, job=args.job,
        request_defaults={"strategy": args.strategy, "profile": args.profile,
                          "model": model_spec(args, dtype)},
        timeout_s=args.plan_timeout) if rank == 0 else None
    planner = schedule_agreement(client, group=side)
    planner.prefetch(0, batches[0], timeout=max(START_TIMEOUT_S, args.plan_timeout))
    model = enable_cp_attention(tiny_llama(args, "sdpa", dtype)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    log_file = None
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        log_file = (args.log_dir / f"rank{rank}.jsonl").open("w")

    records: list[dict[str, Any]] = []
    for step in range(args.steps):
        start = time.perf_counter()
        got = planner.get(step)
        wait_ms = (time.perf_counter() - start) * 1e3
        if step + 1 < args.steps:
            planner.prefetch(step + 1, batches[step + 1])
        schedule = got.schedule
        plans = got.plans()
        counter = CommCounter()
        loss_sum = torch.zeros((), device=device)
        record: dict[str, Any] = {"step": step, "rank": rank}
        for m, (mb, plan) in enumerate(zip(schedule["micro_batches"], plans, strict=True)):
            attn = ContextParallelAttention(plan, agreed=True, counter=counter,
                                            verify="first" if step == 0 else "never")
            ids = micro_batch_ids(args, step, mb["sequence_ids"], batches[step]).to(device)
            if attn.layout.group_index < 0:
                continue  # this rank is in no CP group of this micro-batch
            with use_cp_attention(attn):
                out = model(**prepare_batch(attn, ids))
            # Local losses sum to the micro-batch's mean loss; average the micro-batches.
            (out.loss / len(plans)).backward()
            loss_sum += out.loss.detach().float() / len(plans)
            if step == 0 and m == 0 and args.check_reference:
                record.update(check_reference(args, attn, plan, out.logits, ids, dtype))
        if world > 1:
            for p in model.parameters():  # a rank that skipped every micro-batch
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            all_reduce_grads(model, 1)
            dist.all_reduce(loss_sum)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        record.update({
            "loss": float(loss_sum), "step_ms": (time.perf_counter() - start) * 1e3,
            "plan_wait_ms": wait_ms, "fallback": got.fallback, "reason": got.reason,
            "source": got.source, "schedule_id": got.schedule_id,
            "plan_ids": [p.plan_id for p in plans],
            "degrees": [mb["degrees"] for mb in schedule["micro_batches"]],
            "est_makespan_ms": schedule["est_makespan_ms"],
            "kv_bytes": counter.forward_bytes + counter.backward_bytes})
        records.append(record)
        if log_file is not None:
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()
        if rank == 0:
            print(f"step {step:3d}  loss {record['loss']:.4f}  step {record['step_ms']:7.1f} ms  "
                  f"wait {wait_ms:6.3f} ms  fallback {got.reason or '-':11s}  "
                  f"schedule {got.schedule_id[:12]}  degrees {record['degrees']}", flush=True)
        if step == 0 and args.check_reference:
            # Each rank compared its own group's documents: rank 0 prints the worst of all.
            worst = torch.tensor(record.get("reference_max_abs_diff", 0.0), dtype=torch.float64,
                                 device=device)
            if world > 1:
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            if rank == 0:
                print(f"step {step:3d}  reference: max |logits - one process| over every "
                      f"group {float(worst):.2e}", flush=True)

    waits = [r["plan_wait_ms"] for r in records]
    summary = {"steps": args.steps, "world": world, "planner": args.planner_url,
               "mean_wait_ms": float(np.mean(waits)), "p99_wait_ms": p99(waits),
               "fallbacks": sum(r["fallback"] for r in records),
               "mean_step_ms": float(np.mean([r["step_ms"] for r in records])),
               "final_loss": records[-1]["loss"]}
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


def check_reference(args: argparse.Namespace, attn: ContextParallelAttention, plan: Plan,
                    logits: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype
                    ) -> dict[str, float]:
    """Max |logits - one-process logits| over this rank's group's real tokens.

    Collective over the rank's CP group (the gather); every group compares its own docs.
    """
    full = attn.undispatch(logits[0].detach().float(), gather=True)
    want, _ = reference_logits(args, dtype, ids.device, ids, list(plan.doc_lengths))
    mine = torch.zeros(len(ids), dtype=torch.bool, device=ids.device)
    group = plan.groups[attn.layout.group_index]
    for doc in group.docs:
        begin = sum(plan.doc_lengths[:doc])
        mine[begin:begin + plan.doc_lengths[doc]] = True
    return {"reference_max_abs_diff": float((full[mine] - want[mine]).abs().max())}


if __name__ == "__main__":
    main()

"""The PyTorch kernel's block size: time per computed attention pair across block shapes.

    .venv/bin/python -m bench.kernel_blocks            # writes bench/results/kernel_blocks.md

The exact PyTorch kernel (worker_runtime/kernels.py) computes every (query block, key
block) pair dense, one Python iteration per pair. The step-time model prices it per
computed pair (plus per block pair), so the time per pair should not depend on the shape
of a query block's key range. Here: one query block of 256 rows of one document against
``k`` earlier keys of it (every pair visible), forward + backward, for several ``k`` and
key-block sizes, in ns per computed pair (process CPU time, median of the repeats; one
torch thread; the model_check heads: 4 heads, 2 KV heads x 32, float32). The spread across
``k`` of one block size is what the per-pair rate cannot capture.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from worker_runtime.kernels import (
    BLOCK_K,
    BLOCK_Q,
    attention_backward,
    attention_forward,
    build_masked_meta,
)

RESULTS = Path(__file__).resolve().parent / "results"
HEADS, KV_HEADS, DIM = 4, 2, 32
KEYS = (64, 300, 1024, 2074, 3072)
BLOCKS = ((256, 1024), (256, 512), (256, 256), (128, 256))


def ns_per_pair(keys: int, block_q: int, block_k: int, repeats: int, queries: int = 256) -> float:
    """Forward + backward ns per computed pair of ``queries`` rows after ``keys`` keys."""
    q_doc, q_pos = np.zeros(queries, np.int64), np.arange(keys, keys + queries)
    k_doc, k_pos = np.zeros(keys, np.int64), np.arange(keys)
    meta = build_masked_meta(q_doc, q_pos, k_doc, k_pos, block_q=block_q, block_k=block_k)
    gen = torch.Generator().manual_seed(keys)
    q = torch.randn(queries, HEADS, DIM, generator=gen)
    k, v = (torch.randn(keys, KV_HEADS, DIM, generator=gen) for _ in range(2))
    dout = torch.randn(queries, KV_HEADS, HEADS // KV_HEADS, DIM, generator=gen)
    times = []
    for _ in range(repeats + 1):  # the first call warms up
        start = time.process_time()
        out, lse = attention_forward(q, k, v, meta, 0.1)
        attention_backward(dout, q, k, v, lse, (dout * out).sum(-1), meta, 0.1)
        times.append(time.process_time() - start)
    pairs = sum((q1 - q0) * (k1 - k0) for q0, q1, blocks in meta.blocks for k0, k1 in blocks)
    return statistics.median(times[1:]) / pairs * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS / "kernel_blocks.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    lines = [
        "# PyTorch kernel: ns per computed pair by block shape",
        "",
        f"Command: `.venv/bin/python -m bench.kernel_blocks --repeats {args.repeats}`",
        "",
        f"One query block of 256 rows against k earlier keys of its document, forward + backward, "
        f"{HEADS} heads / {KV_HEADS} KV heads x {DIM}, float32, 1 thread; process CPU time, median "
        f"of {args.repeats}; {os.cpu_count()} cores, load average {load:.1f} at start. The "
        f"runtime's blocks: {BLOCK_Q} x {BLOCK_K}.",
        "",
        "| block (queries x keys) | " + " | ".join(f"k = {k}" for k in KEYS) + " | max / min |",
        "|---|" + "---:|" * (len(KEYS) + 1),
    ]
    for block_q, block_k in BLOCKS:
        row = [ns_per_pair(k, block_q, block_k, args.repeats) for k in KEYS]
        lines.append(f"| {block_q} x {block_k} | " + " | ".join(f"{x:.1f}" for x in row)
                     + f" | {max(row) / min(row):.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

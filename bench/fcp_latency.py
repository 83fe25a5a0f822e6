"""FCP solver latency alone, for a quiet machine: 512 sequences per data set, N = 64.

    python -m bench.fcp_latency            # 30 runs per data set

The same call as section 2 of ``bench.fcp_bench`` (``plan_global_batch``: split, stage 1,
stage 2, DP; no shard plans) on batch 0 of each data set, without the other sections, so
it can run when the machine is otherwise idle. Prints the load average, then per data
set the wall median / p99 and the solving thread's CPU median in ms.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from bench.fcp_bench import DATASETS, batch
from planner_service.fcp import plan_global_batch


def main(runs: int = 30) -> None:
    print(f"load average {os.getloadavg()[0]:.2f}, {runs} runs per data set, N = 64, E = 32768")
    for dataset in DATASETS:
        seqs = batch(dataset, 0)
        wall, cpu = [], []
        for _ in range(runs):
            t0, c0 = time.perf_counter(), time.thread_time()
            plan_global_batch(seqs, num_ranks=64, memory_tokens=32768)
            wall.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.thread_time() - c0) * 1e3)
        print(f"{dataset}: {len(seqs)} sequences, wall median {np.median(wall):.2f} ms, "
              f"p99 {np.percentile(wall, 99):.2f} ms, CPU median {np.median(cpu):.2f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30)

"""Benchmarks: rerunnable commands whose outputs live in bench/results/."""

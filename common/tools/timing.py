"""Timing helpers shared by the demo, the benchmark and the tuner."""

from __future__ import annotations

import time

import torch


def gpu_time_ms(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median GPU time of ``fn()`` in ms (``triton.testing.do_bench``, which clears the L2 between calls)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def wall_time_us(fn, calls: int = 200, device: str = "cuda", warmup_s: float = 0.2, repeats: int = 3) -> float:
    """Wall time per call of ``fn()`` in a plain Python loop, host work included, in µs.

    Calls ``fn`` for ``warmup_s`` first: an idle GPU runs at a low clock (seen
    at 345 MHz on the H200), which would inflate the first hundreds of calls.
    Then ``repeats`` loops of ``calls`` calls; the median loop counts (one loop
    disturbed by other work on a shared host moved single loops by 1.5x).
    """
    deadline = time.perf_counter() + warmup_s
    while True:
        fn()
        if time.perf_counter() > deadline:
            break
    per_call = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(per_call)[len(per_call) // 2]


def attention_flops(B, H, Lq, Lk, D, Dv=None, causal=False) -> float:
    """2 matrix products of 2·Lq·Lk·D each per head (D + Dv when they differ), halved when causal."""
    Dv = D if Dv is None else Dv
    flops = 2.0 * B * H * Lq * Lk * (D + Dv)
    return flops / 2 if causal else flops

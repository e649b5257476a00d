"""GPU probes run by hand: compiled-kernel facts, host time per call, decode sweep.

Run on the GPU: python tools/probe.py [regs] [host] [decode]. Prints only; nothing
is written to the project.

- regs: registers, spills, shared memory and the MMA / copy instructions of the
  compiled Triton kernels, forward and backward (launched through the project's
  own launcher).
- host: where the wall time of one small call goes, step by step (backend choice,
  validation, plan, launch), against SDPA's.
- ops: what the torch.library operators cost on the host, on the homework's
  shapes: the direct call (no grad), the forward operator called itself, a
  forward that records autograd, and forward + backward; SDPA alongside.
- dropout: forward and forward + backward TFLOP/s with and without dropout, with SDPA's.
- features: sliding window (4096 at L = 32k causal) against the full causal call and
  against SDPA with the window as a mask; soft-capping's and sinks' cost.
- varlen: packed variable-length prefill (64 sequences of 128-8192 tokens) against our
  dense kernel on each sequence and SDPA on the padded batch.
- paged: paged decode (pages of 16 and 64 keys, shuffled) against our contiguous-cache
  decode on the same keys, kernel time by CUDA-graph replay, bandwidth of K/V read; append_kv.
- paged_prefill: a chunk of 512 query rows a sequence through a paged cache of 4096 keys (B 4, 32
  query heads over 8, D 128, bf16, causal, pages of 16 and 64, shuffled), each paged variant.
- paged_extras: what ALiBi, left padding and per-sequence query lengths cost the paged kernels
  (decode and 4-row chunks, pages of 64, graph replay), and the rotary kernel of a decode step.
- paged_sweep: paged decode with pages of PROBE_PAGES keys (default 16) under other key steps, warps
  and stages, both backends (NineToothed's pages of 16 run at 0.57-0.64x of the contiguous decode).
- paged_fp8_sweep: paged decode from FP8 caches (pages of PROBE_PAGES, default 16 and 64) under other key
  steps, warps, stages and register caps (PROBE_BACKENDS, default triton), against bf16 pages and the
  contiguous FP8 decode.
- paged_fp8_locality: Triton's paged FP8 decode at pages of 16, 32, 64 and 128, the table shuffled or in
  address order, value pages row- or column-major (whether the pages' size or their order in memory sets its speed).
- paged_batch: paged decode at a large batch, the paged plan's stages against 3, 2, and 2 with the
  dense path's register cap; beside dense decode and SDPA.
- decode: split-KV decode shapes under several programs-per-SM targets and
  tile configurations, against SDPA.
- graphs: a serving decode step (append_kv + paged_attention) eager against CUDA-graph replay.
- stages: unsplit decode launches of many short-row programs, 2 pipeline stages against 3.
- maxnreg: `stages`' D 128 shapes, 3 and 2 stages, and the D 64 forward, every kernel capped at
  $PROBE_MAXNREG registers (run once per cap, and once without).
- fwd_tiles: NineToothed's D 64 forward under its table's tile and the tune's others, fp16 and bf16.
- split_sweep: the split decode shapes short of the bound in `bandwidth`, under other tiles and
  programs-per-SM targets (SWEEP_SHAPES="B:H:H_kv:Lq:Lk ..." for others).
- bandwidth: decode kernel time (graph replay) and K/V bandwidth over batch 1-64, Lq 1 and 16,
  GQA and MHA, against SDPA's.
- steps: the reused path's host time per call, step by step (template lookup, the bound launch,
  rebind, argument building, our launch cache, Triton's compiled-kernel launch, allocations), on a
  decode shape and a homework shape, both backends' totals beside SDPA's.
- bwd_tune: NineToothed's backward tuned like `tune --backends ninetoothed --passes bwd` (every
  candidate's time printed), beside its shipped table's and Triton's shipped backward on the same
  inputs; the new table is written to $OUT/nt_configs.json (the package's table is not touched).
  BWD_TUNE_KEYS="128:full:1024 ..." limits it to those keys (D:full|causal:L).
- gqa_bwd: the causal backward with 32 query heads over 8 K/V heads against MHA's at the same FLOPs
  (D 64 and 128, L 1k and 4k, fp16), both backends and SDPA: what the dK/dV pass's group loop costs.
- gqa_step: issue 43's grouped-query training step (forward + backward, 32 query heads over 8 K/V heads,
  causal, L 8192, D 128, bf16): the triton backend's default, its deterministic backward (the tl passes),
  NineToothed and SDPA's default, TFLOP/s (3.5 forwards' FLOPs).
- nt_bwd_small: NineToothed's backward at (4, 32, 1024, 64), bf16: do_bench, graph replay and wall time per
  call, both backends (whether the host or the kernels make its gap).
- host_python: our Python per step of a growing decode loop (split keys), both backends, with the
  kernel launches stubbed out once bound (and, on a CPU, the interpreter's quieting left out, as on a
  GPU): what the library adds to Triton's launches. Runs on a CPU (under the interpreter) too.
- loop: a transformers-style decode loop (the cache grown by torch.cat each step): wall
  time per step, the attention call alone, its kernel time (graph replay), host = wall - kernel.
- gluon: the Gluon Hopper forward against our tl kernel and SDPA (TFLOP/s, both dtypes, D 64-256).
- gluon_tiles: the Gluon forward's tiles swept at L 4096 (the three variants), SDPA beside.
- default_vs_sdpa: the triton backend's default forward (on sm_90 what the config table dispatches)
  against SDPA's default, bf16, at the benchmark's 18 forward shapes.
- gluon_tiles_fp8: the Gluon ping-pong forward's FP8 tiles swept at L 4096, the tl FP8 forward and SDPA beside.
- gluon_host: what a call of the Gluon path costs the host (it is launched through Triton's JIT each call,
  not bound): wall time per call and do_bench of attention() with the table's dispatch and with the tl
  kernel (ATTENTION_GLUON=0) at small and mid shapes, D 128 bf16 causal.
- gluon_bwd_host: the one-pass backward in a user's loop against the tl backward, both bound from a layout's
  third call: wall time per call and do_bench of attention_backward() with the one pass forced, the tl backward,
  and the default dispatch (its size guard), around the guard; where the one pass starts to pay in a loop.
- train_step: where a training step's time goes: do_bench of the forward with and without grad, the backward
  and the step, a loop's wall time per step, the kernels a step launches (torch.profiler) and the step's host
  time by Python function (cProfile); the triton backend with its dispatched backward and with the tl
  backward, and SDPA.
- gluon_fp8: the Gluon ping-pong forward with FP8 inputs against the tl kernel's FP8 forward, the
  ping-pong bf16 forward and SDPA's bf16 (issue 44's prefill shapes; TFLOP/s, do_bench).
- gluon_bwd: the Gluon backward (impl_triton.gluon_backward) against our tl backward and SDPA's, the
  backward alone (do_bench; 2.5x the forward's FLOPs), bf16, B·L = 16k, H·D = 2048, causal and not.
- varlen_decode: a decoding step as a packed batch (64 sequences, 1 or 4 queries each), laid out
  per sequence against the packed layout, both backends, SDPA on the padded batch.
- serving: transformers' continuous batching (generate_batch) on flash_triton / flash_ninetoothed
  against sdpa: tokens as sdpa's, tokens per second of 64 requests.
- fp8: FP8 inputs (issue 44): the prefill forward (B·L 16k, H·D 2048, L 4k and 16k, D 64 and 128, causal
  and not) in e4m3 (V as given, copied column-major by the plan, and given column-major; tiles swept at
  L 4k) against our bf16 forward and SDPA's, TFLOP/s; decode from an FP8 cache (bf16 and fp16 queries;
  B 8, 32 heads over 8, D 128, Lk 16k and 64k; contiguous and in pages of 16 and 64) against the bf16
  cache, TB/s of cache read (graph replay); both backends.
- static: generate over a static cache, the forward compiled with CUDA graphs (reduce-overhead),
  sdpa / triton / ninetoothed: tokens per second, graph breaks, recompiles, tokens as sdpa's
  (PROBE_PROFILE=1: each one's compiled generate under torch.profiler, its top ops by GPU and CPU time).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import re
import sys
import time

import torch
import torch.nn.functional as F

from common.interpret import use_interpreter_if_no_gpu

use_interpreter_if_no_gpu()  # (host_python runs on a CPU too; before any kernel is decorated)

import impl_triton.attention as ta  # noqa: E402
from common import attention, plan  # noqa: E402
from common.backends import resolve  # noqa: E402
from common.configs import Config, override  # noqa: E402
from common.tools.timing import attention_flops, gpu_time_ms, wall_time_us  # noqa: E402
from common.validation import check_call  # noqa: E402


def _describe(name, kernel):
    ptx = kernel.asm.get("ptx", "")
    mma = sorted(set(re.findall(r"(wgmma\.mma_async[\w.]*|mma\.sync[\w.]*)", ptx)))
    print(f"{name}: regs={kernel.n_regs} spills={kernel.n_spills} shared={kernel.metadata.shared} "
          f"mma={mma[:3]} cp.async={'cp.async' in ptx} tma={'cp.async.bulk.tensor' in ptx}", flush=True)


def regs():
    for D in (64, 128):
        for causal in (False, True):
            L = 4096
            B, H = 16384 // L, 2048 // D
            q, k, v = (torch.randn(B, H, L, D, dtype=torch.float16, device="cuda", requires_grad=True)
                       for _ in range(3))
            for launcher in (ta._fwd_launcher, ta._dq_launcher, ta._dkdv_launcher):
                launcher._by_class.clear()
            attention(q, k, v, is_causal=causal).sum().backward()
            for name, launcher in (("fwd", ta._fwd_launcher), ("bwd dq", ta._dq_launcher),
                                   ("bwd dkdv", ta._dkdv_launcher)):
                (kernel,) = launcher._by_class.values()
                _describe(f"D={D} causal={causal} {name}", kernel)


def host():
    for shape in [(2, 4, 16, 32), (1, 16, 128, 128), (2, 4, 1024, 64)]:
        q, k, v = (torch.randn(*shape, dtype=torch.float16, device="cuda") for _ in range(3))
        backend = resolve("triton")
        module = backend.load()

        def validate():
            return check_call(backend, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                              enable_gqa=False, return_lse=False)

        call = validate()
        prepared = plan.make_forward(call, backend, with_lse=False)
        times = {
            "sdpa": wall_time_us(lambda: F.scaled_dot_product_attention(q, k, v)),
            "attention(triton)": wall_time_us(lambda: attention(q, k, v)),
            "attention(ninetoothed)": wall_time_us(lambda: attention(q, k, v, backend="ninetoothed")),
            "resolve": wall_time_us(lambda: resolve(None), device="cpu"),
            "check_call": wall_time_us(validate, device="cpu"),
            "make_forward": wall_time_us(lambda: plan.make_forward(call, backend, with_lse=False), device="cpu"),
            "forward(plan)": wall_time_us(lambda: module.forward(prepared)),
            "torch.empty": wall_time_us(lambda: torch.empty(shape, dtype=torch.float16, device="cuda"), device="cpu"),
        }
        compiled = list(ta._fwd_launcher._by_value.values())[-1]
        print(shape, "  ".join(f"{name} {t:.1f}" for name, t in times.items()),
              f"(compiled kernel: {type(compiled).__name__})", flush=True)


def ops():
    from common.ops import OPS

    for shape in [(2, 4, 16, 32), (4, 8, 64, 64), (1, 16, 128, 128), (2, 4, 1024, 64)]:
        for backend in ("triton", "ninetoothed"):
            q, k, v = (torch.randn(*shape, dtype=torch.float16, device="cuda") for _ in range(3))
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            forward_op = OPS[backend][0]
            scale = shape[-1] ** -0.5

            def fwd_bwd(f):
                f().sum().backward()

            times = {
                "direct": wall_time_us(lambda: attention(q, k, v, backend=backend)),
                "operator": wall_time_us(lambda: forward_op(q, k, v, None, False, scale, 0.0, None, [-1, -1, 0], 0.0,
                                                                  None)),
                "grad fwd": wall_time_us(lambda: attention(qg, kg, vg, backend=backend)),
                "fwd+bwd": wall_time_us(lambda: fwd_bwd(lambda: attention(qg, kg, vg, backend=backend))),
                "sdpa": wall_time_us(lambda: F.scaled_dot_product_attention(q, k, v)),
                "sdpa grad fwd": wall_time_us(lambda: F.scaled_dot_product_attention(qg, kg, vg)),
                "sdpa fwd+bwd": wall_time_us(lambda: fwd_bwd(lambda: F.scaled_dot_product_attention(qg, kg, vg))),
            }
            print(shape, backend, "  ".join(f"{name} {t:.1f}" for name, t in times.items()), flush=True)


def dropout():
    """Dropout's cost: forward and forward + backward with p = 0 and p = 0.1, against SDPA's."""
    for D in (64, 128):
        for causal in (False, True):
            L = 4096
            B, H = 16384 // L, 2048 // D
            q, k, v = (torch.randn(B, H, L, D, dtype=torch.bfloat16, device="cuda", requires_grad=True)
                       for _ in range(3))
            flops = 4 * B * H * L * L * D / (2 if causal else 1)
            line = [f"D={D} causal={causal}"]
            for name, f in (("sdpa", lambda p: F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=p)),
                            ("triton", lambda p: attention(q, k, v, is_causal=causal, dropout_p=p)),
                            ("ninetoothed", lambda p: attention(q, k, v, is_causal=causal, dropout_p=p,
                                                                backend="ninetoothed"))):
                for p in (0.0, 0.1):
                    with torch.no_grad():
                        fwd = gpu_time_ms(lambda: f(p))
                    both = gpu_time_ms(lambda: f(p).backward(torch.ones_like(q)))
                    line.append(f"{name} p={p}: fwd {flops / fwd / 1e9:.0f} fwd+bwd {3.5 * flops / both / 1e9:.0f}")
            print("  ".join(line), "(TFLOP/s)", flush=True)


def features():
    """Issue 14's targets: a 4096-key sliding window at L = 32k causal against the full causal call and
    against SDPA given the same window as a boolean mask; soft-capping's and sinks' cost (bf16, D = 128),
    soft-capping with tanh.approx (the default for 16-bit inputs) and with the exp2 form."""
    B, H, D, L, W = 1, 16, 128, 32768, 4096
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    offset = torch.arange(L, device="cuda")[None, :] - torch.arange(L, device="cuda")[:, None]
    window_mask = (offset <= 0) & (offset >= -(W - 1))
    sinks = torch.randn(H, device="cuda")
    exact_kind = plan.softcap_kind

    def exp2_kind(softcap, dtype, device, interpreted):
        return plan.Softcap.EXP2 if softcap else plan.Softcap.OFF

    with torch.no_grad():
        for backend in ("triton", "ninetoothed"):
            full = gpu_time_ms(lambda: attention(q, k, v, True, backend=backend))
            windowed = gpu_time_ms(lambda: attention(q, k, v, True, backend=backend, window=(W - 1, 0)))
            capped = gpu_time_ms(lambda: attention(q, k, v, True, backend=backend, softcap=50.0))
            plan.softcap_kind = exp2_kind
            try:
                capped_exp2 = gpu_time_ms(lambda: attention(q, k, v, True, backend=backend, softcap=50.0))
            finally:
                plan.softcap_kind = exact_kind
            sunk = gpu_time_ms(lambda: attention(q, k, v, True, backend=backend, sinks=sinks))
            print(f"{backend}: causal {full:.2f} ms, window {W} {windowed:.2f} ms ({full / windowed:.2f}x faster), "
                  f"softcap {capped:.2f} ms ({capped / full - 1:+.1%}; exp2 form {capped_exp2:.2f} ms, "
                  f"{capped_exp2 / full - 1:+.1%}), sinks {sunk:.2f} ms ({sunk / full - 1:+.1%})", flush=True)
        sdpa = gpu_time_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask))
        sdpa_causal = gpu_time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        ours = gpu_time_ms(lambda: attention(q, k, v, True, window=(W - 1, 0)))
        print(f"SDPA with the window as a boolean mask: {sdpa:.2f} ms (SDPA causal, no window: {sdpa_causal:.2f} ms); "
              f"triton's window {sdpa / ours:.2f}x faster", flush=True)
    for backend in ("triton", "ninetoothed"):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        grad = torch.randn_like(q)

        def step(**extra):
            return lambda: torch.autograd.grad(attention(*leaves, True, backend=backend, **extra), leaves, grad)

        full, windowed = gpu_time_ms(step()), gpu_time_ms(step(window=(W - 1, 0)))
        capped = gpu_time_ms(step(softcap=50.0))
        print(f"{backend} fwd+bwd: causal {full:.2f} ms, window {W} {windowed:.2f} ms ({full / windowed:.2f}x), "
              f"softcap {capped:.2f} ms ({capped / full - 1:+.1%})", flush=True)


def varlen():
    """Issue 15's varlen target: 64 sequences of 128-8192 tokens (a fixed draw), H = 16, D = 128, bf16,
    causal and not. varlen_attention against our dense kernel on each sequence alone (the same tokens;
    the sum of the calls' GPU times) and against SDPA on the padded batch (a key-padding mask); TFLOP/s
    counted on the real tokens only."""
    import itertools

    from common import varlen_attention

    lens = torch.randint(128, 8193, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    H, D, Lmax = 16, 128, max(lens)
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lens), H, D, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    starts = cu.tolist()
    seqs = [tuple(t[a:b].transpose(0, 1)[None] for t in (q, k, v)) for a, b in zip(starts, starts[1:])]
    padded = [torch.zeros(len(lens), H, Lmax, D, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    for i, seq in enumerate(seqs):
        for dst, src in zip(padded, seq):
            dst[i, :, :lens[i]] = src[0]
    real = torch.arange(Lmax, device="cuda")[None, :] < torch.tensor(lens, device="cuda")[:, None]
    print(f"{len(lens)} sequences, {sum(lens)} tokens (mean {sum(lens) / len(lens):.0f}, max {Lmax})", flush=True)
    with torch.no_grad():
        for causal in (False, True):
            flops = sum(4 * H * L * L * D for L in lens) / (2 if causal else 1)
            for backend in ("triton", "ninetoothed"):
                packed = gpu_time_ms(lambda: varlen_attention(q, k, v, cu, cu, Lmax, Lmax, causal, backend=backend))
                dense = sum(gpu_time_ms(lambda s=s: attention(*s, causal, backend=backend), 5, 10) for s in seqs)
                print(f"causal={causal} {backend}: varlen {packed:.2f} ms ({flops / packed * 1e-9:.0f} TFLOP/s), "
                      f"dense per sequence {dense:.2f} ms ({flops / dense * 1e-9:.0f} TFLOP/s): "
                      f"{dense / packed:.2f}x", flush=True)
            mask = real[:, None, None, :]
            if causal:
                mask = mask & torch.ones(Lmax, Lmax, dtype=torch.bool, device="cuda").tril()
            sdpa = gpu_time_ms(lambda: F.scaled_dot_product_attention(*padded, attn_mask=mask))
            print(f"causal={causal} SDPA on the padded batch: {sdpa:.2f} ms ({flops / sdpa * 1e-9:.0f} TFLOP/s "
                  f"on real tokens)", flush=True)


def paged():
    """Issue 45's paged targets: decode (Lq = 1; B = 8, 32 query heads over 8 K/V heads, D = 128,
    bf16) from a paged cache (pages of PROBE_PAGES keys, default 1 16 64 128 256; a shuffled table)
    against our dense decode on
    the same keys in a contiguous cache (target >= 0.9x) and the K/V bandwidth (target >= 3.8 TB/s at
    Lk >= 16k). Kernel time by CUDA-graph replay (no host time); then append_kv's time for one token."""
    from common import append_kv, paged_attention
    from common.backends import ANY_PAGE, get_backend

    B, H, H_kv, D = 8, 32, 8, 128
    for Lk in (4096, 16384, 65536):
        k, v = (torch.randn(B, H_kv, Lk, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        q = torch.randn(B, H, 1, D, dtype=torch.bfloat16, device="cuda")
        kv_bytes = 2 * k.numel() * k.element_size()
        dense = _graph_time_ms(lambda: attention(q, k, v, enable_gqa=True))
        line = [f"Lk={Lk}: contiguous {dense * 1e3:.0f} us ({kv_bytes / dense * 1e-9:.2f} TB/s)"]
        for page in [int(p) for p in os.environ.get("PROBE_PAGES", "1 16 64 128 256").split()]:
            caches, table, lengths = _shuffled_pages(k, v, page)
            out = paged_attention(q, *caches, table, lengths, enable_gqa=True)
            torch.testing.assert_close(out, attention(q, k, v, enable_gqa=True), rtol=2e-2, atol=2e-2)
            for backend, variant in PAGED_VARIANTS:
                if page % 16 and not get_backend(backend).supports(ANY_PAGE):
                    continue  # refused with a ValueError (NineToothed: multiples of 16)
                with _paged_variant(variant):
                    t = _graph_time_ms(lambda: paged_attention(q, *caches, table, lengths, enable_gqa=True,
                                                               backend=backend))
                name = f"{backend}{f' {variant}' if variant else ''}"
                line.append(f"{name} page {page} {t * 1e3:.0f} us ({kv_bytes / t * 1e-9:.2f} TB/s, "
                            f"{dense / t:.2f}x)")
            new = torch.randn(B, H_kv, 1, D, dtype=torch.bfloat16, device="cuda")
            start = lengths - 1
            t = _graph_time_ms(lambda: append_kv(*caches, table, start, new, new))
            line.append(f"append_kv page {page} {t * 1e3:.1f} us")
        print("; ".join(line), flush=True)


def paged_prefill():
    """A chunked prefill through the paged cache: each sequence's last 512 of 4096 keys are its query
    rows (causal, bottom-right), B 4, 32 query heads over 8, D 128, bf16, pages of 16 and 64 in a
    shuffled table; each of PAGED_VARIANTS, TFLOP/s by CUDA-graph replay."""
    from common import paged_attention

    B, H, H_kv, D, Lk, Lq = 4, 32, 8, 128, 4096, 512
    k, v = (torch.randn(B, H_kv, Lk, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    q = torch.randn(B, H, Lq, D, dtype=torch.bfloat16, device="cuda")
    flops = 4 * B * H * Lq * (Lk - Lq / 2) * D
    for page in (16, 64):
        caches, table, lengths = _shuffled_pages(k, v, page)
        line = []
        for backend, variant in PAGED_VARIANTS:
            with _paged_variant(variant):
                t = _graph_time_ms(lambda: paged_attention(q, *caches, table, lengths, True, enable_gqa=True,
                                                           backend=backend))
            line.append(f"{backend}{f' {variant}' if variant else ''} {t * 1e3:.0f} us "
                        f"({flops / t * 1e-9:.0f} TFLOP/s)")
        print(f"paged prefill Lq {Lq} Lk {Lk} page {page}: " + "; ".join(line), flush=True)


def _shuffled_pages(k, v, page: int, shuffled: bool = True):
    """Dense keys and values (B, H_kv, Lk, D) as paged caches of ``page`` keys in a shuffled table
    (``shuffled=False``: in order, each sequence's pages one after another in the caches):
    ([key_cache, value_cache], table (B, Lk / page) int32, lengths (B,) int32, all Lk). FP8 tensors
    are moved as their bytes (indexed assignment takes no float8)."""
    B, H_kv, Lk, D = k.shape
    pages = Lk // page
    order = torch.randperm(B * pages, device=k.device) if shuffled else torch.arange(B * pages, device=k.device)
    table = order.view(B, pages).to(torch.int32)
    caches = []
    for x in (k, v):
        cache = torch.empty(B * pages, page, H_kv, D, dtype=x.dtype, device=x.device)
        as_bytes = x.dtype == torch.float8_e4m3fn
        moved = (cache.view(torch.uint8), x.view(torch.uint8)) if as_bytes else (cache, x)
        moved[0][table.long()] = moved[1].view(B, H_kv, pages, page, D).permute(0, 2, 3, 1, 4)
        caches.append(cache)
    return caches, table, torch.full((B,), Lk, dtype=torch.int32, device=k.device)


def _column_pages(cache):
    """The same pages, each stored column-major (a page's keys contiguous for a head and column)."""
    return cache.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)


def paged_extras():
    """The paged kernels with and without the features of FlashAttention's kvcache call: decode (Lq 1)
    and 4 new rows per sequence, B = 8, 32 query heads over 8, D = 128, bf16, pages of 64 in a
    shuffled table, Lk 16k; plain, ALiBi (rows unpacked: per-head slopes), left padding (the first
    quarter skipped), query lengths (rows 1-4 of 4); then the rotary kernel on a decode step's q and k."""
    from common import paged_attention
    from common.backends import get_backend
    from common.rotary import apply_rotary

    B, H, H_kv, D, Lk, page = 8, 32, 8, 128, 16384, 64
    pages = Lk // page
    table = torch.randperm(B * pages, device="cuda").view(B, pages).to(torch.int32)
    caches = [torch.randn(B * pages, page, H_kv, D, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    lengths = torch.full((B,), Lk, dtype=torch.int32, device="cuda")
    extras = {"plain": {}, "alibi": dict(alibi_slopes=torch.rand(H, device="cuda")),
              "leftpad": dict(cache_leftpad=torch.full((B,), Lk // 4, dtype=torch.int32, device="cuda")),
              "query_lengths": dict(query_lengths=torch.randint(1, 5, (B,), dtype=torch.int32, device="cuda"))}
    for Lq in (1, 4):
        q = torch.randn(B, H, Lq, D, dtype=torch.bfloat16, device="cuda")
        for backend in ("triton", "ninetoothed"):
            line, plain = [], None
            for name, kw in extras.items():
                if name == "query_lengths" and Lq == 1:
                    continue
                t = _graph_time_ms(lambda: paged_attention(q, *caches, table, lengths, True, enable_gqa=True,
                                                           backend=backend, **kw))
                plain = plain or t
                line.append(f"{name} {t * 1e3:.0f} us ({t / plain:.2f}x)")
            print(f"Lq={Lq} {backend}: " + "; ".join(line), flush=True)
    angles = torch.rand(Lk, 64, device="cuda")
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    x = torch.randn(B, 1, H, D, dtype=torch.bfloat16, device="cuda")
    for backend in ("triton", "ninetoothed"):
        chosen = get_backend(backend)
        t = _graph_time_ms(lambda: apply_rotary(chosen, x, cos, sin, lengths, per_row=True, interleaved=True))
        print(f"rotary {backend}: q of a decode step (8 x 32 heads) {t * 1e3:.1f} us", flush=True)


# (backend, None: the shipped configuration (NineToothed's small pages' tiles joined into one softmax update a
# step, impl_ninetoothed.attention.PAGED_JOIN), "per-tile": each tile its own update, "tiles4": at most 4 of them unrolled a step
# (PAGED_TILES_PER_STEP and PAGED_FP8_TILES_PER_STEP; 8 and 4 shipped under triton 3.6; "tiles2": 2), or (keys per
# step | None: the shipped one, warps, stages [, maxnreg]))
PAGED_VARIANTS = [("triton", None), ("ninetoothed", None), ("ninetoothed", "per-tile")]
NT_PAGED_SWITCHES = {"per-tile": {"PAGED_JOIN": False},
                     **{f"tiles{n}": {"PAGED_TILES_PER_STEP": n, "PAGED_FP8_TILES_PER_STEP": n} for n in (8, 4, 2)},
                     **{f"small-warps{n}": {"PAGED_FP8_SMALL_TILE_WARPS": n} for n in (2, 4)},
                     "plan-warps": {"PAGED_FP8_SMALL_TILE_WARPS": None},
                     # (FP8 caches' 16-key tiles joined before one product each, PAGED_FP8_JOIN_TILES; with
                     # column-major value pages on 4 warps too)
                     "join-tiles": {"PAGED_FP8_JOIN_TILES": True},
                     "join-tiles-4-warps": {"PAGED_FP8_JOIN_TILES": True, "PAGED_FP8_SMALL_TILE_WARPS": 4}}


@contextlib.contextmanager
def _paged_variant(variant):
    """paged_attention with another configuration (a sweep; the shipped one when None)."""
    import common.paged as paged_module

    if isinstance(variant, tuple) and variant[0] == "splits":  # (either backend: the planner's split count forced)
        with plan.force_splits(variant[1]):
            yield
        return
    if variant in NT_PAGED_SWITCHES:
        import impl_ninetoothed.attention as nt

        switched = NT_PAGED_SWITCHES[variant]
        shipped_values = {name: getattr(nt, name) for name in switched}
        for name, value in switched.items():
            setattr(nt, name, value)
        try:
            yield
        finally:
            for name, value in shipped_values.items():
                setattr(nt, name, value)
        return
    shipped = paged_module.paged_config

    def config(*args):
        base = shipped(*args)
        block_n, warps, stages, *cap = variant
        return dataclasses.replace(base, block_n=block_n or base.block_n, num_warps=warps, num_stages=stages,
                                   maxnreg=cap[0] if cap else None)

    if variant is not None:
        paged_module.paged_config = config
    try:
        yield
    finally:
        paged_module.paged_config = shipped


# (keys per step or None: the shipped one, warps, stages)
PAGED_SWEEP = [None, (32, 4, 6), (128, 4, 4), (128, 8, 4), (256, 8, 3), (64, 8, 5)]


def paged_sweep():
    """Decode from pages of PROBE_PAGES keys (B 8, 32 query heads over 8, D 128, bf16, Lk 16k and
    64k, a shuffled table) under PAGED_SWEEP's configurations, both backends, against our
    contiguous decode: how far the key step, warps and stages move the small pages."""
    from common import paged_attention

    B, H, H_kv, D = 8, 32, 8, 128
    for page in [int(p) for p in os.environ.get("PROBE_PAGES", "16").split()]:
        for Lk in (16384, 65536):
            k, v = (torch.randn(B, H_kv, Lk, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
            q = torch.randn(B, H, 1, D, dtype=torch.bfloat16, device="cuda")
            dense = _graph_time_ms(lambda: attention(q, k, v, enable_gqa=True))
            caches, table, lengths = _shuffled_pages(k, v, page)
            for backend in ("triton", "ninetoothed"):
                line = []
                for variant in PAGED_SWEEP:
                    with _paged_variant(variant):
                        t = _graph_time_ms(lambda: paged_attention(q, *caches, table, lengths, enable_gqa=True,
                                                                   backend=backend))
                    line.append(f"{variant or 'shipped'} {dense / t:.2f}x")
                print(f"page {page} Lk={Lk} {backend}: " + "; ".join(line), flush=True)


# (NineToothed's also at 8 and 2 tiles a step of small pages, 4 shipped: at 8 its FP8 pages of 16 spill, compiled
# for sm_90)
PAGED_FP8_SWEEP = [None, (None, 4, 3), (None, 4, 5, 168), (None, 8, 4), (256, 4, 3), (64, 4, 5), "tiles8", "tiles2"]


def _paged_switch(word: str):
    """A PROBE_SWITCHES word: one of NT_PAGED_SWITCHES as it is, "cfg:KEYS,WARPS,STAGES[,MAXNREG]" as a
    _paged_variant configuration (KEYS "-": the shipped key step), or "splits:N" (either backend: every call
    split into N key ranges, common.plan.force_splits)."""
    if word.startswith("splits:"):
        return ("splits", int(word.removeprefix("splits:")))
    if not word.startswith("cfg:"):
        return word
    keys, *rest = word.removeprefix("cfg:").split(",")
    return (None if keys == "-" else int(keys), *(int(x) for x in rest))


def paged_fp8_sweep():
    """Issue 44's paged FP8 decode (B 8, 32 query heads over 8, D 128, bf16 query, FP8 caches, Lk 16k
    and 64k, pages of PROBE_PAGES keys, default 16 and 64, shuffled) under PAGED_FP8_SWEEP's (key step,
    warps, stages [, register cap]), the value pages row-major and column-major, PROBE_BACKENDS (default
    triton); against the same kernel's bf16 paged call (target 1.8x) and its contiguous FP8 decode with
    the values column-major. PROBE_B and PROBE_LK: another batch and lengths (a large batch: the plan's register
    cap, common.plan.shallow_stages). PROBE_SWITCHES (e.g. "tiles4 tiles2 cfg:-,2,5"): the shipped configuration and
    those only, each one of NineToothed's switches or a configuration "cfg:KEYS,WARPS,STAGES[,MAXNREG]"
    (KEYS "-": the shipped key step)."""
    from common import paged_attention, quantize_fp8

    switches = [_paged_switch(word) for word in os.environ.get("PROBE_SWITCHES", "").split()]
    sweep = [None, *switches] if switches else PAGED_FP8_SWEEP

    B, H, H_kv, D = int(os.environ.get("PROBE_B", "8")), 32, 8, 128
    for Lk in [int(n) for n in os.environ.get("PROBE_LK", "16384 65536").split()]:
        k, v = (torch.randn(B, H_kv, Lk, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        q = torch.randn(B, H, 1, D, dtype=torch.bfloat16, device="cuda")
        (k8, kd), (v8, vd) = quantize_fp8(k), quantize_fp8(v)
        v8_cols = v8.transpose(2, 3).contiguous().transpose(2, 3)
        for page in [int(p) for p in os.environ.get("PROBE_PAGES", "16 64").split()]:
            caches, table, lengths = _shuffled_pages(k, v, page)
            (key_cache, value_cache), table8, _ = _shuffled_pages(k8, v8, page)
            value_columns = _column_pages(value_cache)
            for backend in os.environ.get("PROBE_BACKENDS", "triton").split():
                bf16 = _graph_time_ms(lambda: paged_attention(q, *caches, table, lengths, enable_gqa=True,
                                                              backend=backend), replays=20)
                dense8 = _graph_time_ms(lambda: attention(q, k8, v8_cols, enable_gqa=True, k_descale=kd,
                                                          v_descale=vd, backend=backend), replays=20)
                line = [f"bf16 paged {bf16 * 1e3:.0f} us, fp8 contiguous {dense8 * 1e3:.0f} us"]
                for name, values in (("rows", value_cache), ("columns", value_columns)):
                    for variant in sweep:
                        if isinstance(variant, str) and backend != "ninetoothed":
                            continue  # (NineToothed's switches)
                        with _paged_variant(variant):
                            t = _graph_time_ms(lambda: paged_attention(q, key_cache, values, table8, lengths,
                                                                       enable_gqa=True, k_descale=kd,
                                                                       v_descale=vd, backend=backend), replays=20)
                        line.append(f"{name} {variant or 'shipped'} {t * 1e3:.0f} us {bf16 / t:.2f}x "
                                    f"({dense8 / t:.2f}x contiguous)")
                print(f"fp8 page {page} B={B} Lk={Lk} {backend}: " + "; ".join(line), flush=True)


def paged_fp8_locality():
    """Issue 44: Triton's paged FP8 decode with column-major value pages ran at the contiguous decode's speed
    at pages of 64 (75 µs at Lk 16k, H200) and 1.3x slower at pages of 16 (97 µs), from the same SASS (the
    same tile, 760-779 instructions a step): whether it is the pages' order in memory. B 8, 32 query heads
    over 8, D 128, bf16 query, Lk 16k and 64k; pages of 16, 32, 64 and 128, the table shuffled or in
    address order; value pages row- and column-major; graph replay, TB/s of FP8 cache read and the ratio
    to the contiguous FP8 decode with the values column-major."""
    from common import paged_attention, quantize_fp8

    B, H, H_kv, D = 8, 32, 8, 128
    for Lk in (16384, 65536):
        k, v = (torch.randn(B, H_kv, Lk, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        q = torch.randn(B, H, 1, D, dtype=torch.bfloat16, device="cuda")
        (k8, kd), (v8, vd) = quantize_fp8(k), quantize_fp8(v)
        gb8 = 2 * k.numel() / 1e9
        v8_cols = v8.transpose(2, 3).contiguous().transpose(2, 3)
        dense = _graph_time_ms(lambda: attention(q, k8, v8_cols, enable_gqa=True, k_descale=kd, v_descale=vd,
                                                 backend="triton"), replays=20)
        print(f"fp8 locality Lk={Lk}: contiguous {dense * 1e3:.0f} us {gb8 / dense:.2f} TB/s", flush=True)
        for page in (16, 32, 64, 128):
            line = []
            for shuffled in (True, False):
                (key_cache, value_cache), table, lengths = _shuffled_pages(k8, v8, page, shuffled)
                for name, values in (("rows", value_cache), ("columns", _column_pages(value_cache))):
                    t = _graph_time_ms(lambda: paged_attention(q, key_cache, values, table, lengths, enable_gqa=True,
                                                               k_descale=kd, v_descale=vd, backend="triton"),
                                       replays=20)
                    line.append(f"{'shuffled' if shuffled else 'in order'} {name} {t * 1e3:.0f} us "
                                f"{gb8 / t:.2f} TB/s {dense / t:.2f}x")
            print(f"  page {page}: " + "; ".join(line), flush=True)


def paged_batch():
    """Paged decode at a large batch (more programs than 2 an SM, unsplit), where the paged plan's
    deep pipeline (up to 160 KB of stages: 1 program an SM) meets the dense path's large-batch
    rule (2 stages, 128 registers; the paged plan takes it too since this probe's run of
    2026-12-01): K/V TB/s by graph replay, shipped / 3 stages / 2 stages / 2 stages and the cap,
    both backends, beside our dense decode (the rule on) and SDPA's (bf16, D 128)."""
    from common import paged_attention

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    variants = [None, (None, 4, 3), (None, 4, 2), (None, 4, 2, 128)]
    for B, H, H_kv, Lk, page in [(64, 32, 8, 4096, 16), (64, 32, 8, 4096, 64), (16, 32, 32, 4096, 64),
                                 (32, 32, 8, 8192, 64), (8, 32, 8, 16384, 64)]:
        k, v = (torch.randn(B, H_kv, Lk, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        q = torch.randn(B, H, 1, 128, dtype=torch.bfloat16, device="cuda")
        gb = 2 * k.numel() * k.element_size() / 1e9
        pages = Lk // page
        table = torch.randperm(B * pages, device="cuda").view(B, pages).to(torch.int32)
        caches = []
        for x in (k, v):
            cache = torch.empty(B * pages, page, H_kv, 128, dtype=x.dtype, device="cuda")
            cache[table.long()] = x.view(B, H_kv, pages, page, 128).permute(0, 2, 3, 1, 4)
            caches.append(cache)
        lengths = torch.full((B,), Lk, dtype=torch.int32, device="cuda")
        ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        sdpa = gb / _graph_time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), replays=20)
        line = [f"B={B} H={H}/{H_kv} Lk={Lk} page {page} ({B * H_kv / sms:.2f} programs/SM): sdpa {sdpa:.2f}"]
        for backend in ("triton", "ninetoothed"):
            dense = gb / _graph_time_ms(lambda: attention(q, k, v, enable_gqa=True, backend=backend), replays=20)
            times = []
            for variant in variants:
                with _paged_variant(variant):
                    out = paged_attention(q, *caches, table, lengths, enable_gqa=True, backend=backend)
                    bad = "" if (out.float() - ref.float()).abs().max().item() < 0.05 else " WRONG"
                    t = _graph_time_ms(lambda: paged_attention(q, *caches, table, lengths, enable_gqa=True,
                                                               backend=backend), replays=20)
                times.append(f"{gb / t:.2f}{bad}")
            line.append(f"{backend} dense {dense:.2f} paged " + " / ".join(times))
        print("  ".join(line), flush=True)


def _graph_time_ms(fn, replays: int = 50) -> float:
    """Kernel time of fn() per call: captured once in a CUDA graph, replayed (no host work)."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return sorted(times)[len(times) // 2]


def _programs_per_sm(per_sm: int):
    """Inside the block, splits aim at per_sm programs per SM for every row width."""
    return plan.use_planner(dataclasses.replace(plan.current_planner(), programs_per_sm=per_sm,
                                                programs_per_sm_wide=per_sm))


def _decode_shapes(dtype):
    """The decode sweep's inputs: (Lq, Lk, q, k, v), B = 8, 32 query heads over 8 K/V heads,
    D = 128, Lq 1 and 16, Lk 4k-64k."""
    for Lq in (1, 16):
        for Lk in (4096, 16384, 65536):
            q = torch.randn(8, 32, Lq, 128, dtype=dtype, device="cuda")
            k, v = (torch.randn(8, 8, Lk, 128, dtype=dtype, device="cuda") for _ in range(2))
            yield Lq, Lk, q, k, v


def decode():
    H, H_kv = 32, 8
    for Lq, Lk, q, k, v in _decode_shapes(torch.float16):
        sdpa = gpu_time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        line = [f"Lq={Lq} Lk={Lk} sdpa {sdpa * 1e3:.0f}us"]
        rows = Lq * H // H_kv
        for config in [Config(max(16, rows), 64, 4, 3), Config(max(16, rows), 128, 4, 3),
                       Config(max(16, rows), 64, 4, 4), Config(max(16, rows), 64, 4, 2)]:
            with override(config):
                for per_sm in (1, 2, 4):
                    with _programs_per_sm(per_sm):
                        t = gpu_time_ms(lambda: attention(q, k, v, enable_gqa=True))
                    line.append(f"{config.block_n}/{config.num_warps}w/{config.num_stages}s/x{per_sm}: "
                                f"{sdpa / t:.2f}")
        for _ in range(2):
            sdpa = gpu_time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
            nt = gpu_time_ms(lambda: attention(q, k, v, enable_gqa=True, backend="ninetoothed"))
            tr = gpu_time_ms(lambda: attention(q, k, v, enable_gqa=True))
            wall = [wall_time_us(lambda: f(), calls=100) for f in (
                lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                lambda: attention(q, k, v, enable_gqa=True),
                lambda: attention(q, k, v, enable_gqa=True, backend="ninetoothed"))]
            line.append(f"default: sdpa {sdpa * 1e3:.0f}us triton {sdpa / tr:.2f} ninetoothed {sdpa / nt:.2f} "
                        f"wall us sdpa/triton/nt {wall[0]:.0f}/{wall[1]:.0f}/{wall[2]:.0f}")
        print("  ".join(line), flush=True)


def graphs():
    """A serving decode step (append_kv, paged_attention, lengths advanced; B = 4, 32 query heads over
    8 K/V heads, D = 128, bf16, pages of 64, 3000 keys and growing): wall time per step in a plain
    Python loop against the same step captured in a CUDA graph and replayed, and the kernels' own
    time (graph replay with the host far ahead); SDPA's eager step over a static dense cache beside."""
    from common import append_kv, paged_attention

    B, H, H_kv, D, page, start, steps = 4, 32, 8, 128, 64, 3000, 200
    max_pages = -(-(start + 6000) // page)  # room for the warm-up and timed steps
    for backend in ("triton", "ninetoothed"):
        key_cache = torch.randn(B * max_pages, page, H_kv, D, device="cuda", dtype=torch.bfloat16)
        value_cache = torch.randn_like(key_cache)
        table = torch.randperm(B * max_pages, device="cuda").view(B, max_pages).to(torch.int32)
        seqlens = torch.full((B,), start, dtype=torch.int32, device="cuda")
        query = torch.randn(B, H, 1, D, device="cuda", dtype=torch.bfloat16)
        new = torch.randn(B, H_kv, 1, D, device="cuda", dtype=torch.bfloat16)

        def step():
            lengths = append_kv(key_cache, value_cache, table, seqlens, new, new, backend=backend)
            out = paged_attention(query, key_cache, value_cache, table, lengths, enable_gqa=True, backend=backend)
            seqlens.copy_(lengths)
            return out

        eager = wall_time_us(step, calls=steps // 2, warmup_s=0.05)
        seqlens.fill_(start)
        graph_time = _graph_time_ms(step, replays=20) * 1e3  # kernel time per step (the host far ahead)
        seqlens.fill_(start)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                step()
        seqlens.fill_(start)
        replay = wall_time_us(graph.replay, calls=steps // 2, warmup_s=0.05)
        print(f"{backend}: eager step {eager:.0f} us wall, graph replay {replay:.0f} us wall, kernels "
              f"{graph_time:.0f} us", flush=True)
    # SDPA over a preallocated dense cache (a static cache, as transformers' StaticCache): write the
    # token in place, attend over the filled part. (A torch.cat cache grew through the warm-up loop.)
    room = 5000
    k = torch.randn(B, H_kv, start + room, D, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.bfloat16)
    one = torch.randn(B, H_kv, 1, D, device="cuda", dtype=torch.bfloat16)
    state = {"n": start}

    def sdpa_step():
        n = start + (state["n"] - start) % room  # wraps: the length stays within the warm-up's reach
        k[:, :, n:n + 1].copy_(one)
        state["n"] = n + 1
        return F.scaled_dot_product_attention(q, k[:, :, :n + 1], k[:, :, :n + 1], enable_gqa=True)

    print(f"SDPA eager step (static dense cache: the token written in place, then SDPA): "
          f"{wall_time_us(sdpa_step, calls=steps // 2, warmup_s=0.05):.0f} us wall", flush=True)


def loop():
    """Issue 12's decode loop: B = 4, 32 query heads over 8 K/V heads, D = 128, bf16, keys growing
    from 3000 by one token a step (torch.cat of K and V, as transformers' DynamicCache): wall time
    per step with SDPA, triton and ninetoothed; the attention call alone on a fixed cache (wall,
    and kernel time by graph replay); host time = wall - kernel."""
    B, H, H_kv, D, start = 4, 32, 8, 128, 3000
    q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.bfloat16)
    one = torch.randn(B, H_kv, 1, D, device="cuda", dtype=torch.bfloat16)
    calls = {
        "sdpa": lambda k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "triton": lambda k, v: attention(q, k, v, enable_gqa=True, backend="triton"),
        "ninetoothed": lambda k, v: attention(q, k, v, enable_gqa=True, backend="ninetoothed"),
    }
    for name, call in calls.items():
        base = [torch.randn(B, H_kv, start, D, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        state = {"kv": base}

        def step():
            k, v = (torch.cat([t, one], 2) for t in state["kv"])
            state["kv"] = (k, v)
            return call(k, v)

        def reset():
            state["kv"] = base

        step_wall = wall_time_us(step, calls=100, warmup_s=0.05)
        reset()
        k, v = base
        alone = wall_time_us(lambda: call(k, v), calls=200, warmup_s=0.05)
        kernel = _graph_time_ms(lambda: call(k, v)) * 1e3
        cat = _graph_time_ms(lambda: [torch.cat([t, one], 2) for t in base]) * 1e3
        print(f"{name}: step (cat K, cat V, attention) {step_wall:.0f} us wall; attention alone {alone:.1f} us wall, "
              f"kernel {kernel:.1f} us, host {alone - kernel:.1f} us; the two cats' kernels {cat:.1f} us", flush=True)


def _host_us(fn, calls: int = 50, repeats: int = 7) -> float:
    """Host time per call of ``fn()`` (a launch), in µs: ``calls`` calls from an idle stream, not
    waiting for their kernels (far fewer than the launch queue holds), median of ``repeats``. A
    loop timed to the GPU's end measures the kernels instead wherever they outlast the launches
    (the decode step's 20 µs kernel did: every launch variant read 19 µs, 2026-12-01)."""
    per_call = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return sorted(per_call)[len(per_call) // 2]


def steps():
    """Where the host time of a reused call goes (plan templates): each step timed alone, in a
    loop; the launch's parts by host time alone (``_host_us``), the calls by wall time."""
    from common import dispatch
    from common.reuse import PLANS

    backend = resolve("triton")
    module = backend.load()
    cases = [("decode B4 32/8 Lk3000 bf16", (4, 32, 1, 128), (4, 8, 3000, 128), torch.bfloat16, True),
             ("homework (2,4,16,32) fp16", (2, 4, 16, 32), (2, 4, 16, 32), torch.float16, False)]
    for label, q_shape, kv_shape, dtype, gqa in cases:
        q = torch.randn(q_shape, dtype=dtype, device="cuda")
        k, v = (torch.randn(kv_shape, dtype=dtype, device="cuda") for _ in range(2))
        # (plans of other calls, e.g. `loop`'s growing cache, would take these calls instead)
        PLANS.clear()
        for _ in range(3):  # the first plans and keeps the plan, the second binds its launch, the third
            attention(q, k, v, enable_gqa=gqa)  # finds the compiled kernel
        (kept,) = [p for p in PLANS.values() if p.layout[0][7] == q.shape and p.backend.name == "triton"]
        prepared = kept._rebind(q, k, v)
        captured = {}
        launch = ta._fwd_launcher.launch
        ta._fwd_launcher.launch = lambda grid, args, nw, ns, maxnreg=None: captured.update(grid=grid, args=args,
                                                                                           nw=nw, ns=ns)
        module.forward(prepared)
        ta._fwd_launcher.launch = launch
        grid, args, nw, ns = captured["grid"], captured["args"], captured["nw"], captured["ns"]
        compiled = list(ta._fwd_launcher._by_value.values())[-1]
        grid3 = (*grid, 1, 1)[:3]
        addresses = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
        # Triton's compiled-kernel launch in its parts (triton 3.6's CompiledKernel.__getitem__: the
        # current device and stream, the launch metadata for the hooks, then its launcher object)
        import triton

        knobs = triton.knobs.runtime
        stream = torch.cuda.current_stream().cuda_stream
        run, function, packed = compiled.run, compiled.function, compiled.packed_metadata

        def forward_stubbed():  # module.forward with the launch itself left out
            ta._fwd_launcher.launch = lambda *a: None
            try:
                module.forward(prepared)
            finally:
                ta._fwd_launcher.launch = launch

        times = {
            "sdpa": wall_time_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)),
            "attention(triton)": wall_time_us(lambda: attention(q, k, v, enable_gqa=gqa)),
            "attention(ninetoothed)": wall_time_us(lambda: attention(q, k, v, enable_gqa=gqa, backend="ninetoothed")),
            "_again": wall_time_us(lambda: dispatch._again(q, k, v, False, None, gqa, None, False)),
            "plan.launch (bound)": wall_time_us(lambda: kept.launch(q, k, v)),
            "bound launch": wall_time_us(lambda: kept._bound(q, k, v)),
            "plan._rebind": wall_time_us(lambda: kept._rebind(q, k, v), device="cpu"),
            "rebind (keys replanned)": wall_time_us(lambda: kept._rebind(q, k, v, other_keys=True), device="cpu"),
            "module.forward": _host_us(lambda: module.forward(prepared)),
            "module.forward, launch stubbed": wall_time_us(forward_stubbed, device="cpu"),
            "launcher.launch": _host_us(lambda: launch(grid, args, nw, ns)),
            "compiled[grid](*args)": _host_us(lambda: compiled[grid3](*args)),
            # the same launch with each tensor as its address (what a bound launch passes, BoundKernel.run_compiled):
            # Triton's launcher then makes no data_ptr() call or CUDA pointer query per tensor
            "compiled[grid](*addresses)": _host_us(lambda: compiled[grid3](*addresses)),
            "device+stream": wall_time_us(lambda: torch._C._cuda_getCurrentRawStream(torch.cuda.current_device()),
                                          device="cpu"),
            "launch_metadata": wall_time_us(lambda: compiled.launch_metadata(grid3, stream, *addresses), device="cpu"),
            "compiled.run(*addresses)": _host_us(lambda: run(*grid3, stream, function, packed, None,
                                                                 knobs.launch_enter_hook, knobs.launch_exit_hook,
                                                                 *addresses)),
            # no launch hooks registered: None for them and for their metadata (Triton's C launcher then calls
            # no Python per launch)
            "compiled.run, no hooks": _host_us(lambda: run(*grid3, stream, function, packed, None, None, None,
                                                               *addresses)),
            "torch.empty(out)": wall_time_us(lambda: torch.empty(q.shape, dtype=dtype, device="cuda"), device="cpu"),
        }
        print(label + ": " + "  ".join(f"{name} {t:.1f}" for name, t in times.items()), flush=True)


def bandwidth():
    """Decode at the memory bound (issue 12): kernel time by CUDA-graph replay (no host time) and
    the K/V bytes read per second, bf16, D = 128, for triton, ninetoothed and SDPA."""
    shapes = [  # (B, H, H_kv, Lq, Lk)
        (1, 32, 8, 1, 65536), (1, 32, 8, 1, 262144), (8, 32, 8, 1, 16384), (64, 32, 8, 1, 4096),
        (1, 32, 8, 16, 65536), (8, 32, 8, 16, 16384), (1, 32, 32, 1, 32768), (8, 32, 32, 1, 8192),
    ]
    for B, H, H_kv, Lq, Lk in shapes:
        q = torch.randn(B, H, Lq, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, H_kv, Lk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        gb = 2 * k.numel() * k.element_size() / 1e9
        line = [f"B={B} H={H}/{H_kv} Lq={Lq} Lk={Lk} K/V {gb * 1e3:.0f} MB:"]
        for name, fn in (("sdpa", lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
                         ("triton", lambda: attention(q, k, v, enable_gqa=True, backend="triton")),
                         ("ninetoothed", lambda: attention(q, k, v, enable_gqa=True, backend="ninetoothed"))):
            ms = _graph_time_ms(fn, replays=20)
            line.append(f"{name} {ms * 1e3:.0f} us ({gb / ms:.2f} TB/s)")
        print("  ".join(line), flush=True)


def fp8():
    """Issue 44's targets: the FP8 forward (B·L = 16k, H·D = 2048, D 64 and 128, L 4k and 16k) against our
    bf16 forward and SDPA's, V as given (row-major: the plan copies it column-major) and given column-major;
    tiles swept at L 4k; then decode (B 8, 32 query heads over 8, D 128) from an FP8 cache by CUDA-graph
    replay, bf16 and fp16 queries, contiguous and in pages of 16 and 64. PROBE_FP8 (default "prefill sweep
    decode") names the parts run (an A/B of two trees: "prefill decode", the tiles left out)."""
    from common import paged_attention, quantize_fp8
    from common.tools.tune import gluon_off

    parts = os.environ.get("PROBE_FP8", "prefill sweep decode").split()

    def fwd_tflops(fn, B, H, L, D, causal):
        ms = gpu_time_ms(fn)
        return attention_flops(B, H, L, L, D, causal=causal) / ms / 1e9

    sweep = {64: [(128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 4, 3), (128, 128, 8, 4), (64, 128, 4, 4)],
             128: [(128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 256, 8, 2), (64, 128, 4, 3)]}
    for D in (64, 128) if "prefill" in parts else ():
        H = 2048 // D
        for L in (4096, 16384):
            B = 16384 // L
            x = [torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
            (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8(t) for t in x)
            v8_cols = v8.transpose(2, 3).contiguous().transpose(2, 3)  # column-major V (K-major for the P·V MMA)
            for causal in (False, True):
                sdpa = fwd_tflops(lambda: F.scaled_dot_product_attention(*x, is_causal=causal), B, H, L, D, causal)
                line = [f"D={D} L={L} {'causal' if causal else 'full'}: sdpa bf16 {sdpa:.0f}"]
                for backend in ("triton", "ninetoothed"):
                    bf16 = fwd_tflops(lambda: attention(*x, is_causal=causal, backend=backend), B, H, L, D, causal)
                    kw = dict(is_causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, backend=backend)
                    e4m3 = fwd_tflops(lambda: attention(q8, k8, v8, **kw), B, H, L, D, causal)
                    cols = fwd_tflops(lambda: attention(q8, k8, v8_cols, **kw), B, H, L, D, causal)
                    line.append(f"{backend}: bf16 {bf16:.0f} fp8 {e4m3:.0f} ({e4m3 / bf16:.2f}x ours, "
                                f"{e4m3 / sdpa:.2f}x sdpa) fp8 V given col-major {cols:.0f} ({cols / bf16:.2f}x)")
                    if L == 4096 and backend == "triton" and "sweep" in parts:
                        tiles = []  # (the tl kernel's tiles: the Gluon forward switched off)
                        for config in sweep[D]:
                            with override(Config(*config)), gluon_off():
                                try:
                                    tflops = fwd_tflops(lambda: attention(q8, k8, v8_cols, **kw), B, H, L, D, causal)
                                    tiles.append(f"{config} {tflops:.0f}")
                                except Exception as error:  # noqa: BLE001 (a tile that does not fit: the others run)
                                    tiles.append(f"{config} {type(error).__name__}")
                        line.append("tiles (V col-major): " + ", ".join(tiles))
                print("  ".join(line), flush=True)
    for Lk in (16384, 65536) if "decode" in parts else ():
        q = torch.randn(8, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(8, 8, Lk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        (k8, kd), (v8, vd) = quantize_fp8(k), quantize_fp8(v)
        gb16, gb8 = 2 * k.numel() * 2 / 1e9, 2 * k.numel() / 1e9
        line = [f"decode Lk={Lk}:"]
        for backend in ("triton", "ninetoothed"):
            bf16 = _graph_time_ms(lambda: attention(q, k, v, enable_gqa=True, backend=backend), replays=20)
            line.append(f"{backend}: bf16 {bf16 * 1e3:.0f} us ({gb16 / bf16:.2f} TB/s)")
            for query in (q, q.half()):
                e4m3 = _graph_time_ms(lambda: attention(query, k8, v8, enable_gqa=True, k_descale=kd, v_descale=vd,
                                                        backend=backend), replays=20)
                line.append(f"fp8{' fp16 q' if query.dtype == torch.float16 else ''} "
                            f"{e4m3 * 1e3:.0f} us ({gb8 / e4m3:.2f} TB/s, {bf16 / e4m3:.2f}x)")
            for page in (16, 64):  # the same caches in pages (a shuffled table)
                caches, table, lengths = _shuffled_pages(k, v, page)
                paged16 = _graph_time_ms(lambda: paged_attention(q, *caches, table, lengths, enable_gqa=True,
                                                                 backend=backend), replays=20)
                caches8, table, lengths = _shuffled_pages(k8, v8, page)
                paged8 = _graph_time_ms(lambda: paged_attention(q, *caches8, table, lengths, enable_gqa=True,
                                                                k_descale=kd, v_descale=vd, backend=backend),
                                        replays=20)
                line.append(f"pages of {page}: bf16 {paged16 * 1e3:.0f} us fp8 {paged8 * 1e3:.0f} us "
                            f"({gb8 / paged8:.2f} TB/s, {paged16 / paged8:.2f}x)")
        print("  ".join(line), flush=True)


def fp8_decode():
    """FP8-cache decode (B 8, 32 query heads over 8, D 128, bf16 query; kernel time by graph replay): the
    values given column-major against row-major under the plan's tile, contiguous and in pages of 16
    and 64 (a shuffled table; value pages row-major, then column-major), then (PROBE_FP8_TILES=1) the plan's
    tile against 8-warp and deeper ones, under the plan's split target and one program an SM; both
    backends, Lk 16k and 64k; TB/s of FP8 cache read and the ratio to the bf16 cache; the wall time
    per call of a plain loop (host work included), bf16 and FP8."""
    from common import paged_attention, quantize_fp8

    tiles = [None]
    if os.environ.get("PROBE_FP8_TILES"):
        tiles += [(16, 128, 8, 3), (16, 128, 8, 2), (16, 128, 8, 4), (16, 256, 8, 2), (16, 128, 4, 4)]
    for Lk in (16384, 65536):
        q = torch.randn(8, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(8, 8, Lk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        (k8, kd), (v8, vd) = quantize_fp8(k), quantize_fp8(v)
        gb8 = 2 * k.numel() / 1e9
        # the values given column-major (keys contiguous): the P·V operand's pairs run along the keys
        v8_cols = v8.transpose(2, 3).contiguous().transpose(2, 3)
        for backend in ("triton", "ninetoothed"):
            bf16 = _graph_time_ms(lambda: attention(q, k, v, enable_gqa=True, backend=backend), replays=20)
            line = [f"fp8 decode Lk={Lk} {backend}: bf16 {bf16 * 1e3:.0f} us"]
            t = _graph_time_ms(lambda: attention(q, k8, v8_cols, enable_gqa=True, k_descale=kd, v_descale=vd,
                                                 backend=backend), replays=20)
            line.append(f"V column-major: {t * 1e3:.0f} us {gb8 / t:.2f} TB/s {bf16 / t:.2f}x")
            # a decode loop's wall time per call (host work included): FP8 calls keep their plan too
            walls = [wall_time_us(lambda: attention(q, *kv, enable_gqa=True, backend=backend, **d))
                     for kv, d in (((k, v), {}), ((k8, v8_cols), dict(k_descale=kd, v_descale=vd)))]
            line.append(f"wall per call: bf16 {walls[0]:.0f} us, fp8 {walls[1]:.0f} us")
            # pages in a shuffled table; the value pages row-major, then column-major (NineToothed's pages of 16
            # also with each tile its own softmax update, PAGED_JOIN off)
            nt_variants = ((16, "per-tile"),) if backend == "ninetoothed" else ()
            for page, variant in ((16, None), (64, None)) + nt_variants:
                caches, table, lengths = _shuffled_pages(k, v, page)
                (key_cache, value_cache), table8, lengths = _shuffled_pages(k8, v8, page)
                value_columns = _column_pages(value_cache)
                with _paged_variant(variant):
                    paged16 = _graph_time_ms(lambda: paged_attention(q, *caches, table, lengths, enable_gqa=True,
                                                                     backend=backend), replays=20)
                    line.append(f"pages of {page}{f' {variant}' if variant else ''}: bf16 {paged16 * 1e3:.0f} us")
                    for name, values in (("fp8", value_cache), ("fp8 value pages column-major", value_columns)):
                        t = _graph_time_ms(lambda: paged_attention(q, key_cache, values, table8, lengths,
                                                                   enable_gqa=True, k_descale=kd, v_descale=vd,
                                                                   backend=backend), replays=20)
                        line.append(f"{name} {t * 1e3:.0f} us {gb8 / t:.2f} TB/s {paged16 / t:.2f}x")
            for tile in tiles:
                for per_sm in (None, 1):
                    if tile is not None and tile[2] == 4 and per_sm == 1:
                        continue
                    context = override(Config(*tile)) if tile else contextlib.nullcontext()
                    spread = _programs_per_sm(per_sm) if per_sm else contextlib.nullcontext()
                    try:
                        with context, spread:
                            t = _graph_time_ms(lambda: attention(q, k8, v8, enable_gqa=True, k_descale=kd,
                                                                 v_descale=vd, backend=backend), replays=20)
                        result = f"{t * 1e3:.0f} us {gb8 / t:.2f} TB/s {bf16 / t:.2f}x"
                    except Exception as error:  # noqa: BLE001 (a tile that does not fit: the others run)
                        result = type(error).__name__
                    line.append(f"{tile or 'plan'}{'/x1' if per_sm else ''}: {result}")
            print("  ".join(line), flush=True)


def cold():
    """Issue 43's cold first call: (2, 8, 2048, 128) causal fp16 in a fresh process with empty Triton and
    NineToothed caches, each backend twice; the call's wall time (code generation and compiles),
    not counting the imports and CUDA's start, which come before it; then a later process's first call
    with both caches kept, and with NineToothed's kernels generated again (``common.codecache``'s record
    removed)."""
    import subprocess
    import tempfile

    script = ("import time, torch; from common import attention; "
              "q, k, v = (torch.randn(2, 8, 2048, 128, dtype=torch.float16, device='cuda') for _ in range(3)); "
              "torch.cuda.synchronize(); t = time.perf_counter(); attention(q, k, v, is_causal=True, backend='{}'); "
              "torch.cuda.synchronize(); print(time.perf_counter() - t)")
    import shutil

    def first_call(backend, tmp):
        env = dict(os.environ, TRITON_CACHE_DIR=f"{tmp}/triton", TWIN_ATTENTION_CACHE_DIR=f"{tmp}/nt")
        run = subprocess.run([sys.executable, "-c", script.format(backend)], env=env, capture_output=True, text=True)
        return run.stdout.split()[-1] if run.returncode == 0 else f"failed: {run.stderr[-300:]}"

    for backend in ("triton", "ninetoothed"):
        cold, warm, regenerated = [], [], []
        for _ in range(2):
            with tempfile.TemporaryDirectory() as tmp:
                cold.append(first_call(backend, tmp))
                # a later process's first call, the caches kept (NineToothed: its kernels imported from the
                # code cache), and NineToothed's with its record of what it made removed (generated again)
                warm.append(first_call(backend, tmp))
                if backend == "ninetoothed":
                    shutil.rmtree(f"{tmp}/nt/made", ignore_errors=True)
                    regenerated.append(first_call(backend, tmp))
        print(f"cold first call {backend}: {' '.join(cold)} s; a later process's: {' '.join(warm)} s"
              + (f" (its kernels generated again: {' '.join(regenerated)} s)" if regenerated else ""), flush=True)


def split_sweep():
    """The split decode shapes below 3.5 TB/s (or below SDPA) in `bandwidth`: kernel time (graph
    replay) and K/V bandwidth under other tiles, warps, stages and programs-per-SM targets, both
    backends, against the shipped choice and SDPA (bf16, D = 128)."""
    shapes = [(1, 32, 8, 16, 65536), (1, 32, 8, 1, 65536), (8, 32, 8, 16, 16384), (1, 32, 32, 1, 32768)]
    if os.environ.get("SWEEP_SHAPES"):  # e.g. "64:32:8:1:4096 8:32:8:1:16384" (B:H:H_kv:Lq:Lk)
        shapes = [tuple(map(int, shape.split(":"))) for shape in os.environ["SWEEP_SHAPES"].split()]
    for B, H, H_kv, Lq, Lk in shapes:
        q = torch.randn(B, H, Lq, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, H_kv, Lk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        gb = 2 * k.numel() * k.element_size() / 1e9
        rows = max(16, min(64, Lq * H // H_kv))

        def tbs(backend):
            return gb / _graph_time_ms(lambda: attention(q, k, v, enable_gqa=True, backend=backend), replays=20)

        sdpa = gb / _graph_time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), replays=20)
        line = [f"B={B} H={H}/{H_kv} Lq={Lq} Lk={Lk}: sdpa {sdpa:.2f} triton {tbs('triton'):.2f} "
                f"ninetoothed {tbs('ninetoothed'):.2f} TB/s;"]
        results = []
        for block_n, warps, stages in [(64, 4, 3), (64, 4, 4), (64, 4, 2), (128, 4, 3), (128, 4, 2), (64, 8, 3),
                                       (128, 8, 3), (32, 4, 4)]:
            with override(Config(rows, block_n, warps, stages)):
                for per_sm in (1, 2, 4, 8):
                    with _programs_per_sm(per_sm):
                        results.append((tbs("triton"), f"{block_n}/{warps}w/{stages}s/x{per_sm}"))
        results.sort(reverse=True)
        line.append("triton best: " + ", ".join(f"{name} {t:.2f}" for t, name in results[:6]))
        line.append("worst: " + ", ".join(f"{name} {t:.2f}" for t, name in results[-3:]))
        nt = []
        for per_sm in (1, 2, 4, 8):
            with _programs_per_sm(per_sm):
                nt.append(f"x{per_sm} {tbs('ninetoothed'):.2f}")
        line.append("ninetoothed (shipped tile): " + ", ".join(nt))
        print("  ".join(line), flush=True)


def merge_steps():
    """The merge launch (both backends' loop over splits, ``Planner.merge_splits`` a step): decode
    kernel time (graph replay, bf16, D 128) under steps of 2-32 splits, NineToothed as planned
    and the Triton kernel with its own merge turned off (its merge launch every call), each
    output checked against SDPA; the shipped plan first."""
    from common.reuse import PLANS

    shapes = [(8, 32, 8, 16, 16384), (1, 32, 8, 16, 65536), (1, 32, 8, 1, 65536), (8, 32, 8, 1, 16384),
              (1, 32, 32, 1, 32768), (4, 32, 8, 1, 3000)]
    if os.environ.get("SWEEP_SHAPES"):  # as split_sweep's
        shapes = [tuple(map(int, shape.split(":"))) for shape in os.environ["SWEEP_SHAPES"].split()]
    for B, H, H_kv, Lq, Lk in shapes:
        q = torch.randn(B, H, Lq, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, H_kv, Lk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        gb = 2 * k.numel() * k.element_size() / 1e9
        ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        sdpa = gb / _graph_time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), replays=20)
        line = [f"B={B} H={H}/{H_kv} Lq={Lq} Lk={Lk}: sdpa {sdpa:.2f};"]
        for backend in ("ninetoothed", "triton"):
            parts = []
            for step in (None, 2, 4, 8, 16, 32):  # (None: as shipped)
                planner = plan.current_planner()
                if step is not None:
                    planner = dataclasses.replace(planner, merge_splits=step, kernel_merge_max=0,
                                                  kernel_merge_min_bytes=0)
                PLANS.clear()  # (plans keep their merge: each variant plans afresh)
                with plan.use_planner(planner):
                    error = (attention(q, k, v, enable_gqa=True, backend=backend).float() - ref.float()).abs().max()
                    ms = _graph_time_ms(lambda: attention(q, k, v, enable_gqa=True, backend=backend), replays=20)
                PLANS.clear()
                wrong = "" if error < 2e-2 else f" (WRONG: {error:.3f} from SDPA)"
                parts.append(f"{'shipped' if step is None else step} {gb / ms:.2f}{wrong}")
            line.append(f"{backend}, splits a step: {', '.join(parts)} TB/s;")
        print("  ".join(line), flush=True)


def stages():
    """Unsplit decode launches of many short-row programs (``common.plan.shallow_stages``): the
    shipped choice against 3 and 2 stages forced, both backends, kernel time by graph replay and
    K/V bandwidth (bf16, D 64 and 128), with SDPA's; the programs per SM of each launch."""
    shapes = [(64, 32, 8, 1, 4096, 128), (40, 32, 8, 1, 8192, 128), (128, 32, 8, 1, 2048, 128),
              (16, 32, 32, 1, 4096, 128), (8, 32, 32, 1, 8192, 128), (34, 32, 8, 1, 8192, 128),
              (64, 32, 8, 4, 4096, 128), (64, 32, 8, 1, 4096, 64), (16, 32, 32, 1, 8192, 64)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for B, H, H_kv, Lq, Lk, D in shapes:
        q = torch.randn(B, H, Lq, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, H_kv, Lk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        gb = 2 * k.numel() * k.element_size() / 1e9
        sdpa = gb / _graph_time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), replays=20)
        rows, block_n = max(16, Lq * H // H_kv), 64 if D > 64 else 128  # (common.configs.default_config)
        line = [f"B={B} H={H}/{H_kv} Lq={Lq} Lk={Lk} D={D} ({B * H_kv / sms:.2f} programs/SM): sdpa {sdpa:.2f}"]
        for backend in ("triton", "ninetoothed"):
            def tbs():
                return gb / _graph_time_ms(lambda: attention(q, k, v, enable_gqa=True, backend=backend), replays=20)
            shipped = tbs()
            with override(Config(rows, block_n, 4, 3)):
                three = tbs()
            with override(Config(rows, block_n, 4, 2)):
                two = tbs()
            line.append(f"{backend} shipped {shipped:.2f} 3s {three:.2f} 2s {two:.2f}")
        print("  ".join(line), flush=True)


def maxnreg():
    """The `stages` shapes at D 128 (3 and 2 stages) and the D 64 forward (L 4k and 16k), with every
    kernel this process compiles capped at $PROBE_MAXNREG registers (Triton's ``maxnreg`` launch
    option; our launch path passes a config's, which the plan sets for many-program decode only:
    here every compile is capped, by wrapping ``CachedLauncher._compile_fitting``, and the decode
    shapes run forced configs, which carry none); run once per cap and once without (a process each:
    compiled kernels are cached per process). The decode shapes run uncapped and at caps up to
    128, the forward uncapped and at caps from 160. Compiled by triton 3.6 on the CPU,
    NineToothed's D 128 decode kernel takes 143 registers with 2 stages (3 programs an SM), 123
    capped at 128 (4); its D 64 causal forward at 64 x 64 tiles 188 (2 an SM), 168 capped at 168
    (3); ours at 128 x 64 / 4 warps 232 (2 an SM), 168 capped (3)."""
    from common import launch

    cap = int(os.environ.get("PROBE_MAXNREG", "0"))
    if cap:
        def capped(self, grid, args, num_warps, num_stages, maxnreg=None):
            return self.fn[grid](*args, num_warps=num_warps, num_stages=num_stages, maxnreg=cap)
        launch.CachedLauncher._compile_fitting = capped
    print(f"maxnreg {cap or 'none'}:", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    decode = [(64, 32, 8, 1, 4096), (16, 32, 32, 1, 4096), (64, 32, 8, 4, 4096), (128, 32, 8, 1, 2048),
              (40, 32, 8, 1, 8192)]
    for B, H, H_kv, Lq, Lk in decode if cap <= 128 else ():  # (a decode tile's registers: 126-145)
        q = torch.randn(B, H, Lq, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, H_kv, Lk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        gb = 2 * k.numel() * k.element_size() / 1e9
        line = [f"B={B} H={H}/{H_kv} Lq={Lq} Lk={Lk} ({B * H_kv / sms:.2f} programs/SM):"]
        for backend in ("triton", "ninetoothed"):
            def tbs():
                return gb / _graph_time_ms(lambda: attention(q, k, v, enable_gqa=True, backend=backend), replays=20)
            times = []
            for stages in (3, 2):
                with override(Config(max(16, Lq * H // H_kv), 64, 4, stages)):
                    out = attention(q, k, v, enable_gqa=True, backend=backend)
                    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                    bad = "" if (out.float() - ref.float()).abs().max().item() < 0.05 else " WRONG"
                    times.append(f"{stages}s {tbs():.2f}{bad}")
            line.append(f"{backend} " + " ".join(times))
        print("  ".join(line), flush=True)
    # The D 64 forward: NineToothed's worst against ours (causal, L 4096, 0.78x) runs its table's 64 x 64
    # tile at 188 registers (2 programs an SM; ours at that tile 151: 3), 168 capped at 168; ours at
    # 128 x 64 / 4 warps takes 232 (2 an SM), 168 capped (3 an SM), neither spilling: a third program
    # an SM to overlap one's exponentials with another's products, if the cap costs less than that.
    for causal in (True, False) if cap == 0 or cap >= 160 else ():  # (a forward tile's: 151-254)
        for L in (4096, 16384):
            B, H, D = 16384 // L, 32, 64
            q, k, v = (torch.randn(B, H, L, D, dtype=torch.bfloat16, device="cuda") for _ in range(3))
            flops = 4 * B * H * L * L * D / (2 if causal else 1)
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            sdpa = gpu_time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
            line = [f"forward B={B} H={H} L={L} D={D} causal={causal}: sdpa {flops / sdpa / 1e9:.0f}"]
            for backend in ("triton", "ninetoothed"):
                for config in (None, Config(64, 64, 4, 3), Config(128, 64, 4, 3)):
                    with (override(config) if config else contextlib.nullcontext()):
                        out = attention(q, k, v, is_causal=causal, backend=backend)
                        bad = "" if (out.float() - ref.float()).abs().max().item() < 0.05 else " WRONG"
                        t = gpu_time_ms(lambda: attention(q, k, v, is_causal=causal, backend=backend))
                    name = "table" if config is None else "/".join(map(str, dataclasses.astuple(config)))
                    line.append(f"{backend} {name} {flops / t / 1e9:.0f}{bad}")
            print("  ".join(line), flush=True)


def fwd_tiles():
    """NineToothed's D 64 forward under its table's tile and the others its tune tries (64 x 64
    capped at 168 registers too: 3 programs an SM, as the Triton kernel's 64 x 64 tile), fp16 and
    bf16 (the table is tuned in fp16 and used for both), causal or not, L 1024 and 4096, beside
    Triton's table (B·L = 16384, 32 heads; TFLOP/s)."""
    shipped = resolve("ninetoothed").configs
    for dtype in (torch.float16, torch.bfloat16):
        for causal in (True, False):
            for L in (1024, 4096):
                B, H, D = 16384 // L, 32, 64
                q, k, v = (torch.randn(B, H, L, D, dtype=dtype, device="cuda") for _ in range(3))
                flops = 4 * B * H * L * L * D / (2 if causal else 1)
                ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                table = dataclasses.astuple(shipped.lookup(D, dtype, causal, L, L, False))
                t = gpu_time_ms(lambda: attention(q, k, v, is_causal=causal, backend="triton"))
                line = [f"{str(dtype)[6:]} causal={causal} L={L}: triton {flops / t / 1e9:.0f}  nt table {table}"]
                for config in (None, Config(64, 64, 4, 3), Config(64, 64, 4, 3, 168), Config(128, 64, 4, 3),
                               Config(128, 64, 4, 4), Config(128, 64, 8, 3), Config(128, 128, 8, 3)):
                    with (override(config) if config else contextlib.nullcontext()):
                        out = attention(q, k, v, is_causal=causal, backend="ninetoothed")
                        bad = "" if (out.float() - ref.float()).abs().max().item() < 0.05 else " WRONG"
                        t = gpu_time_ms(lambda: attention(q, k, v, is_causal=causal, backend="ninetoothed"))
                    name = "table" if config is None else "/".join(str(x) for x in dataclasses.astuple(config) if x)
                    line.append(f"{name} {flops / t / 1e9:.0f}{bad}")
                print("  ".join(line), flush=True)


def bwd_tune():
    import datetime
    import json
    import os
    import pathlib

    import triton

    from common import attention_backward
    from common.configs import BackwardConfig, ConfigTable, key
    from common.tools.tune import BACKWARD_CANDIDATES, _inputs, tune_one

    nt = resolve("ninetoothed").configs
    entries = dict(nt.entries)
    f16 = torch.float16
    # BWD_TUNE_KEYS="128:full:1024 128:causal:16384" limits the keys (D:full|causal:L); default: all twelve
    wanted = os.environ.get("BWD_TUNE_KEYS", "").split()
    for D in (64, 128):
        for causal in (False, True):
            for L in (1024, 4096, 16384):
                if wanted and f"{D}:{'causal' if causal else 'full'}:{L}" not in wanted:
                    continue
                q, k, v = _inputs(D, L, f16)
                out, lse = attention(q, k, v, is_causal=causal, backend="triton", return_lse=True)
                grad_out = torch.randn_like(out)

                def time_of(backend):
                    return gpu_time_ms(lambda: attention_backward(grad_out, q, k, v, out, lse, is_causal=causal,
                                                                  backend=backend))
                triton_ms = time_of("triton")
                before = nt.lookup_backward(D, f16, causal, L, L, False)
                before_ms = time_of("ninetoothed")
                best, times = tune_one("ninetoothed", D, f16, causal, L, backward=True, verbose=False)
                failed = [c for c in BACKWARD_CANDIDATES[D] if BackwardConfig(*c) not in times]
                ranked = ", ".join(f"{dataclasses.astuple(c)} {t * 1e3:.0f}" for c, t in
                                   sorted(times.items(), key=lambda kv: kv[1]))
                print(f"D={D} causal={causal} L={L}: triton {triton_ms * 1e3:.0f}us  ninetoothed shipped "
                      f"{dataclasses.astuple(before)} {before_ms * 1e3:.0f}us ({triton_ms / before_ms:.2f}x triton)  "
                      f"best {dataclasses.astuple(best)} {times[best] * 1e3:.0f}us ({triton_ms / times[best]:.2f}x)"
                      f"  all: {ranked}  failed: {failed}", flush=True)
                if times[best] < 0.98 * before_ms:  # a gain past do_bench's run-to-run noise
                    for dtype in (torch.float16, torch.bfloat16):
                        entries[key(D, dtype, causal, L, True)] = best
    meta = dict(nt.meta, gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"))
    out_dir = os.environ.get("OUT", "/tmp")
    ConfigTable.write(pathlib.Path(out_dir) / "nt_configs.json", entries, meta)
    print(json.dumps({k: list(dataclasses.astuple(v)) for k, v in entries.items() if k.startswith("bwd")}))


def gqa_bwd():
    """Grouped-query backward against MHA's at the same FLOPs (32 query heads over 8 K/V heads
    against 32 over 32), causal, fp16: both backends loop over a K/V head's query heads in their
    dK/dV pass (the Triton kernel's group loop spilled 464 bytes at D 128, sm_90), so GQA running
    slower per FLOP than MHA is that loop's cost. SDPA's backward (enable_gqa) beside them."""
    from common import attention_backward

    f16 = torch.float16
    for D in (64, 128):
        for L in (1024, 4096):
            B = 16384 // L
            flops = 2.5 * attention_flops(B, 32, L, L, D, causal=True)  # (the backward: 2.5 forwards)
            line = [f"D={D} L={L} causal:"]
            for H_kv in (32, 8):
                q = torch.randn(B, 32, L, D, dtype=f16, device="cuda")
                k, v = (torch.randn(B, H_kv, L, D, dtype=f16, device="cuda") for _ in range(2))
                grad_out = torch.randn_like(q)
                for backend in ("triton", "ninetoothed"):
                    out, lse = attention(q, k, v, is_causal=True, enable_gqa=H_kv != 32, backend=backend,
                                         return_lse=True)
                    ms = gpu_time_ms(lambda: attention_backward(grad_out, q, k, v, out, lse, is_causal=True,
                                                                enable_gqa=H_kv != 32, backend=backend))
                    line.append(f"{backend} {'MHA' if H_kv == 32 else 'GQA'} {ms * 1e3:.0f}us "
                                f"({flops / ms / 1e9:.0f} TFLOP/s)")
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                sdpa_out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=H_kv != 32)
                ms = gpu_time_ms(lambda: torch.autograd.grad(sdpa_out, leaves, grad_out, retain_graph=True))
                line.append(f"sdpa {'MHA' if H_kv == 32 else 'GQA'} {ms * 1e3:.0f}us")
            print("  ".join(line), flush=True)


def gqa_step():
    """Issue 43's grouped-query training step: forward and backward of (2, 32 over 8, 8192, 128), causal,
    bf16, through autograd, each way beside SDPA's default (its backward by enable_gqa)."""
    B, H, H_kv, L, D = 2, 32, 8, 8192, 128
    flops = 3.5 * attention_flops(B, H, L, L, D, causal=True)
    q = torch.randn(B, H, L, D, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    k, v = (torch.randn(B, H_kv, L, D, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(2))
    grad_out = torch.randn_like(q)
    ways = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
            "triton": lambda: attention(q, k, v, is_causal=True, enable_gqa=True, backend="triton"),
            "triton deterministic": lambda: attention(q, k, v, is_causal=True, enable_gqa=True, backend="triton",
                                                      deterministic=True),
            "ninetoothed": lambda: attention(q, k, v, is_causal=True, enable_gqa=True, backend="ninetoothed")}
    line, sdpa_ms = ["(2, 32/8, 8192, 128) causal bf16 fwd+bwd:"], None
    for name, forward in ways.items():
        ms = gpu_time_ms(lambda: torch.autograd.grad(forward(), (q, k, v), grad_out))
        sdpa_ms = sdpa_ms or ms
        line.append(f"{name} {ms * 1e3:.0f}us {flops / ms / 1e9:.0f} TFLOP/s ({sdpa_ms / ms:.2f}x SDPA)")
    print("  ".join(line), flush=True)


def nt_bwd_small():
    """Issue 43's NineToothed backward gap at (B 4, H 32, L 1024, D 64), bf16 (0.55x Triton's by do_bench
    in one process, where the benchmark's (16, 32, 1024, 64) shows 0.91-0.98x): attention_backward's
    do_bench time, its kernel time by CUDA-graph replay (no host work) and a plain loop's wall time per
    call, both backends, causal and not. do_bench near the wall time and far above the graph's says
    the host bounds it (its L2 clearing hides only so much host work), not the kernels."""
    from common import attention_backward

    B, H, L, D = 4, 32, 1024, 64
    q, k, v, grad_out = (torch.randn(B, H, L, D, dtype=torch.bfloat16, device="cuda") for _ in range(4))
    for causal in (False, True):
        line = [f"({B}, {H}, {L}, {D}) {'causal' if causal else 'full'}:"]
        for backend in ("triton", "ninetoothed"):
            out, lse = attention(q, k, v, is_causal=causal, backend=backend, return_lse=True)

            def step():
                return attention_backward(grad_out, q, k, v, out, lse, is_causal=causal, backend=backend)

            bench, wall = gpu_time_ms(step), wall_time_us(step) / 1e3
            try:
                graph = f"{_graph_time_ms(step, replays=20) * 1e3:.0f} us"
            except Exception as error:  # noqa: BLE001 (a step that cannot be captured: the other figures stand)
                graph = type(error).__name__
            line.append(f"{backend} do_bench {bench * 1e3:.0f} us, graph {graph}, wall {wall * 1e3:.0f} us")
        print("  ".join(line), flush=True)


def host_python():
    import common.launch as launch
    import common.ops as ops
    import common.reuse as reuse

    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    # a split step, D 128: B 1, 32 query heads over 8 K/V heads on a GPU; 4 over 1 on a CPU, where the
    # interpreter's two pretended SMs split that
    B, H, H_kv = (1, 32, 8) if on_gpu else (1, 4, 1)
    for backend in ("triton", "ninetoothed"):
        q = torch.randn(B, H, 1, 128, dtype=torch.float16, device=device)
        k, v = (torch.randn(B, H_kv, 3000, 128, dtype=torch.float16, device=device) for _ in range(2))

        def grow(k, v):
            new = torch.randn(B, H_kv, 1, 128, dtype=torch.float16, device=device)
            return torch.cat([k, new], 2), torch.cat([v, new], 2)
        for _ in range(3):  # plan, bind, the first growing launch: real launches
            k, v = grow(k, v)
            attention(q, k, v, enable_gqa=True, backend=backend)
        caches = []
        for _ in range(200):
            k, v = grow(k, v)
            caches.append((k, v))
        launches = [0]
        saved = launch.BoundKernel.launch_new, launch.BoundKernel.run_compiled, ops._quiet, reuse._quiet_interpreter

        def stub(self, args, key_or_kernel):  # (a bound launch calls one of the two, with its arguments built)
            launches[0] += 1
        launch.BoundKernel.launch_new = launch.BoundKernel.run_compiled = stub
        ops._quiet = lambda backend: contextlib.nullcontext()  # a GPU runs no NumPy: nothing to quiet
        reuse._quiet_interpreter = contextlib.nullcontext
        try:
            loops = []
            for _ in range(6):
                start = time.perf_counter()
                for k_, v_ in caches:
                    attention(q, k_, v_, enable_gqa=True, backend=backend)
                loops.append((time.perf_counter() - start) / len(caches) * 1e6)
        finally:
            launch.BoundKernel.launch_new, launch.BoundKernel.run_compiled, ops._quiet, reuse._quiet_interpreter = saved
        loops = sorted(loops[1:])  # (the first loop warms up)
        print(f"{backend}: our Python per decode step {loops[2]:.1f} us (loops {', '.join(f'{t:.1f}' for t in loops)});"
              f" stubbed launches per step {launches[0] / 6 / len(caches):.2f}", flush=True)


def repeat_bwd():
    """Whether the backward is bitwise the same over repeated calls: racecheck reports write-write hazards
    in NineToothed's dQ kernel where replicated lanes of delta's row sum meet in shared memory (see
    benchmarks/NOTES.md, "compute-sanitizer"); 100 backward calls of each shape, every dq, dk, dv compared
    bit for bit with the first. RACE_ONLY=1: one call of sanitize's small case only (for racecheck)."""
    cases = [(2, 3, 17, 33, 40, True), (2, 8, 1000, 1000, 64, True), (1, 4, 300, 700, 128, False)]
    for B, H, Lq, Lk, D, causal in cases[:1] if os.environ.get("RACE_ONLY") else cases:
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.float16, requires_grad=True)
                   for L in (Lq, Lk, Lk))
        grad = torch.randn(B, H, Lq, D, device="cuda", dtype=torch.float16)
        for backend in ("triton", "ninetoothed"):
            def grads():
                out = attention(q, k, v, is_causal=causal, backend=backend)
                return torch.autograd.grad(out, (q, k, v), grad)
            first = grads()
            differ = 0
            for _ in range(0 if os.environ.get("RACE_ONLY") else 100):
                differ += any(not torch.equal(a, b) for a, b in zip(first, grads()))
            print(f"{backend} ({B},{H},{Lq}x{Lk},{D}){' causal' if causal else ''}: 100 backward calls, "
                  f"{differ} differ bitwise from the first", flush=True)


def repeat_varlen_bwd():
    """repeat_bwd for tools/sanitize.py's packed sequences (float32, D 24, causal, GQA), where
    racecheck found the write-write hazards: 100 backward calls compared bit for bit with the first."""
    from common import varlen_attention
    from tests.test_varlen import _cu

    lens_q, lens_k = [5, 0, 33, 70, 1], [9, 3, 33, 64, 1]
    q = torch.randn(sum(lens_q), 4, 24, device="cuda", requires_grad=True)
    k, v = (torch.randn(sum(lens_k), 2, 24, device="cuda", requires_grad=True) for _ in range(2))
    grad = torch.randn_like(q)
    for backend in ("ninetoothed",) if os.environ.get("RACE_ONLY") else ("triton", "ninetoothed"):
        def grads():
            out = varlen_attention(q, k, v, _cu(lens_q), _cu(lens_k), 70, 64, True, enable_gqa=True,
                                   backend=backend, alignment="bottom_right")
            return torch.autograd.grad(out, (q, k, v), grad)
        first = grads()
        differ = sum(any(not torch.equal(a, b) for a, b in zip(first, grads()))
                     for _ in range(0 if os.environ.get("RACE_ONLY") else 100))
        print(f"{backend} varlen float32 D 24: 100 backward calls, {differ} differ bitwise from the first", flush=True)


def default_vs_sdpa():
    """The triton backend's default forward (on sm_90 the kernel its config table names: the Gluon variant or
    the tl kernel) against SDPA's default backend (cuDNN on an H100/H200), bf16, at the benchmark's shapes (B·L
    = 16k, H·D = 2048, D 64/128/256, L 1k/4k/16k, causal and not): TFLOP/s each (causal counts half), the
    better of two ``do_bench`` medians each, and their ratio."""
    from triton.testing import do_bench

    for D in (64, 128, 256):
        for L in (1024, 4096, 16384):
            B, H = 16384 // L, 2048 // D
            q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            for causal in (False, True):
                flops = 4 * B * H * L * L * D / (2 if causal else 1)
                runs = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                        "triton": lambda: attention(q, k, v, is_causal=causal, backend="triton")}
                ms = {name: min(do_bench(fn, warmup=25, rep=100) for _ in range(2)) for name, fn in runs.items()}
                print(f"D {D} L {L} causal {int(causal)}: sdpa {flops / ms['sdpa'] * 1e-9:.0f} triton "
                      f"{flops / ms['triton'] * 1e-9:.0f} TFLOP/s, {ms['sdpa'] / ms['triton']:.3f}x", flush=True)


# float32's tiles before common.configs' FLOAT32_DEFAULTS and FLOAT32_BACKWARD_DEFAULTS kept its products in
# registers: the 16-bit ones (forward, backward) by padded head dim
FLOAT32_OLD_TILES = {64: ((128, 64, 4, 3), (32, 128, 128, 32, 4, 3)),
                     128: ((64, 32, 4, 3), (32, 128, 128, 32, 4, 3)),
                     256: ((64, 32, 4, 2), (16, 32, 32, 16, 4, 1))}


def float32_tiles():
    """float32 attention (full-precision products, on the FMA units) with the shipped tiles against the
    16-bit ones it took before (FLOAT32_OLD_TILES), (2, 8, 1024, D), causal, PROBE_F32_DIMS (default
    "64 128 256"), PROBE_BACKENDS (default triton): each variant's first call of forward + backward in
    seconds (compiles included: run it with empty TRITON_CACHE_DIR and TWIN_ATTENTION_CACHE_DIR), then
    do_bench ms of the forward and of forward + backward; the outputs checked against SDPA in float64."""
    from triton.testing import do_bench

    from common.configs import BackwardConfig
    from common.reference import reference

    for backend in os.environ.get("PROBE_BACKENDS", "triton").split():
        for D in [int(d) for d in os.environ.get("PROBE_F32_DIMS", "64 128 256").split()]:
            q, k, v = (torch.randn(2, 8, 1024, D, device="cuda", requires_grad=True) for _ in range(3))
            grad = torch.randn(2, 8, 1024, D, device="cuda")
            expected = reference(q.detach(), k.detach(), v.detach(), is_causal=True)
            line = []
            for name, tiles in (("shipped", None), ("16-bit tiles", FLOAT32_OLD_TILES[D])):
                with contextlib.ExitStack() as stack:
                    if tiles is not None:
                        stack.enter_context(override(Config(*tiles[0])))
                        stack.enter_context(override(BackwardConfig(*tiles[1])))

                    def step():
                        out = attention(q, k, v, is_causal=True, backend=backend)
                        out.backward(grad)
                        return out

                    start = time.perf_counter()
                    out = step()
                    torch.cuda.synchronize()
                    first = time.perf_counter() - start
                    error = (out.detach().double() - expected).abs().max().item()
                    fwd = do_bench(lambda: attention(q, k, v, is_causal=True, backend=backend), warmup=5, rep=50)
                    both = do_bench(step, warmup=5, rep=50)
                line.append(f"{name}: first call {first:.1f} s, fwd {fwd:.2f} ms, fwd+bwd {both:.2f} ms, "
                            f"max error {error:.1e}")
            print(f"float32 {backend} D {D} causal (2, 8, 1024): " + "; ".join(line), flush=True)


def gluon_tiles():
    """The Gluon forward's tiles swept (BLOCK_M, BLOCK_N, STAGES, warps; the three variants, and ping-pong in
    persistent programs, "ps", with the next Q loaded early where the tile leaves room for it; ping-pong with
    12 warps: three consumer warp groups, FlashAttention-3's tile at D 64) at the benchmark's shapes, bf16,
    causal and not: TFLOP/s each, SDPA's beside; a tile that does not build or fit says why.
    PROBE_GLUON_DIMS: the head dims swept ("64 128" unless set; 256 too); PROBE_GLUON_LENGTHS: the lengths
    L ("4096" unless set), B = 16384 / L; PROBE_GLUON_CONFIGS: only these tiles ("128,128,3,8 192,128,3,12");
    PROBE_GLUON_VARIANTS: only these variants ("plain ws pp ps")."""
    from triton.testing import do_bench

    from impl_triton import gluon_attention as ga

    candidates = {64: [(128, 64, 2, 4), (128, 64, 3, 8), (128, 128, 2, 8), (128, 128, 3, 8), (128, 128, 4, 8),
                       (64, 128, 3, 4), (256, 64, 3, 8), (256, 64, 2, 8), (192, 64, 4, 12), (192, 128, 2, 12),
                       (192, 128, 3, 12)],
                  128: [(128, 64, 2, 8), (128, 64, 3, 8), (128, 128, 2, 8), (128, 128, 2, 4), (64, 128, 2, 4),
                        (128, 128, 3, 8)],
                  256: [(128, 64, 2, 8), (128, 32, 2, 8), (128, 32, 3, 8), (128, 32, 4, 8), (64, 64, 2, 4),
                        (64, 64, 3, 4)]}
    heads = {64: 32, 128: 16, 256: 8}
    dims = [int(d) for d in os.environ.get("PROBE_GLUON_DIMS", "64 128").split()]
    lengths = [int(n) for n in os.environ.get("PROBE_GLUON_LENGTHS", "4096").split()]
    only = [tuple(int(x) for x in c.split(",")) for c in os.environ.get("PROBE_GLUON_CONFIGS", "").split()]
    kinds = os.environ.get("PROBE_GLUON_VARIANTS", "plain ws pp ps").split()
    for (B, H, L, D) in ((16384 // L, heads[d], L, d) for d in dims for L in lengths):
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for causal in (False, True):
            flops = 4 * B * H * L * L * D / (2 if causal else 1)
            sdpa = flops / do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)) * 1e-9
            line = [f"({B}, {H}, {L}, {D}) causal={causal}: sdpa {sdpa:.0f}"]
            for config in only or candidates[D]:
                for variant, kw in (("", {}), (" ws", dict(specialized=True)), (" pp", dict(pingpong=True)),
                                    (" ps", dict(pingpong=True, persistent=True))):
                    if (variant.strip() or "plain") not in kinds:
                        continue
                    # (ping-pong: two or three consumer warp groups of 64 or 128 rows each; the others at most
                    # 128 rows and 8 warps)
                    consumers = config[3] // 4
                    if (kw.get("pingpong") and (consumers not in (2, 3) or config[0] // consumers not in (64, 128))
                            or not kw.get("pingpong") and (config[0] > 128 or config[3] > 8)):
                        continue
                    try:
                        ms = do_bench(lambda: ga.forward(q, k, v, D ** -0.5, 0 if causal else None, False,
                                                         config=config, **kw))
                        line.append(f"{config}{variant} {flops / ms * 1e-9:.0f}")
                    except Exception as error:  # noqa: BLE001 (a tile that does not build: the others still run)
                        line.append(f"{config}{variant} {type(error).__name__}")
            print("; ".join(line), flush=True)


def gluon_tiles_fp8():
    """The Gluon ping-pong forward's FP8 tiles swept (BLOCK_M, BLOCK_N, STAGES, warps: two consumers of 64
    or 128 rows, or three of 64) at issue 44's L 4096 prefill shapes, causal and not, against the tl kernel's FP8 forward
    (attention(), the Gluon kernel switched off) and SDPA's bf16: TFLOP/s each; a tile that does not
    build or fit says why."""
    from triton.testing import do_bench

    from common import quantize_fp8
    from impl_triton import gluon_attention as ga

    candidates = [(128, 128, 3, 8), (128, 128, 2, 8), (128, 64, 4, 8), (256, 64, 3, 8), (256, 64, 2, 8),
                  (192, 128, 3, 12)]
    for (B, H, L, D) in ((4, 32, 4096, 64), (4, 16, 4096, 128)):
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8(t) for t in (q, k, v))
        v8 = v8.transpose(2, 3).contiguous().transpose(2, 3)
        for causal in (False, True):
            flops = 4 * B * H * L * L * D / (2 if causal else 1)
            rate = lambda fn: flops / do_bench(fn, warmup=25, rep=100) * 1e-9  # noqa: E731
            sdpa = rate(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
            tl = rate(lambda: _tl_kernel(q8, k8, v8, is_causal=causal, backend="triton", q_descale=qd,
                                         k_descale=kd, v_descale=vd))
            line = [f"fp8 ({B}, {H}, {L}, {D}) causal={causal}: sdpa bf16 {sdpa:.0f}, tl fp8 {tl:.0f}"]
            for config in candidates:
                def pingpong(config=config):
                    return ga.forward(q8, k8, v8, D ** -0.5, 0 if causal else None, False, pingpong=True,
                                      descales=(qd, kd, vd), config=config)
                try:
                    line.append(f"{config} {rate(pingpong):.0f}")
                except Exception as error:  # noqa: BLE001 (a tile that does not build: the others still run)
                    line.append(f"{config} {type(error).__name__}")
            print("; ".join(line), flush=True)


def varlen_decode():
    """A decoding step as a packed batch (transformers' continuous batching on flash names, and
    flash_attn_varlen_func's decode): 64 sequences, one query each (and 4: speculative), keys
    200-2000 each (a fixed draw), 32 query heads over 8, D 128, bf16, causal bottom-right.
    varlen_attention laid out per sequence (the default here) against the packed layout
    (SHORT_QUERIES = 0), and SDPA on the padded batch; GPU time and K/V bandwidth."""
    import itertools

    import common.varlen
    from common import varlen_attention

    lens_k = torch.randint(200, 2001, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    H, H_kv, D = 32, 8, 128
    cu_k = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32, device="cuda")
    k, v = (torch.randn(sum(lens_k), H_kv, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    kv_bytes = 2 * k.numel() * k.element_size()
    Lmax = max(lens_k)
    padded_k, padded_v = (torch.zeros(64, H_kv, Lmax, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    for i, (a, b) in enumerate(zip(cu_k.tolist(), cu_k.tolist()[1:])):
        padded_k[i, :, :b - a], padded_v[i, :, :b - a] = k[a:b].transpose(0, 1), v[a:b].transpose(0, 1)
    real = torch.arange(Lmax, device="cuda")[None, :] < torch.tensor(lens_k, device="cuda")[:, None]
    default = common.varlen.SHORT_QUERIES
    with torch.no_grad():
        for lq in (1, 4):
            cu_q = torch.arange(0, 64 * lq + 1, lq, dtype=torch.int32, device="cuda")
            q = torch.randn(64 * lq, H, D, dtype=torch.bfloat16, device="cuda")
            line = [f"Lq {lq}"]
            for backend in ("triton", "ninetoothed"):
                for layout, short in (("per sequence", default), ("packed", 0)):
                    common.varlen.SHORT_QUERIES = short
                    try:
                        ms = gpu_time_ms(lambda: varlen_attention(q, k, v, cu_q, cu_k, lq, Lmax, True, enable_gqa=True,
                                                                  alignment="bottom_right", backend=backend))
                    finally:
                        common.varlen.SHORT_QUERIES = default
                    line.append(f"{backend} {layout} {ms * 1e3:.0f} µs ({kv_bytes / ms * 1e-9:.2f} TB/s)")
            pq = q.view(64, lq, H, D).transpose(1, 2)
            mask = real[:, None, None, :] & (torch.arange(Lmax, device="cuda")[None, None, None, :]
                                             <= (torch.tensor(lens_k, device="cuda")[:, None, None, None] - lq
                                                 + torch.arange(lq, device="cuda")[None, None, :, None]))
            ms = gpu_time_ms(lambda: F.scaled_dot_product_attention(pq, padded_k, padded_v, attn_mask=mask,
                                                                    enable_gqa=True))
            line.append(f"SDPA padded {ms * 1e3:.0f} µs")
            print("; ".join(line), flush=True)


def gluon():
    """Issue 43: the Gluon Hopper forward (impl_triton.gluon_attention; its variants: one partition, with a
    producer warp, two consumer warp groups in ping-pong, and those in persistent programs) against our tl
    kernel and SDPA's default in one process: TFLOP/s (do_bench median; causal counts half), bf16 and fp16
    (PROBE_GLUON_DTYPES), B·L = 16k, H·D = 2048 (D 64, 128) and D 256; each variant's ratio to SDPA and to
    the tl kernel, and the largest error of any against the tl kernel's output. PROBE_GLUON_VARIANTS: the
    variants timed ("one producer pingpong persistent" unless set; also "persistent-q-late", persistent
    programs that load each row block's Q only when it starts)."""
    from triton.testing import do_bench

    from impl_triton import gluon_attention as ga

    shapes = [(16, 32, 1024, 64), (4, 32, 4096, 64), (2, 32, 8192, 64), (1, 32, 16384, 64), (16, 16, 1024, 128),
              (4, 16, 4096, 128), (1, 16, 16384, 128), (4, 8, 4096, 256)]
    variants = os.environ.get("PROBE_GLUON_VARIANTS", "one producer pingpong persistent").split()

    for dtype in (getattr(torch, name) for name in os.environ.get("PROBE_GLUON_DTYPES", "bfloat16 float16").split()):
        for B, H, L, D in shapes:
            q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=dtype) for _ in range(3))
            for causal in (False, True):
                flops = 4 * B * H * L * L * D / (2 if causal else 1)
                options = dict(ga.VARIANTS, **{"persistent-q-late": dict(ga.VARIANTS["persistent"], prefetch_q=False)})
                runs = {name: functools.partial(ga.forward, q, k, v, D ** -0.5, 0 if causal else None, False,
                                                **options[name]) for name in variants}
                runs["tl"] = lambda: _tl_kernel(q, k, v, is_causal=causal, backend="triton")
                runs["sdpa"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                tflops = {name: flops / do_bench(fn, warmup=25, rep=100) * 1e-9 for name, fn in runs.items()}
                reference = runs["tl"]().float()
                error = max((runs[name]().float() - reference).abs().max().item() for name in variants)
                ratios = ", ".join(f"{name} {tflops[name] / tflops['sdpa']:.2f} / {tflops[name] / tflops['tl']:.2f}"
                                   for name in variants)
                print(f"{str(dtype)[6:]} ({B}, {H}, {L}, {D}) causal={causal}: "
                      + ", ".join(f"{name} {value:.0f}" for name, value in tflops.items())
                      + f" TFLOP/s; against sdpa / tl: {ratios}; max |gluon - tl| {error:.1e}", flush=True)


def gluon_fp8():
    """Issues 43 and 44: the Gluon ping-pong forward with FP8 q, k, v (values column-major, descales per
    batch and K/V head), in programs a row block each and in persistent programs, against the tl kernel's FP8 forward (attention() with the same inputs, the Gluon
    kernel switched off), the ping-pong bf16 forward and SDPA's bf16 default, at the FP8 targets' shapes
    (B·L 16k, H·D 2048, L 4k and 16k, D 64 and 128, causal and not): TFLOP/s (do_bench median), and the
    largest difference between the two FP8 outputs."""
    from triton.testing import do_bench

    from common import quantize_fp8
    from impl_triton import gluon_attention as ga

    for L in (4096, 16384):
        for D in (64, 128):
            B, H = 16384 // L, 2048 // D
            q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8(t) for t in (q, k, v))
            v8 = v8.transpose(2, 3).contiguous().transpose(2, 3)
            for causal in (False, True):
                flops = 4 * B * H * L * L * D / (2 if causal else 1)
                runs = {
                    "gluon_fp8": lambda: ga.forward(q8, k8, v8, D ** -0.5, 0 if causal else None, False,
                                                    pingpong=True, descales=(qd, kd, vd)),
                    "persistent_fp8": lambda: ga.forward(q8, k8, v8, D ** -0.5, 0 if causal else None, False,
                                                         pingpong=True, persistent=True, descales=(qd, kd, vd)),
                    "tl_fp8": lambda: _tl_kernel(q8, k8, v8, is_causal=causal, backend="triton", q_descale=qd,
                                                 k_descale=kd, v_descale=vd),
                    "gluon_bf16": lambda: ga.forward(q, k, v, D ** -0.5, 0 if causal else None, False, pingpong=True),
                    "sdpa_bf16": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                }
                tflops = {name: flops / do_bench(fn, warmup=25, rep=100) * 1e-9 for name, fn in runs.items()}
                error = max((runs[name]().float() - runs["tl_fp8"]().float()).abs().max().item()
                            for name in ("gluon_fp8", "persistent_fp8"))
                print(f"({B}, {H}, {L}, {D}) causal={causal}: gluon fp8 {tflops['gluon_fp8']:.0f}, persistent fp8 "
                      f"{tflops['persistent_fp8']:.0f}, tl fp8 {tflops['tl_fp8']:.0f}, gluon bf16 "
                      f"{tflops['gluon_bf16']:.0f}, sdpa bf16 {tflops['sdpa_bf16']:.0f} TFLOP/s; gluon fp8 / tl fp8 "
                      f"{tflops['gluon_fp8'] / tflops['tl_fp8']:.2f}, persistent fp8 / tl fp8 "
                      f"{tflops['persistent_fp8'] / tflops['tl_fp8']:.2f}, / sdpa bf16 "
                      f"{tflops['persistent_fp8'] / tflops['sdpa_bf16']:.2f}; max |gluon - tl| {error:.1e}", flush=True)


def gluon_host():
    """What a call of the Gluon path costs in a user's loop (its launch bound from a layout's second call,
    as the tl kernel's): wall time per call (plain loop) against do_bench, attention() with the Gluon kernel
    forced (ATTENTION_GLUON=1), with the tl kernel, and with the config table's dispatch (size guard
    included), bf16, from shapes whose kernels take tens of µs to ones of milliseconds: where the
    Gluon path starts to pay in a loop (``gluon_attention.MIN_FLOPS``)."""
    from impl_triton import gluon_attention as ga

    shapes = [(B, H, L, 128, True) for B, H, L in ((1, 32, 512), (1, 32, 1024), (2, 32, 1024), (4, 32, 1024),
                                                   (2, 32, 2048), (1, 32, 4096), (4, 32, 4096))]
    shapes += [(B, 32, L, 64, False) for B, L in ((2, 1024), (4, 1024), (2, 2048), (1, 4096), (4, 4096))]
    for B, H, L, D, causal in shapes:
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        chosen = resolve("triton").configs.lookup_gluon(D, torch.bfloat16, causal, L)
        flops = 4 * B * H * L * L * D / (2 if causal else 1)
        line = [f"({B}, {H}, {L}, {D}) {'causal' if causal else 'full'} {flops:.1e} FLOPs, table: {chosen} "
                f"(large enough: {ga.large_enough(B, H, L, L, D, causal)})"]
        for name, switch in (("gluon", "1"), ("tl", "0"), ("dispatch", None)):
            with _gluon_switch(switch):
                fn = lambda: attention(q, k, v, is_causal=causal, backend="triton")  # noqa: E731
                fn()
                line.append(f"{name} wall {wall_time_us(fn):.0f} µs, do_bench {gpu_time_ms(fn) * 1e3:.0f} µs")
        print("; ".join(line), flush=True)


def gluon_bwd_host():
    """Issue 43: what the one-pass backward costs a user's loop. Its three launches are bound from a layout's third
    call (gluon_backward.BoundOnePass), as the tl backward's; below some size the one pass's faster kernel still
    loses to its host time (three launches, seven descriptors rebased). Wall time
    per call (plain loop) and do_bench of attention_backward() with the one pass forced (ATTENTION_GLUON=1), the tl
    backward (0) and the default dispatch (unset: the size guard, gluon_attention.large_enough), bf16, at shapes
    around the guard (its FLOPs: 4·B·H·L²·D, half causal, against MIN_FLOPS). Triton >= 3.9 (the one pass)."""
    from common import attention_backward
    from impl_triton import gluon_attention as ga
    from impl_triton import gluon_backward as gb

    if not gb.bulk_reduce_add():
        import triton

        print(f"gluon_bwd_host: the one pass needs triton >= 3.9; this is {triton.__version__}")
        return
    shapes = [(B, H, L, 128, True) for B, H, L in ((1, 8, 1024), (1, 32, 1024), (2, 32, 1024), (4, 32, 1024),
                                                   (1, 8, 4096), (1, 32, 4096))]
    shapes += [(B, H, L, 64, False) for B, H, L in ((1, 8, 1024), (2, 32, 1024), (1, 8, 4096), (1, 32, 4096))]
    for B, H, L, D, causal in shapes:
        q, k, v, grad = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        out, lse = attention(q, k, v, is_causal=causal, backend="triton", return_lse=True)
        flops = 4 * B * H * L * L * D / (2 if causal else 1)
        line = [f"({B}, {H}, {L}, {D}) {'causal' if causal else 'full'} {flops:.1e} FLOPs "
                f"(large enough: {ga.large_enough(B, H, L, L, D, causal)})"]
        for name, switch in (("one pass", "1"), ("tl", "0"), ("dispatch", None)):
            with _gluon_switch(switch):
                fn = functools.partial(attention_backward, grad, q, k, v, out, lse, is_causal=causal,
                                       backend="triton")
                fn()
                line.append(f"{name} wall {wall_time_us(fn):.0f} µs, do_bench {gpu_time_ms(fn) * 1e3:.0f} µs")
        print("; ".join(line), flush=True)


def train_step():
    """Issue 43: where a training step's time goes, bf16, at the benchmark's 1k and 4k shapes (B·L = 16k,
    H·D = 2048). Per shape and way (the triton backend as dispatched; the triton backend with the tl backward,
    its one pass held to longer keys; SDPA): do_bench of the forward without grad and with it, the backward
    alone, the step (forward + backward); a plain loop's wall time per step; the kernels of five steps under
    torch.profiler (device time per step); and for the triton ways the Python functions with the most own
    time over twenty steps (cProfile): the step's host work, which sets its time where the kernels are short."""
    import cProfile
    import pstats

    from common.reuse import BACKWARDS
    from impl_triton import gluon_backward as gb

    shapes = [(16, 16, 1024, 128, True), (16, 16, 1024, 128, False), (16, 32, 1024, 64, True),
              (16, 32, 1024, 64, False), (4, 16, 4096, 128, True)]
    min_length = gb.ONE_PASS_MIN_LENGTH
    for B, H, L, D, causal in shapes:
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
        for way in ("triton", "triton, tl backward", "sdpa"):
            gb.ONE_PASS_MIN_LENGTH = 1 << 62 if way == "triton, tl backward" else min_length
            BACKWARDS.clear()  # (a layout's kept backward follows the threshold it was planned under)
            if way == "sdpa":
                fn = functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=causal)
            else:
                fn = functools.partial(attention, q, k, v, is_causal=causal, backend="triton")
            with torch.no_grad():
                forward = gpu_time_ms(fn)
            with_grad = gpu_time_ms(fn)
            out = fn()
            backward = gpu_time_ms(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))

            def step():
                return torch.autograd.grad(fn(), (q, k, v), grad)

            line = (f"({B}, {H}, {L}, {D}) {'causal' if causal else 'full'} {way}: forward {forward * 1e3:.0f} µs "
                    f"({with_grad * 1e3:.0f} with grad), backward {backward * 1e3:.0f}, step "
                    f"{gpu_time_ms(step) * 1e3:.0f}, wall per step {wall_time_us(step):.0f}")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
            kernels = sorted(((e.self_device_time_total / 5, e.key) for e in prof.key_averages()
                              if e.self_device_time_total > 0), reverse=True)
            print(f"{line}; kernels {sum(t for t, _ in kernels):.0f} µs a step: "
                  + ", ".join(f"{name[:48]} {t:.0f}" for t, name in kernels[:6]), flush=True)
            if way != "sdpa":
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(20):
                    step()
                profiler.disable()
                torch.cuda.synchronize()
                stats = pstats.Stats(profiler)
                rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:12]
                print("    host, own µs a step: " + "; ".join(
                    f"{func[2]} ({os.path.basename(func[0])}:{func[1]}) {own / 20 * 1e6:.0f}"
                    for func, (_, _, own, _, _) in rows), flush=True)
    gb.ONE_PASS_MIN_LENGTH = min_length
    BACKWARDS.clear()


@contextlib.contextmanager
def _gluon_switch(value):
    """ATTENTION_GLUON set to ``value`` (None: unset) inside the block."""
    saved = os.environ.pop("ATTENTION_GLUON", None)
    if value is not None:
        os.environ["ATTENTION_GLUON"] = value
    try:
        yield
    finally:
        os.environ.pop("ATTENTION_GLUON", None)
        if saved is not None:
            os.environ["ATTENTION_GLUON"] = saved


def _tl_kernel(*args, **kwargs):
    """attention() with the Gluon kernel switched off (ATTENTION_GLUON=0, tune's switch)."""
    from common.tools.tune import gluon_off

    with gluon_off():
        return attention(*args, **kwargs)


def _tl_backward(*args, **kwargs):
    """attention_backward() with the Gluon one pass switched off (ATTENTION_GLUON=0): the tl backward."""
    from common import attention_backward
    from common.tools.tune import gluon_off

    with gluon_off():
        return attention_backward(*args, **kwargs)


def gluon_bwd():
    """Issue 43: the Gluon backward's two passes (also with the other dK/dV overlap) and its one-pass
    scheme (dQ by atomics; where triton has it, by the bulk reduce-add too; each also with dK's product
    issued after dQ's, "first"; and with a loader warp and a dQ warp, "ws" (at gluon_backward.ws_tile's tile),
    also at another, "ws other", and with each row tile's stats read from shared memory, "ws stats smem", also at
    D 64's other tiles) against the tl backward (attention_backward, triton, the Gluon one pass switched off) and SDPA's backward (its
    default, cuDNN) on the same forward's output, the backward alone: TFLOP/s at 2.5x the forward's FLOPs (causal
    half), do_bench median, bf16; and the largest gradient difference from the tl backward's. PROBE_BWD_LENGTHS,
    PROBE_BWD_SCHEMES, PROBE_BWD_TILES=0, PROBE_BWD_WS=0: less of it, for a call short of time."""
    from triton.testing import do_bench

    from impl_triton import gluon_backward as gb

    lengths = [int(n) for n in os.environ.get("PROBE_BWD_LENGTHS", "1024 4096 16384").split()]
    for B, H, L, D in ((16, 32, 1024, 64), (4, 32, 4096, 64), (1, 32, 16384, 64), (16, 16, 1024, 128),
                       (4, 16, 4096, 128), (1, 16, 16384, 128)):
        if L not in lengths:  # (PROBE_BWD_LENGTHS: the lengths to run, for a call short of time)
            continue
        q, k, v, grad = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        for causal in (False, True):
            flops = 2.5 * 4 * B * H * L * L * D / (2 if causal else 1)
            out, lse = attention(q, k, v, is_causal=causal, backend="triton", return_lse=True)
            qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
            sdpa_out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
            runs = {
                "gluon": lambda: gb.backward(q, k, v, out, grad, lse, D ** -0.5, 0 if causal else None),
                "tl": functools.partial(_tl_backward, grad, q, k, v, out, lse, is_causal=causal, backend="triton"),
                "sdpa": lambda: torch.autograd.grad(sdpa_out, (qs, ks, vs), grad, retain_graph=True),
            }
            # (the dK/dV pass's other tiles: the overlap at row tiles of 64 and 32, or none; PROBE_BWD_TILES=0
            # leaves them out, for a call that only compares the schemes)
            for name, dkdv in (("overlap 64", (64, 128, 3, 8, True)), ("overlap 32", (32, 128, 4, 8, True)),
                               ("no overlap", (64, 128, 2, 8, False))):
                if dkdv != gb.tiles(D)[1] and os.environ.get("PROBE_BWD_TILES", "1") != "0":
                    runs[name] = functools.partial(gb.backward, q, k, v, out, grad, lse, D ** -0.5,
                                                   0 if causal else None, dkdv=dkdv)
            runs["one-pass"] = lambda: gb.backward_fused(q, k, v, out, grad, lse, D ** -0.5, 0 if causal else None)
            runs["one-pass first"] = lambda: gb.backward_fused(q, k, v, out, grad, lse, D ** -0.5,
                                                               0 if causal else None, dq_first=True)
            if gb.bulk_reduce_add():  # (dQ by the copy engine's bulk reduce-add: triton 3.9)
                runs["one-pass tma"] = lambda: gb.backward_fused(q, k, v, out, grad, lse, D ** -0.5,
                                                                 0 if causal else None, dq_tma=True)
                runs["one-pass tma first"] = lambda: gb.backward_fused(q, k, v, out, grad, lse, D ** -0.5,
                                                                       0 if causal else None, dq_tma=True,
                                                                       dq_first=True)
                if os.environ.get("PROBE_BWD_WS", "1") != "0":  # (0: its GPU tests failed or hung)
                    runs["one-pass ws"] = lambda: gb.backward_fused(q, k, v, out, grad, lse, D ** -0.5,
                                                                    0 if causal else None, specialized=True)
                    # (its other tile: the plain one pass's row tiles of 32 at D 128, a third ring slot at D 64;
                    # gluon_backward.ws_tile has the measured one)
                    other = (32, 128, 3, 8, True) if D == 128 else (64, 128, 3, 8, False)
                    runs["one-pass ws other"] = functools.partial(gb.backward_fused, q, k, v, out, grad, lse, D ** -0.5,
                                                                  0 if causal else None, specialized=True, tile=other)
                    # (each row tile's m2 and delta read from shared memory where used, STATS_SMEM; and at D 64
                    # FlashAttention-3's tile, 128 rows x 128 keys, which spills less that way)
                    runs["one-pass ws stats smem"] = functools.partial(
                        gb.backward_fused, q, k, v, out, grad, lse, D ** -0.5, 0 if causal else None, specialized=True,
                        stats_smem=True)
                    # (D 64's other tiles with the stats so, each built for sm_90 without spill or nearly:
                    # 128 rows (48 / 256 bytes of stack, full / causal), 128 rows with dQ^T's product (32 / 144),
                    # a third ring slot, dQ^T's product at 64 rows (none))
                    for name, other in (("128 rows", (128, 128, 2, 8, False)), ("128 rows dqt", (128, 128, 2, 8, True)),
                                        ("3 stages", (64, 128, 3, 8, False)), ("dqt", (64, 128, 2, 8, True))):
                        if D == 64:
                            runs[f"one-pass ws stats smem {name}"] = functools.partial(
                                gb.backward_fused, q, k, v, out, grad, lse, D ** -0.5, 0 if causal else None,
                                specialized=True, tile=other, stats_smem=True)
            # (PROBE_BWD_SCHEMES: the variants to run beside tl and sdpa, comma-separated names, for a call
            # short of time)
            schemes = os.environ.get("PROBE_BWD_SCHEMES")
            if schemes:
                runs = {name: fn for name, fn in runs.items() if name in ("tl", "sdpa", *schemes.split(","))}
            tflops = {name: flops / do_bench(fn, warmup=25, rep=100) * 1e-9 for name, fn in runs.items()}
            tl_grads = runs["tl"]()
            # (gluon: the two passes; overlap / no overlap: their dK/dV pass's other tiles; one-pass: dQ by
            # atomics, tma: by the bulk reduce-add, first: dK's product after dQ's; ws: a loader warp and a dQ
            # warp beside the consumers)
            variants = "; ".join(
                f"{name} {tflops[name]:.0f} ({tflops[name] / tflops['tl']:.2f}x tl, max |it - tl| "
                f"{max((a.float() - b.float()).abs().max().item() for a, b in zip(fn(), tl_grads)):.1e})"
                for name, fn in runs.items() if name not in ("tl", "sdpa"))
            print(f"bf16 ({B}, {H}, {L}, {D}) causal={causal}, backward TFLOP/s: {variants}; tl {tflops['tl']:.0f}, "
                  f"sdpa {tflops['sdpa']:.0f} (tl/sdpa {tflops['tl'] / tflops['sdpa']:.2f})", flush=True)


def serving():
    """Issue 45 item 4: transformers' continuous batching (generate_batch) on our backends
    ("flash_triton", "flash_ninetoothed": under transformers 5.17 its "paged|" route, decoding steps
    over its paged cache through our paged kernels) against its own "sdpa": random-weight Llama and
    Qwen3 (PROBE_MODELS, default both), 16 prompts of 16-256 tokens, greedy, 32 new tokens, in
    float32: the share of positions whose token matches SDPA's; then, in bf16, tokens per second of
    64 concurrent requests (prompts of 128, 64 new tokens each), the three side by side."""
    import transformers

    import common.hf

    common.hf.register()
    shapes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                  dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                       num_key_value_heads=4)),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                  dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=128)),
    }
    names = ["sdpa", "flash_triton", "flash_ninetoothed"]
    print("transformers", transformers.__version__, flush=True)
    # (FlashAttention's own slot where the package is installed; it is not part of our requirements)
    if importlib.util.find_spec("flash_attn") is not None:
        names.append("flash_attention_2")
    else:
        print("flash_attention_2: not run (no flash_attn package here)", flush=True)
    for label in os.environ.get("PROBE_MODELS", "llama qwen3").split():
        config_class, model_class, sizes = shapes[label]
        config = config_class(vocab_size=8192, max_position_embeddings=4096, **sizes)
        generator = torch.Generator().manual_seed(1)
        lengths = torch.randint(16, 257, (16,), generator=generator).tolist()
        prompts = [torch.randint(1, 8192, (n,), generator=generator).tolist() for n in lengths]
        bench_prompts = [torch.randint(1, 8192, (128,), generator=generator).tolist() for _ in range(64)]
        greedy = transformers.GenerationConfig(max_new_tokens=32, do_sample=False, eos_token_id=-1, pad_token_id=0)
        bench = transformers.GenerationConfig(max_new_tokens=64, do_sample=False, eos_token_id=-1, pad_token_id=0)
        # (the cache sized here, not from the GPU's free memory: 64 requests of 192 tokens need 192 blocks of 64)
        sizes = dict(num_blocks=512, block_size=64, max_batch_tokens=2048)
        if hasattr(transformers, "ContinuousBatchingConfig"):
            batching = dict(continuous_batching_config=transformers.ContinuousBatchingConfig(**sizes))
        else:  # (older transformers read the sizes from the generation config)
            batching = {}
            for generation in (greedy, bench):
                for name, value in sizes.items():
                    setattr(generation, name, value)
        tokens = {}
        for name in names:
            torch.manual_seed(0)  # (the same float32 weights for each)
            model = model_class(config).to("cuda").eval()
            model.set_attn_implementation(name)
            start = time.perf_counter()
            try:
                with torch.no_grad():
                    out = model.generate_batch(inputs=prompts, generation_config=greedy, **batching)
                    tokens[name] = [out[k].generated_tokens for k in sorted(out, key=lambda r: int(r.split("_")[1]))]
                    checked = time.perf_counter()
                    model.to(torch.bfloat16)
                    model.generate_batch(inputs=bench_prompts[:8], generation_config=bench, **batching)  # warm-up
                    torch.cuda.synchronize()
                    warm = time.perf_counter()
                    out = model.generate_batch(inputs=bench_prompts, generation_config=bench, **batching)
                    torch.cuda.synchronize()
                    elapsed = time.perf_counter() - warm
            except Exception as error:  # noqa: BLE001 (one implementation's failure must not hide the others')
                print(f"{label} {name} failed after {time.perf_counter() - start:.0f} s: {type(error).__name__}: "
                      f"{str(error)[:300]}", flush=True)
                continue
            generated = sum(len(r.generated_tokens) for r in out.values())
            match = ""
            if name != "sdpa" and "sdpa" in tokens:
                pairs = [(a, b) for ours, ref in zip(tokens[name], tokens["sdpa"]) for a, b in zip(ours, ref)]
                match = f", {sum(a == b for a, b in pairs) / len(pairs):.1%} of positions as sdpa (fp32)"
            print(f"{label} {name}: {generated / elapsed:.0f} tokens/s (bf16){match}; float32 run "
                  f"{checked - start:.1f} s, warm-up {warm - checked:.1f} s, timed {elapsed:.1f} s", flush=True)


def static():
    """Issue 45 item 5: ``generate`` over a static cache, its decoding steps compiled by transformers
    (fullgraph, inductor with CUDA graphs: ``mode="reduce-overhead"``), random-weight Llama (bf16,
    batch 8, prompts of 128, 128 new tokens, greedy) on "sdpa", "triton" and "ninetoothed" in one
    process: tokens per second after warm-up (and eager, compile disabled), graph breaks, graphs
    Inductor ran without CUDA graphs, recompiles of the timed call (an error), tokens as sdpa's (32
    in float32 first, then the bf16 ones)."""
    import transformers
    from torch._dynamo.utils import counters

    import common.hf

    common.hf.register()
    config = transformers.LlamaConfig(vocab_size=8192, max_position_embeddings=4096, hidden_size=1024,
                                      intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                                      num_key_value_heads=4)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, 8192, (8, 128), generator=generator).cuda()
    greedy = transformers.GenerationConfig(max_new_tokens=128, do_sample=False, eos_token_id=-1, pad_token_id=0,
                                           cache_implementation="static",
                                           compile_config=transformers.CompileConfig(fullgraph=True))
    print("transformers", transformers.__version__, flush=True)

    def timed(model, **options):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(input_ids=input_ids, generation_config=greedy, **options)
        torch.cuda.synchronize()
        return out, time.perf_counter() - start

    tokens, exact, line = {}, {}, []
    for name in ("sdpa", "triton", "ninetoothed"):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).to("cuda").eval()
        model.set_attn_implementation(name)
        torch._dynamo.reset()
        counters.clear()
        try:
            with torch.no_grad():
                # (tokens compared in float32, where a random-weight model's choices are not bf16's near ties)
                exact[name] = model.generate(input_ids=input_ids, generation_config=greedy,
                                             max_new_tokens=32)[:, input_ids.shape[1]:]
                model.to(torch.bfloat16)
                torch._dynamo.reset()
                counters.clear()
                _, warm = timed(model)
                timed(model)
                with torch._dynamo.config.patch(error_on_recompile=True):
                    out, elapsed = timed(model)
                timed(model, disable_compile=True)
                _, eager = timed(model, disable_compile=True)
                if os.environ.get("PROBE_PROFILE"):  # where a compiled generate's time goes, by op
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                            torch.profiler.ProfilerActivity.CUDA]) as profile:
                        timed(model)
                    for order in ("self_cuda_time_total", "self_cpu_time_total"):
                        print(f"{name}, by {order}:\n"
                              + profile.key_averages().table(sort_by=order, row_limit=10, max_name_column_width=60),
                              flush=True)
        except Exception as error:  # noqa: BLE001 (one implementation's failure must not hide the others')
            line.append(f"{name} failed: {type(error).__name__}: {str(error)[:400]}")
            continue
        tokens[name] = out[:, input_ids.shape[1]:]
        match = ""
        if name != "sdpa" and "sdpa" in tokens:
            match = (f", {(exact[name] == exact['sdpa']).float().mean().item():.1%} of positions as sdpa's "
                     f"(float32), {(tokens[name] == tokens['sdpa']).float().mean().item():.1%} (bf16)")
        breaks = sum(counters["graph_break"].values())
        skips = counters["inductor"]["cudagraph_skips"]  # (a graph Inductor runs without CUDA graphs)
        n = tokens[name].numel()
        line.append(f"{name}: {n / elapsed:.0f} tokens/s compiled, {n / eager:.0f} eager (first call {warm:.1f} s, "
                    f"{breaks} graph breaks, {counters['stats']['unique_graphs']} graphs, {skips} CUDA-graph "
                    f"skips){match}")
    print("; ".join(line), flush=True)


if __name__ == "__main__":
    for name in sys.argv[1:] or ["regs", "host", "ops", "decode"]:
        globals()[name]()

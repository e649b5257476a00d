"""``tune``: pick block sizes, warps and stages per case on the GPU, once.

For each kernel backend, pass (forward, backward), padded head dim, causal
mode and query-length bucket it times a short list of candidate
configurations on a throughput shape of that bucket (B·L = 16k tokens,
H·D = 2048) and keeps the fastest: timed in float16 for every 16-bit dtype
asked, and, where ``float8_e4m3fn`` is asked, the forward timed again in FP8
(query, keys and values; column-major values) for the FP8 entries. Candidates are timed through
``common.configs.override``; the live tables are never touched. The new
entries are merged into each backend's ``configs.json`` (in its package) after
every key, so a run cut short keeps what it timed. Users' calls only look the
tables up.

The ``gluon`` pass (the Triton backend on an sm_90 GPU) times, per 16-bit key, the ``tl`` kernel against
each variant of the Gluon forward (``impl_triton.gluon_attention``) on the same shape and writes the
fastest into the table's ``gluon`` section, which sends plain forwards on sm_90 to their kernel; with
``float8_e4m3fn`` asked, the FP8 keys too (the tl kernel's FP8 forward against the ping-pong variant's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os

import torch

from common.backends import get_backend, kernel_backends
from common.configs import LENGTH_BUCKETS, BackwardConfig, Config, ConfigTable, key, override

CANDIDATES = {
    16: [(128, 64, 4, 3), (128, 128, 4, 3), (64, 64, 4, 3), (128, 64, 4, 4)],
    32: [(128, 64, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 4, 4)],
    64: [(128, 64, 4, 3), (128, 64, 4, 4), (128, 128, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3),
         (64, 64, 4, 3), (64, 128, 4, 3), (128, 32, 4, 4),
         # 3 programs an SM where a 64 x 64 tile takes more than 168 registers (NineToothed's: 222)
         (64, 64, 4, 3, 168)],
    128: [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
          (128, 32, 4, 4), (64, 128, 4, 3), (128, 64, 8, 4)],
    256: [(64, 32, 4, 2), (64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 3), (128, 64, 8, 2)],
}
# (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, warps, stages)
BACKWARD_CANDIDATES = {
    64: [(32, 128, 128, 32, 4, 3), (64, 128, 128, 64, 8, 3), (32, 64, 64, 32, 4, 3), (64, 64, 64, 64, 4, 3),
         (32, 128, 128, 32, 4, 4), (64, 128, 128, 64, 4, 3), (32, 128, 128, 32, 8, 2)],
    128: [(32, 128, 128, 32, 8, 3), (64, 128, 128, 64, 8, 2), (32, 64, 64, 32, 4, 3), (64, 64, 64, 64, 8, 2),
          (32, 128, 128, 32, 4, 3), (16, 128, 128, 16, 4, 3), (64, 128, 128, 64, 8, 3)],
}
# FP8 (e4m3) query, keys and values: tiles of half the bytes (the H200's FP8 probe ranked these;
# benchmarks/NOTES.md, issue 44). Forward only: FP8 attention has no backward.
FP8_CANDIDATES = {
    64: [(128, 128, 4, 3), (128, 64, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3), (128, 64, 4, 4)],
    128: [(128, 128, 8, 3), (64, 128, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 256, 8, 2)],
}
PASSES = ("fwd", "bwd", "gluon")
DTYPES = ("float16", "bfloat16", "float8_e4m3fn")


def _inputs(block_d, bucket, dtype, requires_grad=False):
    """(q, k, v, descales): a throughput shape of the bucket; FP8 quantized (descales per batch and
    head, the values column-major as the plan would make them), descales {} otherwise."""
    from common import quantize_fp8

    B, H = max(1, 16384 // bucket), max(1, 2048 // block_d)
    if dtype == torch.float8_e4m3fn:
        (q, qd), (k, kd), (v, vd) = (quantize_fp8(torch.randn(B, H, bucket, block_d, device="cuda"))
                                     for _ in range(3))
        v = v.transpose(2, 3).contiguous().transpose(2, 3)
        return q, k, v, dict(q_descale=qd, k_descale=kd, v_descale=vd)
    return (*(torch.randn(B, H, bucket, block_d, dtype=dtype, device="cuda", requires_grad=requires_grad)
              for _ in range(3)), {})


def tune_one(backend: str, block_d: int, dtype, is_causal: bool, bucket: int, backward=False, verbose=True):
    """The fastest candidate for one table key, and every candidate's time, each timed with the Gluon kernels
    switched off (``gluon_off``): the table's entries are the tl kernels' tiles, and on sm_90 the Gluon forward
    or one-pass backward would otherwise run in their place at the keys they serve."""
    from common import attention, attention_backward
    from common.tools.timing import gpu_time_ms

    q, k, v, descales = _inputs(block_d, bucket, dtype)
    if backward:
        out, lse = attention(q, k, v, is_causal=is_causal, backend=backend, return_lse=True)
        grad_out = torch.randn_like(out)
        candidates = [BackwardConfig(*c) for c in BACKWARD_CANDIDATES[block_d]]

        def fn():
            return attention_backward(grad_out, q, k, v, out, lse, is_causal=is_causal, backend=backend)
    else:
        fp8 = dtype == torch.float8_e4m3fn
        candidates = [Config(*c) for c in (FP8_CANDIDATES if fp8 else CANDIDATES).get(block_d, CANDIDATES[block_d])]

        def fn():
            return attention(q, k, v, is_causal=is_causal, backend=backend, **descales)
    times = {}
    for candidate in candidates:
        with override(candidate), gluon_off():
            try:
                times[candidate] = gpu_time_ms(fn)
            except Exception as error:  # noqa: BLE001 - e.g. out of shared memory for this tile shape
                if verbose:
                    print(f"  {candidate}: {type(error).__name__}: {str(error)[:80]}")
    best = min(times, key=times.get)
    if verbose:
        entry = key(block_d, dtype, is_causal, bucket, backward)
        ranked = ", ".join(f"{dataclasses.astuple(c)}: {t * 1e3:.0f}us"
                           for c, t in sorted(times.items(), key=lambda kv: kv[1])[:3])
        print(f"{backend:<12} {entry:<34} best {best}  ({ranked})", flush=True)
    return best, times


@contextlib.contextmanager
def gluon_off():
    """Inside the block the Triton backend runs the tl kernel on sm_90 too (``ATTENTION_GLUON=0``)."""
    saved = os.environ.get("ATTENTION_GLUON")
    os.environ["ATTENTION_GLUON"] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["ATTENTION_GLUON"]
        else:
            os.environ["ATTENTION_GLUON"] = saved


def tune_gluon(block_d: int, dtype, is_causal: bool, bucket: int, verbose=True):
    """The fastest kernel for one key of the gluon section ("tl" or a Gluon variant), and every
    kernel's time: the tl kernel through ``attention()`` (the Gluon kernel switched off), each
    variant through ``gluon_attention.forward``, on tune's shape of the bucket (FP8: its inputs, values
    column-major, and the ping-pong variants alone, the ones that take them)."""
    from common import attention
    from common.tools.timing import gpu_time_ms
    from impl_triton import gluon_attention as ga

    q, k, v, descales = _inputs(block_d, bucket, dtype)
    scale = block_d ** -0.5
    times = {}
    with gluon_off():
        times["tl"] = gpu_time_ms(lambda: attention(q, k, v, is_causal=is_causal, backend="triton", **descales))
    fp8 = dtype == torch.float8_e4m3fn
    variants = {name: options for name, options in ga.VARIANTS.items() if options.get("pingpong") or not fp8}
    given = dict(descales=(descales["q_descale"], descales["k_descale"], descales["v_descale"])) if fp8 else {}
    for name, options in variants.items():
        try:
            times[name] = gpu_time_ms(lambda: ga.forward(q, k, v, scale, 0 if is_causal else None, False, **options,
                                                         **given))
        except Exception as error:  # noqa: BLE001 - a variant that does not build at this head dim
            if verbose:
                print(f"  {name}: {type(error).__name__}: {str(error)[:80]}")
    best = min(times, key=times.get)
    if verbose:
        entry = key(block_d, dtype, is_causal, bucket)
        ranked = ", ".join(f"{name}: {t * 1e3:.0f}us" for name, t in sorted(times.items(), key=lambda kv: kv[1]))
        print(f"{'gluon':<12} {entry:<34} best {best}  ({ranked})", flush=True)
    return best, times


def _gluon_pass(args, path, entries, meta, gluon) -> None:
    """The gluon pass's keys (sm_90, the Triton backend, head dims the Gluon kernel takes), each written
    as it is timed."""
    from impl_triton import gluon_attention as ga

    if torch.cuda.get_device_capability() != (9, 0):
        print("gluon pass skipped: the Gluon forward runs on sm_90 only", flush=True)
        return
    sixteen_bit = [getattr(torch, name) for name in args.dtypes if name != "float8_e4m3fn"]
    fp8 = "float8_e4m3fn" in args.dtypes
    for block_d in (d for d in args.head_dims if d in ga.HEAD_DIMS):
        for is_causal in (False, True):
            for bucket in args.buckets:
                if sixteen_bit:
                    best, _ = tune_gluon(block_d, torch.float16, is_causal, bucket)
                    for dtype in sixteen_bit:
                        gluon[key(block_d, dtype, is_causal, bucket)] = best
                if fp8 and block_d in ga.FP8_HEAD_DIMS:
                    best, _ = tune_gluon(block_d, torch.float8_e4m3fn, is_causal, bucket)
                    gluon[key(block_d, torch.float8_e4m3fn, is_causal, bucket)] = best
                ConfigTable.write(path, entries, meta, gluon)


def main(args) -> int:
    if not torch.cuda.is_available():
        from common.tools.cli import CommandError

        raise CommandError("tune needs a CUDA GPU; this machine has none")
    import triton

    meta = dict(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        how="twin-attention tune (timed in float16, applied to every 16-bit dtype listed; FP8 timed in FP8)",
    )
    sixteen_bit = [getattr(torch, name) for name in args.dtypes if name != "float8_e4m3fn"]
    fp8 = "float8_e4m3fn" in args.dtypes
    for backend in args.backends:
        spec = get_backend(backend)
        entries = dict(spec.configs.entries)  # the new table starts from the committed one
        gluon = dict(spec.configs.gluon)
        path = ConfigTable.path(spec.package)
        for pass_ in args.passes:
            if pass_ == "gluon":
                if backend == "triton":
                    _gluon_pass(args, path, entries, meta, gluon)
                continue
            backward = pass_ == "bwd"
            for block_d in args.head_dims:
                if backward and block_d not in BACKWARD_CANDIDATES:
                    continue
                for is_causal in (False, True):
                    for bucket in args.buckets:
                        if sixteen_bit:
                            best, _ = tune_one(backend, block_d, torch.float16, is_causal, bucket, backward)
                            for dtype in sixteen_bit:
                                entries[key(block_d, dtype, is_causal, bucket, backward)] = best
                        if fp8 and not backward:
                            best, _ = tune_one(backend, block_d, torch.float8_e4m3fn, is_causal, bucket)
                            entries[key(block_d, torch.float8_e4m3fn, is_causal, bucket)] = best
                        # written after every key: a run cut short (a time limit) keeps what it timed
                        ConfigTable.write(path, entries, meta, gluon)
        print(f"wrote {path}")
    return 0


DESCRIPTION = """\
Times candidate block sizes, warps and stages for each kernel backend, pass, padded head
dim, causal mode and query-length bucket on a GPU (timed in float16; FP8's forward in FP8),
and writes the fastest into each backend's committed configs.json. Users' calls only look the tables up.

The gluon pass (the Triton backend on an sm_90 GPU) times, per 16-bit key, the tl kernel against each
variant of the Gluon forward on the same shape and writes the fastest into the table's gluon section,
which sends plain forwards on sm_90 to their kernel.
"""


def add_arguments(parser):
    parser.add_argument("--backends", nargs="+", default=list(kernel_backends()), choices=list(kernel_backends()),
                        help="kernel backends to tune")
    parser.add_argument("--passes", nargs="+", default=list(PASSES), choices=PASSES,
                        help="the forward, the backward, and/or the gluon section (the Triton backend on sm_90: "
                             "the tl kernel or a Gluon variant per key)")
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128], choices=sorted(CANDIDATES),
                        help="padded head dims")
    parser.add_argument("--buckets", nargs="+", type=int, default=[b for b in LENGTH_BUCKETS if b >= 1024],
                        choices=LENGTH_BUCKETS, help="query-length buckets")
    parser.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"], choices=DTYPES,
                        help="dtypes that get the tuned entries (float8_e4m3fn: the forward, timed in FP8)")

"""``tune``: pick block sizes, warps and stages per case on the GPU, once.

For each backend, padded head dim, dtype, causal mode and query-length bucket
it times a short list of candidate configurations on a throughput shape of
that bucket (B·L = 16k tokens, H·D = 2048) and writes the fastest into the
backend's committed ``configs.json``. Users' calls only look the table up.
"""

from __future__ import annotations

import datetime
import importlib

import torch

from common.configs import LENGTH_BUCKETS, Config, key

CANDIDATES = {
    16: [(128, 64, 4, 3), (128, 128, 4, 3), (64, 64, 4, 3), (128, 64, 4, 4)],
    32: [(128, 64, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 4, 4)],
    64: [(128, 64, 4, 3), (128, 64, 4, 4), (128, 128, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3),
         (64, 64, 4, 3), (64, 128, 4, 3), (128, 32, 4, 4)],
    128: [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
          (128, 32, 4, 4), (64, 128, 4, 3), (128, 64, 8, 4)],
    256: [(64, 32, 4, 2), (64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 3), (128, 64, 8, 2)],
}
MODULES = {"triton": "impl_triton.attention", "ninetoothed": "impl_ninetoothed.attention"}


def tune_one(backend: str, block_d: int, dtype, is_causal: bool, bucket: int, verbose=True):
    """The fastest candidate for one table key, and every candidate's time."""
    from common import attention
    from common.timing import gpu_time_ms

    module = importlib.import_module(MODULES[backend])
    table = module.CONFIGS
    entry = key(block_d, dtype, is_causal, bucket)
    L = bucket
    B, H = max(1, 16384 // L), max(1, 2048 // block_d)
    q, k, v = (torch.randn(B, H, L, block_d, dtype=dtype, device="cuda") for _ in range(3))
    previous = table.entries.get(entry)
    times = {}
    try:
        for candidate in CANDIDATES[block_d]:
            table.entries[entry] = Config(*candidate)
            type(table).lookup.cache_clear()
            try:
                times[candidate] = gpu_time_ms(lambda: attention(q, k, v, is_causal=is_causal, backend=backend))
            except Exception as error:  # e.g. out of shared memory for this tile shape
                if verbose:
                    print(f"  {candidate}: {type(error).__name__}: {str(error)[:80]}")
    finally:
        if previous is None:
            table.entries.pop(entry, None)
        else:
            table.entries[entry] = previous
        type(table).lookup.cache_clear()
    best = min(times, key=times.get)
    if verbose:
        ranked = ", ".join(f"{c}: {t * 1e3:.0f}us" for c, t in sorted(times.items(), key=lambda kv: kv[1])[:3])
        print(f"{backend:<12} {entry:<30} best {best}  ({ranked})", flush=True)
    return Config(*best), times


def main(args) -> int:
    if not torch.cuda.is_available():
        print("tune needs a CUDA GPU; this machine has none.")
        return 2
    import triton

    for backend in args.backends:
        module = importlib.import_module(MODULES[backend])
        table = module.CONFIGS
        for block_d in args.head_dims:
            for is_causal in (False, True):
                for bucket in args.buckets:
                    best, _ = tune_one(backend, block_d, torch.float16, is_causal, bucket)
                    for dtype_name in args.dtypes:
                        table.entries[key(block_d, getattr(torch, dtype_name), is_causal, bucket)] = best
        meta = dict(
            gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
            date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            how="python -m common tune (timed in float16, applied to every dtype listed)",
        )
        table.save(meta)
        print(f"wrote {table.path}")
    return 0


def add_arguments(parser):
    parser.add_argument("--backends", nargs="+", default=list(MODULES), choices=list(MODULES))
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128], choices=sorted(CANDIDATES))
    parser.add_argument("--buckets", nargs="+", type=int, default=[b for b in LENGTH_BUCKETS if b >= 1024],
                        choices=LENGTH_BUCKETS)
    parser.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"], choices=["float16", "bfloat16"])

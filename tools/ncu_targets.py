"""One call of a named attention case inside a CUDA profiler range, for Nsight Compute (`ncu`).

    ncu --profile-from-start off --clock-control none --set full -o REPORT python3 tools/ncu_targets.py NAME

Each case compiles and runs its call twice before the range (so no compilation and no plan building is
profiled), then runs it once between ``cudaProfilerStart`` and ``cudaProfilerStop``: the report holds that
call's kernels only. ``python3 tools/ncu_targets.py --list`` prints the cases. Cases pair our kernel with
SDPA's on the same inputs (``sdpa-...``, cuDNN by default), so that the counters of the two can be read
side by side: tensor-pipe and MUFU utilisation, shared-memory traffic, warp stall reasons.
"""

from __future__ import annotations

import os
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from common import attention, attention_backward, quantize_fp8  # noqa: E402

# name: (B, H, L, D, causal, what): B·L = 16k tokens, H·D = 2048, the benchmark's shapes; what is
# "fwd" (triton, the committed dispatch), "fwd-tl" (the tl kernel: ATTENTION_GLUON=0), "fwd-nt"
# (ninetoothed), "fp8" (e4m3 q, k, v through triton's dispatch), "bwd" (triton's backward alone),
# "bwd-nt", or "sdpa"/"sdpa-bwd" (SDPA's default backend on bf16 inputs).
CASES = {
    "d128-4k": (4, 16, 4096, 128, False, "fwd"),
    "d128-4k-tl": (4, 16, 4096, 128, False, "fwd-tl"),
    "d128-4k-nt": (4, 16, 4096, 128, False, "fwd-nt"),
    "d128-4k-sdpa": (4, 16, 4096, 128, False, "sdpa"),
    "d128-4k-causal": (4, 16, 4096, 128, True, "fwd"),
    "d128-4k-causal-sdpa": (4, 16, 4096, 128, True, "sdpa"),
    "d64-1k": (16, 32, 1024, 64, False, "fwd"),
    "d64-1k-sdpa": (16, 32, 1024, 64, False, "sdpa"),
    "d256-4k": (4, 8, 4096, 256, False, "fwd"),
    "d256-4k-sdpa": (4, 8, 4096, 256, False, "sdpa"),
    "fp8-d128-4k": (4, 16, 4096, 128, False, "fp8"),
    "bwd-d128-4k": (4, 16, 4096, 128, False, "bwd"),
    "bwd-d128-4k-nt": (4, 16, 4096, 128, False, "bwd-nt"),
    "bwd-d128-4k-sdpa": (4, 16, 4096, 128, False, "sdpa-bwd"),
}
# name: (page size, backend, value pages column-major) of a paged FP8 decode (B 8, 32 query heads over 8, D 128,
# Lk 16k, bf16 query, a shuffled table): issue 44's small pages, where the two kernels' speeds part
# (benchmarks/NOTES.md has what each case showed)
PAGED_FP8_CASES = {"paged-fp8-p16": (16, "triton", True), "paged-fp8-p64": (64, "triton", True),
                   "paged-fp8-p16-nt": (16, "ninetoothed", True), "paged-fp8-p16-rows": (16, "triton", False),
                   "paged-fp8-p16-nt-rows": (16, "ninetoothed", False)}


def make_paged_fp8_call(page: int, backend: str, columns: bool):
    """A paged FP8 decode over caches of ``page`` keys (``tools/probe.py``'s pages) by ``backend``, the
    value pages column-major or row-major."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from probe import _column_pages, _shuffled_pages

    from common import paged_attention

    torch.manual_seed(0)
    k, v = (torch.randn(8, 8, 16384, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(8, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    (k8, kd), (v8, vd) = quantize_fp8(k), quantize_fp8(v)
    (key_cache, value_cache), table, lengths = _shuffled_pages(k8, v8, page)
    values = _column_pages(value_cache) if columns else value_cache
    return lambda: paged_attention(q, key_cache, values, table, lengths, enable_gqa=True, k_descale=kd, v_descale=vd,
                                   backend=backend)


def make_call(name: str):
    """The case's inputs and a function running its call once."""
    if name in PAGED_FP8_CASES:
        return make_paged_fp8_call(*PAGED_FP8_CASES[name])
    B, H, L, D, causal, what = CASES[name]
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if what == "sdpa":
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if what == "sdpa-bwd":
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        grad = torch.randn_like(out)
        return lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
    if what == "fp8":
        (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8(t) for t in (q, k, v))
        return lambda: attention(q8, k8, v8, is_causal=causal, backend="triton", q_descale=qd, k_descale=kd,
                                 v_descale=vd)
    backend = "ninetoothed" if what.endswith("-nt") else "triton"
    if what.startswith("bwd"):
        out, lse = attention(q, k, v, is_causal=causal, backend=backend, return_lse=True)
        grad = torch.randn_like(out)
        return lambda: attention_backward(grad, q, k, v, out, lse, is_causal=causal, backend=backend)
    if what == "fwd-tl":
        os.environ["ATTENTION_GLUON"] = "0"
    return lambda: attention(q, k, v, is_causal=causal, backend=backend)


def main(argv: list[str]) -> None:
    if not argv or argv[0] == "--list":
        print("\n".join(f"{name}: B, H, L, D, causal, what = {case}" for name, case in CASES.items()))
        print("\n".join(f"{name}: paged FP8 decode, pages of {page}, {backend}, value pages "
                        f"{'column' if columns else 'row'}-major" for name, (page, backend, columns) in PAGED_FP8_CASES.items()))
        return
    call = make_call(argv[0])
    for _ in range(2):  # compiled, planned and bound before the range
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"{argv[0]}: profiled one call", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

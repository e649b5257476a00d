"""Odd shapes through every kernel of both backends, for compute-sanitizer.

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 tools/sanitize.py

Forward (plain, masked, grouped-query, split-KV decode, Dv != D, ragged
lengths, transposed layouts, dropout), the split merge, and the backward (dQ
and dK/dV passes) on the same calls. Each result is also checked against SDPA
in float64, so a run proves both "no bad access" and "right answer".
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, ".")
from common import attention  # noqa: E402
from common.plan import force_splits  # noqa: E402
from tests.cases import Case, check_grads, check_output, make_inputs, sdpa_kwargs  # noqa: E402

f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
CASES = [
    Case(1, 2, 1, 1, 16),
    Case(2, 3, 17, 33, 40, causal=True),
    Case(1, 2, 33, 17, 80, Dv=48, dtype=bf16),
    Case(2, 4, 65, 129, 64, H_kv=2, causal=True, layout="transposed"),
    Case(1, 2, 50, 70, 128, mask="additive-empty-rows", mask_shape="B1LqLk"),
    Case(1, 2, 31, 47, 24, dtype=f32, mask="bool", mask_shape="1Lk", layout="strided", scale=-0.7),
    Case(None, 2, 130, 130, 256, causal=True),
]
DECODE = [Case(2, 8, 1, 3000, 128, H_kv=2), Case(1, 4, 5, 2100, 64)]


def main() -> int:
    torch.manual_seed(0)
    runs = 0
    for backend in ("triton", "ninetoothed"):
        for case in CASES + DECODE:
            q, k, v, mask = make_inputs(case, "cuda")
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            kwargs = sdpa_kwargs(case, mask)
            out = attention(q, k, v, backend=backend, **kwargs)
            check_output(out, q, k, v, **kwargs)
            grad_out = torch.randn_like(out)
            out.backward(grad_out)
            check_grads((q.grad, k.grad, v.grad), q, k, v, grad_out, out=out, **kwargs)
            runs += 1
        with force_splits(3):
            case = Case(1, 2, 7, 200, 32)
            q, k, v, _ = make_inputs(case, "cuda")
            check_output(attention(q, k, v, backend=backend), q, k, v)
        q, k, v = (torch.randn(1, 2, 45, 32, device="cuda", requires_grad=True) for _ in range(3))
        attention(q, k, v, is_causal=True, dropout_p=0.3, backend=backend).sum().backward()
        runs += 2
    torch.cuda.synchronize()
    print(f"sanitize: {runs} calls (forward and backward), all matched SDPA")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

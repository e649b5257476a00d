"""What SDPA's default CUDA path does at the edges our semantics must decide (run on the GPU).

Prints facts, asserts nothing: negative scales, rows whose every key is masked
out, empty batches, attn_mask together with is_causal; and where the host time
of one small call goes.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from common.reference import reference


def main():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 40, 64, dtype=torch.float16, device="cuda") for _ in range(3))
    ref = reference(q, k, v, scale=-0.5)
    out = F.scaled_dot_product_attention(q, k, v, scale=-0.5)
    print(f"negative scale: default SDPA max|err| vs float64 math {(out.double() - ref).abs().max().item():.3g}, "
          f"NaN: {out.isnan().any().item()}")
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(q, k, v, scale=-0.5)
            print(f"  {backend.name}: max|err| {(o.double() - ref).abs().max().item():.3g}")
        except Exception as error:  # noqa: BLE001
            print(f"  {backend.name}: {type(error).__name__}: {str(error)[:100]}")
    mask = torch.ones(40, 40, dtype=torch.bool, device="cuda")
    mask[::3] = False
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    rows = out[:, :, ::3].float()
    print(f"fully masked rows, default SDPA: all zero {bool((rows == 0).all())}; equal to mean of v "
          f"{torch.allclose(rows, v.float().mean(2, keepdim=True).expand_as(rows), atol=1e-2)}")
    with sdpa_kernel(SDPBackend.MATH):
        print(f"fully masked rows, math backend: all zero {bool((F.scaled_dot_product_attention(q, k, v, attn_mask=mask)[:, :, ::3] == 0).all())}")
    for shape in ((0, 2, 8, 32), (2, 0, 8, 32)):
        e = torch.randn(shape, dtype=torch.float16, device="cuda")
        try:
            r = F.scaled_dot_product_attention(e, e, e)
            print(f"empty {shape}: returned {type(r).__name__} {getattr(r, 'shape', None)}")
        except Exception as error:  # noqa: BLE001
            print(f"empty {shape}: {type(error).__name__}: {str(error)[:100]}")
    try:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
        print("attn_mask + is_causal: accepted by default SDPA")
    except Exception as error:  # noqa: BLE001
        print(f"attn_mask + is_causal: {type(error).__name__}: {str(error)[:100]}")

    # Host time of one tiny call, piece by piece.
    import common
    import impl_triton.attention as ta
    from common import plan as planning
    from common.backends import BACKENDS
    from common.dispatch import full_attention
    from common.validation import check_call

    q, k, v = (torch.randn(2, 4, 16, 32, dtype=torch.float16, device="cuda") for _ in range(3))
    triton_backend = BACKENDS["triton"]
    module = triton_backend.load()

    def per_call(fn, n=2000):
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / n * 1e6

    def validate():
        return check_call(triton_backend, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                          enable_gqa=False, return_lse=False)

    def planned_launch():  # validation, a fresh plan and the backend's launch (no kept plan)
        return module.forward(planning.make_forward(validate(), triton_backend, with_lse=False))

    def through_dispatch():  # the same, the compiled kernel forgotten: Triton's own dispatch every call
        ta._fwd_launcher.clear()
        return planned_launch()

    print(f"host µs per call: triton launch through Triton's dispatch every call {per_call(through_dispatch, 200):.1f}")
    print(f"host µs per call: validation {per_call(validate):.1f}, "
          f"validation + plan + launch {per_call(planned_launch):.1f}, "
          f"full_attention() {per_call(lambda: full_attention(q, k, v)):.1f}, "
          f"attention() (a kept plan) {per_call(lambda: common.attention(q, k, v)):.1f}, "
          f"torch.empty {per_call(lambda: torch.empty(2, 4, 16, 32, dtype=torch.float16, device='cuda')):.1f}, "
          f"SDPA {per_call(lambda: F.scaled_dot_product_attention(q, k, v)):.1f}")

if __name__ == "__main__":
    main()

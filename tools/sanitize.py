"""Odd shapes through every kernel of both backends, for compute-sanitizer.

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 tools/sanitize.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python3 tools/sanitize.py --small

Forward (plain, masked, grouped-query, split-KV decode, Dv != D, ragged
lengths, transposed layouts, dropout), the split merge, and the backward (dQ
and dK/dV passes) on the same calls; a window with bottom-right alignment,
soft-capping and sinks (forward and backward); packed variable-length sequences
(forward and backward); a paged cache (append_kv, then paged_attention, split
and not). Each result is also checked against a float64 reference, so a run
proves both "no bad access" and "right answer". Without a GPU it runs on the
CPU under Triton's interpreter (a quick check of the script itself). ``--small``:
one small case through each kernel (racecheck replays every shared-memory
access, so its run is kept short). ``--backend NAME``: that backend only (two
sanitizer runs side by side, one a backend, finish in half the time).
"""

from __future__ import annotations

import contextlib
import sys

import torch

sys.path.insert(0, ".")
from common import attention  # noqa: E402
from common.plan import force_splits  # noqa: E402
from tests.cases import Case, check_grads, check_output, make_inputs, sdpa_kwargs  # noqa: E402
from tests.conftest import DEVICE  # noqa: E402 (and the interpreter, without a GPU)

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


def main(small: bool = False, backends=("triton", "ninetoothed")) -> int:
    torch.manual_seed(0)
    runs = 0
    cases = CASES[1:2] if small else CASES + DECODE
    for backend in backends:
        for case in cases:
            q, k, v, mask = make_inputs(case, DEVICE)
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            kwargs = sdpa_kwargs(case, mask)
            out = attention(q, k, v, backend=backend, **kwargs)
            check_output(out, q, k, v, **kwargs)
            grad_out = torch.randn_like(out)
            out.backward(grad_out)
            check_grads((q.grad, k.grad, v.grad), q, k, v, grad_out, out=out, **kwargs)
            runs += 1
            print(f"{backend} {case.id}: matched", flush=True)  # (a run cut short says how far it got)
        with force_splits(3):
            case = Case(1, 2, 7, 200, 32)
            q, k, v, _ = make_inputs(case, DEVICE)
            check_output(attention(q, k, v, backend=backend), q, k, v)
        q, k, v = (torch.randn(1, 2, 45, 32, device=DEVICE, requires_grad=True) for _ in range(3))
        attention(q, k, v, is_causal=True, dropout_p=0.3, backend=backend).sum().backward()
        runs += 2 + model_features(backend) + varlen(backend) + paged(backend)
        print(f"{backend}: split merge, dropout, features, varlen, paged: matched", flush=True)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    print(f"sanitize: {runs} calls (forward and backward), all matched SDPA")
    return 0


def _close(got, expected, tol, what):
    torch.testing.assert_close(got.double(), expected.double(), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def model_features(backend) -> int:
    """A window, bottom-right, soft-capping and sinks in one call (float32), forward and backward."""
    from tests.test_model_features import _sinks_reference

    q = torch.randn(1, 4, 29, 40, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(1, 2, 45, 40, device=DEVICE, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, device=DEVICE, requires_grad=True)
    features = dict(is_causal=True, alignment="bottom_right", window=(6, 0), softcap=3.0)
    out = attention(q, k, v, sinks=sinks, enable_gqa=True, backend=backend, **features)
    expected, leaves = _sinks_reference(q, k, v, sinks, **features)
    _close(out, expected, 2e-4, f"{backend} features")
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    expected.backward(grad_out.double())
    for name, got, leaf in zip(("dq", "dk", "dv", "dsinks"), (q, k, v, sinks), leaves):
        _close(got.grad, leaf.grad, 1e-3, f"{backend} features {name}")
    return 1


def varlen(backend) -> int:
    """Five packed sequences (an empty one, one of length 1), causal, GQA: forward and backward."""
    from common import varlen_attention
    from tests.test_varlen import _cu, _reference

    lens_q, lens_k = [5, 0, 33, 70, 1], [9, 3, 33, 64, 1]
    q = torch.randn(sum(lens_q), 4, 24, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), 2, 24, device=DEVICE, requires_grad=True) for _ in range(2))
    out = varlen_attention(q, k, v, _cu(lens_q), _cu(lens_k), 70, 64, True, enable_gqa=True, backend=backend,
                           alignment="bottom_right")
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected, _ = _reference(*leaves, lens_q, lens_k, True, "bottom_right", None, None)
    _close(out, expected, 2e-4, f"{backend} varlen")
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    expected.backward(grad_out.double())
    for name, got, leaf in zip(("dq", "dk", "dv"), (q, k, v), leaves):
        _close(got.grad, leaf.grad, 1e-3, f"{backend} varlen {name}")
    return 1


def paged(backend) -> int:
    """append_kv of a prompt into pages of 16 (a shuffled table with spare pages), then
    paged_attention of its last rows, causal, GQA, with and without split pages."""
    from common import append_kv, paged_attention
    from tests.test_paged import _cache, _reference

    lens = [0, 37, 130, 5]
    key_cache, value_cache, table, _, _, _ = _cache([n + 3 for n in lens], 2, 40, 24, 16, torch.float32)
    k_new = [torch.randn(2, n, 40, device=DEVICE) for n in lens]
    v_new = [torch.randn(2, n, 24, device=DEVICE) for n in lens]
    longest = max(lens)
    # (padded to one length: the padding lands past a sequence's length, written and never read)
    pad = [torch.nn.functional.pad(t, (0, 0, 0, longest - t.shape[1])) for t in k_new]
    pad_v = [torch.nn.functional.pad(t, (0, 0, 0, longest - t.shape[1])) for t in v_new]
    start = torch.zeros(len(lens), dtype=torch.int32, device=DEVICE)
    append_kv(key_cache, value_cache, table, start, torch.stack(pad), torch.stack(pad_v), backend=backend)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    query = torch.randn(len(lens), 4, 3, 40, device=DEVICE)
    expected = _reference(query, k_new, v_new, True)
    for splits in (None, 3):
        with force_splits(splits) if splits else contextlib.nullcontext():
            out = paged_attention(query, key_cache, value_cache, table, seqlens, True, enable_gqa=True,
                                  backend=backend)
        _close(out, expected, 2e-4, f"{backend} paged (splits {splits})")
    return 3


if __name__ == "__main__":
    args = sys.argv[1:]
    chosen = (args[args.index("--backend") + 1],) if "--backend" in args else ("triton", "ninetoothed")
    raise SystemExit(main(small="--small" in args, backends=chosen))

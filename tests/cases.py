"""Test cases and the accuracy check shared by the test modules."""

from __future__ import annotations

import dataclasses

import torch

from common.reference import (
    delta_rounding_effect,
    error_bound,
    float32_scores_math,
    grad_error_bound,
    ieee_float32,
    reference,
    reference_lse,
    same_dtype_math,
    score_rounding_effect,
)

LSE_TOLERANCE = {torch.float16: 1e-3, torch.bfloat16: 1e-3, torch.float32: 1e-5}


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention call: shapes, dtype, flags, memory layout and mask."""

    B: int | None  # None: 3-D inputs (H, L, D)
    H: int
    Lq: int
    Lk: int
    D: int
    Dv: int | None = None  # None: same as D
    H_kv: int | None = None  # None: same as H; else grouped-query attention
    dtype: torch.dtype = torch.float16
    causal: bool = False
    scale: float | None = None
    # or "transposed" (a (B, L, H, D) buffer), "strided" (every other element), "misaligned" (contiguous,
    # one element past a 16-byte boundary: no vector or asynchronous copies)
    layout: str = "contiguous"
    mask: str | None = None  # None, "bool", "additive", "bool-empty-rows", "additive-empty-rows"
    mask_shape: str = "BHLqLk"  # which dims the mask has (others broadcast): "LqLk", "B11Lk", "B1LqLk", ...

    @property
    def id(self) -> str:
        parts = [f"B{self.B}" if self.B is not None else "3d", f"H{self.H}"]
        if self.H_kv is not None:
            parts.append(f"Hkv{self.H_kv}")
        parts.append(f"L{self.Lq}" if self.Lq == self.Lk else f"Lq{self.Lq}-Lk{self.Lk}")
        parts.append(f"D{self.D}" + (f"-Dv{self.Dv}" if self.Dv is not None else ""))
        parts.append(str(self.dtype).removeprefix("torch."))
        if self.causal:
            parts.append("causal")
        if self.scale is not None:
            parts.append(f"scale{self.scale}")
        if self.layout != "contiguous":
            parts.append(self.layout)
        if self.mask is not None:
            parts.append(f"{self.mask}-mask-{self.mask_shape}")
        return "-".join(parts)

    @property
    def enable_gqa(self) -> bool:
        return self.H_kv is not None


def params(cases):
    """pytest parameters with readable ids."""
    import pytest

    return [pytest.param(case, id=case.id) for case in cases]


def committed_tiles(backward: bool) -> list:
    """pytest parameters ``(backend, head dim, tile)``: every tile of each kernel backend's
    committed table for the pass (tuned on the H200 for lengths of 1024 and more, which the
    other tests' small cases never look up)."""
    import pytest

    from common.backends import get_backend
    from tests.conftest import KERNEL_BACKENDS

    tiles = set()
    for backend in KERNEL_BACKENDS:
        for name, tile in get_backend(backend).configs.entries.items():
            if name.startswith("bwd-") == backward:
                head_dim = int(name.removeprefix("bwd-").split("-")[0].removeprefix("d"))
                tiles.add((backend, head_dim, tile))
    def numbers(tile):  # (a table's tiles set no register cap)
        return tuple(x for x in dataclasses.astuple(tile) if x is not None)

    return [pytest.param(backend, head_dim, tile, id=f"{backend}-d{head_dim}-{'x'.join(map(str, numbers(tile)))}")
            for backend, head_dim, tile in sorted(tiles, key=lambda t: (t[0], t[1], numbers(t[2])))]


def _tensor(case: Case, batch, heads, length, dim, device):
    dtype = case.dtype
    if case.layout == "transposed":
        t = torch.randn(batch, length, heads, dim, dtype=dtype, device=device).transpose(1, 2)
    elif case.layout == "strided":
        t = torch.randn(batch, heads, length, 2 * dim, dtype=dtype, device=device)[..., ::2]
    elif case.layout == "misaligned":
        t = torch.randn(batch * heads * length * dim + 1, dtype=dtype, device=device)[1:]
        t = t.view(batch, heads, length, dim)
    else:
        t = torch.randn(batch, heads, length, dim, dtype=dtype, device=device)
    return t[0] if case.B is None else t


def _mask(case: Case, device):
    if case.mask is None:
        return None
    B = case.B if case.B is not None else 1
    full = {"B": B, "H": case.H, "Lq": case.Lq, "Lk": case.Lk}
    dims = {
        "LqLk": ("Lq", "Lk"), "1Lk": (1, "Lk"), "B11Lk": ("B", 1, 1, "Lk"), "B1LqLk": ("B", 1, "Lq", "Lk"),
        "1HLqLk": (1, "H", "Lq", "Lk"), "BHLqLk": ("B", "H", "Lq", "Lk"), "HLqLk": ("H", "Lq", "Lk"),
    }[case.mask_shape]
    shape = tuple(full[d] if isinstance(d, str) else d for d in dims)
    if case.mask.startswith("bool"):
        mask = torch.rand(shape, device=device) < 0.7
    else:
        mask = torch.randn(shape, device=device).to(case.dtype) * 2
        mask = mask.masked_fill(torch.rand(shape, device=device) < 0.2, float("-inf"))
    if case.mask.endswith("empty-rows"):
        # every key masked out for every third query row
        rows = torch.zeros(case.Lq, 1, dtype=torch.bool, device=device)
        rows[::3] = True
        mask = mask.masked_fill(rows, False if mask.dtype == torch.bool else float("-inf"))
    return mask


def make_inputs(case: Case, device):
    """Fresh random (query, key, value, attn_mask) for a case."""
    B = case.B if case.B is not None else 1
    H_kv = case.H_kv if case.H_kv is not None else case.H
    Dv = case.Dv if case.Dv is not None else case.D
    q = _tensor(case, B, case.H, case.Lq, case.D, device)
    k = _tensor(case, B, H_kv, case.Lk, case.D, device)
    v = _tensor(case, B, H_kv, case.Lk, Dv, device)
    return q, k, v, _mask(case, device)


def sdpa_kwargs(case: Case, attn_mask):
    return dict(is_causal=case.causal, scale=case.scale, attn_mask=attn_mask, enable_gqa=case.enable_gqa)


def check_output(out, q, k, v, **kwargs):
    """Assert ``out`` is SDPA's answer, by the rule of ``common.reference.error_bound``."""
    ref = reference(q, k, v, **kwargs)
    assert out.shape == ref.shape, f"shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    assert out.dtype == q.dtype, f"dtype {out.dtype}, expected {q.dtype}"
    assert out.device == q.device
    assert not out.isnan().any(), "NaN in the output: an element was left unwritten or computed as NaN"
    if ref.numel() == 0:
        return 0.0
    with torch.no_grad():
        same_error = _max_error(same_dtype_math(q.detach(), k.detach(), v.detach(), **kwargs), ref)
        if q.dtype == torch.float32:  # (the scores' float32 rounding, drawn once more: float32_scores_math)
            same_error = max(same_error, _max_error(float32_scores_math(q.detach(), k.detach(), v.detach(),
                                                                        **kwargs), ref))
    bound, rounding = error_bound(ref, q.dtype, same_error)
    error = (out.double() - ref).abs().max().item()
    assert error <= bound, (f"max error {error:.3g} > bound {bound:.3g} (rounding of the exact answer, or SDPA's "
                            f"math in {q.dtype}: {rounding:.3g})")
    return error


def _max_error(got, expected) -> float:
    """Largest |got - expected|, ignoring NaN (SDPA's math in half precision may give NaN
    where every key is masked out)."""
    return torch.nan_to_num((got.double() - expected).abs(), nan=0.0).max().item()


def check_lse(lse, q, k, **kwargs):
    """Assert ``lse`` is the log-sum-exp of the scaled, masked scores."""
    ref = reference_lse(q, k, **kwargs)
    assert lse.shape == ref.shape and lse.dtype == torch.float32
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(lse), finite), "lse must be -inf exactly where every key is masked out"
    assert (lse[~finite] == float("-inf")).all()
    tolerance = LSE_TOLERANCE[q.dtype] * (1 + ref[finite].abs())
    error = (lse[finite].double() - ref[finite]).abs()
    assert (error <= tolerance).all(), f"lse max error {error.max().item():.3g}"



def reference_grads(q, k, v, grad_out, *, grad_lse=None, **kwargs):
    """(dq, dk, dv) of SDPA's math backend in float64 (and of its log-sum-exp, with ``grad_lse``)."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = reference(*leaves, **kwargs)
    loss = (out * grad_out.double()).sum()
    if grad_lse is not None:
        lse_kwargs = {name: value for name, value in kwargs.items() if name != "enable_gqa"}
        loss = loss + (reference_lse(leaves[0], leaves[1], **lse_kwargs) * grad_lse.double()).sum()
    loss.backward()
    return [t.grad for t in leaves]


def grad_bounds(q, k, v, grad_out, *, grad_lse=None, out=None, **kwargs):
    """(refs, bounds): SDPA's (dq, dk, dv) in float64 and how far, at most, a correct
    FlashAttention-style backward in the inputs' dtype may be from each (the rule of
    ``common.reference.grad_error_bound``); ``out``: the forward's output the backward used
    (its rounding moves dq and dk)."""
    refs = reference_grads(q, k, v, grad_out, grad_lse=grad_lse, **kwargs)
    same = [0.0, 0.0, 0.0]
    if grad_lse is None:  # SDPA's math in the inputs' dtype, differentiated the same way
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with ieee_float32():  # (its backward's products too)
            grads_same = torch.autograd.grad(same_dtype_math(*leaves, **kwargs), leaves, grad_out)
        same = [_max_error(g, r) for g, r in zip(grads_same, refs)]
    lse_kwargs = {name: value for name, value in kwargs.items() if name != "enable_gqa"}
    with torch.no_grad():
        exact = reference(q, k, v, **kwargs)
        stored = out.detach() if out is not None else None
    # What any FlashAttention-style backward moves by: delta from the stored output, and
    # p recomputed from the scores and the log-sum-exp in float32 (both grow with |scale|).
    from_output = [*delta_rounding_effect(q, k, v, exact, grad_out, stored=stored, **lse_kwargs), 0.0]
    from_scores = score_rounding_effect(q, k, v, grad_out, **lse_kwargs)
    bounds = [grad_error_bound(ref, like.dtype, same_error, a + b)[0] if ref.numel() else 0.0
              for ref, like, same_error, a, b in zip(refs, (q, k, v), same, from_output, from_scores)]
    return refs, bounds


def check_grads(grads, q, k, v, grad_out, *, grad_lse=None, out=None, **kwargs):
    """Assert (dq, dk, dv) are SDPA's gradients, by the rule of ``common.reference.grad_error_bound``;
    ``out``: the forward's output the backward used (its rounding moves dq and dk)."""
    refs, bounds = grad_bounds(q, k, v, grad_out, grad_lse=grad_lse, out=out, **kwargs)
    errors = []
    for name, grad, ref, like, bound in zip(("dq", "dk", "dv"), grads, refs, (q, k, v), bounds):
        assert grad is not None, f"{name} is missing"
        assert grad.shape == like.shape and grad.dtype == like.dtype, f"{name}: {grad.shape} {grad.dtype}"
        assert not grad.isnan().any(), f"NaN in {name}"
        if ref.numel() == 0:
            continue
        error = (grad.double() - ref).abs().max().item()
        assert error <= bound, f"{name}: max error {error:.3g} > bound {bound:.3g}"
        errors.append(error)
    return errors

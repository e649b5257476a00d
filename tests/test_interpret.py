"""The interpreter fixes of common/interpret.py: applied only under the interpreter, and they work."""

from __future__ import annotations

import functools

import pytest
import torch

from common.interpret import apply_interpreter_fixes, interpreter_requested
from tests.conftest import INTERPRETED

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="the fixes apply only under Triton's interpreter")


def test_applied_under_the_interpreter():
    assert interpreter_requested()
    assert apply_interpreter_fixes() is True


def test_constexpr_spelled_in_full_is_recognised():
    import triton.runtime.jit as jit

    apply_interpreter_fixes()
    assert jit._normalize_ty("triton.language.constexpr") == "constexpr"
    assert jit._normalize_ty("tl.constexpr") == "constexpr"


def test_overflow_checks_off_unless_asked(monkeypatch):
    """Fix 4: the interpreter's per-operation int32 overflow assertions are off, and
    TWIN_ATTENTION_OVERFLOW_CHECKS=1 leaves them on."""
    import dataclasses
    import types

    from common import compat, interpret

    apply_interpreter_fixes()
    builder = compat.interpreter_builder()
    assert builder.options.sanitize_overflow is False
    fake = types.SimpleNamespace(options=dataclasses.replace(builder.options, sanitize_overflow=True))
    monkeypatch.setenv("TWIN_ATTENTION_OVERFLOW_CHECKS", "1")
    interpret._without_overflow_checks(fake)
    assert fake.options.sanitize_overflow is True
    monkeypatch.delenv("TWIN_ATTENTION_OVERFLOW_CHECKS")
    interpret._without_overflow_checks(fake)
    assert fake.options.sanitize_overflow is False


def test_ninetoothed_can_make_a_kernel():
    """Code generation asks the driver for device properties: the stand-in answers."""
    import triton

    apply_interpreter_fixes()
    properties = triton.runtime.driver.active.utils.get_device_properties(
        triton.runtime.driver.active.get_current_device()
    )
    assert properties["max_shared_mem"] > 0 and properties["max_num_regs"] > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dot_of_half_precision_tiles(dtype):
    """tl.dot of bfloat16 tiles multiplies values, not bit patterns."""
    import triton
    import triton.language as tl

    apply_interpreter_fixes()

    @triton.jit
    def matmul16(A, B, C):
        r = tl.arange(0, 16)
        a = tl.load(A + r[:, None] * 16 + r[None, :])
        b = tl.load(B + r[:, None] * 16 + r[None, :])
        tl.store(C + r[:, None] * 16 + r[None, :], tl.dot(a, b))

    a = torch.randn(16, 16, dtype=dtype)
    b = torch.randn(16, 16, dtype=dtype)
    c = torch.full((16, 16), float("nan"))
    matmul16[(1,)](a, b, c)
    torch.testing.assert_close(c, a.float() @ b.float(), rtol=1e-5, atol=1e-5)


def _bf16_cases() -> torch.Tensor:
    """float32 values whose truncation to bfloat16 and rounding to nearest even differ, or that
    a conversion may mishandle: ties either way, near the largest bfloat16, subnormals, inf, NaN."""
    one_ulp = 2.0**-7  # bfloat16's spacing in [1, 2)
    named = [
        0.99999994, -0.99999994,  # just below 1: rounds to 1.0, truncates to 0.99609375
        1 + one_ulp / 2, 1 + 3 * one_ulp / 2, -(1 + one_ulp / 2), -(1 + 3 * one_ulp / 2),  # ties: to even
        1 + one_ulp / 2 + 2.0**-20, 1 + one_ulp / 2 - 2.0**-20,  # just above, just below halfway
        3.3895313892515355e38, 3.3961e38, 3.3967e38, -3.3967e38, 3.4028235e38,  # max, below / above halfway to inf
        1e-40, -1e-40, 2.0**-133 * 3, 1.1754942e-38,  # subnormals
        0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"),
    ]
    bits = torch.tensor([0x7F800001, 0x7FC00001, 0x7FFFFFFF, 0x3F807FFF, 0x3F808000, 0x3F818000, 0x3F81FFFF],
                        dtype=torch.int64).to(torch.int32).view(torch.float32)  # NaNs of low payload; exact bit cases
    spread = torch.randn(200) * torch.logspace(-30, 30, 200)
    return torch.cat([torch.tensor(named, dtype=torch.float32), bits, spread])


def _same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan), "NaN not kept (or made)"
    kind = torch.int16
    mismatched = (actual.view(kind) != expected.view(kind)) & ~nan
    assert not mismatched.any(), list(zip(actual[mismatched].tolist(), expected[mismatched].tolist()))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # NumPy's float16, to inf
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_converts_to_half_precision_as_torch_does(dtype):
    """Fix 6: float32 -> bfloat16 under the interpreter rounds to nearest even, as a GPU (and torch)
    does, with inf and NaN kept, by ``.to`` and by a store into a bfloat16 tensor, bit for bit
    with ``x.to(torch.bfloat16)`` but for NaN payloads; float16 conversions did so already."""
    import triton
    import triton.language as tl

    apply_interpreter_fixes()

    @triton.jit
    def convert(X, Y, Z, n, BLOCK: tl.constexpr):
        r = tl.arange(0, BLOCK)
        x = tl.load(X + r, mask=r < n)
        tl.store(Y + r, x.to(Y.dtype.element_ty), mask=r < n)  # explicit
        tl.store(Z + r, x, mask=r < n)  # implicit, on store

    x = _bf16_cases()
    explicit, implicit = (torch.full_like(x, float("nan"), dtype=dtype) for _ in range(2))
    convert[(1,)](x, explicit, implicit, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    expected = x.to(dtype)
    _same_bits(explicit, expected)
    _same_bits(implicit, expected)
    if dtype == torch.bfloat16:
        assert explicit[0].item() == 1.0  # 0.99999994, which truncation makes 0.99609375


def test_bf16_rounding_applies_only_where_the_interpreter_truncates():
    """The fix's check tells a truncating conversion from a rounding one, so a Triton whose
    interpreter rounds already is left as it is; the installed interpreter rounds once fixed."""
    import numpy as np

    from common import interpret

    apply_interpreter_fixes()

    def truncating(values):
        return (np.ascontiguousarray(values, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)

    assert interpret._interpreter_rounds_bf16(truncating) is False
    assert interpret._interpreter_rounds_bf16(interpret.bf16_bits) is True
    assert interpret._interpreter_rounds_bf16() is True


def test_e4m3_conversions_match_torch():
    """Fix 7: float32, float16 and bfloat16 -> float8_e4m3fn under the interpreter round to
    nearest even and saturate to +-448, as a GPU's cvt.rn.satfinite does (torch's conversion after
    a clamp), bit for bit; and e4m3 -> float32 keeps NaN."""
    import triton
    import triton.language as tl

    apply_interpreter_fixes()

    @triton.jit
    def convert(X, Y, W, n, BLOCK: tl.constexpr):
        r = tl.arange(0, BLOCK)
        x = tl.load(X + r, mask=r < n)
        y = x.to(tl.float8e4nv)
        tl.store(Y + r, y.to(tl.bfloat16).to(tl.float32), mask=r < n)
        tl.store(W + r, x.to(tl.bfloat16).to(tl.float8e4nv).to(tl.float16).to(tl.float32), mask=r < n)

    x = torch.cat([torch.linspace(-520.0, 520.0, 4001), torch.linspace(-0.02, 0.02, 801),
                   torch.tensor([1.998, 0.3125, 0.34375, 2.0**-10, 3 * 2.0**-11])])
    y, w = torch.empty_like(x), torch.empty_like(x)
    convert[(1,)](x, y, w, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    assert torch.equal(y, x.clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert torch.equal(w, x.bfloat16().float().clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert y[-5].item() == 2.0  # 1.998, which the unfixed interpreter made 1.0

    @triton.jit
    def widen(X, Y, n, BLOCK: tl.constexpr):
        r = tl.arange(0, BLOCK)
        tl.store(Y + r, tl.load(X + r, mask=r < n).to(tl.float32), mask=r < n)

    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    out = torch.empty(256)
    widen[(1,)](codes, out, 256, BLOCK=256)
    assert torch.equal(out.isnan(), codes.float().isnan())
    assert torch.equal(out[~out.isnan()], codes.float()[~out.isnan()])


def test_e4m3_rounding_applies_only_where_the_interpreter_misrounds():
    import numpy as np

    from common import interpret

    apply_interpreter_fixes()

    def truncating(values):
        return interpret.e4m3_bits(np.trunc(np.asarray(values, dtype=np.float32) * 8) / 8)

    assert interpret._interpreter_rounds_e4m3(truncating) is False
    assert interpret._interpreter_rounds_e4m3(interpret.e4m3_bits) is True
    assert interpret._interpreter_rounds_e4m3() is True


def _counted_patch_passes(monkeypatch) -> list:
    """The fixes applied, and a list that gets the module of each pass of the interpreter pointing a
    module's ``triton.language`` members at its builtins (``interpreter._patch_builtin``)."""
    from triton.runtime import interpreter

    apply_interpreter_fixes()
    passes = []
    patch_builtin = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: passes.append(a[0]) or patch_builtin(*a))
    return passes


def test_calls_inside_a_launch_patch_the_language_once(monkeypatch):
    """Fix 8: the launch points triton.language at the interpreter's builtins once; the helper called
    on every step of its loop finds them in place, and the launch restores the originals at its end."""
    import triton.language as tl

    kernel, passes = _doubling_kernel(), _counted_patch_passes(monkeypatch)
    x, y = torch.randn(16), torch.full((16,), float("nan"))
    kernel[(1,)](x, y, STEPS=6)
    torch.testing.assert_close(y, x * 64)
    launch_passes = len(passes)
    assert launch_passes > 0
    passes.clear()
    kernel[(1,)](x, y, STEPS=1)
    assert len(passes) == launch_passes  # (the helper's call adds none, however many steps)
    assert tl.core.is_builtin(tl.arange) and tl.core.is_builtin(tl.tensor.__add__)  # (restored)


def test_a_call_inside_a_launch_keeps_the_modules_it_patched(monkeypatch):
    """Fix 8, a helper whose module sees only ``triton.language.core`` (``tl.sum``, called on every step)
    in a kernel that sees ``triton.language``: the first call patches core, which then stays patched to
    the launch's end (one pass however many steps), and the launch restores both modules."""
    import triton.language as tl

    kernel, passes = _summing_kernel(), _counted_patch_passes(monkeypatch)
    x, y = torch.randn(16), torch.full((16,), float("nan"))
    kernel[(1,)](x, y, STEPS=1)  # (a first launch: the interpreter's rewrite of a helper adds to its module)
    passes.clear()
    kernel[(1,)](x, y, STEPS=6)
    torch.testing.assert_close(y, x.sum().expand(16) * 6)
    assert passes.count(tl.core) == 1
    launch_passes = len(passes)
    passes.clear()
    kernel[(1,)](x, y, STEPS=1)
    assert len(passes) == launch_passes
    assert tl.core.is_builtin(tl.core.reduce) and tl.core.is_builtin(tl.core.tensor.__add__)  # (restored)
    assert tl.core.is_builtin(tl.arange)


@functools.cache
def _summing_kernel():
    """A kernel adding the sum of 16 values STEPS times (``tl.sum``: a @triton.jit function of
    triton/language/standard.py, whose globals hold ``core``)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(X, Y, STEPS: tl.constexpr):
        offs = tl.arange(0, 16)
        x = tl.load(X + offs)
        total = tl.zeros((16,), tl.float32)
        for _ in range(STEPS):
            total += tl.sum(x, axis=0)
        tl.store(Y + offs, total)

    return kernel


_INT32_EDGES = [0, 1, -1, 7, -7, 3, -3, 2**31 - 1, -2**31, 46341, -46341]


def _scalar(value, dtype):
    """A scalar tl.tensor of ``dtype`` (the interpreter's one-element handle, as a kernel's scalars)."""
    import numpy as np
    import triton.language as tl

    from common import compat

    numpy_type = {"int32": np.int32, "int64": np.int64, "int1": np.bool_}[dtype.name]
    return tl.tensor(compat.interpreter_handle(np.array([value], dtype=numpy_type), dtype), dtype)


def _same(fast, slow):
    import numpy as np

    assert fast.type == slow.type and fast.handle.dtype == slow.handle.dtype
    assert fast.handle.data.dtype == slow.handle.data.dtype and fast.handle.data.shape == slow.handle.data.shape
    np.testing.assert_array_equal(fast.handle.data, slow.handle.data)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (NumPy: division by zero, as the slow path's)
def test_scalar_integer_operations_match_the_type_checked_path(monkeypatch):
    """Fix 9: every operation the fast path takes (scalar int32 tensors and Python ints in int32's range,
    either side; scalar int1 tensors for & and |) gives what Triton's type-checked semantic gives (value,
    wrap-around, C division and remainder, result type) without reaching the type checking; operands
    outside it (int64, a Python int past 32 bits, a block) take the type-checked path, unchanged."""
    import triton.language as tl
    from triton.language import semantic as semantic_module
    from triton.runtime import interpreter

    from common import interpret

    apply_interpreter_fixes()
    semantic = interpreter.interpreter_semantic
    checked = []
    type_checking = semantic_module.TritonSemantic.binary_op_type_checking_impl
    monkeypatch.setattr(semantic_module.TritonSemantic, "binary_op_type_checking_impl",
                        lambda self, *a, **k: checked.append(a) or type_checking(self, *a, **k))

    def both(name, a, b):
        checked.clear()
        args = (False,) if name in ("add", "sub", "mul") else ()
        fast = getattr(semantic, name)(a, b, *args)
        fast_checked = len(checked)
        slow = getattr(type(semantic), name)(semantic, a, b, *args)
        _same(fast, slow)
        return fast_checked

    names = [*interpret._INT32_OPERATIONS, *interpret._INT32_COMPARISONS]
    for name in names:
        for a in _INT32_EDGES:
            for b in _INT32_EDGES:
                if name in ("floordiv", "mod") and b == 0:
                    continue
                for left, right in ((_scalar(a, tl.int32), _scalar(b, tl.int32)), (_scalar(a, tl.int32), b),
                                    (a, _scalar(b, tl.int32))):
                    assert both(name, left, right) == 0, (name, a, b)
    for name in interpret._INT1_OPERATIONS:
        for a in (False, True):
            for b in (False, True):
                assert both(name, _scalar(a, tl.int1), _scalar(b, tl.int1)) == 0
    # the type-checked path: a 64-bit operand, a float, a block; a Python int past 32 bits
    assert both("add", _scalar(5, tl.int64), 3) > 0
    assert both("add", _scalar(5, tl.int32), 1.5) > 0
    with pytest.raises(ValueError, match="out of range"):  # (Triton's error for both paths)
        semantic.mul(_scalar(5, tl.int32), 2**33, False)
    block = tl.tensor(interpreter.TensorHandle(__import__("numpy").arange(4, dtype="int32"), tl.int32),
                      tl.block_type(tl.int32, [4]))
    assert both("floordiv", block, _scalar(3, tl.int32)) > 0


def test_scalar_integer_operations_keep_overflow_checks_when_asked(monkeypatch):
    """Fix 9 with fix 4 off (TWIN_ATTENTION_OVERFLOW_CHECKS=1: the interpreter's own overflow checks):
    +, - and * of int32 scalars take the checked path, whose assertion sees the overflow."""
    import dataclasses

    import triton.language as tl
    from triton.runtime import interpreter

    from common import compat

    apply_interpreter_fixes()
    builder = compat.interpreter_builder()
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, sanitize_overflow=True))
    asserted = []
    semantic = interpreter.interpreter_semantic
    monkeypatch.setattr(type(semantic), "device_assert", lambda self, cond, msg, mask: asserted.append(msg))
    semantic.add(_scalar(2**31 - 1, tl.int32), 1, True)
    assert asserted and "overflow" in asserted[0]


@functools.cache
def _doubling_kernel():
    """A kernel doubling 16 values STEPS times through a helper (made on first use: under the
    interpreter only, and visible to the kernel as a module global)."""
    import triton
    import triton.language as tl

    global _twice

    @triton.jit
    def _twice(x):
        return x * 2

    @triton.jit
    def kernel(X, Y, STEPS: tl.constexpr):
        offs = tl.arange(0, 16)
        x = tl.load(X + offs)
        for _ in range(STEPS):
            x = _twice(x)
        tl.store(Y + offs, x)

    return kernel


def test_accesses_outside_the_launchs_tensors_fail():
    """tests/bounds.py: a load or store whose mask lets an address past a tensor through fails the launch,
    naming the kernel; one that stays inside, or is masked off, passes (views of a larger buffer too)."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy(src, dst, n, BLOCK: tl.constexpr, MASKED: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        if MASKED:
            tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)
        else:
            tl.store(dst + offs, tl.load(src + offs))

    buffer = torch.randn(64)
    src, dst = buffer[8:20], torch.empty(12)  # (the view's neighbours in the buffer are not its elements)
    copy[(1,)](src, dst, 12, BLOCK=16, MASKED=True)
    assert torch.equal(dst, src)
    with pytest.raises(Exception, match=r"kernel copy: load of 4 address\(es\) outside every tensor of the launch; "
                                        r"the first 0 bytes past the end of the tensor of shape \(12,\)"):
        copy[(1,)](src, dst, 12, BLOCK=16, MASKED=False)

"""The interpreter fixes of common/interpret.py: applied only under the interpreter, and they work."""

from __future__ import annotations

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


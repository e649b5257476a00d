"""Running the kernels on a CPU under Triton's interpreter.

Triton runs ``@triton.jit`` functions on CPU tensors, one NumPy operation at a
time, when ``TRITON_INTERPRET=1`` is set before a kernel is *decorated* (for
us: before ``impl_triton`` is imported, or before ``ninetoothed.make`` runs).
:func:`use_interpreter_if_no_gpu` sets it on machines without a CUDA device.

Three fixes make the interpreter run our kernels, all for reasons outside our
code, a fourth, an eighth and a ninth make it faster, and a fifth, a sixth and a seventh make it type
integers and round bfloat16 and float8 as a compiled kernel does. :func:`apply_interpreter_fixes` applies
them; it is a no-op unless the interpreter is on, so a GPU run never sees them.
Each reaches the interpreter through ``common.compat``.

1. Triton's interpreter keeps bfloat16 values as their uint16 bit patterns and
   its ``tl.dot`` multiplies those patterns as integers (triton-lang/triton
   issue 11584; bfloat16 is "not supported yet" there). We widen bfloat16 dot
   operands to float32 first, which is exact and is what the tensor cores do.
   Both backends need this for bfloat16 on a CPU; nothing else we do computes
   on bfloat16 values (we widen before arithmetic).
2. ``ninetoothed.make`` asks Triton's *active driver* for the current device
   and its properties (shared memory, registers) to size its code. On a
   machine without a GPU Triton has no driver ("0 active drivers"), so we
   register a stand-in that answers those two questions with an H100/H200's
   figures. Nothing else reaches the driver under the interpreter.
3. Triton's interpreter (3.7 and newer) reads each kernel parameter's
   annotation as a string and recognises a compile-time constant only when it
   is spelled ``constexpr`` or ``tl.constexpr``. NineToothed's generated code
   spells it ``triton.language.constexpr``, so its constant parameters would
   turn into tensors ("arange's arguments must be of type tl.constexpr"). We
   teach Triton's annotation normaliser that spelling too.
4. The interpreter checks every 32-bit integer +, - and * for overflow (each
   one becomes a widening, the operation, two comparisons and an assertion);
   a compiled kernel does so only when built with ``debug=True``. NineToothed's
   generated code is mostly such index arithmetic, so the checks more than double
   its interpreted time. We turn them off; ``TWIN_ATTENTION_OVERFLOW_CHECKS=1``
   keeps them.
5. A compiled kernel types an integer parameter annotated ``int64`` as int64
   whatever its value (Triton's JIT reads the annotation); the interpreter types
   every integer by its value, so a stride under 2^31 stays int32 there and an
   offset built from it wraps past 2^31 elements. Our launch path annotates
   NineToothed's batch and head strides so for a launch past 2^31 elements
   (``common.launch._rejitted``); we make the interpreter pass such an argument as
   int64 too, so that the CPU suite runs what the GPU compiles.
6. A GPU converts float32 to bfloat16 rounding to nearest, ties to even (``.to``,
   and a store into a bfloat16 tensor); Triton's interpreter (3.9) truncates
   (0.99999994 gives 0.99609375 where the GPU and torch give 1.0), which would
   make the CPU suite's bfloat16 results differ from the GPU's. We round as the
   GPU does, with inf and NaN kept, where the installed interpreter does not
   already (checked by converting a few values once). Its float16 conversions
   (NumPy's) round correctly already.
7. A GPU converts float32, float16 and bfloat16 to float8_e4m3fn rounding to nearest, ties
   to even, and saturating to +-448 (``cvt.rn.satfinite``); Triton's interpreter (3.9) adds
   the rounding bit without carrying it into the exponent (1.998 gives 1.0, not 2.0) and lets
   values past 448 become NaN. Its float8 -> wider conversions read e4m3's NaN as 480. The FP8
   forward rounds probabilities to e4m3 (``p.to(v.dtype)``), so we convert as the GPU does, by
   way of torch's float8_e4m3fn (which rounds to nearest even), where the installed
   interpreter does not already (checked by converting a few values once).
8. The interpreter points ``triton.language`` at its own builtins when a launch starts and
   again at every call of a ``@triton.jit`` function inside it, each pass walking the modules'
   members; NineToothed's kernels call dozens of helpers a program, so the passes were a sizeable
   part of their interpreted time (benchmarks/NOTES.md). A call inside a launch whose language
   modules the launch already patched skips the pass; one that uses a module the launch has not
   patched (``tl.sum``'s module sees only ``triton.language.core``) patches it, and it stays patched
   for the rest of the launch. The launch restores every module at its end.
9. Every ``tl`` operation under the interpreter goes through Triton's type checking (the operands'
   computation type, a cast of each to it, a broadcast) before its one NumPy operation; for two
   scalar int32 values that costs many times the operation, and NineToothed's generated index
   arithmetic is mostly such scalars (benchmarks/NOTES.md has the counts). An
   operation whose operands are scalar int32 tensors or Python ints in int32's range (+, -, *, //, %,
   comparisons), or scalar int1 tensors (&, |), goes straight to the builder function the type
   checking would have reached, with the same operands: the same result, in the same type.
"""

from __future__ import annotations

import functools
import os
import threading

from common import compat

_ENV = "TRITON_INTERPRET"
_OVERFLOW_CHECKS = "TWIN_ATTENTION_OVERFLOW_CHECKS"


def interpreter_requested() -> bool:
    """Whether ``TRITON_INTERPRET=1`` is set (kernels decorated from now on run interpreted)."""
    return os.environ.get(_ENV, "0") == "1"


def use_interpreter_if_no_gpu() -> bool:
    """Turn Triton's interpreter on when this machine has no CUDA device.

    Must run before any kernel is decorated. Returns whether the interpreter is
    on afterwards.
    """
    import torch

    if not torch.cuda.is_available():
        os.environ[_ENV] = "1"
    return interpreter_requested()


class _StandInDriver:
    """Answers the two questions ``ninetoothed.make`` asks Triton's driver.

    The figures are an H100/H200's (sm_90): they only size NineToothed's
    generated code, whose block sizes we fix ourselves anyway.
    """

    PROPERTIES = {
        "max_shared_mem": 232448,
        "max_num_regs": 65536,
        "multiprocessor_count": 132,
        "warpSize": 32,
    }

    class utils:  # noqa: N801 - mirrors the attribute name Triton's drivers use
        @staticmethod
        def get_device_properties(device):
            return dict(_StandInDriver.PROPERTIES)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def _normalize_ty_with_full_constexpr_spelling(original):
    @functools.wraps(original)
    def normalize(ty):
        if isinstance(ty, str) and ty.strip().startswith("triton.language."):
            ty = ty.strip().removeprefix("triton.language.")
        return original(ty)

    return normalize


def _bf16_dot_widening(original):
    import triton.language as tl

    @functools.wraps(original)
    def create_dot(self, a, b, d, *args, **kwargs):
        if a.dtype.scalar == tl.bfloat16:
            a = self.cast_impl(a, tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = self.cast_impl(b, tl.float32)
        return original(self, a, b, d, *args, **kwargs)

    return create_dot


@functools.cache
def apply_interpreter_fixes() -> bool:
    """Apply the fixes above when the interpreter is on; return whether it is on.

    Idempotent; call it before launching or making a kernel.
    """
    if not interpreter_requested():
        return False
    compat.wrap_interpreter_dot(_bf16_dot_widening)
    if not compat.has_active_driver():
        compat.set_active_driver(_StandInDriver())
    compat.wrap_annotation_normaliser(_normalize_ty_with_full_constexpr_spelling)
    _without_overflow_checks(compat.interpreter_builder())
    _annotated_integers()
    _bf16_rounding()
    _e4m3_rounding()
    compat.wrap_language_patching(_patch_once_a_launch)
    _scalar_integer_operations()
    return True


class _LaunchPatch(threading.local):
    """The language modules the running launch (in this thread) has patched, None between launches;
    and the scopes of the calls inside it that patched more, restored when it ends."""

    modules = None
    deferred = ()


_launch_patch = _LaunchPatch()


class _Kept:
    """The scope of a call that patched nothing: nothing to restore."""

    def restore(self) -> None:
        pass


def _patch_once_a_launch(original):
    """Fix 8: ``_patch_lang(fn)`` runs in full for a launch (no launch running in this thread) and
    for a call that uses a language module the launch has not patched yet, which then stays patched
    until the launch ends; any other call inside a launch finds its modules patched already."""
    import triton.language as tl

    def languages(fn) -> frozenset:
        return frozenset(id(value) for value in fn.__globals__.values() if value is tl or value is tl.core)

    def patch_lang(fn):
        running, mine = _launch_patch.modules, languages(fn)
        if running is not None and mine <= running:
            return _Kept()
        scope = original(fn)
        if running is not None:  # a call inside the launch: its modules stay patched to the launch's end
            _launch_patch.modules = running | mine
            _launch_patch.deferred.append(scope)
            return _Kept()
        _launch_patch.modules, _launch_patch.deferred = mine, []
        restore = scope.restore

        def restore_and_end():  # (the last patched first: each scope puts back what it found)
            deferred, _launch_patch.modules, _launch_patch.deferred = _launch_patch.deferred, None, ()
            for inner in reversed(deferred):
                inner.restore()
            restore()

        scope.restore = restore_and_end
        return scope

    return patch_lang


# Fix 9: the builder function Triton's semantic calls for two signed 32-bit integers (an int32
# result, or int1 for a comparison), and for two int1 values
_INT32_OPERATIONS = {"add": "create_add", "sub": "create_sub", "mul": "create_mul", "floordiv": "create_sdiv",
                     "mod": "create_srem"}
_INT32_COMPARISONS = {"less_than": "create_icmpSLT", "less_equal": "create_icmpSLE",
                      "greater_than": "create_icmpSGT", "greater_equal": "create_icmpSGE",
                      "equal": "create_icmpEQ", "not_equal": "create_icmpNE"}
_INT1_OPERATIONS = {"and_": "create_and", "or_": "create_or"}
_OVERFLOW_CHECKED = {"add", "sub", "mul"}


def _scalar_integer_operations() -> None:
    """Fix 9: the interpreter's semantic operations on scalar int32 (and int1) operands skip the type
    checking that leaves them as they are."""
    import triton.language as tl

    builder = compat.interpreter_builder()
    int32, int1, dtype = tl.int32, tl.int1, tl.dtype

    def int32_handle(value):
        """``value``'s handle where it is a scalar int32 tensor or a Python int that Triton types int32."""
        if type(value) is int:
            return builder.get_int32(value) if -2**31 <= value < 2**31 else None
        kind = getattr(value, "type", None)
        return value.handle if type(kind) is dtype and kind.name == "int32" else None

    def int1_handle(value):
        kind = getattr(value, "type", None)
        return value.handle if type(kind) is dtype and kind.name == "int1" else None

    def fast(name, create, result, handle_of):
        def wrap(original):
            make = getattr(builder, create)
            checked = name in _OVERFLOW_CHECKED

            def operation(input, other, *args, **kwargs):
                # (an overflow-checked operation keeps the check where fix 4 is off)
                if type(input) is not int or type(other) is not int:
                    a, b = handle_of(input), handle_of(other)
                    if a is not None and b is not None and not (checked and builder.options.sanitize_overflow):
                        return tl.tensor(make(a, b), result)
                return original(input, other, *args, **kwargs)

            return operation

        return wrap

    for name, create in _INT32_OPERATIONS.items():
        compat.wrap_interpreter_semantic(name, fast(name, create, int32, int32_handle))
    for name, create in _INT32_COMPARISONS.items():
        compat.wrap_interpreter_semantic(name, fast(name, create, int1, int32_handle))
    for name, create in _INT1_OPERATIONS.items():
        compat.wrap_interpreter_semantic(name, fast(name, create, int1, int1_handle))


class _Int64(int):
    """An integer argument the interpreter must pass as int64 (fix 5)."""


def _annotated_integers() -> None:
    """Fix 5: an integer argument of a parameter annotated int64 reaches the interpreted
    kernel as an int64 scalar, as it reaches a compiled one."""

    def typed_conversion(implicit_cvt):
        def cvt(arg):
            return compat.int64_scalar(int(arg)) if type(arg) is _Int64 else implicit_cvt(arg)

        return cvt

    def typed_launch(run):
        @functools.wraps(run)
        def typed_run(self, *args, **kwargs):
            annotations = getattr(self.fn, "__annotations__", None) or {}
            wide = {name for name, ty in annotations.items() if compat.normalized_annotation(ty) == "i64"}
            if wide:
                args = tuple(_Int64(a) if type(a) is int and name in wide else a
                             for name, a in zip(self.arg_names, args))
                kwargs = {name: _Int64(a) if type(a) is int and name in wide else a for name, a in kwargs.items()}
            return run(self, *args, **kwargs)

        return typed_run

    compat.wrap_implicit_conversion(typed_conversion)
    compat.wrap_interpreted_run(typed_launch)


def _without_overflow_checks(builder) -> None:
    """Fix 4: no int32 overflow assertion after every integer +, - and * in the kernels that
    ``builder`` (the interpreter's) runs (the interpreter's default; compiled kernels have it only
    with ``debug=True``), unless TWIN_ATTENTION_OVERFLOW_CHECKS=1 asks for it."""
    import dataclasses

    options = getattr(builder, "options", None)
    if os.environ.get(_OVERFLOW_CHECKS, "0") == "1" or not getattr(options, "sanitize_overflow", False):
        return
    builder.options = dataclasses.replace(options, sanitize_overflow=False)


def bf16_bits(values):
    """float32 ``values`` (a NumPy array) as bfloat16 bit patterns (uint16), rounded to nearest,
    ties to even, as a GPU converts them; an overflow rounds to inf, and a NaN stays a NaN (the
    canonical one, 0x7FFF)."""
    import numpy as np

    values = np.ascontiguousarray(values, dtype=np.float32)
    bits = values.view(np.uint32)
    rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FFF), rounded)


_BF16_PROBE = (0.99999994, -0.99999994, 1.00390625, 1.01171875, -3.4e38)  # truncation and rounding differ


def _interpreter_rounds_bf16(cast=None) -> bool:
    """Whether ``cast`` (float32 NumPy array -> bfloat16 bit patterns; by default this Triton's
    interpreter's conversion) already converts as :func:`bf16_bits` does (ties to even, NaN kept)."""
    import numpy as np
    import triton.language as tl

    if cast is None:
        def cast(values):
            return compat.interpreter_cast(values, tl.float32, tl.bfloat16)

    probe = np.array([*_BF16_PROBE, float("nan")], dtype=np.float32)
    probe[-1:].view(np.uint32)[:] = 0x7F800001  # a NaN whose payload truncation loses
    converted = np.asarray(cast(probe)).view(np.uint16)
    nan = converted[-1]
    return bool(np.array_equal(converted[:-1], bf16_bits(probe[:-1])) and (nan & 0x7F80) == 0x7F80 and nan & 0x7F)


def _bf16_rounding() -> None:
    """Fix 6: the interpreter's float32 -> bfloat16 conversions round to nearest even
    (:func:`bf16_bits`), where a version that truncates them is installed."""
    if _interpreter_rounds_bf16():
        return
    import triton.language as tl

    def rounded(cast_impl):
        @functools.wraps(cast_impl)
        def cast(self, src, dst_type):
            if dst_type.scalar == tl.bfloat16 and src.dtype.scalar == tl.float32:
                return compat.interpreter_handle(bf16_bits(src.data).reshape(src.data.shape), tl.bfloat16)
            return cast_impl(self, src, dst_type)

        return cast

    compat.wrap_interpreter_cast(rounded)


def e4m3_bits(values):
    """float32 ``values`` (a NumPy array) as float8_e4m3fn bit patterns (uint8), rounded to
    nearest, ties to even, saturated to +-448 as a GPU converts them (a NaN stays a NaN)."""
    import numpy as np
    import torch

    values = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    return values.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def _as_float32(data, dtype):
    """The NumPy array ``data`` of ``tl`` type ``dtype`` (float32, float16, bfloat16 bit patterns,
    float8_e4m3fn bit patterns) as float32 values."""
    import numpy as np
    import torch
    import triton.language as tl

    if dtype == tl.bfloat16:
        return (np.ascontiguousarray(data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype == tl.float8e4nv:
        e4m3 = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8)).view(torch.float8_e4m3fn)
        return e4m3.float().numpy()
    return np.asarray(data, dtype=np.float32)


_E4M3_PROBE = (1.998, -1.998, 0.0038, 500.0, -1000.0, 0.3125, 0.34375)  # carry, subnormal, saturation, ties


def _interpreter_rounds_e4m3(cast=None) -> bool:
    """Whether ``cast`` (float32 NumPy array -> float8_e4m3fn bit patterns; by default this Triton's
    interpreter's conversion) already converts as :func:`e4m3_bits` does."""
    import numpy as np
    import triton.language as tl

    if cast is None:
        def cast(values):
            return compat.interpreter_fp8_cast(values, tl.float32, tl.float8e4nv)

    probe = np.array(_E4M3_PROBE, dtype=np.float32)
    return bool(np.array_equal(np.asarray(cast(probe)).view(np.uint8), e4m3_bits(probe)))


def _e4m3_rounding() -> None:
    """Fix 7: the interpreter's conversions to float8_e4m3fn (from float32, float16 or bfloat16,
    rounding to nearest) round to nearest even and saturate (:func:`e4m3_bits`), and its
    conversions from it keep NaN, where the installed version does not already."""
    if _interpreter_rounds_e4m3():
        return
    import numpy as np
    import triton.language as tl

    wider = (tl.float32, tl.float16, tl.bfloat16)

    def rounded(create_fp_to_fp):
        @functools.wraps(create_fp_to_fp)
        def cast(self, src, dst_type, rounding_mode):
            source, target = src.dtype.scalar, dst_type.scalar
            if target == tl.float8e4nv and source in wider and compat.interpreter_rounding_to_nearest(rounding_mode):
                values = _as_float32(src.data, source)
                return compat.interpreter_handle(e4m3_bits(values).reshape(np.shape(src.data)), tl.float8e4nv)
            if source == tl.float8e4nv and target in wider:
                values = _as_float32(src.data, source).reshape(np.shape(src.data))
                if target == tl.bfloat16:
                    return compat.interpreter_handle(bf16_bits(values).reshape(values.shape), tl.bfloat16)
                return compat.interpreter_handle(values.astype(np.float16 if target == tl.float16 else np.float32),
                                                 target)
            return create_fp_to_fp(self, src, dst_type, rounding_mode)

        return cast

    compat.wrap_interpreter_fp8_cast(rounded)

"""common/compat.py: each private part of triton, NineToothed and torch it reaches is still there
and still behaves as it relies on, in the installed versions.

A failure names the library, its installed version, the versions compat was checked against and
the assumption that no longer holds: the place to look is common/compat.py's function of that name.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import pathlib

import pytest
import torch
import triton.language as tl

from common import compat
from tests.conftest import DEVICE, INTERPRETED

interpreter_only = pytest.mark.skipif(
    not INTERPRETED, reason="the interpreter's parts are reached only under the interpreter (the CPU suite)")


def _holds(condition, library: str, assumption: str) -> None:
    """Fail loudly, naming the library, its version and ``assumption``, unless ``condition``."""
    if not condition:
        version = importlib.metadata.version(library)
        checked = ", ".join(compat.CHECKED[library])
        pytest.fail(f"{library} {version} (common/compat.py was checked against {checked}): {assumption} no longer "
                    f"holds; update common/compat.py for this version", pytrace=False)


# -- torch ---------------------------------------------------------------------------------------


def test_torch_raw_stream():
    """cuda_raw_stream: torch._C._cuda_getCurrentRawStream(index) is the current stream's handle."""
    if not torch.cuda.is_available():
        _holds(compat.cuda_raw_stream is None or callable(compat.cuda_raw_stream), "torch",
               "torch._C._cuda_getCurrentRawStream is absent or callable")
        return
    _holds(callable(compat.cuda_raw_stream), "torch", "torch._C._cuda_getCurrentRawStream exists on a CUDA build")
    index = torch.cuda.current_device()
    _holds(compat.cuda_raw_stream(index) == torch.cuda.current_stream(index).cuda_stream, "torch",
           "torch._C._cuda_getCurrentRawStream(index) returns the current stream's cuda_stream")


# -- triton: compiled kernels ---------------------------------------------------------------------


def test_triton_compiled_launch_form():
    """compiled_launch_form / direct_launcher: the compiled-kernel launch has the form called directly."""
    _holds(compat.compiled_launch_form(), "triton",
           f"CompiledKernel.__getitem__'s runner calls {compat._LAUNCH_FORM!r} and the launch hooks "
           "(triton.knobs.runtime.launch_enter_hook / launch_exit_hook) are chains with a 'calls' list")


def test_triton_launch_scratch_metadata():
    """needs_launch_scratch: a compiled kernel's metadata has global_scratch_size and profile_scratch_size."""
    import triton.backends.nvidia.compiler as nvidia

    source = inspect.getsource(nvidia)
    _holds('metadata["global_scratch_size"]' in source and 'metadata["profile_scratch_size"]' in source, "triton",
           "the NVIDIA backend records global_scratch_size and profile_scratch_size in a compiled kernel's metadata")


# -- triton: @triton.jit functions ----------------------------------------------------------------


def _plain(x, n, big, BLOCK: tl.constexpr):
    pass


def test_triton_jit_parameters():
    """jit_parameters / jit_arg_names: a JITFunction's params carry name, num, is_constexpr and
    do_not_specialize; arg_names lists its parameters (the interpreter's function's too)."""
    import triton
    from triton.runtime.jit import JITFunction

    fn = JITFunction(_plain, do_not_specialize=["n"])
    try:
        parameters = compat.jit_parameters(fn)
    except AttributeError as error:
        parameters = error
    _holds(parameters == (("x", 0, False, False), ("n", 1, False, True), ("big", 2, False, False),
                          ("BLOCK", 3, True, False)), "triton",
           f"JITFunction.params are KernelParams with name, num, is_constexpr, do_not_specialize (read: {parameters})")
    _holds(compat.jit_arg_names(fn) == ("x", "n", "big", "BLOCK"), "triton", "JITFunction.arg_names")
    _holds(compat.jit_arg_names(triton.jit(_plain)) == ("x", "n", "big", "BLOCK"), "triton",
           "arg_names on what @triton.jit returns (an InterpretedFunction under the interpreter)")
    _holds(compat.is_jit_function(triton.jit(_plain)) and compat.is_jit_function(fn)
           and not compat.is_jit_function(_plain), "triton",
           "@triton.jit returns a JITFunction, or under the interpreter an InterpretedFunction "
           "(triton.runtime.interpreter)")


def test_triton_rejit_types_an_int64_annotation():
    """rejit: a kernel made again from ``kernel.fn`` with an ``"int64"`` annotation and
    do_not_specialize, which Triton's JIT reads as an i64 parameter not specialised on."""
    import triton
    from triton.runtime.jit import JITFunction

    kernel = triton.jit(_plain)
    _holds(getattr(kernel, "fn", None) is _plain, "triton", "@triton.jit's result keeps the function as .fn")
    before = dict(_plain.__annotations__)
    again = compat.rejit(kernel, do_not_specialize=["n"], int64=["big"])
    assert again.fn is not _plain and _plain.__annotations__ == before  # the original is unchanged
    assert again.fn.__annotations__ == {**before, "big": "int64"}
    assert compat.jit_arg_names(again) == ("x", "n", "big", "BLOCK")
    params = {p.name: p for p in JITFunction(again.fn, do_not_specialize=["n"]).params}
    _holds(getattr(params["big"], "annotation_type", None) == "i64", "triton",
           "a parameter annotated 'int64' has the JIT's annotation_type 'i64' (it is typed so whatever its value)")
    _holds(getattr(params["n"], "do_not_specialize", None) is True, "triton", "do_not_specialize marks the KernelParam")


# -- NineToothed ----------------------------------------------------------------------------------


def _arrangement(x, y):
    return x.tile((16,)), y.tile((16,))


def _application(x, y):
    y = x + 1  # noqa: F841 - NineToothed makes an assignment to a parameter a store


def _made(tmp_path, monkeypatch):
    """A tiny ninetoothed.make handle, made through our code cache in ``tmp_path``."""
    import ninetoothed

    from common import codecache
    from common.interpret import apply_interpreter_fixes

    apply_interpreter_fixes()
    monkeypatch.setenv(codecache.ENV_VAR, str(tmp_path))
    codecache.use_private_cache()
    _holds(compat.restart_tensor_count(), "ninetoothed", "ninetoothed.Tensor.num_instances is an int class attribute")
    tensors = (ninetoothed.Tensor(1), ninetoothed.Tensor(1))
    names = [tensor.name for tensor in tensors]
    _holds([name.endswith(f"tensor_{i}") for i, name in enumerate(names)] == [True, True], "ninetoothed",
           f"Tensors are named after Tensor.num_instances, counted from where it was set (named {names})")
    return ninetoothed.make(_arrangement, _application, tensors, kernel_name="compat_probe", num_warps=1,
                            num_stages=1)


def test_ninetoothed_generated_launch(tmp_path, monkeypatch):
    """generated_launch / generated_launcher / generated_namespace / replace_launched_kernel / read_generated_launch /
    use_code_cache: a handle keeps its generated launcher and kernel, the launcher names the kernel
    in its module's globals and launches it once as kernel[grid](...) with each tensor, its sizes
    and strides, and the module was written through our cache_source into our directory."""
    from common import codecache

    handle = _made(tmp_path, monkeypatch)
    generated = compat.generated_launch(handle)
    _holds(generated is not None, "ninetoothed",
           "a ninetoothed.make handle keeps its launcher as _launch (a function) and its @triton.jit kernel as _kernel")
    launch, kernel = generated
    _holds(compat.generated_namespace(handle) is launch.__globals__, "ninetoothed", "handle._launch.__globals__")
    _holds(compat.generated_launcher(handle) is launch, "ninetoothed", "handle._launch")
    described = compat.read_generated_launch(launch)
    _holds(described is not None and len(described) == len(compat.jit_arg_names(kernel)), "ninetoothed",
           f"the generated launcher calls kernel[grid](...) once, an argument per kernel parameter (read: {described})")
    _holds(("input", 0) in described and ("size", 0, 0) in described and ("stride", 0, 0) in described,
           "ninetoothed", f"the launcher passes each tensor, its x.size(d) and x.stride(d) (read: {described})")
    written = list(tmp_path.glob("*.py"))
    _holds(written and all(path.stem == codecache.source_key(path.read_text()) for path in written), "ninetoothed",
           "make writes its generated module through ninetoothed.generation.cache_source into generation.CACHE_DIR "
           f"(looked up at each call; found {written})")
    path = compat.generated_source_file(handle)
    _holds(path is not None and pathlib.Path(path) in written, "ninetoothed",
           f"a handle names the module make wrote as _source (named {path})")
    rebuilt = compat.handle_of_generated(path, "compat_probe")
    _holds(type(rebuilt) is type(handle) and rebuilt._source == path
           and rebuilt._launch.__code__.co_code == launch.__code__.co_code
           and compat.jit_arg_names(rebuilt._kernel) == compat.jit_arg_names(kernel), "ninetoothed",
           "make's handle is ninetoothed.jit._Handle(module's kernel, module's launch_<kernel_name>, path), "
           "the module imported by ninetoothed.jit.import_from_path")
    calls = []

    class Routed:
        def __getitem__(self, grid):
            return lambda *args, **options: calls.append((args, options))

    _holds(compat.replace_launched_kernel(launch, kernel, Routed()), "ninetoothed",
           "exactly one global name of the generated launcher holds its kernel")
    x = torch.arange(20, dtype=torch.float32, device=DEVICE)
    handle(x, torch.empty_like(x))
    _holds(len(calls) == 1 and calls[0][0][0] is x, "ninetoothed",
           "calling the handle calls its launcher, which launches the kernel through that global name")


# -- triton: the interpreter ----------------------------------------------------------------------


@interpreter_only
def test_triton_interpreter_builder():
    """wrap_interpreter_dot / wrap_interpreter_cast / interpreter_handle / interpreter_builder:
    the builder's create_dot and cast_impl take TensorHandles, and its options say sanitize_overflow."""
    import numpy as np
    from triton.runtime import interpreter

    builder = compat.interpreter_builder()
    _holds(isinstance(builder, interpreter.InterpreterBuilder), "triton",
           "triton.runtime.interpreter.interpreter_builder is the interpreter's InterpreterBuilder")
    _holds(hasattr(getattr(builder, "options", None), "sanitize_overflow"), "triton",
           "the interpreter builder's options have sanitize_overflow")
    for name, head in (("create_dot", ["self", "a", "b", "d"]), ("cast_impl", ["self", "src", "dst_type"])):
        method = inspect.unwrap(getattr(interpreter.InterpreterBuilder, name, None))
        params = list(inspect.signature(method).parameters)[:len(head)] if callable(method) else None
        _holds(params == head, "triton", f"InterpreterBuilder.{name}({', '.join(head)}, ...)")
    handle = compat.interpreter_handle(np.array([1.5], dtype=np.float32), tl.float32)
    _holds(handle.data.dtype == np.float32 and handle.dtype == tl.float32, "triton",
           "TensorHandle(data, dtype) keeps .data and .dtype")
    _holds(compat.interpreter_cast(np.array([1.5], dtype=np.float32), tl.float32, tl.float16).tolist() == [1.5],
           "triton", "InterpreterBuilder.cast_impl(TensorHandle, tl type) returns the converted TensorHandle")


@interpreter_only
def test_triton_interpreter_conversions_go_through_cast_impl():
    """wrap_interpreter_cast (fix 6): .to(tl.bfloat16) and a store into a bfloat16 tensor reach
    InterpreterBuilder.cast_impl, so both round once fixed."""
    import triton

    from common.interpret import apply_interpreter_fixes

    apply_interpreter_fixes()

    @triton.jit
    def convert(X, Y, Z):
        x = tl.load(X)
        tl.store(Y, x.to(tl.bfloat16))
        tl.store(Z, x)

    x = torch.tensor([0.99999994])
    y, z = torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.bfloat16)
    convert[(1,)](x, y, z)
    _holds(y.item() == 1.0, "triton", "x.to(tl.bfloat16) under the interpreter converts with cast_impl")
    _holds(z.item() == 1.0, "triton", "a store into a bfloat16 tensor under the interpreter converts with cast_impl")


@interpreter_only
def test_triton_interpreter_annotations_and_arguments():
    """wrap_annotation_normaliser / normalized_annotation / wrap_interpreted_run /
    wrap_implicit_conversion / int64_scalar: the JIT's annotation normaliser is read at each use,
    an interpreted launch goes through InterpretedFunction.run and _implicit_cvt."""
    import triton
    from triton.runtime import interpreter

    from common.interpret import apply_interpreter_fixes

    apply_interpreter_fixes()
    _holds(compat.normalized_annotation("tl.constexpr") == "constexpr"
           and compat.normalized_annotation("int64") == "i64", "triton",
           "triton.runtime.jit._normalize_ty reads 'tl.constexpr' as 'constexpr' and 'int64' as 'i64'")
    source = inspect.getsource(interpreter)
    _holds("from .jit import _normalize_ty" in source, "triton",
           "the interpreter imports jit._normalize_ty when it reads a kernel's annotations (so a wrapper takes effect)")
    _holds("_implicit_cvt(arg)" in source and callable(getattr(interpreter, "_implicit_cvt", None)), "triton",
           "the interpreter converts each launch argument with the module function _implicit_cvt")
    run = inspect.unwrap(interpreter.InterpretedFunction.run)
    _holds(list(inspect.signature(run).parameters)[:2] == ["self", "args"], "triton",
           "InterpretedFunction.run(self, *args, **kwargs)")
    scalar = compat.int64_scalar(2**40)
    _holds(scalar.dtype == tl.int64 and scalar.handle.data.tolist() == [2**40], "triton",
           "tl.tensor(TensorHandle(np.int64 array, tl.int64), tl.int64) is an int64 scalar")
    _holds(callable(getattr(triton.runtime.driver, "set_active", None)), "triton", "triton.runtime.driver.set_active")


def test_generated_masks_are_simplified_without_changing_their_value():
    """common.codecache.simplified: each mask term once, terms that hold for every value of their integer
    operands' ranges dropped, a leading True kept, (x - c) + c folded; the values it computes are unchanged."""
    import numpy as np

    from common.codecache import simplified

    source = ("def f(a, n, load):\n"
              "    return load(a, mask=True & (a < n - 1 + 1) & (0 < 1) & (a >= 0) & (a < n - 1 + 1) & (a >= 0),"
              " other=0)\n")
    short = simplified(source)
    assert "mask=True & (a < n) & (a >= 0), other=0" in short, short
    namespace_long, namespace_short = {}, {}
    exec(source, namespace_long)  # noqa: S102 - the test's own source
    exec(short, namespace_short)  # noqa: S102
    for a in range(-2, 6):
        assert (namespace_long["f"](a, 4, lambda x, mask, other: mask)
                == namespace_short["f"](a, 4, lambda x, mask, other: mask))
    assert simplified("def broken(:\n") == "def broken(:\n"  # not Python: as it is
    # a mask whose terms all hold is left whole
    assert "mask=(0 < 1) & (1 >= 0)" in simplified("load(x, mask=(0 < 1) & (1 >= 0))\n")
    # terms whose operands' integer ranges decide them: aranges against their bounds, remainders by 1
    # and products by 0 of NineToothed's integer names; kept where the range does not decide or the
    # name is not one of those (a float's remainder by 1 can be negative)
    source = ("def g(ninetoothed_tensor_0_index_1, ninetoothed_ninetoothed_tensor_0_size_2, x, np, load):\n"
              "    return load(x, mask=True & (np.arange(0, 4)[:, None] < 4) & (np.arange(0, 4)[None, :] >= 0)"
              " & (ninetoothed_tensor_0_index_1 % 1 < 1) & (ninetoothed_tensor_0_index_1 % 1 * 0 >= 0)"
              " & (ninetoothed_ninetoothed_tensor_0_size_2 * 0 < 1) & (np.arange(0, 4)[:, None] < 3)"
              " & (x % 1 >= 0) & (np.arange(0, 4)[None, :] < ninetoothed_ninetoothed_tensor_0_size_2)"
              " & (np.arange(0, 4)[None, :] + 1 - 1 <= 3) & (ninetoothed_tensor_0_index_1 < 2))\n")
    short = simplified(source)
    kept = short[short.index("mask="):]
    assert kept.count("&") == 4 and "< 3" in kept and "x % 1 >= 0" in kept, kept
    assert "< ninetoothed_ninetoothed_tensor_0_size_2" in kept and "index_1 < 2" in kept, kept
    namespace_long, namespace_short = {}, {}
    exec(source, namespace_long)  # noqa: S102 - the test's own source
    exec(short, namespace_short)  # noqa: S102
    for i, n, x in ((0, 3, 0.5), (1, 4, -0.5), (3, 2, 1.0)):
        masks = [namespace["g"](i, n, x, np, lambda x, mask: np.broadcast_to(mask, (4, 4)))
                 for namespace in (namespace_long, namespace_short)]
        assert (masks[0] == masks[1]).all()
    # nothing to prune: the source as it is, its comments and layout kept (the code cache names and
    # writes what it was given)
    plain = "# generated\nimport triton\n\n\ny = load(x,  mask=a < n)  # one term\n"
    assert simplified(plain) == plain

"""Every touch of another library's private parts (triton, NineToothed, torch), each behind one
small function.

Each function states what it relies on and the versions it was checked against
(:data:`CHECKED`); the rest of the code reaches those parts only through here, and
``tests/test_compat.py`` checks each assumption against the installed versions, failing with
the library, its version and the assumption when one no longer holds. Where a function can tell
at run time that its assumption fails, it says so by its result (None, False) and its caller
takes Triton's or NineToothed's public path instead.

Importing this module imports torch only: triton and NineToothed are imported by the functions
that use them (importing ``common`` imports no triton, so ``TRITON_INTERPRET`` can still be set).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types

import torch

CHECKED = {"triton": ("3.6", "3.9"), "ninetoothed": ("0.26",), "torch": ("2.11", "2.13")}  # GPU and CPU versions
_MARK = "__wrapped_by_twin_attention__"

# -- torch -------------------------------------------------------------------------------------

# The current CUDA stream of a device as an int (``torch._C._cuda_getCurrentRawStream(index)``),
# without building a Stream object; None on a build without CUDA. Checked: torch 2.11, 2.13.
cuda_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


# -- triton: compiled kernels ------------------------------------------------------------------

_LAUNCH_FORM = ("self.run(grid[0], grid[1], grid[2], stream, self.function, self.packed_metadata, launch_metadata, "
                "knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *args)")


def triton_version() -> tuple[int, int]:
    """The installed Triton's (major, minor) version: where a choice of ours depends on the version
    (what one compiles faster or without spills), it reads this."""
    import triton

    return tuple(int(part) for part in triton.__version__.split(".")[:2])


def compiled_launch_form() -> bool:
    """Whether ``CompiledKernel.__getitem__``'s runner calls ``self.run(grid[0], grid[1], grid[2],
    stream, self.function, self.packed_metadata, launch_metadata, enter_hook, exit_hook, *args)``
    (read from its source) and the launch hooks are chains whose ``calls`` list says whether any
    is registered. Checked: triton 3.6, 3.9."""
    try:
        from triton import knobs
        from triton.compiler.compiler import CompiledKernel

        source = " ".join(inspect.getsource(CompiledKernel.__getitem__).split())
    except (ImportError, AttributeError, OSError, TypeError):
        return False
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return _LAUNCH_FORM in source and all(isinstance(getattr(h, "calls", None), list) for h in hooks)


def direct_launcher(current_device=torch.cuda.current_device, raw_stream=cuda_raw_stream):
    """``launch(kernel, grid, args)``: launch a compiled kernel as ``kernel[grid](*args)`` would, by
    calling its runner (``kernel.run``, ``kernel.function``, ``kernel.packed_metadata``) directly,
    without the launch metadata and the empty hook chains, while no launch hook is registered (a
    profiler's); through ``kernel[grid]`` while one is. ``grid`` is (x, y, z); each argument as the
    runner takes it (a tensor's address may be passed as an int). None where
    :func:`compiled_launch_form` does not hold or there is no raw stream (no CUDA).
    Checked: triton 3.6, 3.9; torch 2.11."""
    if raw_stream is None or not compiled_launch_form():
        return None
    from triton import knobs

    runtime = knobs.runtime

    def launch(kernel, grid, args) -> None:
        if runtime.launch_enter_hook.calls or runtime.launch_exit_hook.calls:
            kernel[grid](*args)
        else:
            kernel.run(grid[0], grid[1], grid[2], raw_stream(current_device()), kernel.function,
                       kernel.packed_metadata, None, None, None, *args)

    return launch


def needs_launch_scratch(kernel) -> bool:
    """Whether a compiled kernel asks for global or profiler scratch memory at launch, which its
    launch path allocates (``kernel.metadata.global_scratch_size`` / ``profile_scratch_size``,
    0 or absent when none). Checked: triton 3.6, 3.9."""
    metadata = getattr(kernel, "metadata", None)
    return bool(getattr(metadata, "global_scratch_size", 0) or getattr(metadata, "profile_scratch_size", 0))


# -- triton: @triton.jit functions -------------------------------------------------------------


def is_jit_function(obj) -> bool:
    """Whether ``obj`` is what ``@triton.jit`` returns: a ``JITFunction``, or under the interpreter
    an ``InterpretedFunction`` (from the private ``triton.runtime.interpreter``).
    Checked: triton 3.6, 3.9."""
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(obj, (triton.runtime.JITFunction, InterpretedFunction))


def jit_parameters(fn) -> tuple:
    """(name, position, is constexpr, not specialised) of each parameter of a ``JITFunction``,
    from its ``params`` (``KernelParam``: ``name``, ``num``, ``is_constexpr``,
    ``do_not_specialize``); () for the interpreter's function, which has none.
    Checked: triton 3.6, 3.9."""
    return tuple((p.name, p.num, p.is_constexpr, bool(getattr(p, "do_not_specialize", False)))
                 for p in getattr(fn, "params", ()))


def jit_arg_names(fn) -> tuple:
    """The parameter names of a ``@triton.jit`` function in signature order (``arg_names``, on a
    ``JITFunction`` and an ``InterpretedFunction`` alike); () where it has none.
    Checked: triton 3.6, 3.9."""
    return tuple(getattr(fn, "arg_names", ()))


def rejit(kernel, do_not_specialize=(), int64=()):
    """``kernel`` (a ``@triton.jit`` function) made again from its Python function (``kernel.fn``),
    not specialised on the parameters ``do_not_specialize`` names, and with those ``int64`` names
    annotated ``"int64"`` on a copy of the function (``kernel`` itself is unchanged). Relies on
    Triton's JIT typing an integer parameter by such an annotation whatever its value (the
    interpreter with fix 5 of ``common.interpret``). Checked: triton 3.6, 3.9."""
    import triton

    original = kernel.fn
    fn = original
    if int64:
        fn = types.FunctionType(original.__code__, original.__globals__, original.__name__, original.__defaults__,
                                original.__closure__)
        fn.__annotations__ = {**original.__annotations__, **dict.fromkeys(int64, "int64")}
        fn.__qualname__, fn.__module__, fn.__doc__ = original.__qualname__, original.__module__, original.__doc__
    return triton.jit(fn, do_not_specialize=list(do_not_specialize))


# -- NineToothed: generated launchers ----------------------------------------------------------


def generated_launch(handle) -> tuple | None:
    """(launcher, kernel) of a ``ninetoothed.make`` handle: its generated Python launcher
    (``handle._launch``, a function whose module globals name the kernel) and its ``@triton.jit``
    kernel (``handle._kernel``); None for a handle of another form. Checked: ninetoothed 0.26."""
    launch, kernel = getattr(handle, "_launch", None), getattr(handle, "_kernel", None)
    if not is_jit_function(kernel) or not hasattr(launch, "__globals__"):
        return None
    return launch, kernel


def generated_launcher(handle):
    """The Python launcher ``ninetoothed.make`` generated for ``handle`` (``handle._launch``), or
    None for a handle of another form. Checked: ninetoothed 0.26."""
    return getattr(handle, "_launch", None)


def generated_namespace(handle) -> dict | None:
    """The namespace of the module ``ninetoothed.make`` generated for ``handle`` (its launcher's
    globals, which its kernel's also are): where names the kernel reads are defined; None for a
    handle of another form. Checked: ninetoothed 0.26."""
    return getattr(getattr(handle, "_launch", None), "__globals__", None)


def replace_launched_kernel(launch, kernel, replacement) -> bool:
    """Bind the one global name of the generated ``launch`` that holds ``kernel`` to
    ``replacement``, which the launcher then calls as ``kernel[grid](*args, num_warps=,
    num_stages=)``; False (nothing changed) where not exactly one name holds it.
    Checked: ninetoothed 0.26."""
    names = [name for name, value in launch.__globals__.items() if value is kernel]
    if len(names) != 1:
        return False
    launch.__globals__[names[0]] = replacement
    return True


def read_generated_launch(launch) -> tuple | None:
    """What each argument of the one kernel launch inside a generated launcher
    (``kernel[grid](...)``) is, read from its source: ``("input", i)`` (the launcher's i-th
    parameter), ``("size", i, d)`` / ``("stride", i, d)`` (``param.size(d)`` / ``param.stride(d)``
    of that parameter) or ``("fixed",)`` (anything else). None where the source does not have
    that form. Checked: ninetoothed 0.26."""
    function = _parsed_function(launch)
    call = _single_launch(function) if function is not None else None
    if call is None:
        return None
    params = {arg.arg: i for i, arg in enumerate(function.args.args)}
    return tuple(_argument_role(arg, params) for arg in call.args)


def _parsed_function(fn) -> ast.FunctionDef | None:
    """The syntax tree of ``fn``'s source, where that source is one plain function."""
    try:
        (function,) = ast.parse(textwrap.dedent(inspect.getsource(fn))).body
    except (OSError, TypeError, SyntaxError, ValueError):
        return None
    return function if isinstance(function, ast.FunctionDef) else None


def _single_launch(function: ast.FunctionDef) -> ast.Call | None:
    """The one ``name[...](...)`` call in ``function``, without starred arguments; None otherwise."""
    calls = [node for node in ast.walk(function) if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)]
    if len(calls) != 1 or any(isinstance(arg, ast.Starred) for arg in calls[0].args):
        return None
    return calls[0]


def _argument_role(arg: ast.expr, params: dict) -> tuple:
    """One launch argument's role (see :func:`read_generated_launch`)."""
    if isinstance(arg, ast.Name) and arg.id in params:
        return ("input", params[arg.id])
    return _size_or_stride(arg, params) or ("fixed",)


def _size_or_stride(arg: ast.expr, params: dict) -> tuple | None:
    """``("size" | "stride", i, d)`` for ``param.size(d)`` / ``param.stride(d)`` with ``d`` an int literal."""
    if not (isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and arg.func.attr in ("size", "stride")):
        return None
    owner, index = arg.func.value, arg.args
    if not (isinstance(owner, ast.Name) and owner.id in params and len(index) == 1 and not arg.keywords):
        return None
    if not (isinstance(index[0], ast.Constant) and type(index[0].value) is int):
        return None
    return (arg.func.attr, params[owner.id], index[0].value)


# -- NineToothed: code generation --------------------------------------------------------------


def use_code_cache(directory, cache_source) -> None:
    """Have ``ninetoothed.make`` write each generated module through ``cache_source(source) ->
    path`` into ``directory``: the module globals ``CACHE_DIR`` and ``cache_source`` of
    ``ninetoothed.generation``, which ``make`` looks up on each call. Checked: ninetoothed 0.26."""
    import ninetoothed.generation as generation

    generation.CACHE_DIR = directory
    generation.cache_source = cache_source


def code_cache_dir():
    """The directory ``ninetoothed.make`` writes generated modules to (``generation.CACHE_DIR``).
    Checked: ninetoothed 0.26."""
    import ninetoothed.generation as generation

    return generation.CACHE_DIR


def generated_source_file(handle) -> str | None:
    """The path of the module ``ninetoothed.make`` wrote and imported for ``handle``
    (``handle._source``), or None for a handle of another form. Checked: ninetoothed 0.26."""
    source = getattr(handle, "_source", None)
    return source if isinstance(source, str) else None


def handle_of_generated(path, kernel_name: str):
    """The handle ``ninetoothed.make(..., kernel_name=kernel_name)`` returns, rebuilt from the
    module it wrote to ``path`` without generating it again: the module imported the way ``make``
    imports it (``ninetoothed.jit.import_from_path``, named by its path), its kernel
    ``kernel_name`` and its launcher ``launch_<kernel_name>`` in a ``ninetoothed.jit._Handle``.
    None where the module lacks either (another version's layout). Checked: ninetoothed 0.26."""
    import importlib

    jit = importlib.import_module("ninetoothed.jit")  # (the package's name ``jit`` is the decorator)
    module = jit.import_from_path(str(path), str(path))
    names = vars(module)
    kernel, launch = names.get(kernel_name), names.get(f"launch_{kernel_name}")
    if kernel is None or not callable(launch):
        return None
    return jit._Handle(kernel, launch, str(path))


def generator_device_properties() -> dict:
    """The properties of the current device that ``ninetoothed.make`` reads (through Triton's
    active driver) when it generates a kernel: they bound its tiles' sizes. Checked: ninetoothed 0.26."""
    import triton

    driver = triton.runtime.driver.active
    return dict(driver.utils.get_device_properties(driver.get_current_device()))


def restart_tensor_count() -> bool:
    """Name the ``ninetoothed.Tensor``s made next from ``tensor_0`` on: their names come from the
    class attribute ``Tensor.num_instances``, a count of every tensor made. False (nothing done)
    for a version without it. Checked: ninetoothed 0.26."""
    from ninetoothed import Tensor

    if not isinstance(getattr(Tensor, "num_instances", None), int):
        return False
    Tensor.num_instances = 0
    return True


# -- triton: the interpreter -------------------------------------------------------------------
# Each wrap_* function below replaces one function of the interpreter by ``wrap(original)``, once
# (a second call finds the first wrapper and does nothing); it returns whether it replaced it.


def _wrap_once(owner, name: str, wrap) -> bool:
    original = getattr(owner, name)
    if getattr(original, _MARK, False):
        return False
    wrapped = wrap(original)
    setattr(wrapped, _MARK, True)
    setattr(owner, name, wrapped)
    return True


def wrap_interpreter_dot(wrap) -> bool:
    """``InterpreterBuilder.create_dot(self, a, b, d, *options)``: ``tl.dot`` under the interpreter,
    on ``TensorHandle``s (``.data`` a NumPy array, ``.dtype`` a ``tl`` type; bfloat16 held as
    uint16 bit patterns). Checked: triton 3.9."""
    from triton.runtime.interpreter import InterpreterBuilder

    return _wrap_once(InterpreterBuilder, "create_dot", wrap)


def wrap_interpreter_cast(wrap) -> bool:
    """``InterpreterBuilder.cast_impl(self, src, dst_type)``: every float conversion under the
    interpreter that is not an fp8 one or a non-default rounding mode (``.to()``, a store's
    conversion to the pointer's type, a constant's), on ``TensorHandle``s. Checked: triton 3.9."""
    from triton.runtime.interpreter import InterpreterBuilder

    return _wrap_once(InterpreterBuilder, "cast_impl", wrap)


def wrap_interpreter_fp8_cast(wrap) -> bool:
    """``InterpreterBuilder.create_fp_to_fp(self, src, dst_type, rounding_mode)``: a float conversion
    to or from an 8-bit float under the interpreter (``.to()``), on ``TensorHandle``s (8-bit floats
    held as uint8 bit patterns). Checked: triton 3.9."""
    from triton.runtime.interpreter import InterpreterBuilder

    return _wrap_once(InterpreterBuilder, "create_fp_to_fp", wrap)


def interpreter_fp8_cast(values, src, dst):
    """The interpreter's own :func:`wrap_interpreter_fp8_cast` conversion (round to nearest) of the
    NumPy array ``values`` (holding ``tl`` type ``src``) to ``tl`` type ``dst``: the result's data."""
    from triton.runtime import interpreter
    from triton.runtime.interpreter import _ir

    return interpreter.interpreter_builder.create_fp_to_fp(interpreter.TensorHandle(values, src), dst,
                                                           _ir.ROUNDING_MODE.RTNE).data


def interpreter_rounding_to_nearest(rounding_mode) -> bool:
    """Whether ``create_fp_to_fp``'s ``rounding_mode`` rounds to nearest (RTNE, or None: the default)."""
    from triton.runtime.interpreter import _ir

    return rounding_mode is None or rounding_mode == _ir.ROUNDING_MODE.RTNE


def interpreter_cast(values, src, dst):
    """The interpreter's own conversion of the NumPy array ``values`` (holding ``tl`` type ``src``)
    to ``tl`` type ``dst``: the data of the ``TensorHandle`` that ``cast_impl`` returns."""
    from triton.runtime import interpreter

    return interpreter.interpreter_builder.cast_impl(interpreter.TensorHandle(values, src), dst).data


def interpreter_handle(data, dtype):
    """A ``TensorHandle`` of the NumPy array ``data`` (bit patterns for bfloat16) as ``tl`` type
    ``dtype``: what the interpreter's builder functions return. Checked: triton 3.9."""
    from triton.runtime.interpreter import TensorHandle

    return TensorHandle(data, dtype)


def has_active_driver() -> bool:
    """Whether Triton has an active driver (``triton.runtime.driver.active`` answers
    ``get_current_device()``); none on a machine without a GPU. Checked: triton 3.6, 3.9."""
    import triton

    try:
        triton.runtime.driver.active.get_current_device()
    except Exception:  # noqa: BLE001 - Triton raises RuntimeError("0 active drivers ...") here
        return False
    return True


def set_active_driver(driver) -> None:
    """Make ``driver`` Triton's active driver (``triton.runtime.driver.set_active``), which
    ``ninetoothed.make`` asks for the device and its properties. Checked: triton 3.9."""
    import triton

    triton.runtime.driver.set_active(driver)


def wrap_annotation_normaliser(wrap) -> bool:
    """``triton.runtime.jit._normalize_ty(ty)``: a parameter annotation as the JIT and the
    interpreter read it (``"constexpr"`` for ``tl.constexpr``, ``"i64"`` for ``"int64"``), looked up
    on that module at each use. Checked: triton 3.9."""
    import triton.runtime.jit as jit

    return _wrap_once(jit, "_normalize_ty", wrap)


def normalized_annotation(ty):
    """``ty`` as Triton's JIT reads a parameter annotation (:func:`wrap_annotation_normaliser`)."""
    import triton.runtime.jit as jit

    return jit._normalize_ty(ty)


def interpreter_builder():
    """The interpreter's one builder (``triton.runtime.interpreter.interpreter_builder``), whose
    ``options`` (a dataclass; ``sanitize_overflow``) every interpreted kernel reads; None where
    there is none. Checked: triton 3.9."""
    from triton.runtime import interpreter

    return getattr(interpreter, "interpreter_builder", None)


def wrap_interpreter_semantic(name: str, wrap) -> bool:
    """Method ``name`` of the interpreter's one ``TritonSemantic`` (``interpreter_semantic``: what
    every ``tl`` builtin calls under the interpreter, e.g. ``add(input, other, sanitize_overflow)``,
    ``floordiv(input, other)``, ``less_than(input, other)``, ``and_(input, other)``, on ``tl.tensor``s
    or Python numbers), replaced on that instance; its ``builder`` is :func:`interpreter_builder`.
    Checked: triton 3.9."""
    from triton.runtime import interpreter

    semantic = getattr(interpreter, "interpreter_semantic", None)
    if semantic is None or getattr(semantic, "builder", None) is not interpreter_builder():
        return False
    return _wrap_once(semantic, name, wrap)


def wrap_language_patching(wrap) -> bool:
    """``triton.runtime.interpreter._patch_lang(fn)``: points ``triton.language`` (and ``.core``,
    where ``fn``'s globals hold it) at the interpreter's builtins and returns the scope whose
    ``restore()`` undoes that; a launch calls it and restores at its end, and every device-function
    call inside calls it again and keeps what it patched. Looked up on that module at each call.
    Checked: triton 3.9."""
    from triton.runtime import interpreter

    return _wrap_once(interpreter, "_patch_lang", wrap)


def wrap_interpreted_run(wrap) -> bool:
    """``InterpretedFunction.run(self, *args, **kwargs)``: one interpreted launch, with
    ``self.fn`` the Python function and ``self.arg_names`` its parameters. Checked: triton 3.9."""
    from triton.runtime.interpreter import InterpretedFunction

    return _wrap_once(InterpretedFunction, "run", wrap)


def wrap_implicit_conversion(wrap) -> bool:
    """``triton.runtime.interpreter._implicit_cvt(arg)``: each scalar argument of an interpreted
    launch made a ``tl.tensor``, looked up on that module at each launch. Checked: triton 3.9."""
    from triton.runtime import interpreter

    return _wrap_once(interpreter, "_implicit_cvt", wrap)


def int64_scalar(value: int):
    """``value`` as the interpreter's int64 scalar argument (a one-element ``TensorHandle``
    in a ``tl.tensor``), what ``_implicit_cvt`` makes of an integer past 32 bits.
    Checked: triton 3.9."""
    import numpy as np
    import triton.language as tl

    return tl.tensor(interpreter_handle(np.array([value], dtype=np.int64), tl.int64), tl.int64)

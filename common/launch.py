"""Launching compiled Triton kernels without Triton's per-call dispatch.

``fn[grid](*args)`` binds every argument to the signature, works out how each
one specialises the kernel (dtype, 16-byte alignment, integer value class),
hashes all that and looks the compiled kernel up: tens of microseconds per
call, more than the whole kernel takes on small inputs. :class:`CachedLauncher`
goes through that path once per *specialisation* and keeps the compiled kernel
it returns; later calls launch it directly (``compiled[grid](*args)``).

Two caches, both keyed only by what Triton itself specialises on (and a little
more), so a kernel is reused only where Triton would pick the same one:

- by value: the exact scalar arguments and each tensor's dtype and alignment.
  One tuple built at C speed; hit by every call of a loop over one shape.
- by class: each integer's class (equal to 1, a multiple of 16, fits in 32
  bits) instead of its value; hit by a new shape that needs no new kernel
  (a decode loop's growing key length), which then enters the first cache.

Used by both backends: ``impl_triton`` launches its kernels through it, and
``impl_ninetoothed`` routes the launch inside NineToothed's generated launcher
through it.
"""

from __future__ import annotations

import contextlib
import operator
import threading

import torch
import triton

from common import compat
from common.interpret import apply_interpreter_fixes
from common.outputs import stream_key

_MAX_BY_VALUE = 4096  # entries before the by-value cache starts over
_BY_CLASS, _BY_VALUE, _LOOSE = range(3)  # how the by-class cache keys a scalar argument
_compile_lock = threading.RLock()
# Every compile asks for fused multiply-adds: the kernels are written for them (a score's scale and its
# row maximum in one FMA, exp2's argument, FP8 descales), and Triton 3.10 turns fusion off by default.
COMPILE_OPTIONS = {"enable_fp_fusion": True}


MIN_COUNTERS = 1024  # counters made at once: most launches never need more


class _TicketCounters:
    """The counters :func:`ticket_counters` keeps, per (device, stream), and the fewest it makes at
    once. One module-level instance whose fields :func:`fresh_counters` swaps, so that a test
    starts from none kept (and a small minimum, to see them grow) without patching this module."""

    __slots__ = ("by_stream", "minimum")

    def __init__(self):
        self.by_stream: dict = {}  # (device, stream) -> counters
        self.minimum = MIN_COUNTERS


_tickets = _TicketCounters()


def ticket_counters(device: torch.device, count: int) -> torch.Tensor:
    """``count`` or more int32 counters at 0, on ``device``, for kernels whose programs take
    tickets (``atomic_add``) and whose last program sets its counter back to 0 before the
    launch ends: zeroed once, then reused by every launch.

    Kept per (device, stream): launches on one stream run one after the other, while
    two streams could run two launches at once. While a CUDA graph is being captured
    and none large enough exist yet, new ones for that launch alone (zeros made during
    a capture are written only when the graph replays: they belong to the graph).
    """
    key = stream_key(device)
    kept = _tickets.by_stream
    counters = kept.get(key)
    if counters is None or counters.numel() < count:
        counters = torch.zeros(max(count, _tickets.minimum), dtype=torch.int32, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return counters
        kept[key] = counters
    return counters


@contextlib.contextmanager
def fresh_counters(minimum: int = MIN_COUNTERS):
    """For tests: inside the block :func:`ticket_counters` keeps counters from none, making at
    least ``minimum`` at once, and the block gets the dict that holds them, (device, stream) ->
    counters, to look at; the counters kept before it, and the minimum, are back after it."""
    if type(minimum) is not int or minimum < 1:
        raise ValueError(f"minimum must be a positive int, got {minimum!r}")
    saved = _tickets.by_stream, _tickets.minimum
    _tickets.by_stream, _tickets.minimum = {}, minimum
    try:
        yield _tickets.by_stream
    finally:
        _tickets.by_stream, _tickets.minimum = saved


class CachedLauncher:
    """Launch one ``@triton.jit`` function: ``launcher(grid, *args, num_warps=,
    num_stages=, maxnreg=None, **constexprs)``, the runtime arguments positionally in
    signature order, the constexprs by keyword; each argument in the same
    role (tensor or scalar) on every call. Safe to call from several threads
    (the caches are dicts written whole; the roles are set in one assignment;
    a miss, which compiles, holds a lock)."""

    def __init__(self, fn):
        self.fn = fn
        self.enabled = isinstance(fn, triton.runtime.JITFunction)  # not under the interpreter
        self._by_value: dict = {}
        self._by_class: dict = {}
        self._roles = None  # (tensor getter, scalar getter, each scalar's kind), set on the first call
        names = [name for name, _, constexpr, _ in compat.jit_parameters(fn) if constexpr]
        # the constexprs in signature order, from the keywords (the parameters after the runtime
        # ones; the interpreter's function has no params, so its names come from its arguments)
        self._constexprs = operator.itemgetter(*names) if len(names) > 1 else (
            (lambda kw, n=names[0]: (kw[n],)) if names else (lambda kw: ()))
        self._arg_names = compat.jit_arg_names(fn)

    def __call__(self, grid, *args, num_warps: int, num_stages: int, maxnreg: int | None = None,
                 **constexprs) -> None:
        if not self.enabled:
            self.fn[grid](*args, num_warps=num_warps, num_stages=num_stages, **constexprs)
            return
        self.run(grid, args + self._constexprs(constexprs), num_warps, num_stages, maxnreg)

    def positional(self, args: tuple, constexprs: dict) -> tuple:
        """The runtime ``args`` and the ``constexprs`` (by name, the parameters after them) as
        one tuple in signature order: what :meth:`run` takes."""
        if self.enabled:
            return args + self._constexprs(constexprs)
        return args + tuple([constexprs[name] for name in self._arg_names[len(args):]])

    def arg_index(self, name: str) -> int:
        """The position of parameter ``name`` in the signature."""
        return self._arg_names.index(name)

    def run(self, grid, args, num_warps: int, num_stages: int, maxnreg: int | None = None) -> None:
        """Launch with every argument positional (:meth:`positional`), through the caches;
        ``maxnreg``, where not None, caps each thread's registers (Triton's launch option; the
        interpreter has no registers to cap)."""
        self.launch(grid, args, num_warps, num_stages, maxnreg)

    def compiled(self, args, num_warps: int, num_stages: int, maxnreg: int | None = None):
        """The compiled kernel a launch of ``args`` (as :meth:`run` takes them) went to, once the
        by-value cache holds it; None before that, under the interpreter, and for a kernel that
        needs scratch memory at launch (global or a profiler's, which a direct launch would not allocate)."""
        if not self.enabled or self._roles is None:
            return None
        tensors, scalars = self._roles[0](args), self._roles[1](args)
        layout = tuple([(t.dtype, t.data_ptr() & 15 == 0) for t in tensors])
        kernel = self._by_value.get((scalars, layout, num_warps, num_stages, maxnreg, torch.cuda.current_device()))
        if kernel is None or compat.needs_launch_scratch(kernel):
            return None
        return kernel

    def launch(self, grid, args, num_warps: int, num_stages: int, maxnreg: int | None = None) -> None:
        """Launch with every argument positional, constexprs included, in signature order."""
        if not self.enabled:
            self.fn[grid](*args, num_warps=num_warps, num_stages=num_stages)
            return
        roles = self._roles
        if roles is None:
            roles = self._roles = self._split_roles(args)
        tensors, scalars = roles[0](args), roles[1](args)
        device = torch.cuda.current_device()
        layout = tuple([(t.dtype, t.data_ptr() & 15 == 0) for t in tensors])
        key = (scalars, layout, num_warps, num_stages, maxnreg, device)
        kernel = self._by_value.get(key)
        if kernel is None:
            kernel = self._by_class_lookup(grid, args, scalars, layout, (num_warps, num_stages, maxnreg), device,
                                           roles[2])
            if kernel is None:
                return  # launched through Triton's own dispatch
            if len(self._by_value) >= _MAX_BY_VALUE:
                self._by_value = {}
            self._by_value[key] = kernel
        if callable(grid):
            grid = grid({})
        if len(grid) < 3:  # a compiled kernel takes exactly (x, y, z)
            grid = (*grid, 1, 1)[:3]
        kernel[grid](*args)

    def clear(self) -> None:
        """Drop every compiled kernel this launcher keeps: its next launch of each specialisation
        goes through Triton's dispatch again (for a test that counts what Triton compiles). Safe
        beside launches from other threads, as the by-value cache's starting over is."""
        self._by_value, self._by_class = {}, {}

    def _split_roles(self, args):
        tensor_at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        scalar_at = [i for i, a in enumerate(args) if not isinstance(a, torch.Tensor)]
        params = compat.jit_parameters(self.fn)
        constexpr_at = {num for _, num, constexpr, _ in params if constexpr}
        loose_at = {num for _, num, _, loose in params if loose}
        # itemgetter of one index returns the item, not a 1-tuple
        tensors = operator.itemgetter(*tensor_at) if len(tensor_at) > 1 else (
            lambda a, i=tensor_at[0]: (a[i],))
        scalars = operator.itemgetter(*scalar_at) if len(scalar_at) > 1 else (
            (lambda a, i=scalar_at[0]: (a[i],)) if scalar_at else (lambda a: ()))
        kinds = tuple(_BY_VALUE if i in constexpr_at else _LOOSE if i in loose_at else _BY_CLASS for i in scalar_at)
        return tensors, scalars, kinds

    def _by_class_lookup(self, grid, args, scalars, layout, options, device, kinds):
        # An integer the kernel is not specialised on (do_not_specialize) keeps only its type
        # (Triton's i32 or i64): a kernel compiled for one value serves every other.
        classes = tuple([
            a if kind == _BY_VALUE or type(a) not in (int, float)  # constexprs (and bools) by value
            else (-(2**31) <= a < 2**31) if type(a) is int and kind == _LOOSE
            else (a == 1, a % 16 == 0, -(2**31) <= a < 2**31) if type(a) is int
            else float
            for a, kind in zip(scalars, kinds)
        ])
        key = (classes, layout, *options, device)
        kernel = self._by_class.get(key)
        if kernel is None:
            # Triton's own dispatch compiles on a miss; first calls from several
            # threads at once go through it one at a time (a first call only).
            with _compile_lock:
                compiled = self._compile_fitting(grid, args, *options)
            # A Triton whose launch returns no launchable kernel keeps the slow path.
            if not hasattr(compiled, "__getitem__"):
                return None
            self._by_class[key] = compiled
            return None  # this call has launched already
        return kernel


    def _compile_fitting(self, grid, args, num_warps, num_stages, maxnreg=None):
        """Compile and launch with ``num_stages``, or with fewer where its pipeline buffers
        do not fit the GPU's shared memory (a configuration tuned on the H200 on a GPU
        with less, or a tile the table did not foresee, e.g. a mask's): stages change
        the kernel's speed, never its grid or its result. Raises when one stage does
        not fit either."""
        capped = {} if maxnreg is None else {"maxnreg": maxnreg}
        while True:
            try:
                return self.fn[grid](*args, num_warps=num_warps, num_stages=num_stages, **capped, **COMPILE_OPTIONS)
            except triton.runtime.errors.OutOfResources as error:
                if num_stages <= 1 or error.name != "shared memory":
                    raise
                num_stages -= 1


class BoundKernel:
    """One kernel's launch bound to a layout: the grid, the launch options and every argument
    fixed but the call's own tensors (and, for a growing cache, a few integers), which a
    subclass puts in place (``__call__``). Once a compiled kernel is known (from the launcher's
    cache, after a launch: :meth:`launch_new`), it is launched directly (:meth:`run_compiled`)
    while what Triton specialises it on holds: that is ``key``, which the subclass builds (the
    inputs' 16-byte alignment, :func:`alignment`, of those a call passes; the class of each varying integer,
    :func:`int_classes`) and looks up in ``kernels``."""

    def __init__(self, launcher: CachedLauncher, grid, num_warps: int, num_stages: int, maxnreg: int | None = None):
        # (x, y, z): a compiled kernel's direct launch reads all three (compat.direct_launcher), so a shorter
        # grid is padded with ones, as Triton pads one
        self.launcher, self.grid = launcher, (*grid, 1, 1)[:3]
        self.num_warps, self.num_stages, self.maxnreg = num_warps, num_stages, maxnreg
        self.kernels: dict = {}  # key -> compiled kernel

    def run_compiled(self, kernel, args) -> None:
        """Launch ``kernel`` (``kernels[key]``, a compiled kernel) with ``args``, every argument
        positional and each tensor as its address (an int): Triton's launcher takes an int as it
        is, where a tensor costs a ``data_ptr()`` call and a CUDA driver query (the pointer's
        attributes) per launch; our tensors are checked CUDA tensors already. Where this Triton's
        compiled-kernel launch has the form :func:`common.compat.direct_launcher` knows, its
        runner is called directly while no launch hook is registered."""
        launch_compiled(kernel, self.grid, args)

    def launch_new(self, args, key) -> None:
        """Launch through the launcher (compiling where needed; ``args`` every argument positional,
        tensors as tensors, as :meth:`CachedLauncher.run` takes them) and keep the compiled
        kernel for ``key``: what a subclass does where ``kernels`` has none for ``key`` yet."""
        self.launcher.run(self.grid, args, self.num_warps, self.num_stages, self.maxnreg)
        kernel = self.launcher.compiled(args, self.num_warps, self.num_stages, self.maxnreg)
        if kernel is not None:
            self.kernels[key] = kernel


class BoundSlots(BoundKernel):
    """A launch bound to a layout argument by argument: every argument fixed but a later call's
    tensors, each at its slot (``slots``: (position, index into the tensors the call passes)), and
    the integers at ``hole_positions``, which the call passes too (``values``: what depends on a
    growing cache's keys). The compiled kernel is kept per alignment of the call's tensors and class
    of each hole's integer (:meth:`BoundKernel.launch_new`). ``args``: the binding call's, every
    argument positional; its tensors at the slots are not kept."""

    def __init__(self, launcher, args, slots, grid, num_warps: int, num_stages: int, maxnreg: int | None = None,
                 hole_positions=()):
        super().__init__(launcher, grid, num_warps, num_stages, maxnreg)
        self.args, self.slots = list(args), tuple(slots)
        for position, _ in self.slots:
            self.args[position] = None
        # the same with the kept tensors' addresses, for a compiled kernel called directly (the
        # kept tensors, stand-ins of the launch's own, stay alive in self.args)
        self.pointer_args = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in self.args]
        self.hole_positions = tuple(hole_positions)

    def __call__(self, tensors, values=()) -> None:
        given = [tensors[index] for _, index in self.slots]
        pointers = [t.data_ptr() for t in given]
        aligned = alignment(pointers)
        key = (aligned, int_classes(values)) if values else aligned
        kernel = self.kernels.get(key)
        args = (self.pointer_args if kernel is not None else self.args).copy()
        for (position, _), arg in zip(self.slots, pointers if kernel is not None else given):
            args[position] = arg
        for position, value in zip(self.hole_positions, values):
            args[position] = value
        if kernel is not None:
            self.run_compiled(kernel, args)
        else:
            self.launch_new(args, key)


class BoundSequence:
    """Bound launches run one after the other on one call's tensors (the backward's passes)."""

    def __init__(self, *launches):
        self.launches = launches

    def __call__(self, tensors) -> None:
        for launch in self.launches:
            launch(tensors)


def _through_getitem(kernel, grid, args) -> None:
    kernel[grid](*args)


# A compiled kernel's launch: its runner called directly where this Triton's launch has the
# form compat knows (and CUDA exists), else Triton's own ``kernel[grid](*args)``.
launch_compiled = compat.direct_launcher() or _through_getitem


def alignment(pointers) -> int:
    """Which of ``pointers`` start at 16-byte multiples, bit i for pointer i: what Triton specialises
    each pointer argument on, so what a bound launch keeps its compiled kernels by. (One flag for all
    of them would run a kernel compiled for one pattern, the query unaligned, on another, the keys
    unaligned, whose query it reads as aligned.)"""
    bits = 0
    for i, pointer in enumerate(pointers):
        if pointer & 15 == 0:
            bits |= 1 << i
    return bits


def int_classes(values) -> tuple:
    """What Triton specialises each integer of ``values`` on (see the by-class cache above),
    in one tuple: a bound launch's per-call key."""
    return tuple([(a == 1, a % 16 == 0, -(2**31) <= a < 2**31) for a in values])


class _Recorder(threading.local):
    launches: dict | None = None  # routed kernel -> its last launch, while this thread records


_recorder = _Recorder()


@contextlib.contextmanager
def recorded_launches():
    """Inside the block, each routed launch this thread makes is kept (:meth:`_RoutedKernel.last`),
    for a caller that binds it (``impl_ninetoothed.attention.bind_forward``); when the block
    ends, none is: the launches' tensors must not outlive the call."""
    launches = _recorder.launches = {}
    try:
        yield
    finally:
        _recorder.launches = None
        launches.clear()


class _RoutedKernel:
    """Stands in for a ``@triton.jit`` function inside generated launch code:
    ``kernel[grid](*args, num_warps=..., num_stages=...)`` goes through a
    :class:`CachedLauncher`, with ``maxnreg`` (a register cap, which the generated code does not
    pass: given when the launcher is routed; NineToothed makes a launcher per set of options)."""

    def __init__(self, fn, maxnreg: int | None = None):
        self.fn = fn
        self.launcher = CachedLauncher(fn)
        self.maxnreg = maxnreg

    def __getitem__(self, grid):
        def run(*args, **options):
            launches = _recorder.launches
            if set(options) <= {"num_warps", "num_stages"}:
                launch_grid = grid({}) if callable(grid) else grid
                launch_grid = (*launch_grid, 1, 1)[:3]  # a compiled kernel takes exactly (x, y, z)
                num_warps, num_stages = options.get("num_warps", 4), options.get("num_stages", 3)
                if launches is not None:
                    launches[self] = (launch_grid, args, num_warps, num_stages)
                self.launcher.launch(launch_grid, args, num_warps, num_stages, self.maxnreg)
            else:  # anything else: Triton's own dispatch, unchanged
                if launches is not None:
                    launches[self] = None
                self.fn[grid](*args, **options)

        return run

    def last(self):
        """(grid, args, num_warps, num_stages) of this thread's last launch through the cache inside
        :func:`recorded_launches`, or None."""
        launches = _recorder.launches
        return launches.get(self) if launches is not None else None


def routed_kernel(handle) -> _RoutedKernel | None:
    """The :class:`_RoutedKernel` that ``handle``'s generated launcher launches, or None."""
    routed = [value for value in (compat.generated_namespace(handle) or {}).values()
              if isinstance(value, _RoutedKernel)]
    return routed[0] if len(routed) == 1 else None


_described: dict = {}  # generated launcher -> launcher_arguments(launcher)


def launcher_arguments(launch) -> tuple | None:
    """What each argument of the one kernel launch inside a NineToothed-generated launcher
    (``kernel[grid](...)``) is (:func:`common.compat.read_generated_launch`): ``("input", i)``,
    ``("size", i, d)``, ``("stride", i, d)`` or ``("fixed",)`` (the constexprs). None where the
    source does not have that form. Read once per launcher."""
    described = _described.get(launch)
    if described is None:
        described = _described[launch] = compat.read_generated_launch(launch) or False
    return described or None


def route_generated_launch(handle, loose=(), maxnreg: int | None = None, wide_strides: bool = False):
    """Route the kernel launch of a ``ninetoothed.make`` handle through a :class:`CachedLauncher`.

    NineToothed generates a Python launcher that reads every size and stride
    and calls ``kernel[grid](...)``, Triton's full dispatch, on each call.
    Replacing the kernel's name in the launcher's globals
    (:func:`common.compat.replace_launched_kernel`) leaves the generated
    code as it is and only changes how its one launch is done (under the
    interpreter, where the launcher's cache is off, only the recording of the
    last launch: :meth:`_RoutedKernel.last`). ``loose`` names the arguments the kernel is not
    specialised on, and ``wide_strides`` types the strides of each tensor's first two
    dimensions as 64-bit integers (:func:`_rejitted`). Where the handle does not look like that (another NineToothed
    version) it is returned untouched (and ``maxnreg``, a register cap for the launch, which
    only our launch path can pass, is then not applied: it changes the kernel's speed, never
    its result).
    """
    generated = compat.generated_launch(handle)
    if generated is None:
        return handle
    launch, kernel = generated
    if loose or wide_strides:
        rejitted = _rejitted(kernel, launch, frozenset(loose), wide_strides)
    else:
        rejitted = kernel
    compat.replace_launched_kernel(launch, kernel, _RoutedKernel(rejitted, maxnreg))
    return handle


def _rejitted(kernel, launch, loose, wide_strides):
    """``kernel`` made again, with ``do_not_specialize`` on the arguments ``loose`` names, as
    :func:`launcher_arguments` describes them (``("size" | "stride", parameter, dim)``), and
    with ``wide_strides``, the strides of each tensor's first two dimensions annotated as
    ``int64``; ``kernel`` itself where the launcher's source is not of the form read here.

    Loose: NineToothed passes every size and stride of a tensor to its kernel, and
    ``ninetoothed.make`` has no ``do_not_specialize`` of its own. Where a growing cache changes
    such an argument (a split's partials: their number of splits, rows x splits), Triton would
    otherwise compile another kernel whenever one passes or leaves a multiple of 16.

    Wide strides: each address NineToothed generates is a sum of (index x stride) products,
    and Triton types an integer argument by its value, so a stride under 2^31 makes its
    product 32-bit, and an offset past 2^31 elements wraps. A parameter annotated ``int64``
    is typed so whatever its value (Triton's JIT reads the annotation, and still specialises
    on the value's divisibility by 16), and its products are 64-bit: NineToothed's own
    ahead-of-time path types every stride so for tensors past 32 bits. Only the first two
    dimensions' (every tensor our kernels take starts (batch, head), or (page, slot) for a
    paged cache): their products are made once a program, where the compiler then folds the
    constant part of each element's offset into its load. Never a tensor's last dimension's: that
    stride is 1, which Triton specialises as a constant, and annotated the loads lost their
    vector width (16-bit loads in place of 16-byte copies). Every stride but the last also
    made ptxas serialise the backward's warpgroup products."""
    described = launcher_arguments(launch)
    arg_names = compat.jit_arg_names(kernel)
    if described is None or not arg_names or len(described) != len(arg_names):
        return kernel
    names = [name for name, role in zip(arg_names, described) if role in loose]
    wide = _wide_strides(arg_names, described) if wide_strides else []
    if not names and not wide:
        return kernel
    if wide:
        apply_interpreter_fixes()  # (the interpreter reads the annotations with its fix 5 only)
    return compat.rejit(kernel, do_not_specialize=names, int64=wide)


def _wide_strides(arg_names, described) -> list:
    """The names of the stride arguments of each tensor's first two dimensions, never its last."""
    last = {}  # each tensor parameter's last dimension
    for role in described:
        if role[0] == "stride":
            last[role[1]] = max(last.get(role[1], 0), role[2])
    return [name for name, role in zip(arg_names, described) if role[0] == "stride" and role[2] < min(2, last[role[1]])]


def define_constants(handle, constants: dict) -> None:
    """Define named constants, as ``tl.constexpr``, in the module that
    ``ninetoothed.make`` generated for ``handle``.

    NineToothed compiles an application's source in a module of its own, where
    the names of the module that wrote it do not exist; the kernels name their
    constants (``LOG2E``, the mask kinds) all the same, and this is where those
    names get their values. Done before the kernel's first launch (when Triton
    reads the module's globals).
    """
    import triton.language as tl

    namespace = compat.generated_namespace(handle)
    if namespace is None:
        raise TypeError(f"{handle!r} has no generated module to define constants in: a ninetoothed.make handle of a "
                        f"form common.compat does not know")
    namespace.update({name: tl.constexpr(value) for name, value in constants.items()})

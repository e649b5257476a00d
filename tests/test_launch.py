"""common.launch: which calls reuse a compiled kernel and which go back to Triton.

Runs on any machine: a stand-in for a ``@triton.jit`` function records what
Triton's dispatch would be asked to do, so the caching rules are checked
without a GPU. (On a GPU every other test launches through the real thing.)
"""

from __future__ import annotations

import types

import pytest
import torch
import triton

from common import launch


class FakeCompiled:
    def __init__(self, log, number):
        self.log, self.number = log, number

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("direct", self.number, grid, args))


class FakeJIT:
    """Stands in for triton.runtime.JITFunction: fn[grid](*args, **options)."""

    def __init__(self, constexpr_positions):
        self.params = [types.SimpleNamespace(num=i, name=f"arg{i}", is_constexpr=i in constexpr_positions)
                       for i in range(4)]
        self.log, self.compiled = [], 0

    def __getitem__(self, grid):
        def run(*args, **options):
            self.compiled += 1
            self.log.append(("dispatch", self.compiled, grid, args))
            return FakeCompiled(self.log, self.compiled)
        return run


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(launch.torch.cuda, "current_device", lambda: 0)
    fn = FakeJIT(constexpr_positions={3})
    launcher = launch.CachedLauncher(fn)
    launcher.enabled = True  # as on a GPU
    return fn, launcher


def test_reuses_the_compiled_kernel(fake):
    fn, launcher = fake
    t = torch.zeros(64)
    args = (t, 64, 0.5, 128)
    launcher.launch((4, 1, 1), args, 4, 3)  # first call: Triton's dispatch
    launcher.launch((4, 1, 1), args, 4, 3)  # by class
    launcher.launch((4, 1, 1), args, 4, 3)  # by value
    assert [entry[0] for entry in fn.log] == ["dispatch", "direct", "direct"]
    assert fn.log[-1][3] == args and fn.log[-1][2] == (4, 1, 1)
    # another length of the same class, another scale: no new kernel
    launcher.launch((4, 1, 1), (t, 96, 0.25, 128), 4, 3)
    assert fn.log[-1][:2] == ("direct", 1)


def test_clear_goes_back_to_triton(fake):
    """After clear() the launcher keeps no compiled kernel: the next launch is Triton's dispatch."""
    fn, launcher = fake
    args = (torch.zeros(64), 64, 0.5, 128)
    for _ in range(2):
        launcher.launch((4, 1, 1), args, 4, 3)
    launcher.clear()
    launcher.launch((4, 1, 1), args, 4, 3)
    assert [entry[0] for entry in fn.log] == ["dispatch", "direct", "dispatch"]


def test_fresh_counters():
    """Inside fresh_counters the ticket counters start from none, at least ``minimum`` at once and
    grown as launches need more; the ones kept before are back after."""
    cpu = torch.device("cpu")
    before = launch.ticket_counters(cpu, 8)
    with launch.fresh_counters(minimum=4) as kept:
        assert launch.ticket_counters(cpu, 2).numel() == 4 and len(kept) == 1
        assert launch.ticket_counters(cpu, 3) is launch.ticket_counters(cpu, 4)
        grown = launch.ticket_counters(cpu, 6)
        assert grown.numel() == 6 and list(kept.values()) == [grown]
    assert launch.ticket_counters(cpu, 8) is before
    assert before.numel() >= launch.MIN_COUNTERS
    with pytest.raises(ValueError, match="minimum must be a positive int"):
        with launch.fresh_counters(minimum=0):
            pass


@pytest.mark.parametrize("change", ["constexpr", "int class", "alignment", "dtype", "warps"])
def test_what_a_kernel_is_specialised_on_goes_back_to_triton(fake, change):
    fn, launcher = fake
    t = torch.zeros(64)
    launcher.launch((4, 1, 1), (t, 64, 0.5, 128), 4, 3)
    args, warps = {
        "constexpr": ((t, 64, 0.5, 64), 4),  # 64 and 128 share an int class; as a constexpr they differ
        "int class": ((t, 1, 0.5, 128), 4),  # 1 is specialised apart from 64
        "alignment": ((t[1:], 64, 0.5, 128), 4),  # a pointer not 16-byte aligned
        "dtype": ((t.half(), 64, 0.5, 128), 4),
        "warps": ((t, 64, 0.5, 128), 8),
    }[change]
    launcher.launch((4, 1, 1), args, warps, 3)
    assert [entry[:2] for entry in fn.log] == [("dispatch", 1), ("dispatch", 2)]


def test_an_argument_not_specialised_on_keeps_one_kernel(monkeypatch):
    """An integer the kernel has ``do_not_specialize`` on: its other classes (1, a multiple of 16,
    other) reuse the compiled kernel, not Triton's dispatch; past 32 bits (Triton's i64, another
    signature) it goes back to Triton."""
    monkeypatch.setattr(launch.torch.cuda, "current_device", lambda: 0)
    fn = FakeJIT(constexpr_positions={3})
    fn.params[1].do_not_specialize = True
    launcher = launch.CachedLauncher(fn)
    launcher.enabled = True  # as on a GPU
    t = torch.zeros(64)
    for n in (64, 1, 17, 96):
        launcher.launch((4, 1, 1), (t, n, 0.5, 128), 4, 3)
    assert [entry[:2] for entry in fn.log] == [("dispatch", 1)] + [("direct", 1)] * 3
    launcher.launch((4, 1, 1), (t, 2**33, 0.5, 128), 4, 3)
    assert fn.log[-1][:2] == ("dispatch", 2)


class SmallSharedMemoryJIT(FakeJIT):
    """A GPU whose shared memory holds at most ``fits`` pipeline stages of this kernel."""

    def __init__(self, fits):
        super().__init__(constexpr_positions={3})
        self.fits, self.tried = fits, []

    def __getitem__(self, grid):
        run = super().__getitem__(grid)

        def fitting(*args, num_stages, **options):
            self.tried.append(num_stages)
            if num_stages > self.fits:
                raise triton.runtime.errors.OutOfResources(num_stages * 50_000, self.fits * 50_000, "shared memory")
            return run(*args, num_stages=num_stages, **options)
        return fitting


@pytest.mark.parametrize("fits", [3, 1, 0])
def test_fewer_stages_where_shared_memory_runs_out(monkeypatch, fits):
    """A configuration whose pipeline outgrows the GPU's shared memory compiles with fewer
    stages (same grid, same arguments); one that does not fit with one stage raises."""
    monkeypatch.setattr(launch.torch.cuda, "current_device", lambda: 0)
    fn = SmallSharedMemoryJIT(fits)
    launcher = launch.CachedLauncher(fn)
    launcher.enabled = True
    args = (torch.zeros(64), 64, 0.5, 128)
    if fits == 0:
        with pytest.raises(triton.runtime.errors.OutOfResources):
            launcher.launch((4, 1, 1), args, 4, 5)
        assert fn.tried == [5, 4, 3, 2, 1]
        return
    launcher.launch((4, 1, 1), args, 4, 5)
    launcher.launch((4, 1, 1), args, 4, 5)  # the fitted kernel, cached under the asked configuration
    assert fn.tried == list(range(5, fits - 1, -1))
    assert [entry[0] for entry in fn.log] == ["dispatch", "direct"]
    assert fn.log[0][3] == args and fn.log[0][2] == (4, 1, 1)


class OptionsJIT(FakeJIT):
    """Records the launch options each compile is asked for."""

    def __init__(self):
        super().__init__(constexpr_positions={3})
        self.options = []

    def __getitem__(self, grid):
        run = super().__getitem__(grid)

        def recording(*args, **options):
            self.options.append(options)
            return run(*args, **options)
        return recording


def test_a_register_cap_compiles_a_kernel_of_its_own(monkeypatch):
    """``maxnreg`` goes to Triton's compile as its launch option (and none where there is no cap), beside
    the fused multiply-adds every compile asks for (``COMPILE_OPTIONS``);
    a capped and an uncapped launch of one kernel each keep their own compiled kernel; a routed
    generated launcher passes the cap it was routed with."""
    monkeypatch.setattr(launch.torch.cuda, "current_device", lambda: 0)
    fn = OptionsJIT()
    launcher = launch.CachedLauncher(fn)
    launcher.enabled = True
    args = (torch.zeros(64), 64, 0.5, 128)
    for _ in range(2):
        launcher.launch((4, 1, 1), args, 4, 2)
        launcher.launch((4, 1, 1), args, 4, 2, 128)
    fused = {"enable_fp_fusion": True}
    assert fn.options == [{"num_warps": 4, "num_stages": 2, **fused},
                          {"num_warps": 4, "num_stages": 2, "maxnreg": 128, **fused}]
    assert [entry[:2] for entry in fn.log] == [("dispatch", 1), ("dispatch", 2), ("direct", 1), ("direct", 2)]
    routed = launch._RoutedKernel(OptionsJIT(), maxnreg=96)
    routed.launcher.enabled = True
    routed[(4,)](*args, num_warps=4, num_stages=3)
    assert routed.fn.options == [{"num_warps": 4, "num_stages": 3, "maxnreg": 96, **fused}]


def test_one_dimensional_and_callable_grids(fake):
    """NineToothed's generated launchers pass grid=lambda meta: (n,)."""
    fn, launcher = fake
    t = torch.zeros(64)
    launcher.launch(lambda meta: (7,), (t, 64, 0.5, 128), 4, 3)
    launcher.launch(lambda meta: (7,), (t, 64, 0.5, 128), 4, 3)
    assert fn.log[-1][:3] == ("direct", 1, (7, 1, 1))


def test_constexprs_by_keyword(fake):
    """launcher(grid, *runtime_args, num_warps=, num_stages=, **constexprs): constexprs join in signature order."""
    fn, launcher = fake
    t = torch.zeros(64)
    launcher((4, 1, 1), t, 64, 0.5, num_warps=4, num_stages=3, arg3=128)
    launcher((4, 1, 1), t, 64, 0.5, num_warps=4, num_stages=3, arg3=128)
    assert [entry[:2] for entry in fn.log] == [("dispatch", 1), ("direct", 1)]
    assert fn.log[-1][3] == (t, 64, 0.5, 128)
    with pytest.raises(KeyError):
        launcher((4, 1, 1), t, 64, 0.5, num_warps=4, num_stages=3, BLOCK=128)  # no such constexpr


def test_routing_a_generated_launcher(device):
    """route_generated_launch swaps the kernel in the launcher's globals (compiled or under the
    interpreter), nothing else; routed_kernel finds it again; inside recorded_launches each
    thread's last launch is kept (what impl_ninetoothed binds), the grid evaluated, and no
    longer."""
    import threading

    import triton

    @triton.jit
    def kernel(x):
        pass

    namespace = {"kernel": kernel}
    exec("def launch(x):\n    return kernel", namespace)
    handle = types.SimpleNamespace(_launch=namespace["launch"], _kernel=kernel)
    assert launch.route_generated_launch(handle) is handle
    routed = namespace["launch"](None)
    assert isinstance(routed, launch._RoutedKernel) and launch.routed_kernel(handle) is routed
    x = torch.zeros(4, device=device)
    routed[lambda meta: (3,)](x, num_warps=2, num_stages=1)
    assert routed.last() is None  # kept only while recording
    with launch.recorded_launches():
        routed[lambda meta: (3,)](x, num_warps=2, num_stages=1)
        assert routed.last() == ((3, 1, 1), (x,), 2, 1)
        elsewhere = []
        thread = threading.Thread(target=lambda: elsewhere.append(routed.last()))
        thread.start()
        thread.join()
        assert elsewhere == [None]
    assert routed.last() is None


def test_reading_a_generated_launcher(tmp_path, monkeypatch):
    """launcher_arguments says what each argument of the one launch inside a launcher is (what
    impl_ninetoothed binds by: its inputs, their sizes and strides); None for any other form."""
    import importlib

    (tmp_path / "generated_launch.py").write_text(
        "def launch(a, b, c, FLAG):\n"
        "    prefix_FLAG = FLAG\n"
        "    kernel[lambda meta: (a.size(0),)](prefix_FLAG, a, a.size(0), a.stride(1), c, b, b.stride(0) + 1,"
        " num_warps=4, num_stages=1)\n"
        "def twice(a):\n"
        "    kernel[(1,)](a)\n"
        "    kernel[(1,)](a)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("generated_launch")
    assert launch.launcher_arguments(module.launch) == (
        ("fixed",), ("input", 0), ("size", 0, 0), ("stride", 0, 1), ("input", 2), ("input", 1), ("fixed",))
    assert launch.launcher_arguments(module.twice) is None
    assert launch.launcher_arguments(len) is None  # no source


def test_a_generated_kernels_batch_and_head_strides_are_64_bit(tmp_path, monkeypatch, device):
    """route_generated_launch(wide_strides=True) makes the kernel again with the strides of each
    tensor's first two dimensions, never its last, annotated int64 (what Triton's JIT types them
    by; the interpreter too, with our fix): a product of such a stride past 2^31 is exact."""
    import importlib

    (tmp_path / "generated_wide.py").write_text(
        "import triton\n"
        "import triton.language as tl\n"
        "@triton.jit\n"
        "def kernel(out, x, x_size_0, x_stride_0, x_stride_1, x_stride_2, y, y_stride_0, y_stride_1):\n"
        "    tl.store(out, x_stride_0 * 3)\n"
        "    tl.store(out + 1, x_stride_1 * 3)\n"
        "    tl.store(out + 2, y_stride_0 * 3)\n"
        "def launch(out, x, y):\n"
        "    kernel[(1,)](out, x, x.size(0), x.stride(0), x.stride(1), x.stride(2), y, y.stride(0), y.stride(1),"
        " num_warps=1, num_stages=1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("generated_wide")
    generated = module.kernel
    handle = types.SimpleNamespace(_launch=module.launch, _kernel=generated)
    launch.route_generated_launch(handle, wide_strides=True)
    annotations = launch.routed_kernel(handle).fn.fn.__annotations__
    assert {name for name, ty in annotations.items() if ty == "int64"} == {"x_stride_0", "x_stride_1", "y_stride_0"}
    assert generated.fn.__annotations__ == {}  # the generated kernel itself is unchanged
    big = 2**30  # x 3: past 2^31
    x = torch.empty(1, device=device).as_strided((1, 1, 1), (big, big + 16, 1))
    y = torch.empty(1, device=device).as_strided((1, 1), (big + 32, 1))
    out = torch.zeros(3, dtype=torch.int64, device=device)
    module.launch(out, x, y)
    assert out.tolist() == [3 * big, 3 * (big + 16), 3 * (big + 32)]


def test_ninetoothed_helpers_define_in_a_generated_module():
    """NineToothed copies the kernels' @triton.jit helpers into a module that imports
    ``triton`` and ``triton.language`` only (on a GPU; not under the interpreter), and
    defining a function there evaluates its annotations: each helper must define in
    such a namespace (a ``tl.constexpr`` annotation raised NameError on the H200)."""
    import inspect
    import textwrap

    import triton

    from common.jit_helpers import JIT_HELPERS

    for helper in JIT_HELPERS:
        source = textwrap.dedent(inspect.getsource(getattr(helper, "fn", helper)))
        assert source.startswith("@triton.jit\n")
        namespace = {"triton": triton}
        # (dont_inherit: not this module's ``from __future__ import annotations``)
        exec(compile(source.removeprefix("@triton.jit\n"), "generated", "exec", dont_inherit=True), namespace)
        assert callable(namespace[helper.__name__])


def test_a_plans_register_cap_reaches_each_backends_launch(device):
    """A forward plan's register cap (what ``common.plan.shallow_stages`` sets on a GPU) is in the
    Triton forward's launch and its bound launch, and NineToothed makes a handle of its own for
    it, whose routed launch passes it."""
    import dataclasses

    import impl_ninetoothed.attention as nt
    import impl_ninetoothed.kernels as ntk
    import impl_triton.attention as ta
    from common.backends import get_backend
    from common.launch import routed_kernel
    from common.plan import make_forward
    from common.validation import check_call

    q, k, v = (torch.randn(1, 2, 3, 16, device=device) for _ in range(3))
    backend = get_backend("triton")
    call = check_call(backend, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False, return_lse=False)
    plan = make_forward(call, backend, with_lse=False)
    plan.config = dataclasses.replace(plan.config, maxnreg=96)
    assert ta._forward_launch(plan)[4] == 96
    assert ta.bind_forward(plan).maxnreg == 96
    capped = nt._make(ntk.premake, 16, 16, 16, 16, None, num_warps=1, num_stages=1, maxnreg=96)
    plain = nt._make(ntk.premake, 16, 16, 16, 16, None, num_warps=1, num_stages=1)
    assert capped is not plain
    assert (routed_kernel(capped).maxnreg, routed_kernel(plain).maxnreg) == (96, None)


def test_a_bound_launch_calls_tritons_launcher_directly():
    """A bound launch of a known compiled kernel calls its launcher as ``kernel[grid](*args)``
    would (grid, the current stream, the kernel's function and metadata, then the arguments),
    with no launch metadata and no hooks, while none is registered; with one registered (a
    profiler's), through ``kernel[grid]``, which calls it. Bound launches take that path wherever
    CUDA exists (this Triton's launch has the form read: tests/test_compat.py), so a grid bound with
    fewer than three entries is padded to (x, y, z)."""
    from triton import knobs

    from common import compat

    calls = []

    class Compiled:
        function, packed_metadata = "function", ("metadata",)

        def run(self, *args):
            calls.append(("run", args))

        def __getitem__(self, grid):
            return lambda *args: calls.append(("getitem", grid, args))

    direct = compat.direct_launcher(current_device=lambda: 3, raw_stream=lambda device: 1000 + device)
    direct(Compiled(), (5, 2, 1), (11, 12))
    assert calls == [("run", (5, 2, 1, 1003, "function", ("metadata",), None, None, None, 11, 12))]

    def hook(metadata):
        pass

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        direct(Compiled(), (5, 2, 1), (11, 12))
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert calls[1] == ("getitem", (5, 2, 1), (11, 12))
    assert compat.direct_launcher(raw_stream=None) is None  # no CUDA: Triton's own launch
    bound = launch.BoundKernel(None, (5, 2, 1), 4, 3)
    bound.run_compiled(Compiled(), (13,))
    if compat.cuda_raw_stream is None:
        assert calls[2] == ("getitem", (5, 2, 1), (13,))
    else:
        assert calls[2][0] == "run" and calls[2][1][:3] == (5, 2, 1) and calls[2][1][-1] == 13
    # (a grid of one or two entries is bound as (x, y, z): the direct launch reads all three)
    assert launch.BoundKernel(None, (7,), 4, 3).grid == (7, 1, 1)
    assert launch.BoundKernel(None, [7, 2], 4, 3).grid == (7, 2, 1)
    direct(Compiled(), launch.BoundKernel(None, (7,), 4, 3).grid, (13,))
    assert calls[-1] == ("run", (7, 1, 1, 1003, "function", ("metadata",), None, None, None, 13))


def test_ninetoothed_forward_is_specialised_on_the_keys_length_only(device, monkeypatch):
    """Calls of many query and key lengths: the integer arguments NineToothed's forward kernels
    are compiled for (those its launch does not loosen) fall in no more classes (Triton's: 1, a
    multiple of 16, other) than the keys' lengths of their calls do. NineToothed passes each
    tensor's sizes, the queries' length eight times, and specialised on all of them a kernel was compiled
    for each combination of their classes (174 forwards for 10,000 calls of lengths 1-299,
    88 without)."""
    import collections

    from common import attention
    from common.reuse import PLANS
    from impl_ninetoothed import attention as nt
    from impl_ninetoothed import kernels as ntk

    def int_class(value):
        return value == 1, value % 16 == 0

    PLANS.clear()
    classes, key_classes = collections.defaultdict(set), collections.defaultdict(set)
    lengths = [(1, 16), (5, 17), (16, 33), (17, 48), (32, 1), (33, 5), (48, 64), (64, 100), (100, 64), (3, 1)]
    for lq, lk in lengths:
        q = torch.randn(1, 2, lq, 32, dtype=torch.float16, device=device)
        k = torch.randn(1, 2, lk, 32, dtype=torch.float16, device=device)
        with launch.recorded_launches():
            attention(q, k, k, is_causal=lq <= lk, backend="ninetoothed")
            launched = [(key, handle, launch.routed_kernel(handle).last()) for key, handle in nt._made.items()
                        if key[0] is ntk.premake and launch.routed_kernel(handle).last() is not None]
        assert len(launched) == 1, launched
        key, handle, (_, args, *_) = launched[0]
        loose = nt._loose_arguments(handle, ntk.application)
        specialised = tuple(int_class(arg) for arg, role in zip(args, launch.launcher_arguments(handle._launch))
                            if role[0] in ("size", "stride") and role not in loose and type(arg) is int)
        classes[key].add(specialised)
        key_classes[key].add(int_class(lk))
    assert len(classes) > 1  # the lengths took several tiles
    for key in classes:
        assert len(classes[key]) <= len(key_classes[key]), (key, classes[key], key_classes[key])


def test_ninetoothed_kernels_take_each_size_once():
    """Each NineToothed kernel takes as sizes only those that can differ between its tensors:
    tensors of equal sizes in every launch share their size symbols (the output, log-sum-exps,
    gradients, bands and sinks the query's (B, H, Lq); the values the keys'; the keys the query's
    (B, H) where each query head reads a K/V head of its own, as every packed call; ...). NineToothed
    unravels the program id from each tensor's own sizes, an integer division by a kernel
    argument apiece, so each size passed twice was work every program did twice (sm_90: 14-26
    divisions before the first key step where 6-7 remain)."""
    import inspect

    from impl_ninetoothed import attention as nt
    from impl_ninetoothed import kernels as ntk
    from impl_ninetoothed import paged_kernels

    query, key, cache = ({(name, d) for d in range(3)} for name in ("query", "key", "key_cache"))
    # (the paged kernel's caches: (num_pages, PAGE / tile, tile, H_kv, D), the tile a constant)
    pages = {("key_cache", d) for d in (0, 1, 3)}
    expected = {
        (ntk.premake, (32, 32, 16, 16, False)): query | {("key", 2), ("key_blocks", 2)},  # (keys of the query's heads)
        (ntk.premake, (32, 32, 16, 16, True)): query | {("key", 2), ("key_blocks", 2), ("output", 3)},
        (ntk.premake, (32, 32, 16, 16, False, None, None, True)): query | key | {("key_blocks", 2)},  # (grouped)
        (ntk.premake, (32, 32, 16, 16, True, None, None, True)): query | key | {("key_blocks", 2), ("output", 3)},
        (ntk.premake_combine, (32, 16, 16)): {("o_part", 0), ("o_part", 1)},
        (ntk.premake_dq, (32, 32, 16, 16)): query | key | {("key_blocks", 2)},
        (ntk.premake_dkdv, (32, 32, 16, 16)): query | key | {("query_blocks", 2)},
        (paged_kernels.premake_paged, (32, 32, 16, 16, None)): query | pages | {("block_table", 1)},
        (paged_kernels.premake_paged, (32, 32, 16, 16, 2)): query | pages | {("block_table", 1), ("output", 3)},
        # (column-major value pages: the value cache of the keys' symbols, its sizes in another order)
        (paged_kernels.premake_paged, (32, 32, 16, 16, None, True)): query | pages | {("block_table", 1)},
        (paged_kernels.premake_append, (32, 32)): key | cache | {("block_table", 1)},
    }
    for (premake, args), sizes in expected.items():
        handle = nt._make(premake, *args, num_warps=4, num_stages=1)
        _, application, _ = premake(*args)
        names = list(inspect.signature(application).parameters)
        described = launch.launcher_arguments(handle._launch)
        assert described is not None, premake
        passed = [(names[role[1]], role[2]) for role in described if role[0] == "size"]
        assert len(passed) == len(set(passed)) and set(passed) == sizes, (premake.__name__, args, sorted(passed))


def test_ninetoothed_dq_is_not_specialised_on_its_batch():
    """NineToothed's dQ pass takes its batch (the query's and the keys' size 0, one symbol each)
    as an argument it is not specialised on, and nothing else: with sizes shared, a batch of 1
    folded into its code had ptxas serialise its warpgroup products (C7515, causal L 16k on the
    H200: 9% slower). The forward and dK/dV passes stay specialised on their batch."""
    import inspect

    from impl_ninetoothed import attention as nt
    from impl_ninetoothed import kernels as ntk

    def loose_sizes(premake, application):
        handle = nt._make(premake, 32, 32, 16, 16, num_warps=4, num_stages=1)
        kernel = launch.routed_kernel(handle).fn
        if hasattr(kernel, "params"):  # a JITFunction (GPU)
            loose = {param.name for param in kernel.params if param.do_not_specialize}
        else:  # an InterpretedFunction
            loose = set(kernel.kwargs.get("do_not_specialize") or ())
        names = list(inspect.signature(application).parameters)
        described = launch.launcher_arguments(handle._launch)
        return {(names[role[1]], role[2]) for name, role in zip(kernel.arg_names, described)
                if role[0] == "size" and name in loose}

    assert loose_sizes(ntk.premake_dq, ntk.dq_application) == {("query", 0), ("key", 0)}
    assert loose_sizes(ntk.premake_dkdv, ntk.dkdv_application) == set()


def test_a_bound_launch_keeps_a_kernel_per_alignment_pattern(monkeypatch):
    """Triton specialises each pointer argument on its 16-byte alignment, so a bound launch keeps its
    compiled kernels by the pattern of its tensors' alignments (``launch.alignment``, a bit each), not
    by whether all of them are aligned: a kernel compiled with the first tensor aligned and the second
    not is never run on tensors the other way round (it would read the first as aligned)."""
    assert launch.alignment([16, 20, 0, 8]) == 0b0101

    class Launcher:  # (stands in for a CachedLauncher: a compiled kernel per launch, named by its alignments)
        def run(self, grid, args, num_warps, num_stages, maxnreg):
            self.last = tuple(a.data_ptr() % 16 == 0 for a in args if isinstance(a, torch.Tensor))

        def compiled(self, args, num_warps, num_stages, maxnreg):
            return ("kernel for", self.last)

    ran = []
    monkeypatch.setattr(launch.BoundKernel, "run_compiled", lambda self, kernel, args: ran.append(kernel))
    bound = launch.BoundSlots(Launcher(), [None, None, 7], [(0, 0), (1, 1)], (1, 1, 1), 4, 3)
    buffer = torch.zeros(64)
    aligned, off = buffer[:8], buffer[1:9]  # (4 bytes off)
    assert aligned.data_ptr() % 16 == 0 and off.data_ptr() % 16 != 0
    for tensors in [(aligned, off), (off, aligned), (aligned, off), (off, aligned), (aligned, aligned)]:
        bound(tensors)
    assert ran == [("kernel for", (True, False)), ("kernel for", (False, True))]
    assert sorted(bound.kernels.values()) == sorted(
        [("kernel for", (True, False)), ("kernel for", (False, True)), ("kernel for", (True, True))])

"""How a call picks its backend, and that each backend computes SDPA's answer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import common
from common import attention, available_backends, use_backend
from common.backends import BACKENDS


@pytest.fixture
def calls(monkeypatch):
    """Record which backend each call reaches (the real launcher still runs)."""
    seen = []
    for name, spec in BACKENDS.items():
        module = spec.load()
        original = module.forward

        def spy(*args, _name=name, _original=original, **kwargs):
            seen.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, "forward", spy)
    # Plans kept by earlier tests would send these calls down the reuse paths (the launch bound
    # to a layout from its second run on, or to a growing cache): start afresh, and see the
    # bound launches too.
    from common.reuse import PLANS, AttentionPlan

    PLANS.clear()
    launch = AttentionPlan.launch

    def launch_spy(self, *args):
        if self._bound:
            seen.append(self.backend.name)
        return launch(self, *args)

    monkeypatch.setattr(AttentionPlan, "launch", launch_spy)
    monkeypatch.delenv("ATTENTION_BACKEND", raising=False)
    return seen


@pytest.fixture
def qkv(device):
    return tuple(torch.randn(1, 2, 24, 32, dtype=torch.float16, device=device) for _ in range(3))


def test_available_backends():
    assert available_backends() == ("triton", "ninetoothed", "torch")
    assert common.__all__ == ["append_kv", "attention", "attention_backward", "available_backends",
                              "paged_attention", "plan_attention", "quantize_fp8", "ring_attention", "shard_sequence",
                              "unshard_sequence", "use_backend", "varlen_attention"]


def test_default_is_triton(calls, qkv):
    attention(*qkv)
    assert calls == ["triton"]


def test_environment_variable(calls, qkv, monkeypatch):
    monkeypatch.setenv("ATTENTION_BACKEND", "ninetoothed")
    attention(*qkv)
    with use_backend("torch"):  # the context manager beats the environment
        attention(*qkv)
    attention(*qkv, backend="triton")  # the keyword beats both
    assert calls == ["ninetoothed", "torch", "triton"]


def test_context_manager_nests(calls, qkv):
    with use_backend("ninetoothed"):
        attention(*qkv)
        with use_backend("torch"):
            attention(*qkv)
            attention(*qkv, backend="triton")
        attention(*qkv)
    attention(*qkv)
    assert calls == ["ninetoothed", "torch", "triton", "ninetoothed", "triton"]


@pytest.mark.parametrize("name", ["triton", "ninetoothed", "torch"])
def test_every_backend_computes_sdpa(name, qkv):
    out = attention(*qkv, is_causal=True, backend=name)
    expected = F.scaled_dot_product_attention(*qkv, is_causal=True)
    torch.testing.assert_close(out, expected, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("name", ["triton", "ninetoothed", "torch"])
def test_every_backend_keeps_gradients(name, device):
    q, k, v = (torch.randn(1, 2, 8, 16, device=device, requires_grad=True) for _ in range(3))
    attention(q, k, v, backend=name).sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape
    assert v.grad.abs().sum() > 0


def test_the_library_loads_no_tool():
    """``import common`` and a call of each backend load no command, plotting, metrics or transformers module."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, torch, common\n"
        "q = torch.randn(1, 2, 8, 16, device='cuda' if torch.cuda.is_available() else 'cpu')\n"
        "for name in common.available_backends():\n"
        "    common.attention(q, q, q, backend=name)\n"
        "print(sorted(m for m in sys.modules if m.startswith('common.tools')\n"
        "             or m.split('.')[0] in ('matplotlib', 'transformers', 'radon')))\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1" if not torch.cuda.is_available() else "0")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_importing_the_library_imports_no_triton():
    """``import common`` imports no triton: Triton's interpreter must be switched on before triton
    decorates its own library's kernels, and a caller (the test suite's conftest, a CPU user)
    switches it after importing common (its ``interpret`` module); a triton imported first made
    every interpreted kernel fail ("Cannot call @triton.jit'd outside of the scope of a kernel")."""
    import subprocess
    import sys

    code = "import sys, common, common.interpret\nprint('triton' in sys.modules)\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize("extra", [{}, {"alignment": "bottom_right"}, {"window": (-1, 0)}])
def test_torch_backend_gives_sdpa_its_causal_flag(extra, qkv, monkeypatch):
    """A call whose band is SDPA's causal one reaches SDPA as ``is_causal=True`` with no mask
    (a mask sends SDPA to a slower kernel), and computes the same thing."""
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((kwargs["attn_mask"], kwargs["is_causal"]))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    is_causal = "window" not in extra
    out = attention(*qkv, is_causal=is_causal, backend="torch", **extra)
    assert seen == [(None, True)]
    torch.testing.assert_close(out, sdpa(*qkv, is_causal=True), rtol=0, atol=0)
    seen.clear()  # a band SDPA's flag cannot say still goes as a mask
    attention(*qkv[:1], qkv[1][:, :, :20], qkv[2][:, :, :20], is_causal=True, backend="torch", alignment="bottom_right")
    assert len(seen) == 1 and seen[0][0] is not None and seen[0][1] is False


def test_a_backend_imported_by_another_thread_is_loaded_whole(tmp_path, monkeypatch):
    """Two threads load a backend whose import is slow: the second waits for the first's import to
    finish instead of taking the half-initialised module from ``sys.modules`` (on the H200 a thread
    once got ``impl_ninetoothed.attention`` without its ``forward``)."""
    import sys
    import threading
    import time

    from common.backends import Backend

    (tmp_path / "slow_backend_for_test.py").write_text(
        "import time\ntime.sleep(0.5)\ndef forward(plan):\n    return 'forward'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "slow_backend_for_test", raising=False)
    spec = Backend("slow", "slow_backend_for_test", "a module that takes 0.5 s to import",
                   kernels=False, capabilities=frozenset(), head_dims=None)
    results = []

    def load():
        try:
            results.append(spec.load().forward(None))
        except AttributeError as error:
            results.append(repr(error))

    first = threading.Thread(target=load)
    first.start()
    deadline = time.monotonic() + 10
    while "slow_backend_for_test" not in sys.modules and time.monotonic() < deadline:
        time.sleep(0.001)  # the first thread's import has begun
    load()
    first.join()
    assert results == ["forward", "forward"]


def test_every_backend_module_keeps_the_contract():
    """Each registered backend's module provides what the written protocol lists (common.backends:
    KernelBackendModule for the kernel backends, BackendModule for the others), with the
    protocol's parameters: nothing common calls is missing or called by another name."""
    import inspect

    from common.backends import BackendModule, KernelBackendModule

    for name, spec in BACKENDS.items():
        protocol = KernelBackendModule if spec.kernels else BackendModule
        module = spec.load()
        assert isinstance(module, protocol), (name, protocol.__name__)
        for member in dir(protocol):
            wanted = getattr(protocol, member)
            if member.startswith("_") or not inspect.isfunction(wanted):
                continue
            expected = list(inspect.signature(wanted).parameters)[1:]  # (less self)
            assert list(inspect.signature(getattr(module, member)).parameters) == expected, (name, member)
        assert isinstance(module.INTERPRETED, bool), name


def test_compiled_graph_does_not_guard_on_imports(monkeypatch):
    """A graph traced before the backend's module is imported (a model's first attention call
    inside torch.compile) takes whether the backend is interpreted as a constant: later imports
    (sys.modules growing) must not recompile it."""
    import dataclasses
    import sys
    import types

    spec = dataclasses.replace(BACKENDS["triton"], module="_backend_module_not_imported")

    def scaled(x):
        return x * (2 if spec.interpreted() else 3)

    compiled = torch.compile(scaled, fullgraph=True, backend="eager")
    torch._dynamo.reset()
    x = torch.ones(3)
    first = compiled(x)
    monkeypatch.setitem(sys.modules, "_imported_after_tracing", types.ModuleType("_imported_after_tracing"))
    with torch._dynamo.config.patch(error_on_recompile=True):
        torch.testing.assert_close(compiled(x), first)
    torch.testing.assert_close(first, scaled(x))

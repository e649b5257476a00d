"""Bad input: a clear TypeError/ValueError naming the argument, before any kernel runs."""

from __future__ import annotations

import sys

import pytest
import torch

import common
from common import attention
from common.backends import BACKENDS


@pytest.fixture
def qkv(device):
    return tuple(torch.randn(2, 4, 16, 32, dtype=torch.float16, device=device) for _ in range(3))


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """Fail the test if a backend's launcher is reached: every error must come first."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a kernel was launched for bad input")

    for backend in ("triton", "ninetoothed"):
        monkeypatch.setattr(BACKENDS[backend].load(), "forward", forbidden)


def replace(qkv, index, tensor):
    qkv = list(qkv)
    qkv[index] = tensor
    return qkv


def test_not_a_tensor(qkv, backend):
    with pytest.raises(TypeError, match="key must be a torch.Tensor, got list"):
        attention(qkv[0], [1.0], qkv[2], backend=backend)


@pytest.mark.parametrize("shape", [(16, 32), (1, 2, 4, 16, 32)])
def test_wrong_ndim(qkv, backend, shape, device):
    with pytest.raises(ValueError, match="query must be 4-D"):
        attention(torch.randn(shape, dtype=torch.float16, device=device), *qkv[1:], backend=backend)
    with pytest.raises(ValueError, match="value must have as many dims as query"):
        attention(*qkv[:2], qkv[2][0], backend=backend)


@pytest.mark.parametrize("index, shape, message", [
    (1, (3, 4, 16, 32), "batch sizes differ"),
    (2, (2, 2, 16, 32), "key and value must have the same number of heads"),
    (1, (2, 2, 16, 32), "key and value must have the same number of heads"),
    (2, (2, 4, 15, 32), "same sequence length"),
    (1, (2, 4, 16, 40), "same head dim"),
])
def test_mismatched_shapes(qkv, backend, index, shape, message, device):
    bad = torch.randn(shape, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match=message):
        attention(*replace(qkv, index, bad), backend=backend)


def test_heads_without_enable_gqa(qkv, backend, device):
    kv = torch.randn(2, 2, 16, 32, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        attention(qkv[0], kv, kv, backend=backend)


def test_gqa_heads_not_divisible(backend, device):
    q = torch.randn(2, 6, 16, 32, dtype=torch.float16, device=device)
    kv = torch.randn(2, 4, 16, 32, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match=r"query heads \(6\) must be a multiple of the key/value heads \(4\)"):
        attention(q, kv, kv, enable_gqa=True, backend=backend)


@pytest.mark.parametrize("head_dim", [0, 257, 512])
def test_head_dim_out_of_range(backend, head_dim, device):
    q = torch.randn(1, 2, 8, head_dim, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match=r"head dim .* expected 1 <= head_dim <= 256"):
        attention(q, q, q, backend=backend)


def test_value_head_dim_out_of_range(qkv, backend, device):
    v = torch.randn(2, 4, 16, 300, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="value head dim 300"):
        attention(*qkv[:2], v, backend=backend)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int8, torch.bool])
def test_unsupported_dtype(backend, dtype, device):
    q = torch.ones(1, 2, 8, 32, dtype=dtype, device=device)
    with pytest.raises(TypeError, match="supported: float16, bfloat16, float32"):
        attention(q, q, q, backend=backend)


def test_mixed_dtypes(qkv, backend):
    with pytest.raises(TypeError, match="value has dtype float32 but query has float16"):
        attention(*qkv[:2], qkv[2].float(), backend=backend)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device beside the CPU")
def test_mixed_devices(qkv, backend):
    with pytest.raises(ValueError, match="key is on cpu but query is on cuda"):
        attention(qkv[0], qkv[1].cpu(), qkv[2], backend=backend)


@pytest.mark.parametrize("scale, error", [("0.5", TypeError), (True, TypeError), (1j, TypeError),
                                          (float("nan"), ValueError), (float("inf"), ValueError)])
def test_bad_scale(qkv, backend, scale, error):
    with pytest.raises(error, match="scale must be"):
        attention(*qkv, scale=scale, backend=backend)


def test_scale_accepts_ints_and_numpy(qkv, backend):
    import numpy as np

    for scale in (1, np.float32(0.25), np.float64(-0.5)):
        with pytest.raises(AssertionError, match="a kernel was launched"):  # validation passed
            attention(*qkv, scale=scale, backend=backend)


@pytest.mark.parametrize("name, value", [("is_causal", 1), ("enable_gqa", "yes"), ("return_lse", None),
                                         ("deterministic", 0)])
def test_flags_must_be_bool(qkv, backend, name, value):
    with pytest.raises(TypeError, match=f"{name} must be a bool"):
        attention(*qkv, backend=backend, **{name: value})


def test_dropout_p_checked(qkv, backend):
    with pytest.raises(ValueError, match="dropout_p must be a probability"):
        attention(*qkv, dropout_p=1.1, backend=backend)
    with pytest.raises(TypeError, match="dropout_p must be a real number"):
        attention(*qkv, dropout_p="0", backend=backend)


def test_mask_requires_grad(qkv, backend, device):
    mask = torch.zeros(16, 16, dtype=torch.float16, device=device, requires_grad=True)
    with pytest.raises(ValueError, match="attn_mask requires grad, but an attention mask gets no gradient"):
        attention(*qkv, attn_mask=mask, backend=backend)
    with torch.no_grad(), pytest.raises(AssertionError, match="a kernel was launched"):
        attention(*qkv, attn_mask=mask, backend=backend)  # fine without grad
    with pytest.raises(AssertionError, match="a kernel was launched"):
        attention(*qkv, attn_mask=mask.detach(), backend=backend)


# -- attn_mask ------------------------------------------------------------------------
def test_mask_with_causal(qkv, backend, device):
    mask = torch.ones(16, 16, dtype=torch.bool, device=device)
    with pytest.raises(ValueError, match="attn_mask must be None when is_causal=True"):
        attention(*qkv, attn_mask=mask, is_causal=True, backend=backend)


@pytest.mark.parametrize("shape", [(16, 15), (3, 1, 16, 16), (2, 4, 16, 16, 1), (17,)])
def test_mask_wrong_shape(qkv, backend, shape, device):
    mask = torch.ones(shape, dtype=torch.bool, device=device)
    with pytest.raises(ValueError, match=r"attn_mask of shape .* does not broadcast to \(batch, heads, Lq, Lk\)"):
        attention(*qkv, attn_mask=mask, backend=backend)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.bfloat16])
def test_mask_wrong_dtype(qkv, backend, dtype, device):
    mask = torch.zeros(16, 16, dtype=dtype, device=device)
    with pytest.raises(TypeError, match="attn_mask has dtype"):
        attention(*qkv, attn_mask=mask, backend=backend)


def test_mask_not_a_tensor(qkv, backend):
    with pytest.raises(TypeError, match="attn_mask must be a torch.Tensor or None"):
        attention(*qkv, attn_mask=[[True]], backend=backend)


# -- backends -------------------------------------------------------------------------
def test_unknown_backend(qkv):
    expected = "unknown attention backend 'cudnn'; expected one of 'triton', 'ninetoothed', 'torch'"
    with pytest.raises(ValueError, match=expected):
        attention(*qkv, backend="cudnn")
    with pytest.raises(ValueError, match="unknown attention backend"):
        with common.use_backend("flash"):
            pass


def test_unknown_backend_from_environment(qkv, monkeypatch):
    """A bad name from ATTENTION_BACKEND says where it came from: the call itself named none."""
    monkeypatch.setenv("ATTENTION_BACKEND", "nope")
    expected = (r"unknown attention backend 'nope' \(from the environment variable ATTENTION_BACKEND\); "
                "expected one of 'triton', 'ninetoothed', 'torch'")
    for call in (lambda: attention(*qkv), lambda: attention(*qkv, softcap=2.0)):  # the plain path and the full one
        with pytest.raises(ValueError, match=expected):
            call()
    with pytest.raises(ValueError, match=r"unknown attention backend 'cudnn'; expected"):  # a keyword's own name
        attention(*qkv, backend="cudnn")


@pytest.mark.parametrize("kwargs, message", [
    (lambda device: dict(return_lse=True),
     "the 'torch' backend cannot return the log-sum-exp, but the call passed return_lse=True; "
     "use backend='triton' or backend='ninetoothed'"),
    (lambda device: dict(softcap=5.0),
     "the 'torch' backend cannot soft-cap scores, but the call passed softcap=5.0; "
     "use backend='triton' or backend='ninetoothed'"),
    (lambda device: dict(sinks=torch.zeros(4, device=device)),
     r"the 'torch' backend has no attention sinks, but the call passed sinks \(a float32 tensor of shape \(4,\)\); "
     "use backend='triton' or backend='ninetoothed'"),
    (lambda device: dict(deterministic=True),
     r"the 'torch' backend cannot choose its backward, but the call passed deterministic=True "
     r"\(torch.use_deterministic_algorithms\(True\) makes SDPA's reproducible\); "
     "use backend='triton' or backend='ninetoothed'"),
], ids=["return_lse", "softcap", "sinks", "deterministic"])
def test_missing_capability_names_argument_and_value(qkv, kwargs, message, device):
    """A backend without a feature says which argument and value asked for it, and which backends have it."""
    with pytest.raises(ValueError, match=message):
        attention(*qkv, backend="torch", **kwargs(device))


def test_cpu_tensors_without_interpreter(backend, monkeypatch):
    """Triton compiling for a GPU cannot read CPU tensors: say how to run on a CPU instead."""
    monkeypatch.setattr(BACKENDS[backend].load(), "INTERPRETED", False)  # what Backend.interpreted() reads
    q = torch.randn(1, 2, 8, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="set the environment variable TRITON_INTERPRET=1"):
        attention(q, q, q, backend=backend)


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_interpreted_while_another_thread_imports(backend, monkeypatch, interpret):
    """A first call on one thread while another thread is still importing the backend:
    sys.modules holds the module before its body has defined INTERPRETED, and the
    answer must come from the switch the module will read (was an AttributeError)."""
    import types

    monkeypatch.setitem(sys.modules, BACKENDS[backend].module, types.ModuleType("half-imported"))
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    assert BACKENDS[backend].interpreted() is (interpret == "1")


def test_paged_cpu_tensors_without_interpreter():
    """paged_attention and append_kv on CPU tensors, Triton compiling for a GPU: the same one
    clear error as attention(), raised before a backend module is even imported. Run in a
    process without the interpreter's switch (this one has it on)."""
    import os
    import subprocess

    code = (
        "import sys, torch, common\n"
        "q = torch.randn(1, 2, 1, 16)\n"
        "cache = torch.zeros(2, 16, 2, 16)\n"
        "table, lens = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([5], dtype=torch.int32)\n"
        "calls = {'paged_attention': lambda b: common.paged_attention(q, cache, cache, table, lens, backend=b),\n"
        "         'append_kv': lambda b: common.append_kv(cache, cache, table, lens, q, q, backend=b)}\n"
        "for backend in ('triton', 'ninetoothed'):\n"
        "    for name, call in calls.items():\n"
        "        try:\n"
        "            call(backend)\n"
        "            print(name, backend, 'no error')\n"
        "        except ValueError as error:\n"
        "            print(name, backend, error)\n"
        "print(sorted(m for m in sys.modules if m.startswith('impl_')))\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="0")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 5, result.stdout
    for line, (backend, name) in zip(lines, [(b, n) for b in ("triton", "ninetoothed")
                                             for n in ("paged_attention", "append_kv")]):
        assert line.startswith(f"{name} {backend} the {backend!r} backend got CPU tensors"), line
        assert "set the environment variable TRITON_INTERPRET=1" in line, line
    assert lines[-1] == "[]"  # no backend was loaded, so nothing was launched

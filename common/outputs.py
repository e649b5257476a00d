"""Allocating what the kernels write, with a poison switch for tests.

A plan allocates every buffer a kernel writes with the allocator
:func:`allocator` hands it (once per plan). Inside ``with poisoned_outputs():``
that allocator fills each buffer with NaN instead of leaving whatever memory
held, so an element a kernel forgot to write shows up in a comparison instead
of passing by luck. The switch is a context variable: it holds in the thread
(or task) that set it and nowhere else.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch


def _empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def _poisoned(shape, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


_allocator: contextvars.ContextVar = contextvars.ContextVar("output_allocator", default=_empty)


def allocator():
    """``alloc(shape, dtype, device)``: uninitialised tensors, or NaN-filled ones while poisoning."""
    return _allocator.get()


@contextlib.contextmanager
def poisoned_outputs():
    """Fill every buffer a plan allocates with NaN while active (this thread only)."""
    token = _allocator.set(_poisoned)
    try:
        yield
    finally:
        _allocator.reset(token)

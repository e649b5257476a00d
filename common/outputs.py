"""Allocating what the kernels write, with a poison switch for tests.

A plan allocates every buffer a kernel writes with the allocator
:func:`allocator` hands it (once per plan). Inside ``with poisoned_outputs():``
that allocator fills each buffer with NaN instead of leaving whatever memory
held, so an element a kernel forgot to write shows up in a comparison instead
of passing by luck. The switch is a context variable: it holds in the thread
(or task) that set it and nowhere else.

Split keys' partial results are scratch rather than outputs: written and read
back by the launches of one call, on one stream. :func:`partials` hands them out
of one buffer per (device, stream, thread), reused by every later call of that
thread on that stream (launches on one stream run one after the other, and one
thread's calls one after the other, so no call's launches can fall between
another's: NineToothed's split is two launches), which saves a decode step two
allocations. A test sees those buffers from none inside ``with fresh_scratch():``.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading

import torch

from common.compat import cuda_raw_stream


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


def stream_key(device: torch.device) -> tuple:
    """(device, current stream of that device): what may run at once with a launch made now."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return index, cuda_raw_stream(index)
    return device.type, 0


# (device, stream, thread) -> (buffer, {layout: views}). Emptied and refilled in place, never
# replaced: partials reads this one dict, and a test gets a fresh one through fresh_scratch.
_scratch: dict = {}
SCRATCH_LIMIT = 64 << 20  # bytes of partials kept per buffer; larger ones are allocated per call
_MAX_SCRATCH = 64  # buffers kept (threads come and go) before the cache starts over


def partials(rows_shape: tuple, splits: int, dv: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A split launch's float32 partials: (o_part (*rows_shape, splits, dv), lse_part (*rows_shape,
    splits)), contiguous, uninitialised (NaN while poisoning, and then fresh).

    Views of this thread's scratch buffer for the current stream of ``device``, grown as needed:
    valid until this thread's next call on that stream. Fresh (not kept) while poisoning, above
    SCRATCH_LIMIT, and while a CUDA graph is being captured (the graph keeps its own: a replay may
    run on another stream)."""
    rows = 1
    for n in rows_shape:
        rows *= n
    numel = rows * splits * (dv + 1)
    alloc = _allocator.get()
    if alloc is not _empty or numel * 4 > SCRATCH_LIMIT or (
            device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return (alloc((*rows_shape, splits, dv), torch.float32, device),
                alloc((*rows_shape, splits), torch.float32, device))
    key = (*stream_key(device), threading.get_ident())
    buffer, views = _scratch.get(key, (None, None))
    if buffer is None or buffer.numel() < numel:
        if len(_scratch) >= _MAX_SCRATCH:
            _scratch.clear()  # (a call still holding views of a buffer keeps it alive)
        buffer, views = torch.empty(numel, dtype=torch.float32, device=device), {}
        _scratch[key] = buffer, views
    # The views of a layout are made once per buffer (a decode loop asks for the same ones
    # every step; making two views costs a few µs of host time).
    shape = (rows_shape, splits, dv)
    made = views.get(shape)
    if made is None:
        if len(views) >= _MAX_SCRATCH:
            views.clear()
        split_at = rows * splits * dv
        made = views[shape] = (buffer[:split_at].view(*rows_shape, splits, dv),
                               buffer[split_at:numel].view(*rows_shape, splits))
    return made


@contextlib.contextmanager
def fresh_scratch():
    """For tests: inside the block :func:`partials` keeps its buffers from none, and the block
    gets the dict that holds them, (device, stream, thread) -> (buffer, {layout: views}), to look
    at; the buffers kept before it are back after it (those made inside are dropped)."""
    saved = dict(_scratch)
    _scratch.clear()
    try:
        yield _scratch
    finally:
        _scratch.clear()
        _scratch.update(saved)

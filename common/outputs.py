"""Output allocation shared by the backends, with a poison switch for tests.

Backends allocate what a kernel writes through :func:`new_output`. Inside
``with poisoned_outputs():`` the buffers come filled with NaN instead of
whatever memory held, so an element a kernel forgot to write shows up in a
comparison instead of passing by luck.
"""

from __future__ import annotations

import contextlib

import torch

_poison = False


def new_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised (or, when poisoning, NaN-filled) contiguous tensor."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if _poison:
        out.fill_(float("nan"))
    return out


@contextlib.contextmanager
def poisoned_outputs():
    """Fill every buffer allocated by :func:`new_output` with NaN while active."""
    global _poison
    previous, _poison = _poison, True
    try:
        yield
    finally:
        _poison = previous

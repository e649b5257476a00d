"""Under Triton's interpreter, every kernel's memory access checked against the tensors it was launched with.

On a GPU an access a mask lets through outside every tensor reads another allocation's bytes or faults,
and only where it lands outside mapped memory; under the interpreter it reads or writes whatever the
host's memory holds there. So the CPU suite checks each load, store and atomic itself: every address its
mask lets through must lie inside one of the launch's tensor arguments (from its first element's byte to
its last's, by its shape and strides), or the launch fails naming the kernel, the operation and how far
outside which tensor the address is. :func:`install` patches the interpreter (tests/conftest.py calls it
when the suite runs interpreted); nothing changes on a GPU.
"""

from __future__ import annotations

import threading

import numpy as np

_launch = threading.local()  # this thread's launch: its kernel's name and its tensors' byte ranges


def _extent(t) -> tuple[int, int] | None:
    """The bytes [first, last + 1) a strided tensor's elements span; None for an empty one."""
    if t.numel() == 0:
        return None
    first = last = t.data_ptr()
    for size, stride in zip(t.shape, t.stride()):
        span = (size - 1) * stride * t.element_size()
        if span < 0:
            first += span
        else:
            last += span
    return first, last + t.element_size()


def _tensors(arg, found: list) -> None:
    if isinstance(arg, (tuple, list)):
        for item in arg:
            _tensors(item, found)
    elif hasattr(arg, "data_ptr") and hasattr(arg, "numel"):
        found.append(arg)
    elif hasattr(arg, "base") and hasattr(arg, "block_shape"):  # a tensor descriptor
        _tensors(arg.base, found)


def _check(pointers, mask, operation: str) -> None:
    ranges = getattr(_launch, "ranges", None)
    if ranges is None:
        return
    addresses = np.asarray(pointers.data).astype(np.uint64)
    if mask is not None:
        addresses = addresses[np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)]
    addresses = addresses.ravel()
    if addresses.size == 0:
        return
    inside = np.zeros(addresses.shape, dtype=bool)
    for first, last, _ in ranges:
        inside |= (addresses >= first) & (addresses < last)
    if inside.all():
        return
    bad = int(addresses[~inside][0])
    nearest = min(ranges, key=lambda r: min(abs(bad - r[0]), abs(bad - r[1])))
    first, last, shape = nearest
    where = f"{first - bad} bytes before" if bad < first else f"{bad - last} bytes past the end of"
    raise AssertionError(f"kernel {_launch.kernel}: {operation} of {int((~inside).sum())} address(es) outside every "
                         f"tensor of the launch; the first {where} the tensor of shape {shape}")


def install() -> None:
    """Patch Triton's interpreter so that every launch checks its accesses (idempotent)."""
    import triton.runtime.interpreter as interpreter

    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    if getattr(executor, "_bounds_checked", False):
        return
    init_args = executor._init_args_hst

    def init_args_checked(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        tensors: list = []
        _tensors(list(args_hst) + list(kwargs_hst.values()), tensors)
        _launch.kernel = getattr(self.fn, "__name__", "?")
        _launch.ranges = [(*extent, tuple(t.shape)) for t in tensors if (extent := _extent(t)) is not None]
        return args_hst, kwargs_hst

    masked_load, masked_store = builder.create_masked_load, builder.create_masked_store
    atomic_rmw, atomic_cas = builder.create_atomic_rmw, builder.create_atomic_cas

    def load(self, ptrs, mask, *rest):
        _check(ptrs, mask, "load")
        return masked_load(self, ptrs, mask, *rest)

    def store(self, ptrs, value, mask, *rest):
        _check(ptrs, mask, "store")
        return masked_store(self, ptrs, value, mask, *rest)

    def rmw(self, op, ptr, val, mask, *rest):
        _check(ptr, mask, "atomic")
        return atomic_rmw(self, op, ptr, val, mask, *rest)

    def cas(self, ptr, *rest):
        _check(ptr, None, "atomic compare-and-swap")
        return atomic_cas(self, ptr, *rest)

    executor._init_args_hst = init_args_checked
    builder.create_masked_load, builder.create_masked_store = load, store
    builder.create_atomic_rmw, builder.create_atomic_cas = rmw, cas
    executor._bounds_checked = True

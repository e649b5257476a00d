"""The backend registry, the backend contract, and how a call picks its backend.

Order of choice: the ``backend=`` keyword of :func:`common.attention`; the
innermost ``with use_backend(name):``; the environment variable
``ATTENTION_BACKEND``; the default, ``"triton"``. An unknown name is an error
that lists the known ones; nothing ever falls back silently to another backend.
Backends are imported on first use, so choosing "torch" never imports Triton.

The contract
------------
A backend is a :class:`Backend` record (what it is and what it can do) and a
module that implements :class:`BackendModule` (every backend) or
:class:`KernelBackendModule` (backends that launch our kernels): the functions
``common`` calls, and nothing else is called. A backend never validates user
input, picks defaults or copies inputs: that is ``common``'s work, done once for
all backends (``validation``, ``plan``). What a kernel backend plans is only what
it alone reads: its refinement of a plan (``refine_forward``, ``refine_paged``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import os
import sys
import threading
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:  # (importing common imports no triton and no backend)
    from common.paged import PagedPlan
    from common.plan import BackwardPlan, ForwardPlan

DEFAULT = "triton"
ENV_VAR = "ATTENTION_BACKEND"
_LOADED: dict[str, object] = {}  # module name -> a backend module whose import has finished

# Capabilities a backend can have, by name.
LSE = "lse"  # returns the log-sum-exp of each row (return_lse=True)
BACKWARD = "backward"  # has a backward pass
CPU = "cpu"  # runs on CPU tensors without Triton's interpreter
OFFSETS64 = "offsets64"  # indexes with 64-bit offsets: tensors may span 2^31 elements or more
SOFTCAP = "softcap"  # soft-caps the scores (softcap=)
SINKS = "sinks"  # attention sinks: a logit per head in every row's softmax (sinks=)
ANY_PAGE = "any_page"  # paged caches of any page size (without it: multiples of 16)
CAPABILITIES = (LSE, BACKWARD, CPU, OFFSETS64, SOFTCAP, SINKS, ANY_PAGE)


@dataclasses.dataclass(frozen=True)
class Backend:
    """What a backend is and what it can do; see the module docstring for the contract."""

    name: str
    module: str  # import path of the module that implements the contract
    description: str
    kernels: bool  # launches our Triton kernels from a plan (needs a GPU or Triton's interpreter)
    capabilities: frozenset[str]
    head_dims: tuple[int, int] | None  # (min, max) head dim of query/key and of value; None: any

    def __post_init__(self):
        unknown = set(self.capabilities) - set(CAPABILITIES)
        if unknown:
            raise ValueError(f"unknown capabilities {sorted(unknown)}; expected some of {CAPABILITIES}")

    def supports(self, capability: str) -> bool:
        return capability in self.capabilities

    def load(self):
        """The backend's module (imported on first use). Taken from ``_LOADED``, which holds a module
        only once its import finished: ``sys.modules`` holds it from the start of its import, so a
        second thread that read it there got a half-initialised module (one without ``forward``)."""
        module = _LOADED.get(self.module)
        if module is None:
            module = importlib.import_module(self.module)  # waits while another thread imports it
            _LOADED[self.module] = module
        return module

    @property
    def package(self) -> str:
        """The package that holds the module and its committed ``configs.json``."""
        return self.module.rpartition(".")[0]

    @functools.cached_property
    def configs(self):
        """The committed config table (kernel backends)."""
        from common.configs import ConfigTable

        return ConfigTable.load(self.package)

    def interpreted(self) -> bool:
        """Whether this backend's kernels run under Triton's CPU interpreter."""
        return self.kernels and _interpreted(self.module)


@runtime_checkable
class BackendModule(Protocol):
    """What every backend's module provides."""

    INTERPRETED: bool  # its kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1 at their decoration)

    def forward(self, plan: ForwardPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Compute the call the plan describes: ``(out, lse)`` in the kernels' view (lse None
        unless ``plan.with_lse``). Kernel backends launch into the buffers the plan allocated
        (``plan.out``, ``plan.lse``; with ``plan.num_splits > 1`` the partials, then merged)."""


@runtime_checkable
class KernelBackendModule(BackendModule, Protocol):
    """What a backend that launches our kernels provides besides :class:`BackendModule`."""

    def backward(self, plan: BackwardPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Launch the backward kernels into ``plan.grad_query``, ``grad_key``, ``grad_value``; return them."""

    def paged_forward(self, plan: PagedPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention over a paged KV cache (``common.paged``) into ``plan.out`` and, where
        ``plan.with_lse``, its log-sum-exp into ``plan.lse``; return ``(plan.out, plan.lse)``."""

    def append_kv(self, key_cache, value_cache, block_table, cache_seqlens, key, value, *, block_m: int,
                  block_d: int, block_dv: int, descales=None) -> None:
        """Write ``key`` and ``value`` (B, H_kv, L_new, D | Dv) into their slots of the paged caches
        (``descales``: FP8 caches' float32 (B, H_kv) key and value descales, the new tokens quantized)."""

    def rotary(self, x1, x2, o1, o2, cos, sin, starts, per_row: bool) -> None:
        """The rotary embedding: pairs ``x1``, ``x2`` (B, L, H, R/2 strided views) rotated by the
        angles of rows ``starts[b]`` (+ l where ``per_row``) of ``cos``, ``sin`` (S, R/2), into
        ``o1``, ``o2`` (views of another tensor)."""

    def copy_values(self, value, out, pv_order: bool = False) -> None:
        """Copy ``value`` (B, H, L, D) into ``out``, the same sizes in another layout (FP8 values
        made column-major for the e4m3 P·V product, ``common.plan.Planner.fp8_columns``); ``pv_order``
        (L a multiple of ``common.plan.PV_GROUP``): row l of ``value`` into row
        ``common.plan.pv_position(l)`` of ``out``."""

    def refine_forward(self, plan: ForwardPlan, kv_bytes: int) -> None:
        """Set ``plan.refinement`` to this backend's own decisions for the launch planned so far
        (its config and splits, by ``plan.planner``'s settings; ``kv_bytes``: the keys' and values'
        bytes it reads): a hashable value of the backend's, which its launches read and
        ``common.reuse`` keys its bound launches on. Called when a plan is made, never for a
        reused plan's launch."""

    def refine_paged(self, plan: PagedPlan, kv_bytes: int) -> None:
        """As :meth:`refine_forward`, for a paged plan (``kv_bytes``: what its block table can address)."""

    def bind_forward(self, plan: ForwardPlan, keys: bool = False):
        """``plan``'s launch (just made) bound to its layout: a callable taking the call's tensors
        in ``ForwardPlan.ROLES`` order (query, key, value, out, lse, o_part, lse_part, FP8 descales,
        the mask as the call gave it; None for those the call has not) that launches without building its
        arguments again, with ``launch_keys(tensors, blocks_per_split)`` and ``launch_plan(plan)``
        where ``keys`` (later keys of another length and strides); None where it cannot bind it
        (``common.reuse`` then launches each call's plan through :meth:`forward`)."""

    def bind_backward(self, plan: BackwardPlan):
        """``plan``'s launches (just made by :meth:`backward` on this thread) bound to its layout: a
        callable taking the call's tensors in ``BackwardPlan.ROLES`` order that launches both passes
        without building their arguments again; None where it cannot bind them (a mask, dropout,
        row bands, ALiBi: ``common.reuse.KeptBackward`` then plans each call)."""


_KERNEL_HEAD_DIMS = (1, 256)

BACKENDS = {
    b.name: b
    for b in (
        Backend("triton", "impl_triton.attention", "hand-written Triton kernels",
                kernels=True, capabilities=frozenset({LSE, BACKWARD, OFFSETS64, SOFTCAP, SINKS, ANY_PAGE}),
                head_dims=_KERNEL_HEAD_DIMS),
        Backend("ninetoothed", "impl_ninetoothed.attention", "NineToothed arrangements + applications",
                kernels=True, capabilities=frozenset({LSE, BACKWARD, SOFTCAP, SINKS}), head_dims=_KERNEL_HEAD_DIMS),
        Backend("torch", "common.torch_backend", "torch.nn.functional.scaled_dot_product_attention",
                kernels=False, capabilities=frozenset({BACKWARD, CPU, OFFSETS64, ANY_PAGE}), head_dims=None),
    )
}


def available_backends() -> tuple[str, ...]:
    """The names a call can choose from."""
    return tuple(BACKENDS)


def kernel_backends() -> tuple[str, ...]:
    """The backends that run our own kernels (what ``tune`` and ``compare`` work on)."""
    return tuple(name for name, b in BACKENDS.items() if b.kernels)


def get_backend(name: str, *, origin: str = "") -> Backend:
    """The backend called ``name``; an unknown name is an error naming ``origin`` (where it came from)."""
    try:
        return BACKENDS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown attention backend {name!r}{origin}; expected one of {', '.join(map(repr, BACKENDS))}"
        ) from None


_FROM_ENV = f" (from the environment variable {ENV_VAR})"


# The innermost use_backend(...) of each thread. (A thread-local, not a
# ContextVar: torch.compile can read, and guard on, the one but not the other.)
_chosen = threading.local()


def resolve(name: str | None) -> Backend:
    """The backend a call with ``backend=name`` uses (see the module docstring)."""
    if name is None:
        name = getattr(_chosen, "name", None)
    if name is not None:
        return get_backend(name)
    name = os.environ.get(ENV_VAR)
    if name:
        return get_backend(name, origin=_FROM_ENV)
    return BACKENDS[DEFAULT]


@torch.compiler.assume_constant_result
def _interpreted(module: str) -> bool:
    # A constant to torch.compile: its graphs never guard on sys.modules, which
    # grows with every import (each import after warm-up would recompile).
    # Not imported yet, or still being imported by another thread (sys.modules
    # holds it before its body has run): the module will read the same switch.
    # (torch.compile cannot trace an import, so this never imports.)
    interpreted = getattr(sys.modules.get(module), "INTERPRETED", None)
    if interpreted is None:
        return os.environ.get("TRITON_INTERPRET", "0") == "1"
    return interpreted


@contextlib.contextmanager
def use_backend(name: str):
    """Make ``name`` the backend of every :func:`common.attention` call of this
    thread inside the block.

    Nests; an explicit ``backend=`` keyword still wins. Code that
    ``torch.compile`` compiled inside a block recompiles when the choice
    changes.
    """
    get_backend(name)  # fail on entry, not at the first call
    previous = getattr(_chosen, "name", None)
    _chosen.name = name
    try:
        yield
    finally:
        _chosen.name = previous

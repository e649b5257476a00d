"""The backend registry and how a call picks its backend.

Order of choice: the ``backend=`` keyword of :func:`common.attention`; the
innermost ``with use_backend(name):``; the environment variable
``ATTENTION_BACKEND``; the default, ``"triton"``. An unknown name is an error
that lists the known ones; nothing ever falls back silently to another backend.
Backends are imported on first use, so choosing "torch" never imports Triton.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import os

DEFAULT = "triton"
ENV_VAR = "ATTENTION_BACKEND"


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    module: str  # import path of the module that defines forward()
    description: str
    uses_triton: bool  # runs Triton kernels (so CPU tensors need the interpreter)
    differentiable: bool  # has a backward pass
    returns_lse: bool  # can return the log-sum-exp

    def load(self):
        """The backend's module (imported on first use, then kept)."""
        module = _loaded.get(self.name)
        if module is None:
            module = _loaded[self.name] = importlib.import_module(self.module)
        return module


_loaded: dict = {}


BACKENDS = {
    b.name: b
    for b in (
        Backend("triton", "impl_triton.attention", "hand-written Triton kernel", True, False, True),
        Backend("ninetoothed", "impl_ninetoothed.attention", "NineToothed arrangement + application", True, False, True),
        Backend("torch", "common.torch_backend", "torch.nn.functional.scaled_dot_product_attention", False, True, False),
    )
}

_chosen: contextvars.ContextVar[str | None] = contextvars.ContextVar("attention_backend", default=None)


def available_backends() -> tuple[str, ...]:
    """The names a call can choose from."""
    return tuple(BACKENDS)


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown attention backend {name!r}; expected one of {', '.join(map(repr, BACKENDS))}"
        ) from None


def resolve(name: str | None) -> Backend:
    """The backend a call with ``backend=name`` uses (see the module docstring)."""
    if name is None:
        name = _chosen.get()
    if name is None:
        name = os.environ.get(ENV_VAR) or DEFAULT
    return get_backend(name)


@contextlib.contextmanager
def use_backend(name: str):
    """Make ``name`` the backend of every :func:`common.attention` call inside the block.

    Nests; an explicit ``backend=`` keyword still wins.
    """
    get_backend(name)  # fail on entry, not at the first call
    token = _chosen.set(name)
    try:
        yield
    finally:
        _chosen.reset(token)

"""Test set-up: the device, the backends, seeds and poisoned outputs.

Runs on CUDA when a GPU is present; otherwise on the CPU under Triton's
interpreter, which must be switched on before any kernel is decorated, so it
happens here, at import, before the backends load.
"""

from __future__ import annotations

import os
import zlib

# pytest-xdist's workers are the parallelism: one thread each. Two workers of the default
# thread count on 2 cores (CI) took 1.7x as long as two single-threaded ones (NumPy's and
# torch's thread pools fight over the cores); read once at import, so before torch's.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from common.interpret import use_interpreter_if_no_gpu

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # in case torch was imported before this module
INTERPRETED = use_interpreter_if_no_gpu()
if INTERPRETED:  # every kernel access checked against the launch's tensors (tests/bounds.py)
    from tests.bounds import install as _check_bounds

    _check_bounds()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_BACKENDS = ("triton", "ninetoothed")


def _where() -> str:
    if DEVICE == "cuda":
        return "CUDA: " + torch.cuda.get_device_name()
    return "the CPU, under Triton's interpreter (no CUDA device)"


def pytest_report_header(config):
    return f"attention tests on {_where()}"


def pytest_terminal_summary(terminalreporter):
    # The header is hidden by -q (the README's command); this line is not.
    terminalreporter.write_line(f"attention tests ran on {_where()}")


@pytest.fixture(params=KERNEL_BACKENDS)
def backend(request):
    """Each kernel backend in turn (the "torch" backend is the reference, not a subject)."""
    return request.param


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def _seed_and_poison(request):
    """A fresh, reproducible seed per test, and NaN-filled outputs (an unwritten element shows)."""
    from common.outputs import poisoned_outputs

    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    with poisoned_outputs():
        yield


@pytest.fixture
def plans():
    """``common.attention``'s kept plans (common.reuse.PLANS), emptied for this test, and the masked
    layouts it has met once: what it plans is all there is to see."""
    from common.dispatch import _MASKED_ONCE
    from common.reuse import PLANS

    PLANS.clear()
    _MASKED_ONCE.clear()
    yield PLANS
    PLANS.clear()
    _MASKED_ONCE.clear()


@pytest.fixture
def planner():
    """``planner(**settings)`` plans the rest of this test's calls with those settings changed
    (fields of common.plan.Planner, e.g. ``kernel_merge_max=0``); undone when the test ends."""
    import contextlib
    import dataclasses

    from common.plan import current_planner, use_planner

    with contextlib.ExitStack() as stack:
        def choose(**settings):
            return stack.enter_context(use_planner(dataclasses.replace(current_planner(), **settings)))

        yield choose


# The homework's module (test_seed.py) runs unchanged once per kernel backend:
# an autouse fixture, parametrised for that module only, selects the backend
# around each of its tests (every other test sees no parameter and passes through).
def pytest_generate_tests(metafunc):
    if metafunc.module.__name__.rpartition(".")[2] == "test_seed":
        metafunc.parametrize("homework_backend", KERNEL_BACKENDS, indirect=True)


@pytest.fixture(autouse=True)
def homework_backend(request):
    from common import use_backend

    name = getattr(request, "param", None)
    if name is None:
        yield None
        return
    if DEVICE != "cuda":
        pytest.skip(
            "the homework's test hard-codes device='cuda' and there is no CUDA device; "
            "its 16 cases run on the CPU in test_attention.py::test_homework_cases"
        )
    with use_backend(name):
        yield name

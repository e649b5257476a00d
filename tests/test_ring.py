"""ring_attention (context parallelism) against the float64 reference on the full sequence.

On the CPU: 2 and 3 processes over gloo, under Triton's interpreter (each rank runs
tests/ring_worker.py's cases: GQA/MQA, causal contiguous and zigzag, uneven shards, a rank
with no rows, 3-D, Lq != Lk, bad input on one rank). On two or more GPUs: the same through
torchrun over NCCL, with longer sequences.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import ring_attention, shard_sequence, unshard_sequence
from tests import ring_worker
from tests.conftest import DEVICE

needs_gloo = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


@needs_gloo
@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU ring (gloo); GPUs run test_ring_over_nccl")
# Three ranks (uneven shards) for the ring's host logic, which no backend changes; NineToothed in two
# ranks only: under the interpreter its three-rank run cost 83 s of the CPU suite for nothing more.
@pytest.mark.parametrize("ring_backend, world", [("triton", 2), ("triton", 3), ("ninetoothed", 2), ("torch", 2),
                                                 ("torch", 3)])
def test_ring_over_gloo(ring_backend, world, tmp_path):
    mp.spawn(ring_worker.spawned, args=(world, str(tmp_path / "store"), [ring_backend]), nprocs=world, join=True)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ring_over_nccl():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                           "tests.ring_worker", "triton", "ninetoothed", "torch"],
                          env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "passed on 2 GPUs" in done.stdout


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_shard_and_unshard_are_inverse(layout):
    x = torch.randn(2, 3, 24, 5)
    for world in (1, 2, 3):
        shards = [shard_sequence(x, r, world, layout=layout) for r in range(world)]
        assert sum(s.shape[-2] for s in shards) == 24
        torch.testing.assert_close(unshard_sequence(shards, layout=layout), x, rtol=0, atol=0)
    zigzag = shard_sequence(torch.arange(8.0).view(8, 1), 0, 2, layout="zigzag")
    assert zigzag.flatten().tolist() == [0.0, 1.0, 6.0, 7.0]  # chunks 0 and 3 of 4


def test_shard_errors():
    with pytest.raises(ValueError, match="divide by 2 \\* world_size = 4"):
        shard_sequence(torch.randn(10, 3), 0, 2, layout="zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        shard_sequence(torch.randn(10, 3), 0, 2, layout="striped")
    with pytest.raises(ValueError, match="rank must be in"):
        shard_sequence(torch.randn(10, 3), 2, 2)


def test_needs_an_initialised_process_group():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="init_process_group"):
        ring_attention(q, q, q)

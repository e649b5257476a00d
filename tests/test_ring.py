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


@pytest.mark.parametrize("causal", [False, True])
def test_forward_resume(backend, causal, device):
    """A ring's step: keys folded into a running float32 (output, lse) by the kernel itself, in
    place, through strided views, give attention over all the keys (rows that see no key of a
    part, or none at all yet, included)."""
    from common import ops
    from common.backends import get_backend
    from common.validation import check_call
    from tests.cases import check_lse, check_output

    B, H, H_kv, Lq, D = 2, 4, 2, 37, 32
    q = torch.randn(B, H, Lq, D, device=device, dtype=torch.float16)
    k, v = (torch.randn(B, H_kv, 70, D, device=device, dtype=torch.float16) for _ in range(2))
    # a running result laid out with room to spare: its rows are strided views
    acc = torch.full((B, H, Lq + 3, D), float("nan"), device=device)[:, :, 3:]
    lse = torch.full((B, H, Lq + 3), float("-inf"), device=device)[:, :, 3:]
    spec = get_backend(backend)
    # causal: the first part is the diagonal block (rows see keys up to their own), the rest
    # lies below it; not causal, three parts of the keys in any order
    parts = [(slice(0, Lq), True), (slice(Lq, 70), False)] if causal else [
        (slice(40, 70), False), (slice(0, 15), False), (slice(15, 40), False)]
    for keys, block_causal in parts:
        call = check_call(spec, q, k[:, :, keys], v[:, :, keys], attn_mask=None, dropout_p=0.0,
                          is_causal=block_causal, scale=None, enable_gqa=True, return_lse=True)
        ops.forward_resume(spec, call, acc, lse)
    # the keys in the order the parts were folded in
    order = torch.cat([torch.arange(70)[keys] for keys, _ in parts]).to(device)
    mask = None
    if causal:  # row i sees keys 0..i of the diagonal block and every key after it
        mask = torch.ones(Lq, 70, dtype=torch.bool, device=device)
        mask[:, :Lq] = torch.ones(Lq, Lq, dtype=torch.bool, device=device).tril()
    check_output(acc.to(q.dtype), q, k[:, :, order], v[:, :, order], attn_mask=mask, enable_gqa=True)
    check_lse(lse, q, k[:, :, order], attn_mask=mask)


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

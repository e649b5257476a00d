"""What every rank runs to check ring_attention: spawned by tests/test_ring.py (gloo, CPU,
under Triton's interpreter) or started by torchrun on GPUs (NCCL):

    torchrun --nproc-per-node 2 -m tests.ring_worker triton ninetoothed torch

Each rank draws the same full inputs (one seed for all), takes its shard, runs the ring
forward and backward, and holds its rows of the output and of the gradients to the float64
reference computed on the full sequence (the gradients by the single-device tests' rule).
A mismatch raises on that rank.
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common import ring_attention, shard_sequence, unshard_sequence
from common.reference import reference
from tests.cases import grad_bounds


@dataclass(frozen=True)
class RingCase:
    Lq: int
    Lk: int
    causal: bool
    layout: str = "contiguous"
    H: int = 2
    H_kv: int = 2
    D: int = 16
    Dv: int = 16
    dtype: torch.dtype = torch.float32
    scale: float | None = None
    batched: bool = True


def cases(world: int, gpu: bool) -> list[RingCase]:
    """Small shapes for the interpreter, longer ones on GPUs; even and uneven shards."""
    n = 2 * world * (48 if gpu else 3)  # divides by 2·world (zigzag)
    d = 64 if gpu else 16
    # On GPUs every new dtype, head dim or length class is a new compile (for each rank):
    # one 16-bit dtype there; float32 under the interpreter, whose compiles are free.
    full, half = (torch.bfloat16, torch.bfloat16) if gpu else (torch.float32, torch.float16)
    return [
        RingCase(n, n, causal=False, H=4, H_kv=2, D=d, Dv=d + 16, dtype=full),  # GQA, Dv != D
        RingCase(n, n, causal=True, D=d, Dv=d, dtype=full),
        RingCase(n + 1, n + 1, causal=True, D=d, Dv=d, dtype=half),  # uneven shards
        RingCase(n, n, causal=True, layout="zigzag", H=4, H_kv=1, D=d, Dv=d, dtype=full),  # MQA
        RingCase(n // 2 + 1, n + world - 1, causal=False, D=d, Dv=d, dtype=full, scale=-0.7,
                 batched=False),  # Lq != Lk, 3-D
        RingCase(world - 1, world + 1, causal=False, D=d, Dv=d, dtype=full),  # a rank with no query rows
    ]


def _tolerance(dtype):
    return {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]


def check(case: RingCase, backend: str, device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1234)
    shape = (2,) if case.batched else ()

    def draw(*dims):
        return torch.randn(*shape, *dims, generator=gen).to(device, case.dtype)

    q, k, v = draw(case.H, case.Lq, case.D), draw(case.H_kv, case.Lk, case.D), draw(case.H_kv, case.Lk, case.Dv)
    grad_out = draw(case.H, case.Lq, case.Dv)
    mine = [shard_sequence(t, rank, world, layout=case.layout).detach().clone().requires_grad_()
            for t in (q, k, v)]
    out = ring_attention(*mine, is_causal=case.causal, scale=case.scale, enable_gqa=True, backend=backend,
                         layout=case.layout)
    out.backward(shard_sequence(grad_out, rank, world, layout=case.layout))

    expected = reference(*(t.double() for t in (q, k, v)), is_causal=case.causal, scale=case.scale, enable_gqa=True)
    tol = _tolerance(case.dtype)
    where = f"rank {rank} of {world}, {backend}, {case}"
    assert out.dtype == case.dtype and not out.isnan().any(), where
    torch.testing.assert_close(out.double(), shard_sequence(expected, rank, world, layout=case.layout),
                               rtol=tol, atol=tol, msg=lambda m: f"output, {where}: {m}")
    # The gradients by the rule of the single-device tests (tests.cases.grad_bounds), for
    # the whole ring's output as stored: a FlashAttention-style backward takes
    # delta = rowsum(dO * O) from it, whose rounding moves dq and dk by up to |scale| times
    # the scores' spread (in bf16 at scale -0.7, ~4x a fixed tolerance's 0.03).
    shards = [None] * world
    dist.all_gather_object(shards, out.detach().cpu())
    whole = unshard_sequence(shards, layout=case.layout).to(out.device)
    refs, bounds = grad_bounds(q, k, v, grad_out, out=whole, is_causal=case.causal, scale=case.scale,
                               enable_gqa=True)
    for name, got, ref, bound in zip(("dq", "dk", "dv"), mine, refs, bounds):
        assert got.grad is not None and not got.grad.isnan().any(), f"{name}, {where}"
        diff = (got.grad.double() - shard_sequence(ref, rank, world, layout=case.layout)).abs()
        error = diff.max().item() if diff.numel() else 0.0  # (a rank may hold no rows)
        assert error <= bound, f"{name}, {where}: max error {error:.3g} > bound {bound:.3g}"


def check_errors(backend: str, device) -> None:
    """A bad input on one rank is an error on every rank, raised before any block runs."""
    rank = dist.get_rank()
    q = torch.randn(1, 2, 8, 16, device=device)
    k = q.half() if rank == 1 else q  # rank 1's key has the wrong dtype
    try:
        ring_attention(q, k, q, backend=backend)
    except (TypeError, ValueError) as error:
        expected = "key has dtype float16" if rank == 1 else r"rank\(s\) \[1\]"
        assert re.search(expected, str(error)), f"rank {rank}: {error}"
    else:
        raise AssertionError(f"rank {rank}: no error for a bad input on rank 1")
    heads = torch.randn(1, 2 + rank, 8, 16, device=device)  # a different number of heads per rank
    try:
        ring_attention(heads, heads, heads, backend=backend)
    except ValueError as error:
        assert "same query heads" in str(error), f"rank {rank}: {error}"
    else:
        raise AssertionError(f"rank {rank}: no error for shards with different numbers of heads")
    try:  # a bad layout on rank 0 only: an error on every rank, no rank left waiting
        ring_attention(q, q, q, backend=backend, layout="striped" if rank == 0 else "contiguous")
    except ValueError as error:
        expected = "layout must be one of" if rank == 0 else r"rank\(s\) \[0\]"
        assert re.search(expected, str(error)), f"rank {rank}: {error}"
    else:
        raise AssertionError(f"rank {rank}: no error for a bad layout on rank 0")
    lengths = torch.randn(1, 2, 8 + 2 * rank, 16, device=device)  # uneven: no zigzag with is_causal
    try:
        ring_attention(lengths, lengths, lengths, is_causal=True, backend=backend, layout="zigzag")
    except ValueError as error:
        assert "same even shard length" in str(error), f"rank {rank}: {error}"
    else:
        raise AssertionError(f"rank {rank}: no error for a zigzag layout with uneven shards")


def run(backends, device, gpu: bool, progress: bool = False) -> None:
    world = dist.get_world_size()
    for backend in backends:
        check_errors(backend, device)
        for case in cases(world, gpu):
            start = time.perf_counter()
            check(case, backend, device)
            if progress and dist.get_rank() == 0:
                print(f"{backend}: {case} passed in {time.perf_counter() - start:.1f} s", flush=True)


def spawned(rank: int, world: int, store: str, backends) -> None:
    """torch.multiprocessing.spawn's entry: gloo on the CPU."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        run(backends, "cpu", gpu=False)
    finally:
        dist.destroy_process_group()


def main(backends) -> None:
    """torchrun's entry: NCCL, one GPU per rank."""
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    try:
        run(backends, torch.device("cuda", local), gpu=True, progress=True)
        dist.barrier()
        if dist.get_rank() == 0:
            print(f"ring_attention: {len(cases(dist.get_world_size(), True))} cases x {list(backends)} passed "
                  f"on {dist.get_world_size()} GPUs (NCCL)")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:] or ["triton", "ninetoothed", "torch"])

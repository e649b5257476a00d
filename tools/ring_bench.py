"""Ring attention on several GPUs against one GPU, and PyTorch's context_parallel over SDPA.

Run with torchrun (one process per GPU, NCCL):

    torchrun --nproc-per-node 2 tools/ring_bench.py [--lengths 32768 65536 131072] [--json out.json]

For every backend, length and causal flag: the one-GPU call (``attention`` on the whole
sequence), the ring (contiguous layout; zigzag too when causal), and for the ring the time of
its blocks alone (communication switched off) and of its transfers alone, from which the
share of the communication hidden behind compute = (compute + comm - ring) / comm. Times are
the slowest rank's mean over a loop of calls (events around the loop, after a barrier).
TFLOP/s = 4·B·H·L²·D (halved when causal), 2.5x that for the backward. bf16, B = 1, H = 16,
D = 128.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from common import attention, ring_attention, shard_sequence
from common import ring as ring_module

B, H, D = 1, 16, 128
DTYPE = torch.bfloat16
DEVICE = "cuda"  # --smoke: "cpu" over gloo, under Triton's interpreter, tiny shapes (checks this script)


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], device=DEVICE, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed(fn, calls: int) -> float:
    """Mean seconds per call of the slowest rank (after one warm-up call)."""
    fn()
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return slowest((time.perf_counter() - start) / calls)


def flops(length: int, causal: bool, mode: str) -> float:
    f = 4 * B * H * length * length * D / (2 if causal else 1)
    return f * (3.5 if mode == "fwd+bwd" else 1.0)


def step(fn, mode, inputs):
    if mode == "fwd":
        return lambda: fn(*inputs)

    with torch.no_grad():
        grad = torch.randn_like(fn(*inputs))

    def both():
        fn(*inputs).backward(grad)
    return both


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072])
    parser.add_argument("--bwd-lengths", type=int, nargs="+", default=[32768, 65536])
    parser.add_argument("--backends", nargs="+", default=["triton", "ninetoothed"])
    parser.add_argument("--json", default=None)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, interpreter, tiny shapes")
    args = parser.parse_args()
    global DEVICE, B, H, D, DTYPE
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        DEVICE, B, H, D, DTYPE = "cpu", 1, 2, 16, torch.float32
        dist.init_process_group("gloo")
    else:
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []

    def report(row):
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for length in args.lengths:
        full = [torch.randn(B, H, length, D, device=DEVICE, dtype=DTYPE, generator=gen) for _ in range(3)]
        for causal in (False, True):
            modes = ["fwd"] + (["fwd+bwd"] if length in args.bwd_lengths else [])
            for mode in modes:
                for backend in args.backends:
                    leaves = [t.detach().requires_grad_(mode != "fwd") for t in full]
                    one = timed(step(lambda q, k, v: attention(q, k, v, causal, backend=backend), mode, leaves),
                                max(1, args.calls // 2))
                    row = dict(backend=backend, L=length, causal=causal, mode=mode, gpus=world,
                               one_gpu_ms=one * 1e3, one_gpu_tflops=flops(length, causal, mode) / one / 1e12)
                    for layout in ["contiguous"] + (["zigzag"] if causal else []):
                        mine = [shard_sequence(t, rank, world, layout=layout).detach().clone()
                                .requires_grad_(mode != "fwd") for t in full]

                        def ring(q, k, v, layout=layout):
                            return ring_attention(q, k, v, causal, backend=backend, layout=layout)

                        t_ring = timed(step(ring, mode, mine), args.calls)
                        exchange = ring_module._Ring.exchange
                        ring_module._Ring.exchange = lambda self, sends, receives: []  # compute alone
                        try:
                            t_compute = timed(step(ring, mode, mine), args.calls)
                        finally:
                            ring_module._Ring.exchange = exchange
                        row[layout] = dict(ms=t_ring * 1e3, tflops=flops(length, causal, mode) / t_ring / 1e12,
                                           speedup=one / t_ring, compute_ms=t_compute * 1e3)
                    if mode == "fwd":
                        kv = [t.detach() for t in mine[1:]]
                        ring_state = ring_module._Ring.agree(None, _Shapes(mine[0], *kv), None, device=DEVICE)

                        def transfers():
                            shard = kv
                            for _ in range(world - 1):
                                incoming = tuple(torch.empty_like(t) for t in shard)
                                ring_module._wait(ring_state.exchange(shard, incoming))
                                shard = incoming
                        t_comm = timed(transfers, args.calls)
                        for layout in ["contiguous"] + (["zigzag"] if causal else []):
                            r = row[layout]
                            hidden = (r["compute_ms"] + t_comm * 1e3 - r["ms"]) / (t_comm * 1e3)
                            r["comm_ms"], r["hidden"] = t_comm * 1e3, max(0.0, min(1.0, hidden))
                    report(row)
            row = dict(backend="torch-context_parallel", L=length, causal=causal, mode="fwd", gpus=world)
            try:
                row.update(_context_parallel(full, causal, args.calls, world))
            except Exception as error:  # noqa: BLE001 - the anchor is optional; say why it is missing
                row["error"] = repr(error)[:300]
            report(row)
        del full
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


class _Shapes:
    """What _Ring.agree reads of a validated call."""

    def __init__(self, query, key, value):
        self.query, self.key, self.value = query, key, value


def _context_parallel(full, causal, calls, world):
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    length = full[0].shape[2]
    one = timed(lambda: F.scaled_dot_product_attention(*full, is_causal=causal), max(1, calls // 2))
    from torch.distributed.tensor.experimental import _attention

    mesh = init_device_mesh("cuda", (world,))
    buffers = [t.clone() for t in full]
    # Its load balancing (on by default) refuses non-causal calls: a private switch turns it off.
    _attention._cp_options.enable_load_balance = causal
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2], no_restore_buffers=set(buffers)):
        t = timed(lambda: F.scaled_dot_product_attention(*buffers, is_causal=causal), calls)
    return dict(one_gpu_ms=one * 1e3, one_gpu_tflops=flops(length, causal, "fwd") / one / 1e12,
                contiguous=dict(ms=t * 1e3, tflops=flops(length, causal, "fwd") / t / 1e12, speedup=one / t))


if __name__ == "__main__":
    main()

"""GPU probes run by hand: compiled-kernel facts, host time per call, decode sweep.

Run on the GPU: python tools/probe.py [regs] [host] [decode]. Prints only; nothing
is written to the project.

- regs: registers, spills, shared memory and the MMA / copy instructions of the
  compiled Triton kernel (launched through the project's own launcher).
- host: where the wall time of one small call goes (validation, allocation,
  launcher, Triton's compiled-kernel launch), against SDPA's.
- decode: split-KV decode shapes under several programs-per-SM targets and
  tile configurations, against SDPA.
"""

from __future__ import annotations

import re
import sys

import torch
import torch.nn.functional as F

import impl_triton.attention as ta
from common import attention
from common.configs import Config, key, length_bucket
from common.timing import gpu_time_ms, wall_time_us


def regs():
    for D in (64, 128):
        for causal in (False, True):
            L = 4096
            B, H = 16384 // L, 2048 // D
            q, k, v = (torch.randn(B, H, L, D, dtype=torch.float16, device="cuda") for _ in range(3))
            ta._fwd_launcher._by_class.clear()
            attention(q, k, v, is_causal=causal)
            (kernel,) = ta._fwd_launcher._by_class.values()
            ptx = kernel.asm.get("ptx", "")
            mma = sorted(set(re.findall(r"(wgmma\.mma_async[\w.]*|mma\.sync[\w.]*)", ptx)))
            print(f"D={D} causal={causal}: regs={kernel.n_regs} spills={kernel.n_spills} "
                  f"shared={kernel.metadata.shared} mma={mma[:3]} cp.async={'cp.async' in ptx} "
                  f"tma={'cp.async.bulk.tensor' in ptx}", flush=True)


def host():
    from common.backends import resolve
    from common.validation import check_call

    for shape in [(2, 4, 16, 32), (1, 16, 128, 128), (2, 4, 1024, 64)]:
        q, k, v = (torch.randn(*shape, dtype=torch.float16, device="cuda") for _ in range(3))
        backend = resolve("triton")
        times = {
            "sdpa": wall_time_us(lambda: F.scaled_dot_product_attention(q, k, v)),
            "attention(triton)": wall_time_us(lambda: attention(q, k, v)),
            "attention(ninetoothed)": wall_time_us(lambda: attention(q, k, v, backend="ninetoothed")),
            "check_call": wall_time_us(lambda: check_call(
                backend, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False, return_lse=False), device="cpu"),
            "forward": wall_time_us(lambda: ta.forward(q, k, v, is_causal=False, scale=0.1)),
            "torch.empty": wall_time_us(lambda: torch.empty(shape, dtype=torch.float16, device="cuda"), device="cpu"),
        }
        # The launcher alone, and Triton's compiled-kernel launch alone, on a prebuilt call.
        out = torch.empty_like(q)
        config = ta.CONFIGS.lookup(max(16, shape[3]), q.dtype, False, shape[2], shape[2], False)
        args = (q, k, v, out, out, out, *q.stride(), *k.stride(), *v.stride(),
                *out.stride()[:3], 0, out.stride(3), 0, 0, 0, 0, shape[1], 1, shape[2], shape[2], 0.1, 1, 1 << 20,
                shape[3], shape[3], config.block_m, config.block_n, max(16, shape[3]), max(16, shape[3]),
                False, 0, False, False, "tf32", False)
        grid = ((shape[2] + config.block_m - 1) // config.block_m, shape[0] * shape[1], 1)
        launch = lambda: ta._fwd_launcher(grid, args, config.num_warps, config.num_stages)  # noqa: E731
        launch()
        launch()
        times["launcher"] = wall_time_us(launch)
        compiled = list(ta._fwd_launcher._by_value.values())[-1]
        times["compiled[grid]()"] = wall_time_us(lambda: compiled[grid](*args))
        print(shape, "  ".join(f"{name} {t:.1f}" for name, t in times.items()), flush=True)


def decode():
    B, H, H_kv, D = 8, 32, 8, 128
    import common.splitkv as splitkv

    per_sm_default = splitkv.PROGRAMS_PER_SM

    for Lq in (1, 16):
        for Lk in (4096, 16384, 65536):
            q = torch.randn(B, H, Lq, D, dtype=torch.float16, device="cuda")
            k, v = (torch.randn(B, H_kv, Lk, D, dtype=torch.float16, device="cuda") for _ in range(2))
            sdpa = gpu_time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
            line = [f"Lq={Lq} Lk={Lk} sdpa {sdpa * 1e3:.0f}us"]
            rows = Lq * H // H_kv
            entry = key(128, torch.float16, False, length_bucket(rows))
            for config in [Config(max(16, rows), 64, 4, 3), Config(max(16, rows), 128, 4, 3),
                           Config(max(16, rows), 64, 4, 4), Config(max(16, rows), 64, 4, 2)]:
                ta.CONFIGS.entries[entry] = config
                type(ta.CONFIGS).lookup.cache_clear()
                for per_sm in (1, 2, 4):
                    splitkv.PROGRAMS_PER_SM = per_sm
                    t = gpu_time_ms(lambda: attention(q, k, v, enable_gqa=True))
                    line.append(f"{config.block_n}/{config.num_warps}w/{config.num_stages}s/x{per_sm}: {sdpa / t:.2f}")
            ta.CONFIGS.entries.pop(entry)
            type(ta.CONFIGS).lookup.cache_clear()
            splitkv.PROGRAMS_PER_SM = per_sm_default
            for _ in range(2):
                sdpa = gpu_time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
                nt = gpu_time_ms(lambda: attention(q, k, v, enable_gqa=True, backend="ninetoothed"))
                tr = gpu_time_ms(lambda: attention(q, k, v, enable_gqa=True))
                wall = [wall_time_us(lambda: f(), calls=100) for f in (
                    lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                    lambda: attention(q, k, v, enable_gqa=True),
                    lambda: attention(q, k, v, enable_gqa=True, backend="ninetoothed"))]
                line.append(f"default: sdpa {sdpa * 1e3:.0f}us triton {sdpa / tr:.2f} ninetoothed {sdpa / nt:.2f} "
                            f"wall us sdpa/triton/nt {wall[0]:.0f}/{wall[1]:.0f}/{wall[2]:.0f}")
            print("  ".join(line), flush=True)


if __name__ == "__main__":
    for name in sys.argv[1:] or ["regs", "host", "decode"]:
        globals()[name]()

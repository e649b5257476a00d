"""Read what the compiler made of the Triton kernel: registers, spills, MMA instructions.

Run on the GPU: python tools/probe.py. Costs no timing, only compiles.
"""

from __future__ import annotations

import re

import torch
import triton

import impl_triton.attention as ta
from common.configs import padded_head_dim


def compiled(D, dtype, causal, L=4096, mask_kind=0):
    B, H = 16384 // L, 2048 // D
    q, k, v = (torch.randn(B, H, L, D, dtype=dtype, device="cuda") for _ in range(3))
    out = torch.empty_like(q)
    config = ta.CONFIGS.lookup(padded_head_dim(D), dtype, causal, L, L, False)
    grid = (triton.cdiv(L, config.block_m), B * H)
    kernel = ta._attn_fwd[grid](
        q, k, v, out, out, out, *q.stride(), *k.stride(), *v.stride(), *out.stride(), 0, 0, 0, 0,
        H, 1, L, L, 0.1, HEAD_DIM=D, HEAD_DIM_V=D, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_D=padded_head_dim(D), BLOCK_DV=padded_head_dim(D), IS_CAUSAL=causal, MASK_KIND=mask_kind,
        WITH_LSE=False, NEGATIVE_SCALE=False, DOT_PRECISION="tf32", num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return config, kernel


def main():
    for D in (64, 128):
        for causal in (False, True):
            config, kernel = compiled(D, torch.float16, causal)
            ptx = kernel.asm.get("ptx", "")
            mma = sorted(set(re.findall(r"(wgmma\.mma_async[\w.]*|mma\.sync[\w.]*)", ptx)))
            print(f"D={D} causal={causal} {config}: regs={kernel.n_regs} spills={kernel.n_spills} "
                  f"shared={kernel.metadata.shared} mma={mma[:3]} cp.async={'cp.async' in ptx} "
                  f"tma={'cp.async.bulk.tensor' in ptx}")


if __name__ == "__main__":
    main()

"""``compare``: the two programming models side by side, as Markdown (the committed COMPARISON.md with ``--write``).

Code metrics are counted from the current source every time (common/metrics.py
says how). The Triton code NineToothed generates for our kernel is counted the same way and,
when the report goes to a file, saved in a comparison/ folder beside it, to diff against
impl_triton/kernels.py. On a GPU the command also measures build cost (code generation and
compilation of a cold first call, in a fresh process with an empty Triton cache) and per-call
host overhead, kept in that folder's gpu.json; on a CPU it reuses the repository's
comparison/gpu.json and says when and where it was measured. Speed comes from the last
benchmark (benchmarks/results.json, written by ``bench --write``). The narrative is
comparison/NARRATIVE.md. The report goes to stdout unless ``--output`` or ``--write`` names a
file: a plain run rewrites nothing in the repository.
"""

from __future__ import annotations

import inspect
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import torch

from common.tools.metrics import IndexCounts, feature_lines, function_metrics

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository (common/tools/ is two levels down)
OUT_DIR = ROOT / "comparison"

# The functions of each kernel module, by pass: (device code and arrangements, host code).
KERNEL_FUNCTIONS = {
    "triton": {
        "forward": ["_load_tile", "_row_band", "_attn_fwd_inner", "_attn_fwd", "_merge_splits"],
        "backward": ["_attn_bwd_dq_inner", "_attn_bwd_dq", "_attn_bwd_dkdv_inner", "_attn_bwd_dkdv"],
        "paged": ["_paged_fwd", "_append_kv"],
    },
    "ninetoothed": {
        "forward": ["_rows", "_row_slices", "_key_row", "_key_blocks_row", "_mask_row", "_per_split", "arrangement",
                    "_attn_fwd_inner", "application", "combine_arrangement", "combine_application"],
        "backward": ["_group_rows", "_group_row_blocks", "dq_arrangement", "_attn_bwd_dq_inner", "dq_application",
                     "dkdv_arrangement", "_attn_bwd_dkdv_inner", "dkdv_application"],
        "paged": ["_pages", "paged_arrangement", "paged_application", "append_arrangement", "append_application"],
    },
}
HOST_FUNCTIONS = {
    "triton": ["forward", "_forward_launch", "bind_forward", "_bind_tl", "backward", "paged_forward", "append_kv"],
    "ninetoothed": ["_flags", "_attention_inputs", "_key_blocks_inputs", "premake", "premake_combine", "premake_dq",
                    "premake_dkdv", "premake_paged", "premake_append", "_make", "_absent", "blocked_keys",
                    "_row_blocks", "forward", "_is_stand_in", "bind_forward", "backward", "paged_forward", "append_kv"],
}


def _modules() -> dict[str, str]:
    from common.backends import get_backend, kernel_backends

    return {name: get_backend(name).module for name in kernel_backends()}

# Which lines serve which feature (common.metrics.feature_lines): identifiers per feature.
FEATURES = {
    "causal (two-stage loop, diagonal mask)": r"IS_CAUSAL",
    "ragged lengths (bounds masks)": r"MASKED|key_ok|m_ok|\bLk\b|\bLq\b|full_end|source\.shape\[-2\]|offs_n",
    "head dims not a power of two": r"HEAD_DIM|BLOCK_D|d_ok|dv_ok|block_d|other=0",
    "grouped-query heads": r"GROUP|h_kv|group",
    "attention masks": r"MASK_KIND|mask_ptrs|attn_mask|stride_m",
    "log-sum-exp output": r"WITH_LSE|\bLSE\b|\blse\b",
    "negative scales": r"NEGATIVE_SCALE",
    "split keys (decoding) and their merge": r"SPLIT|\bsplit\b|NUM_SPLITS|BLOCKS_PER_SPLIT|blocks_per_split|\bfirst\b"
                                              r"|\blo\b|\bhi\b|_part\b|\bw\b|block_r|BLOCK_R|block_s|BLOCK_S",
}

# What each backend supports (also the README's table).
FEATURE_TABLE = [
    ("float16 / bfloat16 / float32", "yes", "yes", "yes"),
    ("3-D (H, L, D) and 4-D (B, H, L, D) inputs", "yes", "yes", "yes"),
    ("any Lq, Lk >= 1; Lq != Lk; top-left causal", "yes", "yes", "yes"),
    ("head dims 1-256, not only powers of two", "yes", "yes", "yes (any)"),
    ("value head dim != query/key head dim", "yes", "yes", "yes"),
    ("any strides (no copies)", "yes", "yes", "yes"),
    ("grouped-/multi-query heads (enable_gqa)", "yes, in the kernel", "yes, in the arrangement", "yes"),
    ("boolean and additive attn_mask, broadcast by strides", "yes", "yes", "yes"),
    ("log-sum-exp output (return_lse)", "yes", "yes", "no"),
    ("short queries: keys split across programs, GQA heads packed", "yes", "yes", "yes (its own kernels)"),
    ("dropout_p > 0 (Philox mask regenerated in the backward)", "yes", "yes", "yes"),
    ("tensors spanning 2^31 elements or more", "yes (64-bit offsets)",
     "yes, each batch and head under 2^31 (64-bit batch and head strides; a clear error past it)", "yes"),
    ("B·H > 65535", "yes (one grid axis)", "yes", "yes"),
    ("backward pass (autograd, torch.compile), deterministic", "yes", "yes", "yes"),
    ("attention_backward() building block", "yes", "yes", "no"),
    ("FP8 inputs (float8_e4m3fn, FlashAttention-3's descales; forward)", "yes", "yes", "yes (dequantized)"),
    ("runs on a CPU", "Triton's interpreter", "Triton's interpreter", "yes"),
]


# Each backend's kernel modules, beside its registered (host) module.
KERNEL_MODULES = {
    "triton": ["impl_triton.kernels", "impl_triton.paged_kernels"],
    "ninetoothed": ["impl_ninetoothed.tiles", "impl_ninetoothed.kernels", "impl_ninetoothed.paged_kernels"],
}


def _module_source(backend: str) -> str:
    """The source of the backend's kernel modules and its registered module, one after the other."""
    import importlib

    names = KERNEL_MODULES[backend] + [_modules()[backend]]
    return "\n".join(inspect.getsource(importlib.import_module(name)) for name in names)


def _code_data() -> dict:
    """Per backend: metrics of its kernel and host functions, lines per pass and per feature."""
    data = {}
    for backend in _modules():
        source = _module_source(backend)
        functions = KERNEL_FUNCTIONS[backend]
        kernel = function_metrics(source, functions["forward"] + functions["backward"] + functions["paged"])
        host = function_metrics(source, HOST_FUNCTIONS[backend])
        data[backend] = dict(
            kernel=kernel, host=host,
            forward_lines=sum(f.code_lines for f in function_metrics(source, functions["forward"])),
            backward_lines=sum(f.code_lines for f in function_metrics(source, functions["backward"])),
            paged_lines=sum(f.code_lines for f in function_metrics(source, functions["paged"])),
            features=feature_lines(source, functions["forward"] + functions["backward"], FEATURES),
        )
    return data


def _code_totals(d: dict) -> dict:
    """One backend's totals for the summary table."""
    return dict(
        kernel_lines=sum(f.code_lines for f in d["kernel"]),
        host_lines=sum(f.code_lines for f in d["host"]),
        index=sum((f.index for f in d["kernel"]), IndexCounts()).total,
        max_complexity=max(f.complexity for f in d["kernel"]),
        forward_lines=d["forward_lines"], backward_lines=d["backward_lines"], paged_lines=d["paged_lines"],
    )


def _function_rows(data: dict) -> list[str]:
    """The per-function table."""
    lines = ["| backend | function | role | lines | complexity | aranges | address arithmetic | bounds comparisons | load/store masks | `//` and `%` |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for backend, d in data.items():
        for role in ("kernel", "host"):
            for f in d[role]:
                i = f.index
                lines.append(f"| {backend} | `{f.name}` | {role} | {f.code_lines} | {f.complexity} | {i.aranges} | "
                             f"{i.address_arithmetic} | {i.bounds_comparisons} | {i.load_store_masks} | {i.div_mod} |")
    return lines


def code_section() -> tuple[str, dict]:
    data = _code_data()
    lines = ["## Code, counted from the source", "",
             "Lines of code exclude blanks, comments and docstrings; complexity is McCabe's; index expressions "
             "are the hand-written `arange`s, address arithmetic on strides/pointers, bounds comparisons and "
             "load/store `mask=`/`other=` arguments (rules in `common/metrics.py`).", ""]
    lines += _function_rows(data)
    lines += ["", "| | triton | ninetoothed |", "|---|---|---|"]
    totals = {backend: _code_totals(d) for backend, d in data.items()}
    for label, key in (("kernel lines (device code + arrangement)", "kernel_lines"),
                       ("of which the forward (with the split merge)", "forward_lines"),
                       ("of which the backward", "backward_lines"),
                       ("of which the paged KV cache (attention, append)", "paged_lines"),
                       ("launcher lines (host)", "host_lines"),
                       ("hand-written index/pointer/stride/mask expressions in the kernel", "index"),
                       ("highest complexity of a kernel function", "max_complexity")):
        lines.append(f"| {label} | {totals['triton'][key]} | {totals['ninetoothed'][key]} |")
    lines += ["", "### Lines each feature costs in the kernel", "",
              "A line counts for a feature when it names one of the feature's identifiers or sits in the body of "
              "an `if` that does (patterns in `common/compare.py`); one line can serve several features.", "",
              "| feature | triton | ninetoothed |", "|---|---|---|"]
    for feature in FEATURES:
        lines.append(f"| {feature} | {data['triton']['features'][feature]} | {data['ninetoothed']['features'][feature]} |")
    return "\n".join(lines), totals


# The same forward at three levels of abstraction: (level, its backend's modules or its own module, its
# forward's functions, what the author decides there that the level above decides for them).
LEVELS = [
    ("tensor-oriented: NineToothed", "ninetoothed", KERNEL_FUNCTIONS["ninetoothed"]["forward"],
     "how each tensor is tiled and which tiles a program gets (the arrangement), and the loop over them; "
     "the code generator writes every offset, pointer and mask, and Triton's compiler the schedule"),
    ("block-oriented: `triton.language`", "triton", KERNEL_FUNCTIONS["triton"]["forward"],
     "every offset, pointer, mask and loop bound, block by block; the compiler chooses the layouts, the "
     "shared memory, the copies' pipelining and when each product waits"),
    ("warp-group-oriented: Gluon (sm_90)", "impl_triton.gluon_attention",
     ["_softmax_step", "_whole_tiles", "_barriers", "_invalidate", "_gluon_attn_fwd", "_program", "_key_tiles",
      "_consume", "_kv_round", "_load_q", "_prefetch_q", "_v_coord", "_v_operand", "_ws_producer", "_gluon_attn_fwd_ws",
      "_pp_blocks", "_pp_item", "_pp_next", "_pp_block", "_pp_consumer", "_pp_producer", "_gluon_attn_fwd_pp"],
     "the register layouts of S, O and P, the shared-memory ring and its barriers, each TMA copy, when each "
     "asynchronous warp-group MMA is issued and waited for, and which warps copy and which compute"),
]
SCHEDULE_CALLS = ("allocate_shared_memory", "init", "expect", "wait", "arrive", "invalidate", "warpgroup_mma",
                  "warpgroup_mma_wait", "warp_specialize", "fence_async_shared", "_tma_load", "_tma_store",
                  "store_wait", "convert_layout")


def levels_section() -> str:
    """The forward at the three levels: lines, hand-written index expressions, the schedule's explicit
    operations (shared memory, barriers, copies, asynchronous MMAs and their waits, layout conversions),
    and what the author decides at each level."""
    import ast
    import importlib

    out = ["## One forward at three levels", "",
           "The same FlashAttention forward (online softmax over key tiles) written three times. Counted as above; "
           "schedule operations are the calls that place data and order work by hand (shared-memory allocations, "
           "barrier init/expect/wait/arrive, TMA copies in and out, asynchronous MMAs and their waits, warp "
           "specialisation, layout conversions).", "",
           "| level | forward lines | index expressions | schedule operations | what the author decides |",
           "|---|---|---|---|---|"]
    for label, module, names, decides in LEVELS:
        source = (_module_source(module) if module in KERNEL_MODULES
                  else inspect.getsource(importlib.import_module(module)))
        metrics = function_metrics(source, names)
        tree = ast.parse(source)
        functions = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
        schedule = sum(1 for f in functions for n in ast.walk(f) if isinstance(n, ast.Call)
                       and (getattr(n.func, "attr", None) or getattr(n.func, "id", None)) in SCHEDULE_CALLS)
        out.append(f"| {label} | {sum(f.code_lines for f in metrics)} | "
                   f"{sum((f.index for f in metrics), IndexCounts()).total} | {schedule} | {decides} |")
    out += ["", "Not like for like: the first two forwards carry every feature (masks, dropout, windows, "
            "soft-capping, sinks, ALiBi, split keys and their merge); the Gluon one serves the plain forward "
            "(float16/bfloat16, D = Dv 64/128/256, causal or not, grouped heads, the log-sum-exp), written three "
            "ways (one partition; with a producer warp; with a producer warp and two or three consumer warp groups "
            "taking turns, FlashAttention-3's ping-pong, also as persistent programs, at most one an SM running "
            "row blocks one after another, causal ones in pairs of a long and a short block, the next block's Q "
            "loaded early where shared memory allows; ping-pong also takes FP8 inputs, at 0.88-1.00x the `tl` "
            "kernel's FP8 forward on the H200 at its best tiles, in persistent programs more on an H100, below). "
            "On the H200 (`tools/probe.py gluon`, benchmarks/NOTES.md) the "
            "producer-warp variant runs 1.24-1.37x the `tl` kernel at D 256, and ping-pong 1.18-1.24x it at D 128 "
            "and 1.02-1.09x at D 64 from L 4k (0.94-0.95x at 1k): the triton backend sends it the plans its config "
            "table's gluon section names, as `tune --passes gluon` timed them on sm_90 (`ATTENTION_GLUON=1`: "
            "every plan it serves, `0`: none). Against SDPA's cuDNN kernel ping-pong runs 0.95-1.07x at D 128 "
            "from 4k (0.86-0.90x at 1k) and 0.91-1.00x at D 64 from 4k; on an H100 persistent programs took D 64 "
            "at 1k from 0.82x to 0.98x without a mask and from 0.74x to 0.83x causal. With a ring slot's K and V "
            "on barriers of their own (FlashAttention-3's two pipelines: a slot's K goes back to the producer as "
            "soon as S is in, its V once P V is; 16-bit inputs), D 256 went from 0.73-0.82x cuDNN to 0.98-1.13x "
            "on that H100 and D 128 to 0.91-1.12x; the table, retuned there, names persistent programs or "
            "ping-pong at D 128 and 256 from 1k, and FP8 at D 128 through persistent programs (1.01-1.34x the "
            "`tl` kernel's FP8 forward on that H100, whose loop keeps one barrier a slot). On the H200 with that "
            "table (`tools/probe.py default_vs_sdpa`, bf16) the triton backend's default forward runs 0.99-1.10x "
            "cuDNN at D 256, 0.94-1.08x at D 128 and 0.84-1.02x at D 64, 1.02-1.85x its `tl` kernel. "
            "The author also decides how the key loop is laid out in code: at D 128 and 256 under triton 3.9 it "
            "runs as two loops, the tiles every row sees whole and then the masked ones, so that the first carries "
            "no mask code (at D 128 486 instructions a step and no spill in the SASS, from 776 and 6-35 local "
            "accesses, 1-7% faster on an H100, medians of three runs; at D 256 2-10% faster at 5 of 6 shapes in "
            "two runs); and where P is rounded to 16 bits: as soon as its row sums are taken, so that the loop "
            "carries it over to the next round in half the registers (no spill left in the key loops under triton "
            "3.9; on an H100 under 3.6 and 3.9 faster in each of three runs at 1k causal by 2-12% and at 4k causal "
            "at D 64 and 128 by 1-6%, within the runs' spread elsewhere). `tl`'s compiler decides both for the "
            "`tl` kernel, and its layouts too: a row's maximum written as a tree by reshape and split stays in each "
            "thread's registers in Gluon, where in `tl` it cost 40 shuffles a key step (compiled for sm_90). "
            "The same register bits split a tile between the special-function unit and the FMA units: at D 64 "
            "without a causal mask under triton 3.9 a quarter of each tile's exponentials is a cubic polynomial on "
            "the FMA units (FlashAttention-4's remedy where the special-function unit binds), 2-7% faster on an "
            "H100. "
            "Two things of FlashAttention-3's schedule Gluon (in triton 3.6) still cannot write: its key tiles of "
            "160-224 (every Triton tensor's shape is a power of two, and 256 keys spill a consumer's registers), "
            "and the backward's bulk reduce-add of dQ (in triton 3.9's Gluon). Under 3.9 the one pass takes it two "
            "ways: from the consumer warps (`backward_fused(dq_tma=True)`: 0.61-0.94x the `tl` backward on the "
            "H200, timed with torch's float32 glue around it and 3.9's barrier after each warpgroup wait, both "
            "since removed), and with FlashAttention-3's warp roles, a loader warp and a warp of its own issuing "
            "the reduce beside two consumer warp groups (`specialized=True`), whose consumers' 240 registers hold "
            "FlashAttention-3's D 128 tile of 64 rows by 128 keys. Its consumers first held each row tile's "
            "log-sum-exp and delta in registers through the tile's five products; with the loader warp putting "
            "them in shared memory beside Q and dO (`stats_smem=True`, where Gluon lets the author place each "
            "value) it ran 1.09-1.15x faster at D 128 and 1.07-1.24x the `tl` backward at D 64 (H100, triton 3.9 "
            "with its own CUDA 13 ptxas). That is the triton backend's backward at D 64 and 128 from 1024 keys "
            "under triton >= 3.9 where no deterministic backward is asked (its dQ sums land in any order), its "
            "launches bound to a layout as the `tl` backward's: from 4096 keys 1.00-1.07x cuDNN's backward at "
            "D 128 and 0.93-0.99x at D 64, a training step 0.99-1.08x and 0.93-0.97x. What a warp of its own buys is what "
            "`tl` has no word for: the `tl` one pass issuing the same bulk reduce from its compute warps, with "
            "Triton waiting for the copy engine before the staging tile is written again, ran 0.89-0.98x the two "
            "passes. NineToothed compiles to `triton.language`, so it cannot reach this level."]
    return "\n".join(out)


def _selected_functions(source: str, names):
    """The top-level functions of ``source`` named in ``names``, or (``names`` None) its ``@triton.jit`` ones."""
    import ast

    def wanted(node):
        if names is not None:
            return node.name in names
        return any(ast.unparse(d) == "triton.jit" for d in node.decorator_list)

    return [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and wanted(n)]


def _generated_row(label: str, source: str, names) -> tuple:
    """(label, code lines, characters, loads + stores, index counts) of the selected functions of ``source``."""
    import ast

    from common.tools.metrics import code_lines, index_expressions

    functions = _selected_functions(source, names)
    counts = sum((index_expressions(f) for f in functions), IndexCounts())
    lines = code_lines(source)
    n_lines = sum(1 for f in functions for line in range(f.lineno, f.end_lineno + 1) if line in lines)
    chars = sum(len(ast.unparse(f)) for f in functions)
    loads = sum(1 for f in functions for n in ast.walk(f) if isinstance(n, ast.Call) and
                getattr(n.func, "attr", "") in ("load", "store"))
    return label, n_lines, chars, loads, counts


def generated_section(files: pathlib.Path | None = None) -> str:
    """Count NineToothed's generated Triton code beside ours; save it in ``files`` (None: save nothing)."""
    import impl_ninetoothed.attention as nt
    import impl_triton.kernels as ta
    from common.interpret import apply_interpreter_fixes

    apply_interpreter_fixes()
    head_dim, block_m, block_n = 64, 128, 64
    handle = nt._make(nt.premake, head_dim, head_dim, block_m, block_n, None, num_warps=4, num_stages=3)
    generated = pathlib.Path(handle._source).read_text()
    if files is not None:
        files.mkdir(parents=True, exist_ok=True)
        (files / "ninetoothed_generated.py").write_text(
            f"# Generated by ninetoothed.make for impl_ninetoothed/kernels.py (D = Dv = {head_dim}, "
            f"BLOCK_M = {block_m}, BLOCK_N = {block_n}).\n# Saved by `python -m common compare`; do not edit.\n"
            + generated
        )
        where = "`comparison/ninetoothed_generated.py` is"
    else:
        where = ("The code (saved as `comparison/ninetoothed_generated.py` when the report goes to a file: "
                 "`--output PATH` or `--write`) is")
    ours = inspect.getsource(ta)
    rows = [_generated_row("hand-written Triton (ours)", ours, ["_load_tile", "_attn_fwd_inner", "_attn_fwd"]),
            _generated_row("NineToothed's generated Triton", generated, None)]
    out = ["## The Triton code NineToothed generates", "",
           f"{where} what `ninetoothed.make` writes for our arrangement and "
           "application (one configuration); diff it against our kernel, `impl_triton/kernels.py`. "
           "Counted the same way:", "",
           "| | lines | characters | loads + stores | aranges | address arithmetic | bounds comparisons | load/store masks | `//` and `%` |",
           "|---|---|---|---|---|---|---|---|---|"]
    for label, n_lines, chars, loads, c in rows:
        out.append(f"| {label} | {n_lines} | {chars} | {loads} | {c.aranges} | {c.address_arithmetic} | "
                   f"{c.bounds_comparisons} | {c.load_store_masks} | {c.div_mod} |")
    out += ["", "What the generated code carries that ours does not: every load and store gets a mask that "
            "re-checks every level of the arrangement (program-id coordinates, tile indices, element offsets, "
            "each against its bound and against zero), the program id is unravelled into coordinates separately "
            "for each tensor (the `//` and `%` above), and sizes are written as unsimplified symbolic "
            "expressions (`(L - 127 - 1 + 128 - 1) // 128 + 1`). Triton's compiler folds most of it on a GPU "
            "(constant ranges, repeated sub-expressions); the interpreter executes all of it, which is why "
            "NineToothed runs 5-20x slower than our kernel there."]
    return "\n".join(out)


_COLD_START = r"""
import json, sys, time
start = time.perf_counter()
import torch
import common.dispatch  # the library (a bare `import common` defers it to the first use)
backend = sys.argv[1]
q, k, v = (torch.randn(1, 8, 1024, 64, dtype=torch.float16, device="cuda") for _ in range(3))
torch.cuda.synchronize()
imported = time.perf_counter()
codegen = 0.0
if backend == "ninetoothed":
    import impl_ninetoothed.attention as nt
    from common.backends import get_backend
    c = get_backend("ninetoothed").configs.lookup(64, torch.float16, False, 1024, 1024, False)
    t = time.perf_counter(); nt._make(nt.premake, 64, 64, c.block_m, c.block_n, None, num_warps=c.num_warps, num_stages=c.num_stages); codegen = time.perf_counter() - t
t = time.perf_counter(); common.attention(q, k, v, backend=backend); torch.cuda.synchronize(); first = time.perf_counter() - t
t = time.perf_counter(); common.attention(q, k, v, backend=backend); torch.cuda.synchronize(); second = time.perf_counter() - t
print(json.dumps(dict(import_s=imported - start, codegen_s=codegen, first_call_s=first, second_call_s=second)))
"""


def measure_gpu() -> dict:
    """Build cost of a cold first call (fresh process, empty Triton cache) and per-call host overhead."""
    from common import attention
    from common.tools.bench import environment
    from common.tools.timing import wall_time_us

    result = dict(environment=environment(), cold_start={}, host_overhead_us={})
    for backend in _modules():
        cache = tempfile.mkdtemp(prefix="triton-cache-")
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        proc = subprocess.run([sys.executable, "-c", _COLD_START, backend], capture_output=True, text=True,
                              env=env, cwd=ROOT, timeout=300)
        shutil.rmtree(cache, ignore_errors=True)
        if proc.returncode != 0:
            result["cold_start"][backend] = dict(error=proc.stderr[-500:])
        else:
            result["cold_start"][backend] = json.loads(proc.stdout.strip().splitlines()[-1])
    q, k, v = (torch.randn(2, 4, 16, 32, dtype=torch.float16, device="cuda") for _ in range(3))
    for backend in ("triton", "ninetoothed", "torch"):
        result["host_overhead_us"][backend] = wall_time_us(lambda: attention(q, k, v, backend=backend), calls=1000)
    # the baseline: SDPA itself ("torch" above is SDPA behind our validation and planning)
    result["host_overhead_us"]["SDPA, called directly"] = wall_time_us(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), calls=1000)
    return result


def gpu_section(gpu: dict | None) -> str:
    if gpu is None:
        return "## Build cost and host overhead\n\nNot measured: no GPU run has been recorded (comparison/gpu.json)."
    env = gpu["environment"]
    out = ["## Build cost and host overhead", "",
           f"Measured on {env['gpu']} ({env['date']}; torch {env['torch']}, triton {env['triton']}, "
           f"ninetoothed {env['ninetoothed']}). Cold start: a fresh process with an empty Triton cache, "
           "one (1, 8, 1024, 64) fp16 call; code generation is `ninetoothed.make` alone.", "",
           "| | import (s) | code generation (s) | first call, compile included (s) | second call (s) |",
           "|---|---|---|---|---|"]
    for backend, c in gpu["cold_start"].items():
        if "error" in c:
            out.append(f"| {backend} | error: {c['error'][:80]} | | | |")
        else:
            out.append(f"| {backend} | {c['import_s']:.2f} | {c['codegen_s']:.2f} | {c['first_call_s']:.2f} | "
                       f"{c['second_call_s'] * 1e3:.2f} ms |")
    out += ["", "Host overhead: wall time per call of a Python loop on the tiny (2, 4, 16, 32) fp16 shape, "
            "where the GPU work is a few µs:", "", "| backend | µs per call |", "|---|---|"]
    for backend, us in gpu["host_overhead_us"].items():
        out.append(f"| {backend} | {us:.1f} |")
    return "\n".join(out)


def speed_section(results_path: pathlib.Path, files: pathlib.Path | None = None) -> tuple[str, pathlib.Path | None]:
    """The speed table from a results.json; its plot drawn into ``files`` (None: no plot, and a note says so)."""
    if not results_path.exists():
        return "## Speed\n\nNo benchmark results (benchmarks/results.json): run `python -m common bench --write` on a GPU.", None
    data = json.loads(results_path.read_text())
    env = data["environment"]
    rows = [r for r in data["rows"] if r["section"] == "throughput" and "tflops" in r]
    by_shape = {}
    for r in rows:  # (the pass first: forward and backward rows of one shape are two rows)
        key = (r.get("mode", "fwd"), r["dtype"], r["D"], r["Lq"], r["causal"])
        by_shape.setdefault(key, {})[r["backend"]] = r
    out = ["## Speed", "",
           f"From the last benchmark ({env['gpu']}, {env['date']}; `benchmarks/results.json`): TFLOP/s, "
           "B·L = 16384, H·D = 2048; `bwd` is the backward (2.5 forwards' FLOPs).", "",
           "| pass | dtype | D | L | causal | triton | ninetoothed | ninetoothed / triton | triton / SDPA |",
           "|---|---|---|---|---|---|---|---|---|"]
    ratios = {}
    for (mode, dtype, D, L, causal), by in sorted(by_shape.items(), key=lambda item: (item[0][0] != "fwd", item[0])):
        t, n, s = by.get("triton"), by.get("ninetoothed"), by.get("torch")
        if not t or not n:
            continue
        ratio = n["tflops"] / t["tflops"]
        ratios.setdefault(mode, []).append(((dtype, D, L, causal), ratio, t["tflops"], n["tflops"]))
        vs = f"{t['tflops'] / s['tflops']:.2f}" if s else "-"
        out.append(f"| {mode} | {dtype} | {D} | {L} | {'yes' if causal else 'no'} | {t['tflops']:.0f} | "
                   f"{n['tflops']:.0f} | {ratio:.2f} | {vs} |")
    for mode, of_mode in ratios.items():
        values = sorted(r for _, r, _, _ in of_mode)
        out += ["", f"NineToothed / Triton, {mode}: median {values[len(values) // 2]:.2f}, "
                f"range {values[0]:.2f}-{values[-1]:.2f} over {len(values)} shapes."]
    plot = None
    if ratios.get("fwd"):
        plot, line = _plot_line(ratios["fwd"], env, files)
        out += ["", line]
    return "\n".join(out), plot


NO_MATPLOTLIB = "matplotlib is not installed (pip install -e '.[bench]')"


def _plot_line(ratios, env, files: pathlib.Path | None) -> tuple[pathlib.Path | None, str]:
    """The plot of speed by shape and its Markdown line; where none is drawn, the line says why
    (and a missing matplotlib is warned about on stderr too, never dropped silently)."""
    if files is None:
        return None, ("(The plot of speed by shape is drawn only when the report goes to a file: "
                      "`--output PATH` or `--write`.)")
    try:
        import matplotlib
    except ImportError:
        print(f"twin-attention compare: warning: no plot of speed by shape: {NO_MATPLOTLIB}", file=sys.stderr)
        return None, f"(No plot of speed by shape: {NO_MATPLOTLIB}.)"
    matplotlib.use("Agg")
    path = _plot(ratios, env, files)
    return path, f"![speed by shape](comparison/{path.name})"


def _plot(ratios, env, files: pathlib.Path) -> pathlib.Path:
    """Forward TFLOP/s of both backends by shape, as a bar chart in ``files``."""
    import matplotlib.pyplot as plt

    labels = [f"{d[:4]} D{D} L{L}{' c' if c else ''}" for (d, D, L, c), *_ in ratios]
    triton = [t for *_, t, _ in ratios]
    nt = [n for *_, n in ratios]
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 0.45), 4.5))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], triton, width=0.4, label="triton")
    ax.bar([i + 0.2 for i in x], nt, width=0.4, label="ninetoothed")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, rotation=70, fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"forward throughput by shape, {env['gpu']}")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    files.mkdir(parents=True, exist_ok=True)
    path = files / "speed_by_shape.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def feature_section() -> str:
    out = ["## Features", "", "| feature | triton | ninetoothed | torch (SDPA) |", "|---|---|---|---|"]
    out += [f"| {f} | {t} | {n} | {s} |" for f, t, n, s in FEATURE_TABLE]
    return "\n".join(out)


def _gpu_record(interpreted: bool, files: pathlib.Path | None) -> dict | None:
    """Build cost and host overhead: measured on a GPU (kept as ``files``/gpu.json when there is a
    folder), else the repository's comparison/gpu.json, if any."""
    if not interpreted:
        gpu = measure_gpu()
        if files is not None:
            files.mkdir(parents=True, exist_ok=True)
            (files / "gpu.json").write_text(json.dumps(gpu, indent=1) + "\n")
        return gpu
    gpu_path = OUT_DIR / "gpu.json"
    gpu = json.loads(gpu_path.read_text()) if gpu_path.exists() else None
    print("No GPU: code metrics are fresh; build cost and host overhead come from "
          + ("comparison/gpu.json, recorded on " + gpu["environment"]["date"] if gpu else "nowhere (never measured)"),
          file=sys.stderr)
    return gpu


def _destination(args) -> pathlib.Path | None:
    """The report's file: the committed COMPARISON.md with --write, the --output path, or None for stdout."""
    if args.write:
        return ROOT / "COMPARISON.md"
    return None if args.output == "-" else pathlib.Path(args.output)


def main(args) -> int:
    from common.interpret import use_interpreter_if_no_gpu
    from common.tools.cli import require

    require("radon", "bench", "compare")
    interpreted = use_interpreter_if_no_gpu()
    output = _destination(args)
    files = None if output is None else output.parent / "comparison"  # the report's links are relative to it
    gpu = _gpu_record(interpreted, files)
    code, totals = code_section()
    speed, _ = speed_section(ROOT / "benchmarks" / "results.json", files)
    narrative_path = OUT_DIR / "NARRATIVE.md"
    narrative = narrative_path.read_text().strip() if narrative_path.exists() else ""
    document = "\n\n".join([
        "# Triton and NineToothed, side by side",
        "Regenerated by `python -m common compare --write` from the current code (do not edit by hand; the "
        "narrative is `comparison/NARRATIVE.md`). Both kernels implement the same FlashAttention-2 forward with "
        "the same names: `impl_triton/kernels.py` and `impl_ninetoothed/kernels.py`.",
        narrative,
        code,
        levels_section(),
        generated_section(files),
        gpu_section(gpu),
        speed,
        feature_section(),
    ]) + "\n"
    if output is None:
        sys.stdout.write(document)
    else:
        output.write_text(document)
        print(f"wrote {output} and {files}/")
    print(f"kernel lines: triton {totals['triton']['kernel_lines']}, ninetoothed {totals['ninetoothed']['kernel_lines']}; "
          f"index expressions: triton {totals['triton']['index']}, ninetoothed {totals['ninetoothed']['index']}",
          file=sys.stderr if output is None else sys.stdout)
    return 0


DESCRIPTION = """\
The two programming models side by side: code metrics counted from the current source
(lines, complexity, hand-written index expressions, lines per feature), the Triton code
NineToothed generates, build cost and per-call host time (measured on a GPU, else read
from comparison/gpu.json) and speed (from benchmarks/results.json). Prints the Markdown
report on stdout and writes nothing; --output PATH writes it to PATH, with its plot and
NineToothed's generated code in a comparison/ folder beside PATH; --write regenerates the
committed COMPARISON.md and comparison/. Needs radon: pip install -e '.[bench]' (which
brings matplotlib for the plot too).
"""


def add_arguments(parser):
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--output", default="-", metavar="PATH",
                       help="where the Markdown report goes ('-': stdout, nothing written); a file gets its plot "
                            "and generated code in a comparison/ folder beside it")
    where.add_argument("--write", action="store_true",
                       help="regenerate the committed report: COMPARISON.md and comparison/ in the repository")

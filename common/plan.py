"""The host plan: from a validated call to everything a kernel launch needs.

Both kernel backends launch from the same plan, so every host-side decision is
made once, here, and a backend keeps only what its programming model needs
(how to hand the plan's tensors and numbers to its kernels):

- the views the kernels read: for causal calls the keys past Lq - 1 (that no
  row sees) dropped; for short queries the grouped-query heads packed into rows;
- the mask kind; block sizes, warps and stages from the backend's table;
  the dot precision;
- short queries against long keys: whether to split the keys across
  programs ("flash-decoding"), into how many ranges, the partial-output
  buffers and the merge's sizing;
- every output buffer, allocated once (NaN-poisoned under the tests' switch).

:func:`make_forward` plans a forward call, :func:`make_backward` a backward
one; both take a :class:`common.validation.Call`.

Short queries: with few query rows (decoding: Lq = 1 or a few speculative
tokens), one program per block of rows of one head starves the GPU twice
over: every query head of a grouped-query group re-reads the same K/V head,
and there are only B·H programs, each walking all of Lk on one SM.
:func:`pack_gqa` cures the first without touching a kernel (the GROUP query
heads that share a K/V head become GROUP·Lq rows of one head, a view);
:func:`plan_splits` cures the second (the keys cut into ``num_splits`` ranges
of ``blocks_per_split`` key blocks, one program each, each writing a partial
output and its log-sum-exp, then merged: ``o = sum_s exp(lse_s - lse) o_s`` with
``lse = log(sum_s exp(lse_s))``; by the last program of each row block to finish
in the Triton kernels, by a second kernel in NineToothed's).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import functools

import torch

from common.backends import OFFSETS64
from common.configs import BackwardConfig, Config, length_key, next_power_of_2, padded_head_dim
from common.configs import forced as configs_override
from common.outputs import allocator, partials
from common.validation import OFFSET_LIMIT, within_offsets

# Constants both kernels name (impl_triton wraps them as tl.constexpr; the
# NineToothed kernels get them in their generated modules).
LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)
LN2 = 0.6931471805599453  # ln(2): log(x) = log2(x) * LN2
UNIFORM_24 = 2.0**-24  # dropout: the top 24 bits of a 32-bit random draw, times this, are uniform in [0, 1)


class MaskKind(enum.IntEnum):
    """What ``attn_mask`` holds: the kernels' MASK_KIND."""

    NONE = 0
    BOOL = 1  # True takes part
    ADDITIVE = 2  # added to the scaled scores


class Softcap(enum.IntEnum):
    """How the kernels compute soft-capping's tanh: their SOFTCAP."""

    OFF = 0
    EXP2 = 1  # 1 - 2 / (e^(2x) + 1): runs everywhere, the interpreter too
    APPROX = 2  # the GPU's tanh.approx.f32 (NVIDIA, sm_75+): one special-function op where EXP2 takes two


# A launch with fewer programs than SMs is split, into enough splits for about
# this many programs per SM: a decode program streams memory, and more than
# one of them per SM hides its latency (2 won the decode sweep on the H200)...
PROGRAMS_PER_SM = 2
# ...except for programs of WIDE_ROWS rows or more (Lq = 16 of a 4-head group
# packed into 64 rows: four times the products per key read): one per SM, fewer
# and longer programs. H200, tools/probe.py bandwidth (2026-11-30): the Triton
# kernel read K/V at 3.08 TB/s against 2.46 with 2 per SM (B 1, 32/8 heads,
# Lq 16, Lk 64k) and 4.00 against 3.91 (B 8, Lk 16k), NineToothed 3.55/3.53 and
# 4.08/4.05; with 16-row programs 1 per SM was not better (-5% to +3.5%).
PROGRAMS_PER_SM_WIDE = 1
WIDE_ROWS = 64
# A split launch gives each split ceil(key blocks / splits) blocks, which NineToothed's arrangement
# derives from the keys' length and the split count: one kernel for every split size. In a tile of
# this many rows or more (Hopper's warpgroup MMA) NineToothed's kernel walks a split's blocks in one
# masked loop: with two, ptxas serialised every MMA of the kernel (its C7515: the tile's zero
# accumulator set between an MMA and its wait), 3.0-3.3 against 4.1 TB/s at B 8, 32/8 heads, Lq 16,
# Lk 16k on the H200. One masked loop: not serialised, and as fast as the tile size (a power of two
# of key blocks, a kernel per value: compiled again whenever a decode loop's keys crossed one) that
# such tiles took before: 3.62 / 4.07 TB/s against 3.62 / 4.03 at B 1, Lk 64k and B 8, Lk 16k
# (benchmarks/NOTES.md, "Last-to-first rows and one-loop splits timed and merged").
ONE_STAGE_SPLIT_ROWS = 64
# An unsplit launch of short-row programs (decoding at a large batch) with more programs than
# this many per SM pipelines two key blocks instead of three and caps registers at 128, so that
# four programs of 4 warps share an SM (the Triton kernel's 16 x 64 tile at D 128: 70 KB of
# shared memory, 3 an SM, with 3 stages; 38 KB and 128 registers, 4 an SM, with 2; NineToothed's
# takes 143 registers, 3 an SM, unless capped: 123, no spills). H200, bf16, B 64, 32/8 heads,
# Lk 4k: 3.94-3.98 -> 4.47-4.48 TB/s both (SDPA 4.50); split launches (about 2 programs an SM)
# lose with 2 stages. (benchmarks/NOTES.md, "Decode at a large batch", "Register caps".)
SHALLOW_PROGRAMS_PER_SM = 2
SHALLOW_ROWS = 16
SHALLOW_MAX_HEAD_DIM = 128
SHALLOW_MAX_REGISTERS = 128
# Under the interpreter there are no SMs; pretend there are a few, so that the
# CPU suite meets split launches on small decode-like shapes.
INTERPRETER_SMS = 2
# Pack grouped-query heads only for short queries: for long ones a program is
# already full of rows of one head, and packing would change nothing but the
# tile boundaries.
PACK_MAX_LQ = 64
# Split only where each program would otherwise walk this many keys or more:
# below it the merge kernel's launch costs more than the split saves.
MIN_SPLIT_KEYS = 2048
# Rows per program of the merge kernel, and the most elements of its float32 tile (rows x
# splits x Dv): 64 registers a thread in 4 warps.
COMBINE_ROWS = 16
MERGE_TILE = 8192
# Both merges (a launch of their own) walk a row's splits MERGE_SPLITS at a time, so that the
# split counts of a growing cache share one compiled merge; under the interpreter, at most the
# count's own power of two (a padded split costs as much as a real one there). Measured on the
# H200 (bf16, D 128, K/V TB/s of the whole decode, NineToothed / Triton with its merge launch;
# benchmarks/NOTES.md, "Split sizes in symbols"): 8 a step 3.95 / 3.98 at B 8, Lq 16, Lk 16k
# (2 splits of 4096 rows; 32 a step: 3.72 / 3.82, most of each tile padding), 3.64 / 3.63 at
# B 1, Lq 16, Lk 64k (32 splits; 32 a step: 3.62 / 3.66), 2 and 4 a step slower there.
MERGE_SPLITS = 8
# The Triton kernel merges its own splits (the last program of a row block folds them
# in, one launch) while num_splits x BLOCK_M is at most KERNEL_MERGE_MAX; above it one
# program's fold of that many partial rows outlasts a merge launch spread over the GPU
# (measured on the H200 at B 1, Lk 64k: 32 x 16 and 16 x 64 rows took 9 and 15 us at the
# end of the launch; benchmarks/NOTES.md, "Decode at B = 1"). Only where the keys and
# values read are at least KERNEL_MERGE_MIN_BYTES, though: a launch that long (~50 us at
# 4 TB/s) outlasts a decode step's host time, which hides the second launch's; shorter
# ones would pay it in a Python loop. NineToothed always launches its merge.
KERNEL_MERGE_MAX = 256
KERNEL_MERGE_MIN_BYTES = 192 << 20
# CUDA's limit on grid axes 1 and 2 (the split index's axis in the Triton kernel).
MAX_GRID_AXIS = 65535


@dataclasses.dataclass(frozen=True, slots=True)
class Merge:
    """The split merge: ``rows`` rows (B·H·Lq, flattened), BLOCK_R per program, walking a
    row's splits BLOCK_S at a time (:func:`merge_splits`)."""

    rows: int
    block_r: int
    block_s: int


@dataclasses.dataclass(slots=True)
class ForwardPlan:
    """Everything a forward launch needs. Shapes are the kernels' view (after
    packing: H_kv heads of GROUP·Lq rows); ``shape`` is the caller's view."""

    query: torch.Tensor  # (B, Hp, Lqp, D)
    key: torch.Tensor  # (B, H_kv, Lk, D)
    value: torch.Tensor  # (B, H_kv, Lk, Dv)
    attn_mask: torch.Tensor | None  # (B, Hp, Lqp, Lk) view, or None
    mask_kind: MaskKind
    scale: float
    is_causal: bool
    group: int  # query heads per K/V head in the kernels' view (1 once packed)
    shape: tuple[int, int, int, int]  # (B, H, Lq, Dv): the caller's output
    with_lse: bool  # the caller gets the log-sum-exp
    dropout_p: float = 0.0  # the probability of dropping each attention weight
    dropout_scale: float = 1.0  # what kept weights are multiplied by: 1 / (1 - p), 0 for p = 1
    seed: torch.Tensor | None = None  # dropout: the mask's seed, int64, one element, on the inputs' device
    band: tuple[int, int] | None = None  # row i sees keys i + band[0] .. i + band[1] (see band()); None: all
    softcap: float = 0.0  # > 0: scores s become softcap * tanh(s / softcap)
    softcap_kind: Softcap = Softcap.OFF
    sinks: torch.Tensor | None = None  # (B, H, Lq) float32 view of the (H,) sink logits (stride 0 but H)
    row_bands: torch.Tensor | None = None  # per-row bands instead of band (common.varlen.row_bands)
    # Kernel backends only (None for "torch"):
    config: Config | None = None
    block_d: int = 0  # head dims padded to a power of two >= 16
    block_dv: int = 0
    m_blocks: int = 0  # blocks of BLOCK_M query rows per head
    num_splits: int = 1  # key ranges per row block; > 1: partial outputs, then the merge
    blocks_per_split: int = 0  # key blocks per range
    dot_precision: str = "ieee"
    out: torch.Tensor | None = None  # (B, Hp, Lqp, Dv), the inputs' dtype
    lse: torch.Tensor | None = None  # (B, Hp, Lqp) float32, when with_lse
    o_part: torch.Tensor | None = None  # split: (B, Hp, Lqp, S, Dv) float32
    lse_part: torch.Tensor | None = None  # split: (B, Hp, Lqp, S) float32
    merge: Merge | None = None  # split: the merge's sizing
    kernel_merge: bool = False  # split: the Triton kernel merges its own splits (KERNEL_MERGE_MAX, _MIN_BYTES)
    resume: bool = False  # out (float32) and lse hold a running result that these keys fold into

    @property
    def split(self) -> bool:
        return self.num_splits > 1

    @property
    def dropout(self) -> bool:
        return self.dropout_p > 0.0

    @property
    def banded(self) -> int:
        """The kernels' BANDED: 0 (every row sees every key), 1 (band), ROW_BANDS."""
        return ROW_BANDS if self.row_bands is not None else int(self.band is not None)

    @property
    def kernel_lse(self) -> bool:
        """Whether the attention kernel writes log-sum-exps (the merge needs them too)."""
        return self.with_lse or self.num_splits > 1

    def results(self, out: torch.Tensor, lse: torch.Tensor | None):
        """``(out, lse)`` of a backend, in the caller's view (undoes the packing; views)."""
        B, H, Lq, Dv = self.shape
        if out.shape[1] == H:  # not packed (packing puts H_kv < H heads first): as they are
            return out, lse
        out = out.view(B, H, Lq, Dv)
        return out, (lse.view(B, H, Lq) if lse is not None else None)


@dataclasses.dataclass(slots=True)
class BackwardPlan:
    """Everything a backward launch needs: dq, dk, dv from the forward's
    inputs, output and log-sum-exp and the gradient of the output."""

    query: torch.Tensor  # (B, H, Lq, D)
    key: torch.Tensor  # (B, H_kv, Lk, D)
    value: torch.Tensor  # (B, H_kv, Lk, Dv)
    attn_mask: torch.Tensor | None  # (B, H, Lq, Lk) view, or None
    mask_kind: MaskKind
    scale: float
    is_causal: bool
    group: int  # query heads per K/V head
    out: torch.Tensor  # (B, H, Lq, Dv), the forward's output
    lse: torch.Tensor  # (B, H, Lq) float32, the forward's log-sum-exp
    grad_out: torch.Tensor  # (B, H, Lq, Dv)
    grad_lse: torch.Tensor | None  # (B, H, Lq): a gradient reaching the lse too, or None
    dropout_p: float = 0.0  # as the forward's
    dropout_scale: float = 1.0
    seed: torch.Tensor | None = None  # the forward's seed: its mask, regenerated
    band: tuple[int, int] | None = None  # as the forward's
    row_bands: torch.Tensor | None = None  # as the forward's
    softcap: float = 0.0
    softcap_kind: Softcap = Softcap.OFF
    config: BackwardConfig | None = None
    block_d: int = 0
    block_dv: int = 0
    dot_precision: str = "ieee"
    delta: torch.Tensor | None = None  # (B, H, Lq) float32: rowsum(dO * O) - dlse
    grad_query: torch.Tensor | None = None  # (B, H, Lq, D), contiguous
    grad_key: torch.Tensor | None = None  # (B, H_kv, Lk, D)
    grad_value: torch.Tensor | None = None  # (B, H_kv, Lk, Dv)

    @property
    def dropout(self) -> bool:
        return self.dropout_p > 0.0

    banded = ForwardPlan.banded


def dropout_scale(dropout_p: float) -> float:
    """What dropout multiplies a kept weight by; with p = 1 nothing is kept and the output is 0."""
    return 1.0 / (1.0 - dropout_p) if dropout_p < 1.0 else 0.0


def mask_kind(attn_mask: torch.Tensor | None) -> MaskKind:
    if attn_mask is None:
        return MaskKind.NONE
    return MaskKind.BOOL if attn_mask.dtype == torch.bool else MaskKind.ADDITIVE


def dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs get full-precision products, as torch computes them by
    # default (no TF32); half-precision products are exact on tensor cores anyway.
    return "ieee" if dtype == torch.float32 else "tf32"


def softcap_kind(softcap: float, dtype: torch.dtype, device: torch.device, interpreted: bool) -> Softcap:
    """Soft-capping's tanh for these inputs. tanh.approx.f32's relative error (about
    2^-11) is below what 16-bit inputs and probabilities carry, and it halves the
    special-function work per score (that unit bounds the soft-capped kernel); float32
    inputs keep the exact form, as does every target without the instruction."""
    if not softcap:
        return Softcap.OFF
    if interpreted or dtype == torch.float32 or device.type != "cuda" or not _has_tanh_approx(device):
        return Softcap.EXP2
    return Softcap.APPROX


@functools.lru_cache(maxsize=16)
def _has_tanh_approx(device: torch.device) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(device) >= (7, 5)


UNBOUNDED = 2**30  # a band edge no position reaches (lengths stay below it; int32 sums stay in range)
ROW_BANDS = 2  # BANDED for per-row bands: packed variable-length sequences (common.varlen)


def band(is_causal: bool, window, bottom_right: bool, Lq: int, Lk: int) -> tuple[int, int] | None:
    """Which keys each query row sees, as offsets from its index: row i sees keys
    i + lo ... i + hi (then clipped to [0, Lk)); None when it sees them all.

    Row i sits at position i (top-left) or i + Lk - Lq (bottom-right), key j at j;
    ``is_causal`` keeps keys at or before the row's position, ``window`` (left,
    right) those within left before and right after it (-1: unbounded)."""
    if not is_causal and window is None:
        return None
    shift = Lk - Lq if bottom_right else 0
    left, right = window if window is not None else (-1, -1)
    hi = UNBOUNDED if right < 0 else shift + right
    if is_causal:
        hi = min(hi, shift)
    lo = -UNBOUNDED if left < 0 else shift - left
    if lo <= 1 - Lq and hi >= Lk - 1:
        return None  # every row sees every key (e.g. one query row, bottom-right causal: decoding)
    return lo, hi


def sdpa_causal(band: tuple[int, int], Lq: int) -> bool:
    """Whether ``band`` keeps what SDPA's ``is_causal`` keeps: row i sees keys 0..i (top-left
    causal; also bottom-right causal with Lq = Lk, and any window it contains)."""
    return band[0] <= 1 - Lq and band[1] == 0


def band_mask(band: tuple[int, int], Lq: int, Lk: int, device) -> torch.Tensor:
    """The band as a boolean (Lq, Lk) mask, True where row i sees key j (for SDPA and the reference)."""
    offset = torch.arange(Lk, device=device)[None, :] - torch.arange(Lq, device=device)[:, None]
    return (offset >= band[0]) & (offset <= band[1])


def make_forward(call, backend, *, with_lse: bool, resume=None) -> ForwardPlan:
    """Plan the forward pass of a validated call with at least one query row and one key.

    ``resume``: None, or a running ``(out, lse)`` over other keys, float32 (B, H, Lq, Dv) and
    (B, H, Lq), any strides; the call folds its keys into them in place (kernel backends;
    see :func:`common.ops.forward_resume`)."""
    q, k, v, mask = call.query, call.key, call.value, call.attn_mask
    B, H, Lq, D = q.shape
    H_kv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    plan = ForwardPlan(q, k, v, mask, mask_kind(mask), call.scale, call.is_causal, H // H_kv, (B, H, Lq, Dv),
                       with_lse, call.dropout_p, dropout_scale(call.dropout_p), call.dropout_seed)
    plan.band = band(call.is_causal, call.window, call.bottom_right, Lq, Lk)
    plan.softcap = call.softcap or 0.0
    plan.row_bands = call.row_bands
    if not backend.kernels:
        return plan
    plan.softcap_kind = softcap_kind(plan.softcap, q.dtype, q.device, backend.interpreted())
    if call.sinks is not None:
        plan.sinks = call.sinks.float().view(1, H, 1).expand(B, H, Lq)
    if plan.row_bands is None and plan.band is not None and Lq + plan.band[1] < Lk:
        # No row sees a key past Lq - 1 + band[1] (top-left causal: Lq - 1).
        # Dropping them (views) keeps split launches from planning work for them.
        Lk = max(1, Lq + plan.band[1])
        plan.key, plan.value = k[:, :, :Lk], v[:, :, :Lk]
    # Dropout's mask is counted by (head, row): packed rows would change it.
    # (Sinks are per query head: packed rows would mix them.)
    # (Per-row bands, packed sequences, are indexed by row: packing would shift them.)
    # (A running output is laid out by query head and row.)
    unpackable = plan.dropout or plan.sinks is not None or plan.row_bands is not None or resume is not None
    packed = None if unpackable else pack_gqa(q, H_kv, mask, plan.band is not None)
    if packed is not None and not within_offsets(backend, *packed):
        packed = None  # a packed head's rows would pass the 32-bit offsets within a head
    if packed is not None:
        # Each group's query heads as rows of one K/V head (views both ways).
        plan.query, plan.attn_mask = packed
        plan.group = 1
    plan.block_d, plan.block_dv = padded_head_dim(D), padded_head_dim(Dv)
    plan.dot_precision = dot_precision(q.dtype)
    _plan_launch(plan, backend, resume)
    return plan


def _plan_launch(plan: ForwardPlan, backend, resume=None) -> None:
    """The rest of :func:`make_forward`, from the kernels' views on: the config, the row
    blocks, the key splits and the buffers. (What :func:`rebind_forward` does again for
    another length of the keys.)"""
    q = plan.query
    B, Hp, Lqp, _ = q.shape
    Lk, Dv = plan.key.shape[2], plan.value.shape[3]
    interpreted = backend.interpreted()
    config = plan.config = backend.configs.lookup(
        max(plan.block_d, plan.block_dv), q.dtype, plan.is_causal, Lqp, Lk, interpreted)
    plan.m_blocks = -(-Lqp // config.block_m)  # (triton.cdiv costs ~2 µs a call on the host)
    plan.num_splits, plan.blocks_per_split = plan_splits(plan.m_blocks * B * Hp, Lk, config.block_n, q.device,
                                                         config.block_m)
    plan.config = config = shallow_stages(config, plan.m_blocks * B * Hp, plan.num_splits, q.device,
                                          max(plan.block_d, plan.block_dv))
    if plan.row_bands is not None:  # packed sequences: each row block sees its own few
        plan.num_splits, plan.blocks_per_split = 1, -(-Lk // config.block_n)
    if resume is not None:  # one program per row block folds all of its keys in: no split
        plan.out, plan.lse = resume
        plan.with_lse = plan.resume = True
        plan.num_splits, plan.blocks_per_split = 1, -(-Lk // config.block_n)
    if plan.num_splits > 1 and not partials_fit(backend, (B, Hp, Lqp), plan.num_splits, Dv):
        plan.num_splits, plan.blocks_per_split = 1, -(-Lk // config.block_n)
    rows = B * Hp * Lqp
    plan.merge = plan_merge(rows, plan.num_splits, interpreted, plan.block_dv) if plan.num_splits > 1 else None
    kv_bytes = plan.key.numel() * plan.key.element_size() + plan.value.numel() * plan.value.element_size()
    plan.kernel_merge = kernel_merges(plan.num_splits, config.block_m, kv_bytes)
    _allocate_outputs(plan, q.dtype, q.device)


def _allocate_outputs(plan: ForwardPlan, dtype: torch.dtype, device) -> None:
    """The buffers a forward launch writes that the plan does not hold yet: the output,
    the log-sum-exp (when asked for) and a split's partials."""
    B, Hp, Lqp, _ = plan.query.shape
    Dv = plan.value.shape[3]
    alloc = allocator()
    if plan.out is None:
        plan.out = alloc((B, Hp, Lqp, Dv), dtype, device)
    if plan.with_lse and plan.lse is None:
        plan.lse = alloc((B, Hp, Lqp), torch.float32, device)
    if plan.num_splits > 1:
        plan.o_part, plan.lse_part = partials((B, Hp, Lqp), plan.num_splits, Dv, device)


# -- plans reused: a loop of calls with one layout ------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ForwardTemplate:
    """A planned forward call with its tensors taken out: every decision :func:`make_forward`
    made (config, splits, packing, the keys dropped), which depend only on the call's
    arguments and its tensors' shapes, strides, dtypes and device, never on their data
    or addresses. :func:`rebind_forward` plans another call of that layout from it."""

    fields: tuple  # the plan's fields in order (ForwardPlan(*fields)), query, key, value and the outputs None
    query_view: tuple[int, ...] | None  # the packed query's shape, or None (not packed)
    key_length: int | None  # the keys kept (causal calls drop those no row sees), or None (all)
    # the backend's launch bound to this exact layout (bind_launch), once made; False: none can be
    bound: list = dataclasses.field(default_factory=lambda: [None])
    # (config, splits, blocks per split where split) -> the backend's launch bound to this layout
    # less the keys' length and strides (a growing cache: launch_growing), or False
    growing: dict = dataclasses.field(default_factory=dict)
    # the last of those launches (launch_growing): (length key, block_n, key blocks, blocks per
    # split, BoundLaunch), what later keys that plan alike launch again (launch_grown)
    grown: list = dataclasses.field(default_factory=lambda: [None])


@dataclasses.dataclass(frozen=True, slots=True)
class BoundLaunch:
    """A template's launch bound to its exact layout (the backend's ``bind_forward``): what a
    later call of that layout needs to allocate its outputs and launch, and nothing else."""

    launch: object  # the backend's, called with (query, key, value, out, lse, o_part, lse_part)
    device: torch.device
    dtype: torch.dtype
    out_shape: tuple[int, ...]  # (B, Hp, Lqp, Dv), the kernel's view of the output
    shape: tuple[int, ...]  # (B, H, Lq, Dv), the caller's
    with_lse: bool
    num_splits: int
    interpreted: bool  # the kernels run under Triton's interpreter (common.ops quiets NumPy's warnings)


def bind_launch(plan: ForwardPlan, backend) -> BoundLaunch | None:
    """Bind ``plan`` (rebound from a template, just launched) to its layout through the backend's
    ``bind_forward``; None where the backend has none or cannot bind this launch."""
    bind = getattr(backend.load(), "bind_forward", None)
    launch = bind(plan) if bind is not None else None
    return _bound(launch, plan, backend) if launch is not None else None


def _bound(launch, plan: ForwardPlan, backend) -> BoundLaunch:
    """``launch`` (the backend's) with what :func:`launch_bound` needs of ``plan``'s layout."""
    return BoundLaunch(launch, plan.query.device, plan.query.dtype, tuple(plan.out.shape), plan.shape,
                       plan.with_lse, plan.num_splits, backend.interpreted())


def partials_fit(backend, rows_shape: tuple, num_splits: int, dv: int) -> bool:
    """Whether ``backend`` indexes a split launch's partials (``common.outputs.partials``: (*rows_shape,
    splits, Dv) and (*rows_shape, splits)) and its merge's (rows, ...) views: every backend with
    64-bit offsets; one without where a head's part (rows x splits x Dv) and the merge's
    log-sum-exp, one dimension of every row, stay under OFFSET_LIMIT elements."""
    B, H, L = rows_shape
    return backend.supports(OFFSETS64) or (L * num_splits * dv < OFFSET_LIMIT and B * H * L < OFFSET_LIMIT)


def launch_growing(template: ForwardTemplate, plan: ForwardPlan, backend) -> bool:
    """Launch ``plan`` (rebound from ``template`` for keys of another length and strides, its
    outputs allocated) through the launch bound to its config, split count and own-merge choice
    (the blocks per split are a per-call argument of the Triton kernel, and NineToothed's
    derives them from the keys' length); where
    none is yet, launch it through the backend and bind that launch (the backend's
    ``bind_forward(plan, keys=True)``, which may read what was just launched). False where the
    backend binds none for it: the caller launches the plan itself. The bound launch is kept
    as the template's ``grown``, for :func:`launch_grown`."""
    # (the own-merge choice too: it follows the keys' bytes, not only the split count;
    # NineToothed's keys past 2^31 elements never come here: common.dispatch._keys_fit)
    key = (plan.config, plan.num_splits, plan.kernel_merge)
    bound = template.growing.get(key)
    if bound is False:
        return False
    if bound is None:
        from common.launch import recorded_launches  # (not at import: importing common imports no triton)

        module = backend.load()
        bind = getattr(module, "bind_forward", None)
        with recorded_launches():
            module.forward(plan)
            bound = bind(plan, keys=True) if bind is not None else None
        if len(template.growing) >= 64:
            template.growing.clear()
        template.growing[key] = bound or False
        if not bound:
            return True  # launched; later calls of this key launch their plans themselves
    else:
        bound.launch_plan(plan)
    Lk, block_n = plan.key.shape[2], plan.config.block_n
    template.grown[0] = (length_key(Lk), block_n, -(-Lk // block_n), plan.blocks_per_split,
                         _bound(bound, plan, backend))
    return True


def launch_grown(grown: tuple, query, key, value):
    """``(out, lse)`` of a call laid out as a template whose last growing launch was ``grown``
    (its ``grown[0]``, see :func:`launch_growing`), keys of any length and strides: launched
    again with this call's keys where they lead :func:`_plan_launch` to the same decisions
    (the config depends on the keys' length through ``configs.length_key`` alone, the split
    count and blocks per split on the number of key blocks); None where they do not (the
    caller plans the keys again), or where :func:`launch_bound` cannot run."""
    length, block_n, k_blocks, blocks_per_split, bound = grown
    Lk = key.shape[2]
    if length_key(Lk) != length or -(-Lk // block_n) != k_blocks:
        return None
    return launch_bound(bound, query, key, value, blocks_per_split)


def launch_bound(bound: BoundLaunch, query, key, value, blocks_per_split: int | None = None):
    """``(out, lse)`` of a call laid out as ``bound``'s template (4-D tensors), in the caller's
    shape: its outputs allocated, one launch (``blocks_per_split``: a growing launch's, whose
    keys may differ in length and strides: the backend's ``launch_keys`` fills them in).
    None where the launch cannot run here (another current GPU than the template's: the full
    path switches to it)."""
    device = bound.device
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        return None
    # The kernels' views are not made: a bound launch takes from a tensor only its address
    # (its sizes and strides are bound, but a growing cache's keys', which are not viewed), and
    # the packed query, the keys cut to those a causal row sees and the outputs in the packed
    # shape start where the caller's tensors do (contiguous outputs: the same bytes either way).
    alloc = allocator()
    out = alloc(bound.shape, bound.dtype, device)
    lse = alloc(bound.shape[:3], torch.float32, device) if bound.with_lse else None
    o_part = lse_part = None
    if bound.num_splits > 1:
        o_part, lse_part = partials(bound.out_shape[:3], bound.num_splits, bound.out_shape[3], device)
    tensors = (query, key, value, out, lse, o_part, lse_part)
    if blocks_per_split is None:
        bound.launch(tensors)
    else:
        bound.launch.launch_keys(tensors, blocks_per_split)
    return out, lse


def reuse_key():
    """What, besides a call's arguments and layout, :func:`make_forward` decides by: the
    switches of this module and of the config tables (tests, ``tune`` and the probes set
    them)."""
    return (_forced_splits.get(), configs_override(), PROGRAMS_PER_SM, PROGRAMS_PER_SM_WIDE, MIN_SPLIT_KEYS,
            PACK_MAX_LQ, KERNEL_MERGE_MAX, KERNEL_MERGE_MIN_BYTES, MERGE_SPLITS,
            ONE_STAGE_SPLIT_ROWS)


def tensorless_fields(plan) -> list:
    """A plan's fields in order (any plan dataclass), each tensor replaced by None: what a
    template of the plan keeps (common.paged's plans too)."""
    return [None if isinstance(value, torch.Tensor) else value
            for value in (getattr(plan, f.name) for f in dataclasses.fields(plan))]


MAX_TEMPLATES = 1024  # layouts a cache of templates keeps before it starts over


def remember(cache: dict, layout, template) -> None:
    """``cache[layout] = template``, the cache started over once it holds MAX_TEMPLATES."""
    if len(cache) >= MAX_TEMPLATES:
        cache.clear()
    cache[layout] = template


def template_of(plan: ForwardPlan, call) -> ForwardTemplate:
    """The template of a plan made by :func:`make_forward` for ``call`` (no mask, dropout, sinks,
    packed sequences or running result: those hold tensors of their own)."""
    assert plan.attn_mask is None and plan.seed is None and plan.sinks is None and plan.row_bands is None
    assert not plan.resume
    query_view = tuple(plan.query.shape) if plan.query.shape != call.query.shape else None
    key_length = plan.key.shape[2] if plan.key.shape[2] != call.key.shape[2] else None
    return ForwardTemplate(tuple(tensorless_fields(plan)), query_view, key_length)


def rebind_forward(template: ForwardTemplate, query, key, value, backend=None) -> ForwardPlan:
    """The plan of a call whose arguments, and whose tensors' shapes, strides, dtypes and
    device, are those ``template`` was made from: the same decisions, these tensors, fresh
    outputs (what :func:`make_forward` would plan, without planning again).

    With ``backend``, the keys may differ in length and strides (a decode loop's growing
    cache; calls that drop no keys, i.e. ``template.key_length`` None): the config, the
    splits and the buffers are planned again for them (:func:`_plan_launch`)."""
    plan = ForwardPlan(*template.fields)  # (a copy, at a fraction of copy.copy's cost)
    plan.query = query if template.query_view is None else query.view(template.query_view)
    if backend is not None:
        assert template.key_length is None
        plan.key, plan.value = key, value
        _plan_launch(plan, backend)
        return plan
    if template.key_length is not None:
        key, value = key[:, :, :template.key_length], value[:, :, :template.key_length]
    plan.key, plan.value = key, value
    _allocate_outputs(plan, query.dtype, query.device)
    return plan


def make_backward(call, backend, out, lse, grad_out, grad_lse=None) -> BackwardPlan:
    """Plan the backward pass of a validated call with at least one query row and one key."""
    q, k, v, mask = call.query, call.key, call.value, call.attn_mask
    B, H, Lq, D = q.shape
    Lk, Dv = k.shape[2], v.shape[3]
    plan = BackwardPlan(q, k, v, mask, mask_kind(mask), call.scale, call.is_causal, H // k.shape[1],
                        out, lse, grad_out, grad_lse, call.dropout_p, dropout_scale(call.dropout_p),
                        call.dropout_seed)
    plan.band = band(call.is_causal, call.window, call.bottom_right, Lq, Lk)
    plan.softcap = call.softcap or 0.0
    plan.row_bands = call.row_bands
    if not backend.kernels:
        return plan
    plan.softcap_kind = softcap_kind(plan.softcap, q.dtype, q.device, backend.interpreted())
    plan.block_d, plan.block_dv = padded_head_dim(D), padded_head_dim(Dv)
    plan.config = backend.configs.lookup_backward(
        max(plan.block_d, plan.block_dv), q.dtype, call.is_causal, Lq, Lk, backend.interpreted())
    plan.dot_precision = dot_precision(q.dtype)
    alloc = allocator()
    plan.delta = alloc((B, H, Lq), torch.float32, q.device)
    plan.grad_query = alloc(q.shape, q.dtype, q.device)
    plan.grad_key = alloc(k.shape, k.dtype, k.device)
    plan.grad_value = alloc(v.shape, v.dtype, v.device)
    return plan


# -- short queries: grouped-query packing and split keys ------------------------------

_forced_splits: contextvars.ContextVar[int | None] = contextvars.ContextVar("forced_splits", default=None)


@contextlib.contextmanager
def force_splits(num_splits: int):
    """Inside the block, split the keys of every call into ``num_splits`` ranges
    (at most one per key block) whatever the heuristic says; 1 turns splitting off.
    For tests and benchmarks."""
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    token = _forced_splits.set(num_splits)
    try:
        yield
    finally:
        _forced_splits.reset(token)


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_splits(programs: int, Lk: int, block_n: int, device: torch.device, block_m: int = 16) -> tuple[int, int]:
    """``(num_splits, blocks_per_split)`` for a launch of ``programs`` programs per split
    of ``block_m`` rows each.

    Splits only when the unsplit launch leaves the GPU short of programs. The
    split count is that of splits of a power of two of key blocks (as many as the
    GPU wants, rounded down), and ``blocks_per_split`` is ceil(k_blocks / num_splits):
    what NineToothed's arrangement derives from the keys' length and the split count
    (one compiled kernel for every split size). Every split
    holds at least one key block, and ceil(k_blocks / blocks_per_split) == num_splits.
    ``num_splits == 1`` means one program walks all the keys.
    """
    # Every key block counts (causal calls have already dropped the keys past
    # Lq - 1 that no row sees).
    k_blocks = -(-Lk // block_n)
    wanted = _forced_splits.get()
    if wanted is None:
        # (the interpreter has no SMs: its pretended ones take PROGRAMS_PER_SM, so that
        # the CPU suite splits wide rows as well)
        wide = block_m >= WIDE_ROWS and device.type == "cuda"
        target = (PROGRAMS_PER_SM_WIDE if wide else PROGRAMS_PER_SM) * _sm_count(device)
        if programs >= target // 2 or k_blocks * block_n < MIN_SPLIT_KEYS:
            return 1, k_blocks
        wanted = min(-(-target // programs), k_blocks // 2)
    if wanted <= 1:
        return 1, k_blocks
    wanted = min(wanted, MAX_GRID_AXIS)
    power = next_power_of_2(-(-k_blocks // min(wanted, k_blocks)))
    num_splits = -(-k_blocks // power)
    return num_splits, -(-k_blocks // num_splits)


def one_stage_split(block_m: int) -> bool:
    """A split launch of ``block_m``-row tiles at the derived size walks its key blocks in one
    masked loop in NineToothed's kernel (ONE_STAGE_SPLIT_ROWS: a warpgroup MMA's rows)."""
    return block_m >= ONE_STAGE_SPLIT_ROWS


def shallow_stages(config: Config, programs: int, num_splits: int, device: torch.device, block_d: int) -> Config:
    """``config`` with 2 pipeline stages and at most SHALLOW_MAX_REGISTERS registers a thread
    where an unsplit launch of ``programs`` short-row programs (at most SHALLOW_ROWS rows) has
    more than SHALLOW_PROGRAMS_PER_SM of them per SM (more programs resident, each with fewer
    key blocks in flight) at a padded head dim ``block_d`` up to SHALLOW_MAX_HEAD_DIM, else
    ``config`` itself; a forced config (:func:`common.configs.override`) is kept as it is.
    Whether it applies does not change as a decode loop's cache grows: such a launch is never
    split."""
    if (num_splits == 1 and config.block_m <= SHALLOW_ROWS and config.num_stages > 2
            and block_d <= SHALLOW_MAX_HEAD_DIM and configs_override() is None
            and device.type == "cuda" and programs > SHALLOW_PROGRAMS_PER_SM * _sm_count(device)):
        return dataclasses.replace(config, num_stages=2, maxnreg=SHALLOW_MAX_REGISTERS)
    return config


def pack_gqa(query, H_kv: int, attn_mask, banded: bool):
    """``(query, attn_mask)`` with each group's query heads packed into rows, or None.

    query (B, H, Lq, D) with H = GROUP·H_kv becomes (B, H_kv, GROUP·Lq, D):
    row g·Lq + i of K/V head j is row i of query head j·GROUP + g. A view,
    so it exists only where the strides allow (always for Lq = 1 or a
    contiguous query); the mask likewise. An output (B, H_kv, GROUP·Lq, Dv)
    computed from it is, contiguous, the output (B, H, Lq, Dv). Causal and
    windowed calls are not packed (a packed row's position is no longer its row index).
    """
    B, H, Lq, D = query.shape
    if H_kv == H or banded or Lq > PACK_MAX_LQ:
        return None
    group = H // H_kv
    try:
        packed_query = query.view(B, H_kv, group * Lq, D)
        packed_mask = None if attn_mask is None else attn_mask.view(B, H_kv, group * Lq, attn_mask.shape[3])
    except RuntimeError:  # strides that no view can merge
        return None
    return packed_query, packed_mask


def kernel_merges(num_splits: int, block_m: int, kv_bytes: int) -> bool:
    """Whether the Triton kernel merges its own ``num_splits`` splits of ``block_m``-row blocks
    reading ``kv_bytes`` of keys and values (KERNEL_MERGE_MAX, KERNEL_MERGE_MIN_BYTES), or a
    merge launch does."""
    return num_splits > 1 and (num_splits * block_m <= KERNEL_MERGE_MAX or kv_bytes < KERNEL_MERGE_MIN_BYTES)


def merge_splits(num_splits: int, interpreted: bool) -> int:
    """The splits a merge of ``num_splits`` splits takes a step (MERGE_SPLITS)."""
    return min(MERGE_SPLITS, next_power_of_2(num_splits)) if interpreted else MERGE_SPLITS


def plan_merge(rows: int, num_splits: int, interpreted: bool, block_dv: int) -> Merge:
    """The merge of ``rows`` rows of ``num_splits`` splits (dense and paged plans alike): its
    splits a step (:func:`merge_splits`) and rows a program (:func:`combine_rows`)."""
    block_s = merge_splits(num_splits, interpreted)
    return Merge(rows, combine_rows(rows, interpreted, block_s, block_dv), block_s)


def combine_rows(rows: int, interpreted: bool, block_s: int, block_dv: int) -> int:
    """Rows per merge program for ``rows`` merged rows of ``block_s`` splits (a power of two)
    and ``block_dv`` values: COMBINE_ROWS, fewer where a program's (rows, block_s, block_dv)
    float32 tile would pass MERGE_TILE (registers), and fewer under the interpreter, where
    padding rows cost as much as real ones."""
    block_r = max(1, min(COMBINE_ROWS, MERGE_TILE // (block_s * block_dv)))
    return min(block_r, next_power_of_2(rows)) if interpreted else block_r

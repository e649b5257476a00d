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

A decision that one backend alone reads is that backend's: once the launch is
planned, its ``refine_forward`` (``common.backends.KernelBackendModule``) puts
it in ``plan.refinement``, a value of its own (Triton: whether its kernel merges
its own splits; NineToothed: whether a split walks its keys in one loop).

:func:`make_forward` plans a forward call, :func:`make_backward` a backward
one; both take a :class:`common.validation.Call`. The rules they follow are the
methods of a :class:`Planner`, whose fields are the rules' settings: a value a
test or a benchmark builds and plans with (:func:`use_planner`). A plan kept for
later calls of its layout is ``common.reuse``'s.

Short queries: with few query rows (decoding: Lq = 1 or a few speculative
tokens), one program per block of rows of one head starves the GPU twice
over: every query head of a grouped-query group re-reads the same K/V head,
and there are only B·H programs, each walking all of Lk on one SM.
``Planner.pack_gqa`` cures the first without touching a kernel (the GROUP query
heads that share a K/V head become GROUP·Lq rows of one head, a view);
``Planner.splits`` cures the second (the keys cut into ``num_splits`` ranges
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
import os

import torch

from common.backends import OFFSETS64
from common.configs import BackwardConfig, Config, next_power_of_2, padded_head_dim
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


class Widen(enum.IntEnum):
    """How the kernels take FP8 key or value tiles after loading them: their WIDEN_K, WIDEN_V (what
    they widen them to, or in which order an e4m3 product reads them). Never bfloat16: e4m3 -> float16
    is one conversion per pair of values on NVIDIA GPUs, -> bfloat16 several, and a memory-bound decode
    must not spend its time converting; a bfloat16 query is narrowed to float16 instead
    (``common.jit_helpers._narrow_query``)."""

    NONE = 0  # kept in e4m3: an FP8 product on the tensor cores
    FLOAT16 = 1
    # float16, values stored row-major (keys a row apart): widened before the P·V product's transpose
    # (common.jit_helpers._keep_widened), which would otherwise move e4m3 bytes one by one
    FLOAT16_ROWS = 2
    # kept in e4m3, the values copied with each group of PV_GROUP keys in the P·V order (pv_position):
    # the kernels put P's columns in that order too (common.jit_helpers._p_operand)
    PV_ORDER = 3


# The e4m3 P·V order. A warp-group MMA (and mma.sync) hands each thread, of the PV_GROUP score columns
# of a row that one 8-bit A operand's k step spans, the columns 8a + 2t + b (a = 0..3, b = 0..1, t the
# thread's index in its quad); the next product's 8-bit A operand wants 4 consecutive columns a register:
# 16h + 4t + c. P rounded to e4m3 moves from one layout to the other only through shuffles between threads
# (benchmarks/NOTES.md counts them). Numbering the keys of each group so that
# the thread's own columns come out in the operand's order, column 16a1 + 8a0 + 4t1 + 2t0 + b of a group
# (a = 2a1 + a0, t = 2t1 + t0) becomes column 16a1 + 8t1 + 4t0 + 2a0 + b, changes nothing but that
# exchange (P V sums over keys in any order); the values are copied in the same order.
PV_GROUP = 32


def pv_position(key):
    """Where key ``key`` (an int or an integer tensor) sits in the P·V order: the same group of
    PV_GROUP, bits 1-3 of its index in the group rotated (bit 3 to bit 1, bits 1-2 up one)."""
    return (key & ~0b01110) | ((key & 0b00110) << 1) | ((key & 0b01000) >> 2)


# CUDA's limit on grid axes 1 and 2 (the split index's axis in the Triton kernel).
MAX_GRID_AXIS = 65535
# Under the interpreter there are no SMs; pretend there are a few, so that the
# CPU suite meets split launches on small decode-like shapes.
INTERPRETER_SMS = 2


@dataclasses.dataclass(frozen=True)
class Planner:
    """The settings the planning rules decide by: a value, so that a test, ``tune`` or a probe
    plans with other settings by building one and entering :func:`use_planner`, never by
    patching this module. Each rule is a method that states itself in its docstring; the
    measurements behind the defaults are in benchmarks/NOTES.md ("The planner's settings")."""

    # Split a launch with fewer programs than SMs into enough splits for about this many
    # programs per SM (a decode program streams memory; more than one per SM hides latency)...
    programs_per_sm: int = 2
    # ...or this many for programs of at least wide_rows rows (more products per key read).
    programs_per_sm_wide: int = 1
    wide_rows: int = 64
    # Split only where each program would otherwise walk at least this many keys: below it
    # the merge costs more than the split saves.
    min_split_keys: int = 2048
    # Pack grouped-query heads into rows only for queries this short: longer ones already
    # fill a program with rows of one head.
    pack_max_lq: int = 64
    # The merge walks a row's splits this many at a time, so that every split count of a
    # growing cache shares one compiled merge; its rows per program keep a program's float32
    # tile (rows x splits x Dv) within merge_tile elements, at most combine_rows rows.
    merge_splits: int = 8
    merge_tile: int = 8192
    combine_rows: int = 16
    # Settings of one backend's refinement alone (its ``refine_forward``, ``refine_paged``):
    # Triton's kernel merges its own splits while splits x BLOCK_M is at most kernel_merge_max,
    # or while the keys and values read are under kernel_merge_min_bytes
    # (``impl_triton.attention.kernel_merges``)...
    kernel_merge_max: int = 256
    kernel_merge_min_bytes: int = 192 << 20
    # ...NineToothed walks a split of tiles this tall in one masked loop
    # (``impl_ninetoothed.attention.one_stage_split``).
    one_stage_split_rows: int = 64
    # An unsplit launch of more than shallow_programs_per_sm short-row programs (at most
    # shallow_rows rows, head dims up to shallow_max_head_dim) per SM pipelines 2 key blocks
    # and caps registers, so that more programs share an SM (decoding at a large batch).
    shallow_programs_per_sm: int = 2
    shallow_rows: int = 16
    shallow_max_head_dim: int = 128
    shallow_max_registers: int = 128
    # Fixed choices, for tests and benchmarks: the split count of every call (1: none), the SM
    # count to plan for (None: the device's), and whether the GPU has tanh.approx.f32 (None: ask
    # the device; see softcap_kind).
    num_splits: int | None = None
    sms: int | None = None
    tanh_approx: bool | None = None
    # FP8 query, keys and values: the P·V product in e4m3 (the probabilities rounded to e4m3, as
    # FlashAttention-3 does: the tensor cores' FP8 rate), or, False, with the values widened to
    # float16 and the probabilities kept in float16 (2^-11 relative rounding instead of 2^-4).
    fp8_pv: bool = True
    # FP8 values in an e4m3 P·V product are read by the tensor cores along the keys: row-major
    # (each key's Dv contiguous) the kernels transpose every tile in shared memory. From
    # fp8_v_columns_rows query rows per K/V head on, the plan copies V to column-major (keys
    # contiguous) first: one pass over V, which that many rows' products outweigh.
    fp8_v_columns_rows: int = 256

    def __post_init__(self):
        if self.num_splits is not None and (type(self.num_splits) is not int or self.num_splits < 1):
            raise ValueError(f"num_splits must be a positive int or None, got {self.num_splits!r}")

    def sm_count(self, device: torch.device) -> int:
        return self.sms if self.sms is not None else _sm_count(device)

    def softcap_kind(self, softcap: float, dtype: torch.dtype, device: torch.device, interpreted: bool) -> Softcap:
        """Soft-capping's tanh for these inputs. tanh.approx.f32's relative error (about
        2^-11) is below what 16-bit inputs and probabilities carry, and it halves the
        special-function work per score (that unit bounds the soft-capped kernel); float32
        inputs keep the exact form, as does every target without the instruction."""
        if not softcap:
            return Softcap.OFF
        if interpreted or dtype == torch.float32 or device.type != "cuda":
            return Softcap.EXP2
        approx = self.tanh_approx
        if approx is None:
            approx = _has_tanh_approx(device)
        return Softcap.APPROX if approx else Softcap.EXP2

    def splits(self, programs: int, Lk: int, block_n: int, device: torch.device, block_m: int = 16) -> tuple[int, int]:
        """``(num_splits, blocks_per_split)`` for a launch of ``programs`` programs per split of
        ``block_m`` rows each: split only when the unsplit launch leaves the GPU short of
        programs. Splits hold a power of two of key blocks each, ``blocks_per_split =
        ceil(k_blocks / num_splits)`` (what NineToothed's arrangement derives from the keys'
        length and the split count: one compiled kernel for every split size), every split
        at least one block. E.g. 64 programs, 128 SMs, 256 key blocks of 64: 4 splits of 64."""
        k_blocks = -(-Lk // block_n)  # (causal calls have dropped the keys no row sees)
        wanted = self.num_splits
        if wanted is None:
            # (the interpreter's pretended SMs take programs_per_sm, so that the CPU suite splits wide rows too)
            wide = block_m >= self.wide_rows and device.type == "cuda"
            target = (self.programs_per_sm_wide if wide else self.programs_per_sm) * self.sm_count(device)
            if programs >= target // 2 or k_blocks * block_n < self.min_split_keys:
                return 1, k_blocks
            wanted = min(-(-target // programs), k_blocks // 2)
        if wanted <= 1:
            return 1, k_blocks
        wanted = min(wanted, MAX_GRID_AXIS)
        power = next_power_of_2(-(-k_blocks // min(wanted, k_blocks)))
        num_splits = -(-k_blocks // power)
        return num_splits, -(-k_blocks // num_splits)

    def shallow_stages(self, config: Config, programs: int, num_splits: int, device: torch.device,
                       block_d: int) -> Config:
        """``config`` with 2 stages and a register cap where an unsplit launch of ``programs``
        short-row programs oversubscribes the SMs (see the settings), else ``config`` itself;
        a forced config (:func:`common.configs.override`) is kept. A growing cache never
        changes the answer: such a launch is never split."""
        if (num_splits == 1 and config.block_m <= self.shallow_rows and config.num_stages > 2
                and block_d <= self.shallow_max_head_dim and configs_override() is None
                and device.type == "cuda" and programs > self.shallow_programs_per_sm * self.sm_count(device)):
            return dataclasses.replace(config, num_stages=2, maxnreg=self.shallow_max_registers)
        return config

    def fp8_columns(self, value: torch.Tensor, rows: int) -> bool:
        """Whether FP8 values (B, H_kv, Lk, Dv) for an e4m3 P·V product read by ``rows`` query
        rows per K/V head are copied column-major first: where that many rows pay for the copy
        (see fp8_v_columns_rows) and they are not column-major already."""
        return value.dtype == torch.float8_e4m3fn and rows >= self.fp8_v_columns_rows and value.stride(2) != 1

    def pack_gqa(self, query, H_kv: int, attn_mask, banded: bool):
        """``(query, attn_mask)`` with each group's query heads packed into rows, or None.

        query (B, H, Lq, D) with H = GROUP·H_kv becomes (B, H_kv, GROUP·Lq, D): row g·Lq + i
        of K/V head j is row i of query head j·GROUP + g. A view, so it exists only where the
        strides allow (always for Lq = 1 or a contiguous query); the mask likewise. An output
        (B, H_kv, GROUP·Lq, Dv) computed from it is, contiguous, the output (B, H, Lq, Dv).
        Banded calls are not packed (a packed row's position is no longer its row index)."""
        B, H, Lq, D = query.shape
        if H_kv == H or banded or Lq > self.pack_max_lq:
            return None
        group = H // H_kv
        try:
            packed_query = query.view(B, H_kv, group * Lq, D)
            packed_mask = None if attn_mask is None else attn_mask.view(B, H_kv, group * Lq, attn_mask.shape[3])
        except RuntimeError:  # strides that no view can merge
            return None
        return packed_query, packed_mask

    def merge(self, rows: int, num_splits: int, interpreted: bool, block_dv: int) -> Merge:
        """The merge of ``rows`` rows of ``num_splits`` splits (dense and paged plans alike).
        Under the interpreter, where a padded split or row costs as much as a real one, at most
        the count's own power of two of splits a step and of rows a program."""
        block_s = min(self.merge_splits, next_power_of_2(num_splits)) if interpreted else self.merge_splits
        block_r = max(1, min(self.combine_rows, self.merge_tile // (block_s * block_dv)))
        if interpreted:
            block_r = min(block_r, next_power_of_2(rows))
        return Merge(rows, block_r, block_s)


DEFAULT_PLANNER = Planner()
_planner: contextvars.ContextVar[Planner] = contextvars.ContextVar("planner", default=DEFAULT_PLANNER)


def current_planner() -> Planner:
    """The planner of this thread's calls: :data:`DEFAULT_PLANNER` outside :func:`use_planner`."""
    return _planner.get()


@contextlib.contextmanager
def use_planner(planner: Planner):
    """Inside the block, this thread's calls are planned with ``planner`` (plans made outside
    it are not reused inside it, nor the other way round). For tests, ``tune`` and probes."""
    if not isinstance(planner, Planner):
        raise TypeError(f"planner must be a common.plan.Planner, got {type(planner).__name__}")
    token = _planner.set(planner)
    try:
        yield
    finally:
        _planner.reset(token)


def force_splits(num_splits: int):
    """Inside the block, split the keys of every call into ``num_splits`` ranges (at most one per
    key block) whatever the rule says; 1 turns splitting off. For tests and benchmarks."""
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    return use_planner(dataclasses.replace(current_planner(), num_splits=num_splits))


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


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
    sinks: torch.Tensor | None = None  # float32 (H,) sink logits per row as the query's: (B, H, Lq) or packed
    row_bands: torch.Tensor | None = None  # per-row bands instead of band (common.varlen.row_bands)
    # ALiBi per row as the kernels' rows: float32 (B, H, Lq) slopes (views where they can be) and
    # int32 (Lq,) position shifts, row i at position i + alibi_shift[i]
    alibi: torch.Tensor | None = None
    alibi_shift: torch.Tensor | None = None
    # FP8 inputs: (q, k, v) descales, float32 (B, H_kv) (views; None for 1), read per K/V head,
    # or (B, H, Lq) per query head and row (packed sequences, each row its sequence's: see
    # descale_kind); None: no FP8 input. The kernels take FP8 key and value tiles as widen_k, widen_v say.
    descales: tuple | None = None
    widen_k: Widen = Widen.NONE
    widen_v: Widen = Widen.NONE
    out_dtype: torch.dtype | None = None  # the output's dtype (None: the query's)
    # Kernel backends only (None for "torch"):
    config: Config | None = None
    block_d: int = 0  # head dims padded by configs.padded_head_dim (zeros fill the pad)
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
    # The backend's own decisions for this launch (a hashable value of its own, set by its
    # refine_forward: common.backends.KernelBackendModule); part of the reuse key. None for "torch".
    refinement: object = None
    resume: bool = False  # out (float32) and lse hold a running result that these keys fold into
    planner: Planner = None  # the settings it was planned with (DEFAULT_PLANNER unless a caller chose)

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
    def descale_kind(self) -> int:
        """The kernels' DESCALE: 0 (no FP8 input), 1 (a descale per batch and K/V head),
        DESCALE_ROWS (per query head and row)."""
        if self.descales is None:
            return 0
        return DESCALE_ROWS if self.descales[0].ndim == 3 else 1

    @property
    def negative_scale(self) -> bool:
        """The kernels' NEGATIVE_SCALE: the scores' scale is negative, a constant. Never with FP8
        inputs, whose scale holds descales of a sign the kernels read on the GPU."""
        return self.scale < 0 and self.descales is None

    @property
    def kernel_lse(self) -> bool:
        """Whether the attention kernel writes log-sum-exps (the merge needs them too)."""
        return self.with_lse or self.num_splits > 1

    # the tensors a bound forward launch takes, in this order (common.reuse.BoundLaunch; the backends'
    # bind_forward): the descales are an FP8 call's, None without FP8 inputs; the mask a masked call's
    # (the kernels' view of it starts where the caller's mask does), None without one
    ROLES = ("query", "key", "value", "out", "lse", "o_part", "lse_part", "q_descale", "k_descale", "v_descale",
             "attn_mask")

    def tensors(self) -> tuple:
        """The plan's tensors in :attr:`ROLES` order (None for those it has not)."""
        descales = self.descales if self.descales is not None else (None, None, None)
        return (self.query, self.key, self.value, self.out, self.lse, self.o_part, self.lse_part, *descales,
                self.attn_mask)

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
    alibi: torch.Tensor | None = None  # as the forward's
    alibi_shift: torch.Tensor | None = None
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
    # the gradients must be bitwise reproducible: the call asked it, or torch.use_deterministic_algorithms
    deterministic: bool = False

    # the tensors a bound backward launch takes, in this order (common.reuse.KeptBackward; the
    # backends' bind_backward)
    ROLES = ("query", "key", "value", "out", "grad_out", "lse", "grad_lse", "delta", "grad_query", "grad_key",
             "grad_value")

    @property
    def dropout(self) -> bool:
        return self.dropout_p > 0.0

    banded = ForwardPlan.banded

    def tensors(self) -> tuple:
        """The plan's tensors in :attr:`ROLES` order (grad_lse None where there is none)."""
        return tuple([getattr(self, role) for role in self.ROLES])


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


@functools.lru_cache(maxsize=16)
def _has_tanh_approx(device: torch.device) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(device) >= (7, 5)


UNBOUNDED = 2**30  # a band edge no position reaches (lengths stay below it; int32 sums stay in range)
ROW_BANDS = 2  # BANDED for per-row bands: packed variable-length sequences (common.varlen)
DESCALE_ROWS = 2  # DESCALE for per-row descales: packed FP8 sequences (common.varlen)


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


def set_alibi(plan, call, Lq: int, Lk: int) -> None:
    """A plan's ALiBi fields from a call: each row's slope and position shift (the call's own
    per row, or the (B, H) slopes with the same shift for every row: Lk - Lq bottom-right,
    the keys' length before a causal plan drops the keys no row sees)."""
    if call.alibi_slopes is None:
        return
    if call.alibi_shifts is not None:
        plan.alibi, plan.alibi_shift = call.alibi_slopes, call.alibi_shifts
        return
    B, H = call.alibi_slopes.shape
    plan.alibi = call.alibi_slopes[:, :, None].expand(B, H, Lq)
    shift = Lk - Lq if call.bottom_right else 0
    plan.alibi_shift = torch.full((1,), shift, dtype=torch.int32, device=call.alibi_slopes.device).expand(Lq)


def packed_shifts(shifts: torch.Tensor, group: int) -> torch.Tensor:
    """Rows' position shifts (Lq,) for ``group`` heads packed into group * Lq rows: packed row
    g * Lq + i is row i (at position i + shifts[i]), so its shift is shifts[i] - g * Lq."""
    Lq = shifts.shape[0]
    offsets = torch.arange(group, device=shifts.device, dtype=torch.int32)[:, None] * Lq
    return (shifts[None, :] - offsets).flatten()


def alibi_bias(slopes: torch.Tensor, shifts: torch.Tensor, Lk: int) -> torch.Tensor:
    """ALiBi's bias as a float32 (B, H, Lq, Lk) tensor from each row's slope (B, H, Lq) and
    position shift (Lq,): -slope * |i + shift_i - j| (SDPA's mask, the reference)."""
    pos = torch.arange(shifts.shape[0], device=slopes.device)[:, None] + shifts[:, None]
    dist = (pos - torch.arange(Lk, device=slopes.device)[None, :]).abs().float()
    return -slopes.float()[..., None] * dist


def make_forward(call, backend, *, with_lse: bool, resume=None, allocate: bool = True) -> ForwardPlan:
    """Plan the forward pass of a validated call with at least one query row and one key,
    with the settings of :func:`current_planner`.

    ``resume``: None, or a running ``(out, lse)`` over other keys, float32 (B, H, Lq, Dv) and
    (B, H, Lq), any strides; the call folds its keys into them in place (kernel backends;
    see :func:`common.ops.forward_resume`). ``allocate``: False plans no output buffers
    (a plan kept for later calls: ``common.reuse``)."""
    q, k, v, mask = call.query, call.key, call.value, call.attn_mask
    B, H, Lq, D = q.shape
    H_kv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    plan = ForwardPlan(q, k, v, mask, mask_kind(mask), call.scale, call.is_causal, H // H_kv, (B, H, Lq, Dv),
                       with_lse, call.dropout_p, dropout_scale(call.dropout_p), call.dropout_seed)
    plan.band = band(call.is_causal, call.window, call.bottom_right, Lq, Lk)
    plan.softcap = call.softcap or 0.0
    plan.row_bands = call.row_bands
    set_alibi(plan, call, Lq, Lk)
    plan.planner = planner = current_planner()
    plan.out_dtype = call.out_dtype
    if call.descales is not None:
        set_fp8(plan, call, planner)
    if not backend.kernels:
        return plan
    plan.softcap_kind = planner.softcap_kind(plan.softcap, q.dtype, q.device, backend.interpreted())
    if call.sinks is not None:
        plan.sinks = call.sinks.float().view(1, H, 1).expand(B, H, Lq)
    if plan.row_bands is None and plan.band is not None and Lq + plan.band[1] < Lk:
        # No row sees a key past Lq - 1 + band[1] (top-left causal: Lq - 1).
        # Dropping them (views) keeps split launches from planning work for them.
        Lk = max(1, Lq + plan.band[1])
        plan.key, plan.value = k[:, :, :Lk], v[:, :, :Lk]
    if plan.descales is not None and plan.widen_v == Widen.NONE and planner.fp8_columns(plan.value, Lq * (H // H_kv)):
        pv_order = pv_order_fits(plan.value.shape[2])
        plan.value = value_columns(backend, plan.value, pv_order)
        if pv_order:
            plan.widen_v = Widen.PV_ORDER
    # Dropout's mask is counted by (head, row): packed rows would change it.
    # (Sinks are per row: packed, each row reads its own head's, packed_rows.)
    # (Per-row bands, packed sequences, are indexed by row: packing would shift them.)
    # (A running output is laid out by query head and row.) (ALiBi: each packed row its own slope
    # and shift.)
    unpackable = plan.dropout or plan.row_bands is not None or resume is not None or plan.descale_kind == DESCALE_ROWS
    packed = None if unpackable else planner.pack_gqa(q, H_kv, mask, plan.band is not None)
    if packed is not None and not within_offsets(backend, *packed):
        packed = None  # a packed head's rows would pass the 32-bit offsets within a head
    if packed is not None:
        # Each group's query heads as rows of one K/V head (views both ways).
        plan.query, plan.attn_mask = packed
        plan.group = 1
        plan.sinks, plan.alibi = (packed_rows(rows, plan.query) for rows in (plan.sinks, plan.alibi))
        if plan.alibi_shift is not None:
            plan.alibi_shift = packed_shifts(plan.alibi_shift, H // H_kv)
    block_d = padded_head_dim(D)
    if plan.descales is not None and plan.widen_k == Widen.NONE:
        block_d = max(block_d, 32)  # an e4m3 MMA sums 32 products at least (zeros pad the rest)
    plan.block_d, plan.block_dv = tile_widths(block_d, padded_head_dim(Dv), plan.query, plan.key, plan.value)
    plan.dot_precision = dot_precision(q.dtype)
    plan_launch(plan, backend, resume, allocate)
    return plan


def tile_widths(block_d: int, block_dv: int, *tensors) -> tuple[int, int]:
    """The query/key and value tiles' widths: as given (each head dim padded), or both the wider of
    the two where they differ and any of ``tensors`` (the launch's inputs) is read element by element:
    its start or a stride off 16-element units, as Triton specialises them. Compiled for sm_90
    (triton 3.6), key and value tiles of different widths both loaded that way returned wrong values
    or read out of bounds (benchmarks/NOTES.md); tiles of one width are right, and such inputs are
    already off the fast path."""
    if block_d != block_dv and not all(_aligned(t) for t in tensors if t is not None):
        block_d = block_dv = max(block_d, block_dv)
    return block_d, block_dv


def width_class(query, key, value, *more):
    """What of the tensors' addresses and strides ``tile_widths`` may read, for a kept plan's layout
    key: None where the widths cannot differ (padded head dims equal and at least 32, FP8's least),
    else whether every tensor is aligned as ``tile_widths`` asks."""
    block_d, block_dv = padded_head_dim(query.shape[-1]), padded_head_dim(value.shape[-1])
    if block_d == block_dv >= 32:
        return None
    return all(_aligned(t) for t in (query, key, value, *more) if t is not None)


def _aligned(t: torch.Tensor) -> bool:
    """Whether Triton sees ``t``'s start as 16-byte aligned and each stride but a unit one as a
    multiple of 16 (what lets it copy rows in 16-byte pieces)."""
    return t.data_ptr() % 16 == 0 and all(stride == 1 or stride % 16 == 0 for stride in t.stride())


def set_fp8(plan, call, planner: Planner) -> None:
    """A plan's FP8 fields from a call with FP8 inputs: the descales (a ones view for each one
    not given: the kernels read all three; per row where one given is, (B, H, Lq)), and what key
    and value tiles are widened to (to a 16-bit query, float16 (see Widen); values to float16
    where the planner keeps P·V out of e4m3)."""
    plan.descales = fp8_descales(call.descales, call.query, call.key)
    if call.query.dtype in (torch.float16, torch.bfloat16):  # FP8 keys and values under a 16-bit query
        plan.widen_k = plan.widen_v = Widen.FLOAT16
        if call.value.stride(-1) == 1:
            plan.widen_v = Widen.FLOAT16_ROWS
    elif not planner.fp8_pv:
        plan.widen_v = Widen.FLOAT16


def fp8_descales(descales, query, key) -> tuple:
    """The (q, k, v) descales the kernels read for a validated FP8 call's (each None or a tensor):
    the given ones, and for each one not given a ones view of the same shape ((B, H_kv), or per
    row (B, H, Lq) where one given is per row)."""
    per_row = any(d is not None and d.ndim == 3 for d in descales)
    shape = query.shape[:3] if per_row else key.shape[:2]
    one = _one(key.device)
    return tuple(d if d is not None else one.view((1,) * len(shape)).expand(shape) for d in descales)


def pv_order_fits(keys: int) -> bool:
    """Whether values of ``keys`` keys are copied in the P·V order (``Widen.PV_ORDER``): where the
    keys fill whole groups of PV_GROUP, so that the order moves no key past the last."""
    return keys % PV_GROUP == 0


def value_columns(backend, value: torch.Tensor, pv_order: bool = False) -> torch.Tensor:
    """``value`` (B, H_kv, Lk, Dv) copied column-major (each (batch, head)'s keys contiguous) by the
    backend's own kernel: one pass over the values, coalesced on both sides (a strided copy of
    bytes writes one a row). ``pv_order`` (Lk a multiple of PV_GROUP): the keys of each group in the
    P·V order, key l at row ``pv_position(l)``."""
    B, H_kv, Lk, Dv = value.shape
    if pv_order and not pv_order_fits(Lk):
        raise ValueError(f"values in the P·V order take whole groups of {PV_GROUP} keys, got {Lk} keys")
    columns = torch.empty((B, H_kv, Dv, Lk), dtype=value.dtype, device=value.device).transpose(2, 3)
    backend.load().copy_values(value, columns, pv_order)
    return columns


@functools.lru_cache(maxsize=16)
def _one(device: torch.device) -> torch.Tensor:
    """A float32 1 on ``device``, (1, 1): the descale not given (made once, not a launch a call)."""
    return torch.ones((1, 1), dtype=torch.float32, device=device)


def packed_rows(rows, query):
    """Per-row values (B, H, Lq) as the rows of ``query`` (B, H_kv, group * Lq, D) where its grouped
    heads are packed (a copy of B * H * Lq floats where no view merges them); ``rows`` itself
    otherwise (and None)."""
    if rows is None or rows.shape == query.shape[:3]:
        return rows
    return rows.reshape(query.shape[:3])


def plan_launch(plan: ForwardPlan, backend, resume=None, allocate: bool = True) -> None:
    """The rest of :func:`make_forward`, from the kernels' views on: the config, the row
    blocks, the key splits, the backend's refinement and (``allocate``) the buffers, by
    ``plan.planner``. (What a kept plan does again for keys of another length: ``common.reuse``.)"""
    q, planner = plan.query, plan.planner
    B, Hp, Lqp, _ = q.shape
    Lk, Dv = plan.key.shape[2], plan.value.shape[3]
    interpreted = backend.interpreted()
    config = plan.config = backend.configs.lookup(
        max(plan.block_d, plan.block_dv), q.dtype, plan.is_causal, Lqp, Lk, interpreted, plan.key.dtype)
    plan.m_blocks = -(-Lqp // config.block_m)  # (not triton.cdiv: a call into triton costs host time)
    plan.num_splits, plan.blocks_per_split = planner.splits(plan.m_blocks * B * Hp, Lk, config.block_n, q.device,
                                                            config.block_m)
    plan.config = config = planner.shallow_stages(config, plan.m_blocks * B * Hp, plan.num_splits, q.device,
                                                  max(plan.block_d, plan.block_dv))
    if plan.widen_v == Widen.PV_ORDER and config.block_n % PV_GROUP:
        raise ValueError(f"block_n of a forced config must be a multiple of {PV_GROUP} where FP8 values are "
                         f"copied in the P·V order (common.plan.PV_GROUP), got {config.block_n}")
    if plan.row_bands is not None:  # packed sequences: each row block sees its own few
        plan.num_splits, plan.blocks_per_split = 1, -(-Lk // config.block_n)
    if resume is not None:  # one program per row block folds all of its keys in: no split
        plan.out, plan.lse = resume
        plan.with_lse = plan.resume = True
        plan.num_splits, plan.blocks_per_split = 1, -(-Lk // config.block_n)
    if plan.num_splits > 1 and not partials_fit(backend, (B, Hp, Lqp), plan.num_splits, Dv):
        plan.num_splits, plan.blocks_per_split = 1, -(-Lk // config.block_n)
    rows = B * Hp * Lqp
    plan.merge = planner.merge(rows, plan.num_splits, interpreted, plan.block_dv) if plan.num_splits > 1 else None
    kv_bytes = plan.key.numel() * plan.key.element_size() + plan.value.numel() * plan.value.element_size()
    backend.load().refine_forward(plan, kv_bytes)
    if allocate:
        allocate_outputs(plan, plan.out_dtype or q.dtype, q.device)


def allocate_outputs(plan: ForwardPlan, dtype: torch.dtype, device) -> None:
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


def partials_fit(backend, rows_shape: tuple, num_splits: int, dv: int) -> bool:
    """Whether ``backend`` indexes a split launch's partials (``common.outputs.partials``: (*rows_shape,
    splits, Dv) and (*rows_shape, splits)) and its merge's (rows, ...) views: every backend with
    64-bit offsets; one without where a head's part (rows x splits x Dv) and the merge's
    log-sum-exp, one dimension of every row, stay under OFFSET_LIMIT elements."""
    B, H, L = rows_shape
    return backend.supports(OFFSETS64) or (L * num_splits * dv < OFFSET_LIMIT and B * H * L < OFFSET_LIMIT)


def reuse_key():
    """What, besides a call's arguments and layout, a kept plan's launch is decided by: the planner
    and the forced config of this thread (tests, ``tune`` and the probes choose them), and the
    Triton backend's switch between its Gluon and tl kernels on sm_90 (``ATTENTION_GLUON``: a launch
    bound under one setting is not reused under another)."""
    return current_planner(), configs_override(), os.environ.get("ATTENTION_GLUON")


def tensorless_fields(plan) -> list:
    """A plan's fields in order (any plan dataclass), each tensor replaced by None: what a
    plan kept for later calls holds (``common.reuse``, ``common.paged``)."""
    return [None if isinstance(value, torch.Tensor) else value
            for value in (getattr(plan, f.name) for f in dataclasses.fields(plan))]


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
    plan.deterministic = call.deterministic_backward
    set_alibi(plan, call, Lq, Lk)
    if not backend.kernels:
        return plan
    if plan.softcap:  # (without soft-capping: OFF, the field's default; the planner is read only where it decides)
        plan.softcap_kind = current_planner().softcap_kind(plan.softcap, q.dtype, q.device, backend.interpreted())
    plan.block_d, plan.block_dv = tile_widths(padded_head_dim(D), padded_head_dim(Dv), q, k, v, out, grad_out)
    plan.config = backend.configs.lookup_backward(
        max(plan.block_d, plan.block_dv), q.dtype, call.is_causal, Lq, Lk, backend.interpreted())
    plan.dot_precision = dot_precision(q.dtype)
    plan.delta, plan.grad_query, plan.grad_key, plan.grad_value = backward_buffers(q, k, v)
    return plan


def backward_buffers(q, k, v) -> tuple:
    """What a backward launch writes: delta (B, H, Lq) float32 and dq, dk, dv (contiguous, the
    inputs' shapes and dtypes), from the allocator."""
    alloc = allocator()
    return (alloc(q.shape[:3], torch.float32, q.device), alloc(q.shape, q.dtype, q.device),
            alloc(k.shape, k.dtype, k.device), alloc(v.shape, v.dtype, v.device))

"""Plans kept across calls: plan a call's layout once, run it on new tensors many times.

What validation decides and what a :class:`common.plan.ForwardPlan` holds depend only on a
call's arguments and on its tensors' shapes, strides, dtypes and devices, never on their data,
and on their addresses only through whether they are aligned where the tiles' widths depend on
it (``plan.width_class``, part of the layout). So a loop of calls with one layout (every layer
of a model, a benchmark, a decode loop) need not validate and plan each call: an
:class:`AttentionPlan` keeps the decisions of one layout (no tensor) and runs them on new tensors:

- its first run launches through the backend's ``forward``; the second binds that launch to
  the layout (the backend's ``bind_forward``: grid, options and every scalar argument fixed);
  later runs allocate the outputs and launch the bound launch, nothing else.
- **growing keys** are a property of a plan that is not causal: it takes keys and values of
  any length and strides (a KV cache one token longer each step, a cache moved into a longer
  buffer). It plans again only what depends on the keys' length (the config, through its
  length bucket; the split count, through the number of key blocks), only where that
  changes, and launches through a launch bound to each (config, split count). A causal
  plan's layout includes its keys (it drops the keys no row sees).

:func:`plan_attention` makes a plan for a caller to hold (a decode loop, a CUDA graph);
:func:`common.attention` keeps one per layout it meets in :data:`PLANS`, for plain calls and
masked ones: an ``attn_mask`` is a tensor of the call like the query (its shape, strides and
dtype part of the layout, its keys' length too: a masked plan grows no keys), which the kernels
read through a view kept as (shape, strides) over it. No dropout, window, soft-capping or sinks
(those hold tensors or change per call), and no gradient (autograd and ``torch.compile`` go
through the operators of ``common.ops``). Those operators keep their own: a plain forward's plan by
layout in :data:`FORWARDS` (:func:`kept_forward`, a training step's forward), a backward's bound
launches in :data:`BACKWARDS` (:class:`KeptBackward`).
"""

from __future__ import annotations

import dataclasses

import torch

from common import ops
from common import plan as planning
from common.backends import OFFSETS64, resolve
from common.configs import length_key
from common.ops import _on_device
from common.outputs import allocator, partials
from common.validation import FP8_DTYPES, OFFSET_LIMIT, check_call, span


@dataclasses.dataclass(frozen=True, slots=True)
class BoundLaunch:
    """A plan's launch bound to one layout (the backend's ``bind_forward``): what a later call
    of that layout needs to allocate its outputs and launch, and nothing else."""

    launch: object  # the backend's, called with the call's tensors in ForwardPlan.ROLES order
    device: torch.device
    dtype: torch.dtype  # the output's (an FP8 query's is 16-bit)
    out_shape: tuple[int, ...]  # (B, Hp, Lqp, Dv), the kernel's view of the output
    shape: tuple[int, ...]  # (B, H, Lq, Dv), the caller's
    with_lse: bool
    num_splits: int
    interpreted: bool  # the kernels run under Triton's interpreter (quiet NumPy's warnings)

    @classmethod
    def of(cls, launch, plan: planning.ForwardPlan, backend) -> BoundLaunch:
        return cls(launch, plan.query.device, plan.out.dtype, tuple(plan.out.shape), plan.shape,
                   plan.with_lse, plan.num_splits, backend.interpreted())

    def __call__(self, query, key, value, blocks_per_split: int | None = None, descales=(None, None, None),
                 mask=None):
        """``(out, lse)`` in the caller's 4-D shape: the outputs allocated, one launch
        (``blocks_per_split``: keys of another length and strides, which the backend's
        ``launch_keys`` fills in; ``descales``: an FP8 call's, as the kernels read them,
        :func:`common.plan.fp8_descales`; ``mask``: a masked call's ``attn_mask`` as given, whose
        address is the kernels' view's). None where the launch cannot run here (another GPU
        is current than the plan's: the full path switches to it)."""
        device = self.device
        if device.type == "cuda" and device.index != torch.cuda.current_device():
            return None
        # The kernels' views are not made: a bound launch takes from a tensor only its address
        # (the packed query, the keys a causal row sees and the packed outputs start where the
        # caller's tensors do; the outputs are contiguous: the same bytes either way).
        alloc = allocator()
        out = alloc(self.shape, self.dtype, device)
        lse = alloc(self.shape[:3], torch.float32, device) if self.with_lse else None
        o_part = lse_part = None
        if self.num_splits > 1:
            o_part, lse_part = partials(self.out_shape[:3], self.num_splits, self.out_shape[3], device)
        tensors = (query, key, value, out, lse, o_part, lse_part, *descales, mask)
        if self.interpreted:
            with _quiet_interpreter():
                self._launch(tensors, blocks_per_split)
        else:
            self._launch(tensors, blocks_per_split)
        return out, lse

    def _launch(self, tensors, blocks_per_split):
        if blocks_per_split is None:
            self.launch(tensors)
        else:
            self.launch.launch_keys(tensors, blocks_per_split)


def _quiet_interpreter():
    import numpy

    return numpy.errstate(divide="ignore", over="ignore", invalid="ignore")


class AttentionPlan:
    """A plain forward call planned for one layout, run on new tensors (see the module docstring).

    ``run(query, key, value)`` takes tensors of the layout the plan was made for (shapes, strides,
    dtypes, devices; keys and values of any length and strides where ``grows_keys``) and returns
    what :func:`common.attention` returns for them: the output, or ``(output, lse)``. Fresh
    outputs every run. Holds no tensor."""

    __slots__ = ("backend", "layout", "grows_keys", "_arguments", "_fields", "_query_view", "_key_length",
                 "_keys", "_launched", "_bound", "_growing", "_grown", "_fp8", "_value_columns", "_pv_order",
                 "_mask_view")

    def __init__(self, backend, call, layout, arguments: dict, mask=None):
        self.backend = backend
        self.layout = layout  # what a call must match (common.reuse.layout_of)
        # (a masked plan's layout holds its keys', as a causal one's: the mask's last dimension is the keys')
        self.grows_keys = not call.is_causal and call.attn_mask is None
        self._arguments = arguments  # attention()'s keywords: the full path of a call the plan cannot run
        self._launched = False  # run once: the next run binds its launch (a layout met once binds nothing)
        self._bound = None  # the launch bound to the planned keys (BoundLaunch), or False: none can be
        self._growing = {}  # (config, splits, refinement) -> the backend's launch bound for other keys, or False
        self._grown = None  # the last growing launch: (length key, block_n, key blocks, blocks per split, BoundLaunch)
        self._fields = None  # the planned decisions; None: nothing planned (SDPA, or nothing to launch yet)
        # FP8 inputs: each call's descales are its own (passed per run, never kept; a bound launch
        # takes them as tensors of the call)
        self._fp8 = call.descales is not None
        self._value_columns = False  # FP8 values copied column-major each run (common.plan.value_columns)
        self._pv_order = False  # ... in the P·V order (Widen.PV_ORDER)
        # a masked plan's view of each call's mask: (shape, strides) over the caller's mask, where the kernels'
        # view starts (common.plan.make_forward broadcasts it to 4-D and packs it with the query's heads)
        self._mask_view = None
        if backend.kernels and _launches(call.query, call.key):
            self._plan(call, mask)

    def _plan(self, call, mask=None) -> None:
        """Keep the decisions :func:`common.plan.make_forward` makes for ``call`` (4-D; ``mask``: a masked
        call's ``attn_mask`` as given)."""
        q, k, v = call.query, call.key, call.value
        self._keys = (k.shape, k.stride(), v.shape, v.stride())
        with _on_device(q.device):
            plan = planning.make_forward(call, self.backend, with_lse=call.return_lse, allocate=False)
        assert plan.seed is None and plan.sinks is None and plan.row_bands is None
        if plan.attn_mask is not None:
            if plan.attn_mask.data_ptr() != mask.data_ptr():
                return  # (a view that does not start where the caller's mask does: every call planned)
            self._mask_view = (tuple(plan.attn_mask.shape), plan.attn_mask.stride())
        fields = planning.tensorless_fields(plan)
        if self._fp8:
            fields[_DESCALES] = None  # (a tuple of the call's tensors)
            # the plan copied the values column-major where its value is, and the call's is not (in the
            # P·V order where its values are in it)
            self._value_columns = plan.value.stride(2) == 1 and v.stride(2) != 1
            self._pv_order = plan.widen_v == planning.Widen.PV_ORDER
        self._fields = tuple(fields)
        self._query_view = tuple(plan.query.shape) if plan.query.shape != q.shape else None
        self._key_length = plan.key.shape[2] if plan.key.shape[2] != k.shape[2] else None

    def run(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        """Attention of these tensors, as planned. Raises ValueError where they are not of the
        plan's layout (a plan is never applied to a layout it did not decide)."""
        arguments = self._arguments
        layout = layout_of(self.backend, arguments["is_causal"], arguments["scale"], arguments["enable_gqa"],
                           arguments["return_lse"], query, key, value)
        if layout != self.layout:
            raise ValueError(
                "these tensors are not of the layout the plan was made for (shapes, strides, dtypes, devices, "
                "alignment where the head dims differ"
                + (", the keys' length" if not self.grows_keys else "") + ", or the planner settings): "
                "make a plan for them with common.plan_attention")
        return self.results(query, key, value)

    __call__ = run

    def results(self, query, key, value, descales=None, mask=None):
        """:meth:`run` of tensors known to be of the plan's layout (3-D or 4-D, as planned);
        ``descales``: FP8 inputs' (q_descale, k_descale, v_descale), as given to attention();
        ``mask``: a masked plan's call's ``attn_mask``, as given."""
        unbatched = query.ndim == 3
        given = descales
        if unbatched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if descales is not None:
                descales = tuple(None if d is None else d.unsqueeze(0) for d in descales)
        results = self.launch(query, key, value, descales, mask)
        if results is None:  # the full path: an empty call, keys it cannot take, another current GPU
            from common.dispatch import full_attention

            if unbatched:
                query, key, value = query[0], key[0], value[0]
            tensors = {} if given is None else dict(zip(("q_descale", "k_descale", "v_descale"), given))
            if mask is not None:
                tensors["attn_mask"] = mask
            return full_attention(query, key, value, **self._arguments, **tensors)
        out, lse = results
        if unbatched:
            out = out[0]
            lse = lse[0] if lse is not None else None
        return (out, lse) if self._arguments["return_lse"] else out

    def launch(self, query, key, value, descales=None, mask=None):
        """``(out, lse)`` of 4-D tensors of the plan's layout, in the caller's shape (lse None
        unless asked for); None where the full path must run. ``descales``: FP8 inputs' (4-D);
        ``mask``: a masked call's, as given."""
        if mask is not None and self._mask_view is None:
            return None  # (a mask the plan could not keep a view of)
        if self._fields is None:  # planned for no keys (or SDPA): plan once there are some
            if not (self.backend.kernels and self.grows_keys and _launches(query, key)
                    and _keys_fit(self.backend, key, value)):
                return None
            arguments = self._arguments
            fp8 = (*descales, arguments.get("out_dtype")) if descales is not None else (None, None, None, None)
            self._plan(check_call(self.backend, query, key, value, attn_mask=None, dropout_p=0.0,
                                  is_causal=arguments["is_causal"], scale=arguments["scale"],
                                  enable_gqa=arguments["enable_gqa"], return_lse=arguments["return_lse"], fp8=fp8))
        if self.grows_keys and (key.shape, key.stride(), value.shape, value.stride()) != self._keys:
            return self._launch_other_keys(query, key, value, descales)
        bound = self._bound
        if bound:
            if self._fp8:
                key, value, kernel_descales = self._kernel_inputs(query, key, value, descales)
                return bound(query, key, value, None, kernel_descales, mask)
            return bound(query, key, value, mask=mask)
        with _on_device(query.device):
            plan = self._rebind(query, key, value, descales=descales, mask=mask)
            if bound is False or not self._launched:
                self._launched = True
                return self._launch_plan(plan)
            # the second run binds its launch (NineToothed's binding reads what its generated
            # launcher passed: recorded meanwhile)
            from common.launch import recorded_launches  # (importing common must not import triton)

            with recorded_launches():
                results = self._launch_plan(plan)
                launch = self._bind(plan)
            self._bound = BoundLaunch.of(launch, plan, self.backend) if launch is not None else False
        return results

    def _kernel_inputs(self, query, key, value, descales):
        """``(key, value, descales)`` as the kernels read them: the keys a causal plan keeps (the
        keys no row sees dropped; a plan with growing keys drops none), the values then copied
        column-major where the plan copies them (the copy's strides follow the kept length), and an
        FP8 call's descales (:func:`common.plan.fp8_descales`; None without FP8 inputs)."""
        if self._key_length is not None:
            key, value = key[:, :, :self._key_length], value[:, :, :self._key_length]
        if self._value_columns:
            value = planning.value_columns(self.backend, value, self._pv_order)
        fp8 = planning.fp8_descales(descales or (None, None, None), query, key) if self._fp8 else None
        return key, value, fp8

    def _launch_plan(self, plan):
        with ops._quiet(self.backend):
            return plan.results(*self.backend.load().forward(plan))

    def _bind(self, plan, keys: bool = False):
        """The backend's launch of ``plan`` bound to its layout (``keys``: to its layout less the
        keys' length and strides), or None where the backend binds none for it."""
        return self.backend.load().bind_forward(plan, keys=keys)

    def _rebind(self, query, key, value, other_keys: bool = False, descales=None, mask=None) -> planning.ForwardPlan:
        """The plan of these tensors: the kept decisions, these tensors (FP8: these descales, the
        values copied column-major where the plan copies them; a masked plan: the kernels' view of
        ``mask``), fresh outputs; with ``other_keys``, keys of another length and strides: their
        config, splits and buffers planned again (:func:`common.plan.plan_launch`)."""
        plan = planning.ForwardPlan(*self._fields)  # (a copy, at a fraction of copy.copy's cost)
        plan.query = query if self._query_view is None else query.view(self._query_view)
        if self._mask_view is not None:
            plan.attn_mask = mask.as_strided(*self._mask_view)
        plan.key, plan.value, plan.descales = self._kernel_inputs(query, key, value, descales)
        if other_keys:
            planning.plan_launch(plan, self.backend)
        else:
            planning.allocate_outputs(plan, plan.out_dtype or query.dtype, query.device)
        return plan

    def _launch_other_keys(self, query, key, value, descales=None):
        """Keys of another length or strides (``grows_keys``): the last growing launch again where
        these keys plan alike (the config depends on the keys' length through its length key
        alone, the split count and blocks per split on the number of key blocks); else their
        launch planned again and launched through the launch bound to its config and splits."""
        if not _keys_fit(self.backend, key, value):
            return None  # the full path says what is wrong, or takes them
        if self._pv_order and not planning.pv_order_fits(key.shape[2]):
            return None  # (values in the P·V order: keys that do not fill its groups are planned afresh)
        grown = self._grown
        if grown is not None:
            length, block_n, k_blocks, blocks_per_split, bound = grown
            Lk = key.shape[2]
            if length_key(Lk) == length and -(-Lk // block_n) == k_blocks:
                if self._fp8:
                    key, value, kernel_descales = self._kernel_inputs(query, key, value, descales)
                    return bound(query, key, value, blocks_per_split, kernel_descales)
                return bound(query, key, value, blocks_per_split)
        with _on_device(query.device):
            plan = self._rebind(query, key, value, other_keys=True, descales=descales)
            with ops._quiet(self.backend):
                launched = self._launch_growing(plan)
            return plan.results(plan.out, plan.lse) if launched else self._launch_plan(plan)

    def _launch_growing(self, plan) -> bool:
        """Launch ``plan`` (keys of another length) through the launch bound to its config, split
        count and backend's refinement (``plan.refinement``: Triton's own-merge choice, which the
        keys' bytes decide); where none is yet, launch it through the backend and bind that
        launch. False where the backend binds none for it (the caller launches the plan). The
        bound launch becomes the last growing launch."""
        key = (plan.config, plan.num_splits, plan.refinement)
        bound = self._growing.get(key)
        if bound is False:
            return False
        if bound is None:
            from common.launch import recorded_launches

            with recorded_launches():
                self.backend.load().forward(plan)
                bound = self._bind(plan, keys=True)
            if len(self._growing) >= 64:
                self._growing.clear()
            self._growing[key] = bound or False
            if not bound:
                return True  # launched; later calls of this key launch their plans themselves
        else:
            bound.launch_plan(plan)
        Lk, block_n = plan.key.shape[2], plan.config.block_n
        self._grown = (length_key(Lk), block_n, -(-Lk // block_n), plan.blocks_per_split,
                       BoundLaunch.of(bound, plan, self.backend))
        return True


_DESCALES = [f.name for f in dataclasses.fields(planning.ForwardPlan)].index("descales")


def _launches(query, key) -> bool:
    """Whether a call of these 4-D tensors launches anything: at least one query row and one key."""
    return query.shape[0] * query.shape[1] * query.shape[2] > 0 and key.shape[2] > 0


def _keys_fit(backend, key, value) -> bool:
    """Whether a growing plan takes these keys as they are: one length for key and value, at
    least one key, and for a backend with 32-bit offsets, under 2^31 elements each (what
    validation checks of the keys' length and strides; past it the full path checks each
    batch and head)."""
    Lk = key.shape[-2]
    if Lk == 0 or value.shape[-2] != Lk:
        return False
    return backend.supports(OFFSETS64) or (span(key) < OFFSET_LIMIT and span(value) < OFFSET_LIMIT)


def layout_of(backend, is_causal, scale, enable_gqa, return_lse, query, key, value, descales=None, mask=None):
    """The layout a plan is kept by: the call's arguments, the planner's settings, and its tensors'
    shapes, strides, dtypes and devices (a plan that grows its keys: less the keys' length and
    strides); FP8 inputs' ``descales`` ``(q_descale, k_descale, v_descale, out_dtype)``: which
    descales are given, their shapes, strides, dtypes and devices, and the output dtype; a masked
    call's ``mask`` likewise (its keys' length and strides part of it: a masked plan grows no keys);
    where the tiles' widths may depend on it, whether the tensors are aligned (``plan.width_class``)."""
    head = (backend.name, backend.interpreted(), planning.reuse_key(), is_causal, scale, enable_gqa, return_lse,
            query.shape, query.stride(), query.dtype, query.device, key.dtype, key.device, value.dtype, value.device,
            planning.width_class(query, key, value))
    if descales is not None:
        head += (*(None if d is None else (d.shape, d.stride(), d.dtype, d.device) for d in descales[:3]),
                 descales[3])
    if mask is not None:
        mask_layout = (mask.shape, mask.stride(), mask.dtype, mask.device)
        return head, mask_layout, key.shape, key.stride(), value.shape, value.stride()
    if is_causal:
        return head, key.shape, key.stride(), value.shape, value.stride()
    return head, key.shape[:-2], key.shape[-1], value.shape[:-2], value.shape[-1]


class PlanCache:
    """Plans by layout (:func:`layout_of`), at most ``capacity``; started over when full."""

    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self._plans: dict = {}
        self.get = self._plans.get

    def put(self, layout, plan) -> None:
        if len(self._plans) >= self.capacity:
            self._plans.clear()
        self._plans[layout] = plan

    def clear(self) -> None:
        self._plans.clear()

    def values(self):
        return list(self._plans.values())

    def __len__(self) -> int:
        return len(self._plans)

    def __contains__(self, layout) -> bool:
        return layout in self._plans


PLANS = PlanCache()  # common.attention's plans (common.dispatch)


def operator_layout(backend, call, with_lse: bool):
    """The layout an operator's forward is kept by (:func:`kept_forward`): a plain call's (:func:`layout_of`;
    grouped heads where the key/value heads are fewer); None for a call of tensors or options of its own
    besides those (a mask, dropout, a window or bottom-right alignment, soft-capping, sinks, row bands, ALiBi,
    FP8 inputs or another output dtype: those plan every call) and for SDPA."""
    if (not backend.kernels or call.attn_mask is not None or call.dropout_p or call.window is not None
            or call.bottom_right or call.softcap is not None or call.sinks is not None or call.row_bands is not None
            or call.alibi_slopes is not None or call.descales is not None or call.key.dtype in FP8_DTYPES
            or call.query.dtype in FP8_DTYPES or call.out_dtype not in (None, call.query.dtype)):
        return None
    q, k, v = call.query, call.key, call.value
    return layout_of(backend, call.is_causal, call.scale, q.shape[1] != k.shape[1], with_lse, q, k, v)


def kept_forward(backend, call, with_lse: bool):
    """``(out, lse)`` of a validated 4-D call with rows and keys through the plan kept for its layout
    (:data:`FORWARDS`, made by this call where it is the layout's first): the operators' forward, which
    autograd and ``torch.compile`` call (a training step's forward), planned once and bound from its second
    call as :func:`common.attention`'s plain calls are; None where the caller plans and launches it (a layout
    :func:`operator_layout` keeps none of, another GPU current than the tensors', keys a growing plan does
    not take)."""
    layout = operator_layout(backend, call, with_lse)
    if layout is None:
        return None
    plan = FORWARDS.get(layout)
    if plan is None:
        enable_gqa = call.query.shape[1] != call.key.shape[1]
        arguments = dict(is_causal=call.is_causal, scale=call.scale, enable_gqa=enable_gqa, return_lse=with_lse,
                         backend=backend.name)
        plan = AttentionPlan(backend, dataclasses.replace(call, return_lse=with_lse), layout, arguments)
        FORWARDS.put(layout, plan)
    return plan.launch(call.query, call.key, call.value)


FORWARDS = PlanCache()  # the operators' kept forwards by layout (common.ops.forward)


def backward_layout(backend, call, out, lse, grad_out, grad_lse):
    """The layout a backward call is kept by (:class:`KeptBackward`): the call's arguments, the
    planner's settings, and its tensors' shapes, strides, dtypes and devices (the gradient of the
    lse: whether there is one, and its layout); None for a call of tensors of its own besides
    those (a mask, dropout's seed, row bands, ALiBi's slopes: those plan every call) and for SDPA."""
    if (not backend.kernels or call.attn_mask is not None or call.dropout_p or call.row_bands is not None
            or call.alibi_slopes is not None):
        return None
    q, k, v = call.query, call.key, call.value
    return (backend.name, backend.interpreted(), planning.reuse_key(), call.is_causal, call.scale, call.window,
            call.bottom_right, call.softcap, call.deterministic_backward,
            *[(t.shape, t.stride(), t.dtype, t.device) for t in (q, k, v, out, lse, grad_out)],
            planning.width_class(q, k, v, out, grad_out),
            None if grad_lse is None else (grad_lse.shape, grad_lse.stride(), grad_lse.dtype, grad_lse.device))


class KeptBackward:
    """The backward of one layout (:func:`backward_layout`), bound: its first call plans and
    launches as every call did (``run`` returns None: the caller does), its second binds its
    launches to the layout (the backend's ``bind_backward``), and later calls allocate the
    gradients and launch the bound launches, nothing else. Holds no tensor of a call."""

    __slots__ = ("_runs", "_bound", "_interpreted")

    def __init__(self):
        self._runs = 0
        self._bound = None  # the backend's bound launches, or False: it binds none for this layout
        self._interpreted = False

    def run(self, backend, call, out, lse, grad_out, grad_lse):
        """``(dq, dk, dv)`` of a validated call of the kept layout with rows and keys, or None
        where the caller plans and launches it (the first call, a layout the backend binds no
        launch for, another GPU current than the tensors')."""
        q, k, v = call.query, call.key, call.value
        bound = self._bound
        if bound:
            if q.device.type == "cuda" and q.device.index != torch.cuda.current_device():
                return None
            delta, *grads = planning.backward_buffers(q, k, v)
            tensors = (q, k, v, out, grad_out, lse, grad_lse, delta, *grads)
            if self._interpreted:
                with _quiet_interpreter():
                    bound(tensors)
            else:
                bound(tensors)
            return grads
        self._runs += 1
        if bound is False or self._runs == 1:
            return None
        from common.launch import recorded_launches  # (importing common must not import triton)

        with _on_device(q.device):
            plan = planning.make_backward(call, backend, out, lse, grad_out, grad_lse)
            with recorded_launches():
                with ops._quiet(backend):
                    grads = backend.load().backward(plan)
                self._interpreted = backend.interpreted()
                self._bound = backend.load().bind_backward(plan) or False
        return grads


BACKWARDS = PlanCache()  # the kept backwards by layout (common.ops.backward)


def plan_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool = False,
                   scale: float | None = None, *, enable_gqa: bool = False, return_lse: bool = False,
                   backend: str | None = None) -> AttentionPlan:
    """Plan :func:`common.attention` for the layout of these tensors, once, for a caller to hold.

    ``plan.run(q, k, v)`` (or ``plan(q, k, v)``) then computes ``attention(q, k, v, is_causal,
    scale, enable_gqa=..., return_lse=..., backend=...)`` for tensors of the same shapes, strides,
    dtypes and devices, without validating or planning again: a decode loop, or a CUDA graph's
    capture. A plan that is not causal grows its keys: its keys and values may have any length
    and strides (a KV cache one token longer each step); it plans again only what their length
    changes. The tensors given here are only looked at (nothing is launched or kept). Kernel
    backends; with the "torch" backend every run is a plain :func:`common.attention` call.

    Args: as :func:`common.attention` (plain calls: no mask, dropout, window, soft-capping or sinks).

    Returns:
        An :class:`AttentionPlan`. Its ``run`` raises ValueError for tensors of another layout,
        and is planned with the thread's planner settings (``common.plan.use_planner``) of now.
    """
    chosen = resolve(backend)
    call = check_call(chosen, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=is_causal,
                      scale=scale, enable_gqa=enable_gqa, return_lse=return_lse)
    layout = layout_of(chosen, is_causal, scale, enable_gqa, return_lse, query, key, value)
    arguments = dict(is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, return_lse=return_lse,
                     backend=chosen.name)
    return AttentionPlan(chosen, call, layout, arguments)

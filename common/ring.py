"""Context parallelism: ring attention over ``torch.distributed``.

Every rank of a process group holds a contiguous shard (dim -2) of the
sequence of query, key and value; :func:`ring_attention` returns that rank's
shard of the output. The K/V shards travel around the ring (rank r receives
from r - 1 and sends to r + 1) with batched ``isend``/``irecv``, posted before
the block that uses the current shard is computed, so the transfer of the
next shard overlaps the compute of this one. Each block is one call of the
chosen backend's kernel, which folds the block into the running float32 output
and log-sum-exp itself (it starts its online softmax from them: no separate
merge pass over the output).

The backward passes K/V around once more: each rank's dQ accumulates locally,
and the dK/dV accumulators (float32) travel with their K/V shard, gathering
every rank's contribution, until a last step sends them home. Each block's
gradients come from :func:`common.attention_backward` given the *final*
output and log-sum-exp, which makes them exact shares of the full gradient.

Causal attention skips blocks wholly above the diagonal. With contiguous
shards rank r has r + 1 blocks of work, the last rank W; ``layout="zigzag"``
evens that out: the sequence is cut into 2W chunks and rank r holds chunks r
and 2W - 1 - r (:func:`shard_sequence` / :func:`unshard_sequence`), which
gives every rank the same work at every step.

Backend ``"torch"`` computes each block with plain float32 torch math (SDPA
gives no log-sum-exp); it is the reference, not a fast path.
"""

from __future__ import annotations

import torch

from common.backends import resolve
from common.validation import check_call

LAYOUTS = ("contiguous", "zigzag")


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    group=None,
    enable_gqa: bool = False,
    backend: str | None = None,
    layout: str = "contiguous",
) -> torch.Tensor:
    """Attention over a sequence sharded across the ranks of ``group``.

    Every rank calls this with its own shards, in rank order of the group:
    the result is this rank's rows of
    ``attention(full_query, full_key, full_value, is_causal, scale)``.

    Args:
        query: (B, H, Lq_r, D) or (H, Lq_r, D): this rank's query rows.
        key: (B, H_kv, Lk_r, D) or (H_kv, Lk_r, D): this rank's keys.
        value: (B, H_kv, Lk_r, Dv) or (H_kv, Lk_r, Dv).
            Dtypes, head dims and GQA as for :func:`common.attention`; every
            rank's shards have the same dtype, B, H, H_kv, D and Dv; lengths
            may differ between ranks (uneven shards), even be 0.
        is_causal: SDPA's causal mask over the full sequence. Needs query and
            key sharded alike (Lq_r = Lk_r on every rank: one sequence).
        scale: multiplies the scores; None means 1/sqrt(D).
        group: the ``torch.distributed`` process group (None: the default
            group). Its backend must carry the tensors' device (NCCL for CUDA,
            gloo for CPU tensors).
        enable_gqa: allow H_kv < H, as in :func:`common.attention`.
        backend: "triton", "ninetoothed" or "torch" (plain torch per block, the
            reference); None picks as :func:`common.attention` does.
        layout: "contiguous": rank r holds the r-th contiguous piece of the
            sequence. "zigzag": the sequence in 2W equal chunks, rank r holding
            chunks r and 2W - 1 - r, concatenated (:func:`shard_sequence`); with
            is_causal it evens out the work; every rank's Lq_r and Lk_r must be
            the same even number then.

    Returns:
        This rank's output rows, (B, H, Lq_r, Dv) or (H, Lq_r, Dv), in the
        inputs' dtype. Differentiable with respect to query, key and value
        (the backward is a second ring).

    Raises:
        TypeError, ValueError: bad input, raised on every rank alike (the ranks
        exchange their shapes first, one small all-gather, which synchronises
        with the host).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("ring_attention needs torch.distributed initialised (init_process_group) first")
    problem, call, chosen = None, None, None
    try:  # an error here is raised after the exchange, on every rank (no rank left waiting)
        _check_layout(layout)
        chosen = resolve(backend)
        call = check_call(chosen, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=is_causal,
                          scale=scale, enable_gqa=enable_gqa, return_lse=False)
        _check_group_device(group, call.query.device)
    except (TypeError, ValueError) as error:
        problem = error
    ring = _Ring.agree(group, call, problem, device=_exchange_device(group, query))
    ring.check_layout(call.is_causal, layout)
    out = _RingAttention.apply(call.query, call.key, call.value, call.is_causal, call.scale, chosen, ring, layout)
    return out[0] if call.unbatched else out


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, *, layout: str = "contiguous", dim: int = -2):
    """This rank's shard of a full sequence ``x`` (along ``dim``), as :func:`ring_attention` takes it.

    "contiguous": the rank-th of ``world_size`` pieces of ``torch.chunk``
    (uneven when the length does not divide). "zigzag": chunks ``rank`` and
    ``2 * world_size - 1 - rank`` of 2·world_size equal chunks, concatenated
    (the length must divide by 2·world_size).
    """
    _check_layout(layout)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    length = x.shape[dim]
    if layout == "contiguous":
        bounds = _even_bounds(length, world_size)
        return x.narrow(dim, bounds[rank], bounds[rank + 1] - bounds[rank])
    if length % (2 * world_size):
        raise ValueError(f"a zigzag layout needs the length ({length}) to divide by 2 * world_size "
                         f"= {2 * world_size}")
    chunks = x.chunk(2 * world_size, dim)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim)


def unshard_sequence(shards, *, layout: str = "contiguous", dim: int = -2) -> torch.Tensor:
    """The full sequence from every rank's shard (a list in rank order, e.g. from
    ``all_gather``): the inverse of :func:`shard_sequence`."""
    _check_layout(layout)
    shards = list(shards)
    if layout == "contiguous":
        return torch.cat(shards, dim)
    halves = [s.chunk(2, dim) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


def _check_layout(layout) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")


def _even_bounds(length: int, parts: int) -> list[int]:
    """torch.chunk's split points, padded with empty pieces when length < parts."""
    step = -(-length // parts) if length else 0
    return [min(i * step, length) for i in range(parts + 1)]


class _Ring:
    """The group, this rank's place in it and every rank's shard lengths."""

    def __init__(self, group, rank: int, size: int, peers: tuple[int, int], q_lengths, k_lengths):
        self.group, self.rank, self.size = group, rank, size
        self.send_to, self.recv_from = peers  # global ranks of the next and the previous rank
        self.q_lengths, self.k_lengths = q_lengths, k_lengths

    @classmethod
    def agree(cls, group, call, problem, device):
        """Exchange shapes (and whether each rank's input was valid) with every rank; raise
        on every rank alike if any rank's input is bad or the shards do not fit together."""
        import torch.distributed as dist

        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if problem is not None:
            meta = [0] * 9
        else:
            B, H, Lq, D = call.query.shape
            H_kv, Lk, Dv = call.key.shape[1], call.key.shape[2], call.value.shape[3]
            meta = [1, Lq, Lk, B, H, H_kv, D, Dv, _DTYPES.index(call.query.dtype)]
        mine = torch.tensor(meta, dtype=torch.int64, device=device)
        every = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(every, mine, group=group)
        every = torch.stack(every).tolist()  # the host synchronisation (lengths size the receive buffers)
        if problem is not None:
            raise problem
        bad = [r for r, m in enumerate(every) if not m[0]]
        if bad:
            raise ValueError(f"ring_attention: the input of rank(s) {bad} of the group is invalid "
                             f"(the error is raised there)")
        names = ("", "", "", "batch size", "query heads", "key/value heads", "head dim D", "head dim Dv", "dtype")
        for i in range(3, 9):
            if len({m[i] for m in every}) > 1:
                per_rank = [str(_DTYPES[m[i]]).removeprefix("torch.") if i == 8 else m[i] for m in every]
                raise ValueError(f"ring_attention: every rank's shards must have the same {names[i]}; "
                                 f"per rank: {per_rank}")
        peers = tuple(_global(group, (rank + step) % size) for step in (1, -1))
        return cls(group, rank, size, peers, [m[1] for m in every], [m[2] for m in every])

    def check_layout(self, is_causal: bool, layout: str):
        if is_causal and self.q_lengths != self.k_lengths:
            raise ValueError(f"ring_attention with is_causal needs query and key sharded alike (one sequence); "
                             f"query lengths per rank {self.q_lengths}, key lengths {self.k_lengths}")
        if layout == "zigzag" and is_causal:
            lengths = set(self.q_lengths)
            if len(lengths) > 1 or lengths.pop() % 2:
                raise ValueError(f"a zigzag layout needs the same even shard length on every rank; "
                                 f"per rank: {self.q_lengths}")

    def exchange(self, sends, receives):
        """Post sends to the next rank and receives from the previous; return the works.
        Empty tensors are neither sent nor received (both sides know the lengths)."""
        import torch.distributed as dist

        ops = [dist.P2POp(dist.isend, t, self.send_to, self.group) for t in sends if t.numel()]
        ops += [dist.P2POp(dist.irecv, t, self.recv_from, self.group) for t in receives if t.numel()]
        return dist.batch_isend_irecv(ops) if ops else []


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _exchange_device(group, query) -> torch.device:
    """Where the ranks exchange their shapes: a device the group's backend carries (NCCL: the
    query's GPU, or the current one; gloo: the CPU, or the query's device)."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        if isinstance(query, torch.Tensor) and query.device.type == "cuda":
            return query.device
        return torch.device("cuda", torch.cuda.current_device())
    return query.device if isinstance(query, torch.Tensor) else torch.device("cpu")


def _check_group_device(group, device: torch.device) -> None:
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        raise ValueError(f"the process group's backend is NCCL, which carries CUDA tensors only; "
                         f"query is on {device} (use a gloo group for CPU tensors)")


def _global(group, rank: int) -> int:
    import torch.distributed as dist

    return rank if group is None else dist.get_global_rank(group, rank)


def _wait(works):
    for work in works:
        work.wait()


def _blocks(ring: _Ring, source: int, is_causal: bool, layout: str):
    """The (query rows, key rows, causal) pieces this rank computes against the K/V shard of
    rank ``source``: none when every key comes after every query row (causal)."""
    rank = ring.rank
    every = (slice(None), slice(None))
    if not is_causal:
        return [(*every, False)]
    if layout == "contiguous":  # query rows and keys are sharded alike
        return [] if source > rank else [(*every, source == rank)]
    half = ring.q_lengths[rank] // 2  # zigzag: chunks (rank, 2W-1-rank) against (source, 2W-1-source)
    if source == rank:  # both halves in order: causal over the whole shard
        return [(*every, True)]
    if source < rank:  # every row sees the source's first chunk, none its second
        return [(slice(None), slice(0, half), False)]
    return [(slice(half, None), slice(None), False)]  # only the second chunk's rows see anything


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, is_causal, scale, backend, ring, layout):
        B, H, Lq, _ = query.shape
        acc = query.new_zeros((B, H, Lq, value.shape[3]), dtype=torch.float32)
        lse = query.new_full((B, H, Lq), float("-inf"), dtype=torch.float32)
        key, value = key.contiguous(), value.contiguous()
        shard = (key, value)
        for step in range(ring.size):
            source = (ring.rank - step) % ring.size
            if step + 1 < ring.size:  # the next shard travels while this one is used
                incoming = _buffers(shard, ring.k_lengths[(source - 1) % ring.size])
                works = ring.exchange(shard, incoming)
            for rows, keys, causal in _blocks(ring, source, is_causal, layout):
                q, k, v = query[:, :, rows], shard[0][:, :, keys], shard[1][:, :, keys]
                if q.shape[2] and k.shape[2]:
                    _block_forward(backend, q, k, v, causal, scale, acc[:, :, rows], lse[:, :, rows])
            if step + 1 < ring.size:
                _wait(works)
                shard = incoming
        out = acc.to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.is_causal, ctx.scale, ctx.backend, ctx.ring, ctx.layout = is_causal, scale, backend, ring, layout
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        ring, backend = ctx.ring, ctx.backend
        grad_out = grad_out.contiguous()
        dq = torch.zeros_like(query, dtype=torch.float32)
        shard = (key, value)
        # dK/dV accumulators (float32) travel with their K/V shard: at step t this rank holds
        # those of the shard it computes against; after the last step they go home, one rank on.
        grads = (torch.zeros_like(key, dtype=torch.float32), torch.zeros_like(value, dtype=torch.float32))
        arrivals = ([], None)
        for step in range(ring.size):
            source = (ring.rank - step) % ring.size
            if step + 1 < ring.size:
                incoming = _buffers(shard, ring.k_lengths[(source - 1) % ring.size])
                works = ring.exchange(shard, incoming)
            blocks = []
            for rows, keys, causal in _blocks(ring, source, ctx.is_causal, ctx.layout):
                q, k, v = query[:, :, rows], shard[0][:, :, keys], shard[1][:, :, keys]
                if q.shape[2] and k.shape[2]:
                    dq_b, dk_b, dv_b = _block_backward(backend, grad_out[:, :, rows], q, k, v,
                                                       out[:, :, rows], lse[:, :, rows], causal, ctx.scale)
                    dq[:, :, rows] += dq_b
                    blocks.append((keys, dk_b, dv_b))
            _wait(arrivals[0])  # this shard's accumulators, sent on by the previous rank (overlapped)
            for keys, dk_b, dv_b in blocks:
                grads[0][:, :, keys] += dk_b
                grads[1][:, :, keys] += dv_b
            if ring.size > 1:
                arriving = _buffers(grads, ring.k_lengths[(source - 1) % ring.size])
                # (the sent tensors stay referenced until their transfer is waited for)
                arrivals = (ring.exchange(grads, arriving), grads)
                grads = arriving
            if step + 1 < ring.size:
                _wait(works)
                shard = incoming
        _wait(arrivals[0])
        dk, dv = grads
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None, None, None, None


def _buffers(tensors, length: int):
    return tuple(t.new_empty((*t.shape[:2], length, t.shape[3])) for t in tensors)


def _merge(acc, lse, out_b, lse_b):
    """Fold a block's (output, log-sum-exp) into the running ones, in place (float32)."""
    new = torch.logaddexp(lse, lse_b)
    finite = torch.isfinite(new)  # a row with no visible key so far stays (0, -inf)
    safe = torch.where(finite, new, 0.0)
    old_w = torch.where(finite, torch.exp(lse - safe), 0.0).unsqueeze(-1)
    new_w = torch.where(finite, torch.exp(lse_b - safe), 0.0).unsqueeze(-1)
    acc.mul_(old_w).add_(out_b.float() * new_w)
    lse.copy_(new)


def _block_forward(backend, q, k, v, causal, scale, acc, lse):
    """Fold one block into the running float32 (output, log-sum-exp) of its rows, in place;
    queries and keys are aligned top-left (diagonal blocks). The kernel backends do it in the
    attention kernel itself (:func:`common.ops.forward_resume`: no merge pass over the output)."""
    if backend.kernels:
        from common import ops

        call = check_call(backend, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=causal, scale=scale,
                          enable_gqa=True, return_lse=True)
        ops.forward_resume(backend, call, acc, lse)
        return
    s, v = _torch_scores(q, k, v, causal, scale)
    lse_b = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse_b), lse_b, 0.0).unsqueeze(-1))
    _merge(acc, lse, p @ v, lse_b)


def _block_backward(backend, grad_out, q, k, v, out, lse, causal, scale):
    """(dq, dk, dv) of one block given the whole ring's output and log-sum-exp."""
    if backend.kernels:
        from common.dispatch import attention_backward

        return attention_backward(grad_out, q, k, v, out, lse, is_causal=causal, scale=scale, enable_gqa=True,
                                  backend=backend.name)
    group = q.shape[1] // k.shape[1]
    s, v32 = _torch_scores(q, k, v, causal, scale)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, float("inf")).unsqueeze(-1))
    do = grad_out.float()
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ v32.transpose(-1, -2) - (do * out.float()).sum(-1, keepdim=True))
    k32 = k.float().repeat_interleave(group, 1)
    dq = ds @ k32 * scale
    dk = ds.transpose(-1, -2) @ q.float() * scale

    def fold(g):  # sum the query heads of each K/V head's group
        return g.unflatten(1, (k.shape[1], group)).sum(2)

    return dq, fold(dk), fold(dv)


def _torch_scores(q, k, v, causal, scale):
    group = q.shape[1] // k.shape[1]
    k32, v32 = (t.float().repeat_interleave(group, 1) for t in (k, v))
    s = q.float() @ k32.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s, v32

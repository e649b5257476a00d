"""Scaled-dot-product attention written twice: in Triton and in NineToothed.

``attention`` computes what ``torch.nn.functional.scaled_dot_product_attention``
computes, forward and backward, on the backend of your choice;
``attention_backward`` runs a backend's backward kernels directly;
``plan_attention`` plans a call's layout once for a loop to run many times;
``ring_attention`` spreads one sequence over the ranks of a process group;
``varlen_attention`` attends within each sequence of a packed batch;
``paged_attention`` and ``append_kv`` read and write a paged KV cache.
"""

from common.backends import available_backends, use_backend
from common.dispatch import attention, attention_backward
from common.paged import append_kv, paged_attention
from common.reuse import plan_attention
from common.ring import ring_attention, shard_sequence, unshard_sequence
from common.varlen import varlen_attention

__all__ = ["append_kv", "attention", "attention_backward", "available_backends", "paged_attention",
           "plan_attention", "ring_attention", "shard_sequence", "unshard_sequence", "use_backend",
           "varlen_attention"]

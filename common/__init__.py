"""Scaled-dot-product attention written twice: in Triton and in NineToothed.

``attention`` computes what ``torch.nn.functional.scaled_dot_product_attention``
computes, forward and backward, on the backend of your choice;
``attention_backward`` runs a backend's backward kernels directly;
``plan_attention`` plans a call's layout once for a loop to run many times;
``ring_attention`` spreads one sequence over the ranks of a process group;
``varlen_attention`` attends within each sequence of a packed batch;
``paged_attention`` and ``append_kv`` read and write a paged KV cache;
``quantize_fp8`` makes float8_e4m3fn inputs and their descales for ``attention``;
``common.flash_attn_interface`` offers FlashAttention 2's functions, signatures and layout.

The names are imported on first use (``from common import attention`` or ``common.attention``),
so that ``import common`` alone, as the command line does for its help, loads no torch.
"""

import importlib

# public name: the module that defines it
_PUBLIC = {
    "available_backends": "common.backends",
    "use_backend": "common.backends",
    "attention": "common.dispatch",
    "attention_backward": "common.dispatch",
    "append_kv": "common.paged",
    "paged_attention": "common.paged",
    "quantize_fp8": "common.fp8",
    "plan_attention": "common.reuse",
    "ring_attention": "common.ring",
    "shard_sequence": "common.ring",
    "unshard_sequence": "common.ring",
    "varlen_attention": "common.varlen",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    """Import a public name's module on first use and keep the name here (later uses are plain lookups)."""
    if name not in _PUBLIC:
        raise AttributeError(f"module 'common' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))

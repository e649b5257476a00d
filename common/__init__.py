"""Scaled-dot-product attention written twice: in Triton and in NineToothed.

``attention`` computes what ``torch.nn.functional.scaled_dot_product_attention``
computes, forward and backward, on the backend of your choice;
``attention_backward`` runs a backend's backward kernels directly.
"""

from common.backends import available_backends, use_backend
from common.dispatch import attention, attention_backward

__all__ = ["attention", "attention_backward", "available_backends", "use_backend"]

"""Scaled-dot-product attention written twice: in Triton and in NineToothed.

``attention`` computes what ``torch.nn.functional.scaled_dot_product_attention``
computes (forward), on the backend of your choice.
"""

from common.backends import available_backends, use_backend
from common.dispatch import attention

__all__ = ["attention", "available_backends", "use_backend"]

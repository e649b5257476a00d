from common.flash_attn_interface import *  # noqa: F403
from common.flash_attn_interface import _get_block_size_n  # noqa: F401 (FlashAttention's tests import it)

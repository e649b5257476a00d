"""FlashAttention's import names on our interface, for running its tests (tools/fa_suite/run.py)."""

from common.flash_attn_interface import *  # noqa: F403

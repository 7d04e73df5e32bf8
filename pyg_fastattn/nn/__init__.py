"""Drop-in PyG layers on the fused kernels."""
from .base import AdditiveScore, FusedAttentionConv
from .gat_conv import FastGATConv
from .gatv2_conv import FastGATv2Conv
from .graph import (PreparedGraph, cache_info, clear_cache, get_validation,
                    prepare, set_cache_size, set_validation)
from .swap import swap, swap_gat
from .transformer_conv import FastTransformerConv

__all__ = ['FusedAttentionConv', 'AdditiveScore', 'FastGATConv',
           'FastGATv2Conv', 'FastTransformerConv', 'swap', 'swap_gat',
           'prepare', 'PreparedGraph', 'cache_info', 'clear_cache',
           'set_cache_size', 'set_validation', 'get_validation']

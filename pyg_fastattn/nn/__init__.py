"""Drop-in PyG layers on the fused kernels."""
from .gat_conv import FastGATConv
from .graph import (PreparedGraph, cache_info, clear_cache, get_validation,
                    prepare, set_cache_size, set_validation)
from .swap import swap_gat

__all__ = ['FastGATConv', 'swap_gat', 'prepare', 'PreparedGraph',
           'cache_info', 'clear_cache', 'set_cache_size', 'set_validation',
           'get_validation']

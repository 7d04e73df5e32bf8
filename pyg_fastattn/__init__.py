"""pyg_fastattn: fast graph attention for PyTorch Geometric."""
from . import ops
from ._build import info as backend_info
from .nn import (FastGATConv, FastGATv2Conv, FastTransformerConv,
                 FusedAttentionConv, PreparedGraph, prepare, set_validation,
                 swap, swap_gat)

__version__ = '0.1.0'

__all__ = [
    'ops', 'backend_info', '__version__', 'FastGATConv', 'FastGATv2Conv',
    'FastTransformerConv', 'FusedAttentionConv', 'swap', 'swap_gat', 'prepare',
    'PreparedGraph', 'set_validation'
]

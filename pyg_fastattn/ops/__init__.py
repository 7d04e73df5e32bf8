"""Fused graph-attention ops over CSR graphs (rows = destination nodes).

Each op is a ``torch.ops.pyg_fastattn`` custom op with a fake
implementation, an autograd formula and an autocast rule (see ``_lib``); it
runs on CPU and CUDA through compiled kernels, or through
:mod:`pyg_fastattn.reference` where they are unavailable.
"""
from . import _lib
from .attention import attention, softmax_aggregate
from .csr import CSC, csr_to_csc
from .edge_softmax import edge_softmax
from .gat import gat_attention
from .gatv2 import gatv2_attention
from .linear import column_sum, linear
from .sddmm import sddmm, sddmm_csr
from .spmm import segment_sum, spmm
from .transformer import transformer_attention
from ._checks import check_csr

_lib.install_backends()

__all__ = [
    'edge_softmax', 'softmax_aggregate', 'spmm', 'sddmm', 'sddmm_csr',
    'attention', 'gat_attention', 'gatv2_attention', 'transformer_attention',
    'csr_to_csc', 'CSC', 'check_csr', 'segment_sum', 'linear', 'column_sum'
]

"""Fused graph-attention ops over CSR graphs (rows = destination nodes).

Each op is differentiable and runs on CPU and CUDA through compiled kernels,
or through :mod:`pyg_fastattn.reference` when they are unavailable.
"""
from .attention import attention, gat_attention, softmax_aggregate
from .csr import CSC, csr_to_csc
from .edge_softmax import edge_softmax
from .sddmm import sddmm
from .spmm import segment_sum, spmm
from ._checks import check_csr

__all__ = [
    'edge_softmax', 'softmax_aggregate', 'spmm', 'sddmm', 'attention',
    'gat_attention',
    'csr_to_csc', 'CSC', 'check_csr', 'segment_sum'
]

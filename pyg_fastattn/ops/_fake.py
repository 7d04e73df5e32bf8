"""Fake (meta) implementations of the native ops, for torch.compile.

Output shapes depend only on input shapes, so tracing needs no data.
"""
import torch

_register = getattr(torch.library, 'register_fake', None) or getattr(
    torch.library, 'impl_abstract')


def _opmath(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@_register('pyg_fastattn::edge_softmax')
def _edge_softmax(rowptr, scores):
    return torch.empty_like(scores, memory_format=torch.contiguous_format)


@_register('pyg_fastattn::edge_softmax_backward')
def _edge_softmax_backward(rowptr, out, grad_out):
    return torch.empty_like(out, memory_format=torch.contiguous_format)


@_register('pyg_fastattn::sddmm_dot')
def _sddmm_dot(a, b, a_idx, b_idx):
    return a.new_empty((a_idx.shape[0], a.shape[1]))


@_register('pyg_fastattn::spmm')
def _spmm(rowptr, col, weight, weight_perm, values):
    return values.new_empty((rowptr.shape[0] - 1, values.shape[1], values.shape[2]))


@_register('pyg_fastattn::segment_sum')
def _segment_sum(rowptr, perm, src):
    return src.new_empty((rowptr.shape[0] - 1, src.shape[1]))


@_register('pyg_fastattn::attention')
def _attention(rowptr, col, a_src, a_dst, a_edge, mask, values, negative_slope,
               bias=None):
    N, H = rowptr.shape[0] - 1, values.shape[1]
    out = values.new_empty((N, H, values.shape[2]))
    lse = values.new_empty((N, H), dtype=_opmath(values.dtype))
    return out, lse


@_register('pyg_fastattn::attention_backward')
def _attention_backward(rowptr, col, colptr, row, perm, a_src, a_dst, a_edge,
                        mask, values, negative_slope, out, lse, grad_out,
                        grad_z_csr=False, bias=None):
    Ns, H = values.shape[0], values.shape[1]
    return (values.new_empty(values.shape), values.new_empty((col.shape[0], H)),
            values.new_empty((Ns, H)))

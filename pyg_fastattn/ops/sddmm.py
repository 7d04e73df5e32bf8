"""``sddmm``: per-edge scores from node features (sampled dense-dense
product)."""
from typing import Optional

import torch
from torch import Tensor

from . import _lib
from ._checks import (check_csc, check_csr, check_index, check_same_device,
                      check_tensor, index_pair)
from .csr import CSC, maybe_csc, rows_of

# out[e, h] = sum_c a[a_idx[e], h, c] * b[b_idx[e], h, c]  -> [E, H].
# An out-of-range index gives 0 for that edge (Python validates first).
_lib.define('sddmm_dot(Tensor a, Tensor b, Tensor a_idx, Tensor b_idx) -> '
            'Tensor')


def _csr_by(index: Tensor, size: int):
    """Sort edges by ``index``: (rowptr [size + 1], perm [E])."""
    perm = torch.argsort(index, stable=True)
    bounds = torch.arange(size + 1, device=index.device, dtype=index.dtype)
    rowptr = torch.searchsorted(index[perm], bounds).to(index.dtype)
    return rowptr, perm.to(index.dtype)


def _gather_grad(index, other_idx, grad, other, size):
    """grad_x[n] = sum_{e: index[e] = n} grad[e, h] * other[other_idx[e]]."""
    rowptr, perm = _csr_by(index, size)
    return _lib.op('spmm')(rowptr, other_idx[perm.long()], grad, perm, other,
                          None, None, None)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    a, b, a_idx, b_idx = ctx.saved_tensors
    grad = grad.contiguous()
    ga = gb = None
    if ctx.needs_input_grad[0]:
        ga = _gather_grad(a_idx, b_idx, grad, b, a.size(0))
    if ctx.needs_input_grad[1]:
        gb = _gather_grad(b_idx, a_idx, grad, a, b.size(0))
    return ga, gb, None, None


_lib.register('sddmm_dot',
              fake=lambda a, b, a_idx, b_idx: a.new_empty(
                  (a_idx.shape[0], a.shape[1])),
              backward=_backward, setup_context=_setup_context, autocast=True)


# The same over a CSR graph: out[e, h] = <a[row[e], h], b[col[e], h]> for
# each CSR position e (row [E]: its row; N outside every row gives 0). The
# backward walks the CSR (grad a) and its transpose colptr/csc_row/csc_perm
# (grad b) instead of sorting the edges.
_lib.define('sddmm_csr(Tensor a, Tensor b, Tensor rowptr, Tensor col, '
            'Tensor row, Tensor colptr, Tensor csc_row, Tensor csc_perm) -> '
            'Tensor')


def _sddmm_csr_kernel(a, b, rowptr, col, row, colptr, csc_row, csc_perm):
    return _lib.op('sddmm_dot')(a, b, row, col)


def _csr_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _csr_backward(ctx, grad):
    a, b, rowptr, col, row, colptr, csc_row, csc_perm = ctx.saved_tensors
    grad = grad.contiguous()
    spmm = _lib.op('spmm')
    ga = gb = None
    if ctx.needs_input_grad[0]:  # over the rows: sum_e grad[e] * b[col[e]]
        ga = spmm(rowptr, col, grad, None, b, None, None, None)
    if ctx.needs_input_grad[1]:  # over the columns, through csc_perm
        gb = spmm(colptr, csc_row, grad, csc_perm, a, None, None, None)
    return (ga, gb) + (None, ) * 6


_lib.register('sddmm_csr',
              fake=lambda a, b, rowptr, col, row, colptr, csc_row, csc_perm:
              a.new_empty((col.shape[0], a.shape[1])),
              backward=_csr_backward, setup_context=_csr_setup_context,
              autocast=True)
# Composite: the sddmm_dot kernel computes it (a backend kernel of the same
# name, e.g. the reference, takes precedence).
_lib._lib.impl('sddmm_csr', _sddmm_csr_kernel, 'CompositeExplicitAutograd')


def sddmm_csr(rowptr: Tensor, col: Tensor, a: Tensor, b: Tensor,
              csc: Optional[CSC] = None, row: Optional[Tensor] = None,
              validate: bool = True) -> Tensor:
    r"""Per-edge dot products over a CSR graph (rows = destinations):
    ``out[e] = <a[i], b[col[e]]>`` per head, for each edge ``e`` of row ``i``.

    Args:
        rowptr: [N + 1], col: [E] (int32/int64).
        a: [N, H, C] (or [N, C]), b: [Ns, H, C] (or [Ns, C]), one dtype.
        csc: the transpose (:func:`csr_to_csc` with ``Ns`` columns), which
            the backward walks; built now when None.
        row: [E] the row of each edge (N past ``rowptr[N]``), computed when
            None.
        validate: check ``rowptr``/``col`` (one host sync).

    Returns:
        [E, H] (or [E]), in CSR order; 0 at positions past ``rowptr[N]``.
        Differentiable in ``a`` and ``b``; no sort, no atomics.
    """
    check_tensor(rowptr, 'rowptr', dims=(1, ), floating=False)
    check_tensor(col, 'col', dims=(1, ), floating=False)
    check_tensor(a, 'a', dims=(2, 3), floating=True)
    check_tensor(b, 'b', dims=(a.dim(), ), floating=True)
    check_same_device(rowptr=rowptr, col=col, a=a, b=b)
    rowptr, col = index_pair(rowptr, col)
    N = rowptr.numel() - 1
    if a.size(0) != N:
        raise ValueError(f'`a` must have one row per CSR row ({N}), got '
                         f'{a.size(0)}')
    if a.shape[1:] != b.shape[1:]:
        raise ValueError(f'`a` and `b` must agree beyond dim 0, got '
                         f'{tuple(a.shape)} and {tuple(b.shape)}')
    if a.dtype != b.dtype and not torch.is_autocast_enabled(a.device.type):
        raise TypeError(f'`a` and `b` must have one dtype, got {a.dtype} and '
                        f'{b.dtype}')
    if validate:
        check_csr(rowptr, col, col.numel(), b.size(0))
        check_csc(csc, rowptr, col, b.size(0))
    csc = maybe_csc(csc, rowptr, col, b.size(0))
    if row is None:
        row = rows_of(rowptr, col.numel())
    squeeze = a.dim() == 2
    if squeeze:
        a, b = a.unsqueeze(1), b.unsqueeze(1)
    out = _lib.op('sddmm_csr')(a, b, rowptr, col, row.to(rowptr.dtype),
                               csc.colptr, csc.row, csc.perm)
    return out.squeeze(-1) if squeeze else out


def sddmm(a: Tensor, b: Tensor, a_idx: Tensor, b_idx: Tensor, op: str = 'dot',
          validate: bool = True) -> Tensor:
    r"""Per-edge scores from node features (sampled dense-dense product).

    ``op='dot'``: ``out[e] = sum_c a[a_idx[e], ..., c] * b[b_idx[e], ..., c]``
    with ``a`` [Na, C] or [Na, H, C] and ``b`` [Nb, C] or [Nb, H, C]; the
    result is [E] or [E, H]. ``op='add'``: ``a[a_idx] + b[b_idx]`` for [N] or
    [N, H] inputs (GAT's per-node attention terms). Differentiable in ``a``
    and ``b``; ``validate`` checks the index ranges (one host sync).
    """
    if op not in ('dot', 'add'):
        raise ValueError(f"`op` must be 'dot' or 'add', got {op!r}")
    check_tensor(a, 'a', dims=(1, 2) if op == 'add' else (2, 3), floating=True)
    check_tensor(b, 'b', dims=(a.dim(), ), floating=True)
    check_tensor(a_idx, 'a_idx', dims=(1, ), floating=False)
    check_tensor(b_idx, 'b_idx', dims=(1, ), floating=False)
    check_same_device(a=a, b=b, a_idx=a_idx, b_idx=b_idx)
    if a_idx.numel() != b_idx.numel():
        raise ValueError(f'`a_idx` and `b_idx` must have the same length, got '
                         f'{a_idx.numel()} and {b_idx.numel()}')
    if a.shape[1:] != b.shape[1:]:
        raise ValueError(f'`a` and `b` must agree beyond dim 0, got '
                         f'{tuple(a.shape)} and {tuple(b.shape)}')
    if validate:
        check_index(a_idx, a.size(0), 'a_idx')
        check_index(b_idx, b.size(0), 'b_idx')
    if op == 'add':
        return a[a_idx] + b[b_idx]
    if a.dtype != b.dtype:
        raise TypeError(f'`a` and `b` must have one dtype, got {a.dtype} and '
                        f'{b.dtype}')
    if a_idx.dtype != b_idx.dtype:
        a_idx, b_idx = a_idx.long(), b_idx.long()
    squeeze = a.dim() == 2
    if squeeze:
        a, b = a.unsqueeze(1), b.unsqueeze(1)
    out = _lib.op('sddmm_dot')(a, b, a_idx, b_idx)
    return out.squeeze(-1) if squeeze else out

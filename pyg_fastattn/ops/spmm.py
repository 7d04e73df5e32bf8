"""``spmm`` (weighted aggregation over CSR rows) and ``segment_sum``."""
from typing import Optional

import torch
from torch import Tensor

from . import _lib
from ._checks import (_tracing, check_csc, check_csr, check_same_device,
                      check_tensor, index_pair)
from .csr import CSC, maybe_csc, rows_of

# out[i, h, :] = sum_{e in row i} w[h] * values[col[e], h, :], where
# w = weight[weight_perm[e], h] if weight_perm is given, weight[e, h] if
# not, and 1 without weight. -> [N, H, C]. Empty rows give 0.
# colptr/csc_row/csc_perm: the transpose, read only by the backward.
_lib.define('spmm(Tensor rowptr, Tensor col, Tensor? weight, '
            'Tensor? weight_perm, Tensor values, Tensor? colptr, '
            'Tensor? csc_row, Tensor? csc_perm) -> Tensor')
# out[i, h] = sum_{k in row i} src[perm[k] if perm else k, h]  -> [N, H].
_lib.define('segment_sum(Tensor rowptr, Tensor? perm, Tensor src) -> Tensor')


def _spmm_fake(rowptr, col, weight, weight_perm, values, colptr=None,
               csc_row=None, csc_perm=None):
    return values.new_empty((rowptr.shape[0] - 1, ) + values.shape[1:])


def _spmm_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _spmm_backward(ctx, grad_out):
    rowptr, col, weight, weight_perm, values, *csc = ctx.saved_tensors
    grad_out = grad_out.contiguous()
    gw = gv = None
    if ctx.needs_input_grad[2]:
        row = rows_of(rowptr, col.numel())
        gw = _lib.op('sddmm_dot')(grad_out, values, row, col)
        if weight_perm is not None:  # w[e] = weight[weight_perm[e]]
            gw = torch.zeros_like(weight).index_put_((weight_perm.long(), ),
                                                     gw)
    if ctx.needs_input_grad[4]:
        t = maybe_csc(list(csc) + [None], rowptr, col, values.size(0))
        wperm = None
        if weight is not None:
            wperm = t.perm if weight_perm is None else weight_perm[t.perm.long()]
        gv = _lib.op('spmm')(t.colptr, t.row, weight, wperm, grad_out, None,
                              None, None)
    return None, None, gw, None, gv, None, None, None


def _segment_sum_setup_context(ctx, inputs, output):
    rowptr, perm, src = inputs
    ctx.save_for_backward(rowptr, perm)
    ctx.num_src = src.size(0)


def _segment_sum_backward(ctx, grad_out):
    rowptr, perm = ctx.saved_tensors
    n = perm.numel() if perm is not None else ctx.num_src
    row = rows_of(rowptr, n).long()  # N outside every row: gets 0
    g = torch.cat([grad_out, grad_out.new_zeros((1, grad_out.size(1)))])[row]
    if perm is not None:  # a permutation: plain writes, deterministic
        g = g.new_zeros((ctx.num_src, g.size(1))).index_put_((perm.long(), ), g)
    return None, None, g


_lib.register('spmm', fake=_spmm_fake, backward=_spmm_backward,
              setup_context=_spmm_setup_context, autocast=True)
_lib.register('segment_sum',
              fake=lambda rowptr, perm, src: src.new_empty(
                  (rowptr.shape[0] - 1, src.shape[1])),
              backward=_segment_sum_backward,
              setup_context=_segment_sum_setup_context, autocast=True)


def spmm(rowptr: Tensor, col: Tensor, weights: Optional[Tensor], values: Tensor,
         csc: Optional[CSC] = None, validate: bool = True) -> Tensor:
    r"""Weighted aggregation over a CSR graph:
    ``out[i] = sum_{e in row i} weights[e] * values[col[e]]``.

    Args:
        rowptr: [N + 1], col: [E] (int32/int64), edges sorted by row.
        weights: [E] or [E, H], or ``None`` for a plain sum.
        values: [Ns, C] or [Ns, H, C].
        csc: the transpose from :func:`csr_to_csc`, reused by backward; built
            on the fly when ``None``.
        validate: check ``rowptr``/``col`` (one host sync).

    Returns:
        [N, C] or [N, H, C]. Empty rows give 0. Differentiable in ``weights``
        and ``values``.
    """
    check_tensor(rowptr, 'rowptr', dims=(1, ), floating=False)
    check_tensor(col, 'col', dims=(1, ), floating=False)
    check_tensor(values, 'values', dims=(2, 3), floating=True)
    if weights is not None:
        check_tensor(weights, 'weights', dims=(1, 2), floating=True)
        if weights.size(0) != col.numel():
            raise ValueError(f'`weights` must have one row per edge '
                             f'({col.numel()}), got {weights.size(0)}')
    check_same_device(rowptr=rowptr, col=col, weights=weights, values=values)
    rowptr, col = index_pair(rowptr, col)
    if validate:
        check_csr(rowptr, col, col.numel(), values.size(0))
        check_csc(csc, rowptr, col, values.size(0))
    squeeze = values.dim() == 2
    v = values.unsqueeze(1) if squeeze else values
    w = weights
    if w is not None:
        w = w.to(v.dtype)
        if w.dim() == 1:
            w = w.unsqueeze(1).expand(-1, v.size(1)).contiguous()
        elif w.size(1) != v.size(1):
            raise ValueError(f'`weights` has {w.size(1)} heads but `values` '
                             f'has {v.size(1)}')
    csc_args = tuple(csc)[:3] if csc is not None else (None, ) * 3
    out = _lib.op('spmm')(rowptr, col, w, None, v, *csc_args)
    return out.squeeze(1) if squeeze else out


def segment_sum(rowptr: Tensor, src: Tensor, perm: Optional[Tensor] = None,
                validate: bool = True) -> Tensor:
    r"""Deterministic per-row sum: ``out[i] = sum_{k in row i} src[perm[k]]``
    (``src[k]`` without ``perm``).

    Args:
        rowptr: [N + 1] (int32/int64), ending at most at ``E``, the length
            of ``perm`` (or ``src.size(0)`` without it); entries past
            ``rowptr[N]`` are not read.
        src: [E, F] (or [Ns, F] with ``perm``).
        perm: [E] distinct indices into ``src`` (int32/int64), or None.
        validate: check ``rowptr`` and ``perm`` (host syncs).

    Returns:
        [N, F]; empty rows give 0. Differentiable in ``src``.
    """
    check_tensor(rowptr, 'rowptr', dims=(1, ), floating=False)
    check_tensor(src, 'src', dims=(2, ), floating=True)
    if perm is not None:
        check_tensor(perm, 'perm', dims=(1, ), floating=False)
        check_same_device(rowptr=rowptr, src=src, perm=perm)
        if perm.dtype != rowptr.dtype:
            perm = perm.to(rowptr.dtype)
    else:
        check_same_device(rowptr=rowptr, src=src)
    if validate:
        n = src.size(0) if perm is None else perm.numel()
        check_csr(rowptr, perm, n, src.size(0), col_name='perm', tail=True)
        if (perm is not None and perm.numel() > 0 and not _tracing()
                and bool(torch.bincount(perm.long()).max() > 1)):
            raise ValueError('`perm` must not repeat an index (each row of '
                             '`src` is read once)')
    return _lib.op('segment_sum')(rowptr, perm, src)

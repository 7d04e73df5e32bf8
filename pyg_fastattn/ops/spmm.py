from typing import Optional

import torch
from torch import Tensor

from .. import _build
from ._checks import check_csr, check_same_device, check_tensor, index_pair
from .csr import CSC, csc_parts, maybe_csc, rows_of


class SpMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rowptr, col, colptr, row_t, perm, inv, weight, values):
        ctx.save_for_backward(rowptr, col, colptr, row_t, perm, inv, weight,
                              values)
        return _build.backend_for(values.device).spmm(rowptr, col, weight, None, values)

    @staticmethod
    def backward(ctx, grad_out):
        rowptr, col, *csc, weight, values = ctx.saved_tensors
        K = _build.backend_for(values.device)
        grad_out = grad_out.contiguous()
        gw = gv = None
        if ctx.needs_input_grad[6]:
            row = rows_of(rowptr, col.numel())
            gw = K.sddmm_dot(grad_out, values, row, col)
        if ctx.needs_input_grad[7]:
            csc = maybe_csc(csc, rowptr, col, values.size(0))
            wperm = csc.perm if weight is not None else None
            gv = K.spmm(csc.colptr, csc.row, weight, wperm, grad_out)
        return None, None, None, None, None, None, gw, gv


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
    out = SpMM.apply(rowptr, col, *csc_parts(csc), w, v)
    return out.squeeze(1) if squeeze else out


class SegmentSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rowptr, perm, src):
        ctx.save_for_backward(rowptr, perm)
        ctx.num_src = src.size(0)
        return _build.backend_for(src.device).segment_sum(rowptr, perm, src)

    @staticmethod
    def backward(ctx, grad_out):
        rowptr, perm = ctx.saved_tensors
        n = perm.numel() if perm is not None else ctx.num_src
        row = rows_of(rowptr, n).long()  # N outside every row: gets 0
        g = torch.cat([grad_out, grad_out.new_zeros((1, grad_out.size(1)))])[row]
        if perm is not None:  # a permutation: plain writes, deterministic
            g = g.new_zeros((ctx.num_src, g.size(1))).index_put_((perm.long(), ), g)
        return None, None, g


def segment_sum(rowptr: Tensor, src: Tensor,
                perm: Optional[Tensor] = None) -> Tensor:
    r"""Deterministic per-row sum: ``out[i] = sum_{k in row i} src[perm[k]]``
    (``src[k]`` without ``perm``). ``src`` [E, F] -> [N, F]. Differentiable in
    ``src``; ``perm`` must be a permutation (each source read once)."""
    if perm is not None and perm.dtype != rowptr.dtype:
        perm = perm.to(rowptr.dtype)
    if src.device.type == 'cpu' and src.dtype in (torch.float16, torch.bfloat16):
        return SegmentSum.apply(rowptr, perm, src.float()).to(src.dtype)
    return SegmentSum.apply(rowptr, perm, src)

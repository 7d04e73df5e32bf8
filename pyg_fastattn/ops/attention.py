"""``attention`` (GAT's fused score + row softmax + aggregation) and its
backward, and ``softmax_aggregate`` on top of it."""
from typing import Optional

from torch import Tensor

from ..reference import _opmath
from . import _lib
from ._checks import (cast_to, check_csc, check_csr, check_same_device,
                      check_tensor, index_pair)
from .csr import CSC, maybe_csc

# For each row i (destination) and edge e = (j -> i) in it, per head h:
#   z[e] = a_src[j] + a_dst[i] + a_edge[e]      (absent terms are 0)
#   s[e] = z[e] > 0 ? z[e] : negative_slope * z[e]   (1.0: identity)
#   alpha = softmax over the row of s;  p[e] = alpha[e] * mask[e]
#   out[i] = sum_e p[e] * values[j]              -> out [N, H, C]
#   lse[i] = log sum_e exp(s[e])                 -> [N, H], float32 (float64)
# Empty rows and rows whose s are all -inf give out = 0, lse = -inf; a NaN
# (or +inf) s makes its row's out and lse NaN, and the backward passes the
# NaN on to that row's gradients (as autograd through a softmax). bias
# (H * C elements, values' dtype) is added to every row of out (empty ones
# too) in the same store. colptr/csc_row/csc_perm/csc_inv: the transpose
# (csr_to_csc), read only by the backward (built there when absent).
_lib.define(
    'attention(Tensor rowptr, Tensor col, Tensor? a_src, Tensor? a_dst, '
    'Tensor? a_edge, Tensor? mask, Tensor values, float negative_slope, '
    'Tensor? bias, Tensor? colptr, Tensor? csc_row, Tensor? csc_perm, '
    'Tensor? csc_inv) -> (Tensor, Tensor)')
# (No defaults in differentiable ops: the dispatcher drops arguments equal to
# their defaults, and the autograd formula must see every input.)
# Gradients, in one pass over the transpose (colptr [Ns+1], row [E], perm
# [E]: CSR row and CSR position of each CSC entry), alpha recomputed from
# lse:
#   g[e] = mask[e] * <grad_out[i, h], values[j, h]>
#   grad_s[e] = alpha[e] * (g[e] - <grad_out[i, h], out[i, h] - bias>)
#   grad_z[e] = grad_s[e] * (z[e] > 0 ? 1 : negative_slope)
#   grad_values[j] = sum_{e = (j -> i)} alpha[e] * mask[e] * grad_out[i]
#   grad_a_src[j] = sum_{e = (j -> i)} grad_z[e]
# Returns (grad_values [Ns, H, C], grad_z [E, H], grad_a_src [Ns, H]).
# grad_z is in CSC order (entry k for CSC entry k; 0 at k >= colptr[Ns];
# coalesced writes), or in CSR order with grad_z_csr (0 at e >= rowptr[N]).
# grad_a_dst is the CSR row sum of grad_z (in CSC order: of grad_z[inv]).
_lib.define(
    'attention_backward(Tensor rowptr, Tensor col, Tensor colptr, '
    'Tensor row, Tensor perm, Tensor? a_src, Tensor? a_dst, Tensor? a_edge, '
    'Tensor? mask, Tensor values, float negative_slope, Tensor out, '
    'Tensor lse, Tensor grad_out, bool grad_z_csr=False, Tensor? bias=None) '
    '-> (Tensor, Tensor, Tensor)')


def _fake(rowptr, col, a_src, a_dst, a_edge, mask, values, negative_slope,
          bias=None, colptr=None, csc_row=None, csc_perm=None, csc_inv=None):
    N, H = rowptr.shape[0] - 1, values.shape[1]
    out = values.new_empty((N, H, values.shape[2]))
    lse = values.new_empty((N, H),
                           dtype=_opmath(values.dtype))
    return out, lse


def _fake_backward(rowptr, col, colptr, row, perm, a_src, a_dst, a_edge,
                   mask, values, negative_slope, out, lse, grad_out,
                   grad_z_csr=False, bias=None):
    Ns, H = values.shape[0], values.shape[1]
    return (values.new_empty(values.shape),
            values.new_empty((col.shape[0], H)), values.new_empty((Ns, H)))


def _setup_context(ctx, inputs, output):
    (rowptr, col, a_src, a_dst, a_edge, mask, values, slope, bias, *csc) = inputs
    out, lse = output
    ctx.save_for_backward(rowptr, col, a_src, a_dst, a_edge, mask, values,
                          bias, _lib.keep_output(ctx, out), lse, *csc)
    ctx.negative_slope = slope
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # no zeros for lse's gradient


def _backward(ctx, grad_out, _grad_lse):
    if grad_out is None:
        return (None, ) * 13
    (rowptr, col, a_src, a_dst, a_edge, mask, values, bias, out, lse,
     *csc) = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_edge = need[4]
    out = _lib.kept_output(ctx, out, lambda: _lib.op('attention')(
        rowptr, col, a_src, a_dst, a_edge, mask, values, ctx.negative_slope,
        bias, *csc)[0])
    csc = maybe_csc(csc, rowptr, col, values.size(0))
    g_values, g_z, g_src = _lib.op('attention_backward')(
        rowptr, col, csc.colptr, csc.row, csc.perm, a_src, a_dst, a_edge, mask,
        values, ctx.negative_slope, out, lse, grad_out.contiguous(), need_edge,
        bias)
    g_dst = None
    if need[3]:  # CSR row sums; csc.inv maps CSR positions to CSC order
        g_dst = _lib.op('segment_sum')(rowptr, None if need_edge else csc.inv,
                                       g_z)
    g_bias = None
    if need[8]:
        g_bias = _lib.op('column_sum')(
            grad_out.reshape(-1, bias.numel())).view(bias.shape)
    return (None, None, g_src if need[2] else None, g_dst,
            g_z if need_edge else None, None,
            g_values if need[6] else None, None, g_bias) + (None, ) * 4


_lib.register('attention', fake=_fake, backward=_backward,
              setup_context=_setup_context, autocast=True)
_lib.register('attention_backward', fake=_fake_backward)


def attention(rowptr: Tensor, col: Tensor, values: Tensor,
              a_src: Optional[Tensor] = None, a_dst: Optional[Tensor] = None,
              a_edge: Optional[Tensor] = None, mask: Optional[Tensor] = None,
              negative_slope: float = 0.2, csc: Optional[CSC] = None,
              return_lse: bool = False):
    r"""GAT attention over a CSR graph (rows = destinations), in one kernel.

    Per edge ``e = (j -> i)`` and head ``h``::

        z = a_src[j] + a_dst[i] + a_edge[e]     (absent terms are 0)
        s = leaky_relu(z, negative_slope)
        alpha = softmax of s over row i
        out[i] = sum_e alpha * mask[e] * values[j]

    ``values`` [Ns, H, C]; ``a_src`` [Ns, H]; ``a_dst`` [N, H]; ``a_edge`` and
    ``mask`` [E, H] in CSR order (``mask`` is a dropout multiplier, no grad).
    Returns ``out`` [N, H, C] (and the row log-sum-exp [N, H] when
    ``return_lse``). Never allocates [E, H, C]. Indices are NOT validated here
    (callers validate once, e.g. when a graph is prepared); kernels still clamp
    them, so bad indices cannot touch memory out of bounds.
    """
    dt = values.dtype
    args = cast_to(dt, a_src, a_dst, a_edge, mask)
    csc_args = tuple(csc) if csc is not None else (None, ) * 4
    out, lse = _lib.op('attention')(rowptr, col, *args, values,
                                    float(negative_slope), None, *csc_args)
    return (out, lse) if return_lse else out


def softmax_aggregate(rowptr: Tensor, col: Tensor, scores: Tensor,
                      values: Tensor, csc: Optional[CSC] = None,
                      validate: bool = True) -> Tensor:
    r"""Softmax over each row's edge scores and weighted sum of neighbour
    values, in one pass:
    ``out[i] = sum_{e in row i} softmax_row(scores)[e] * values[col[e]]``.

    Args:
        rowptr: [N + 1], col: [E] (int32/int64), edges sorted by row.
        scores: [E] or [E, H].
        values: [Ns, C] (with [E] scores) or [Ns, H, C].
        csc: the transpose (:func:`csr_to_csc`), reused by backward.
        validate: check ``rowptr``/``col`` (one host sync).

    Returns:
        [N, C] or [N, H, C]; empty rows give 0. Differentiable in ``scores``
        and ``values``. Never allocates anything of size E x C.
    """
    check_tensor(rowptr, 'rowptr', dims=(1, ), floating=False)
    check_tensor(col, 'col', dims=(1, ), floating=False)
    check_tensor(scores, 'scores', dims=(1, 2), floating=True)
    check_tensor(values, 'values', dims=(scores.dim() + 1, ), floating=True)
    check_same_device(rowptr=rowptr, col=col, scores=scores, values=values)
    if scores.size(0) != col.numel():
        raise ValueError(f'`scores` must have one row per edge ({col.numel()}),'
                         f' got {scores.size(0)}')
    if scores.dim() == 2 and scores.size(1) != values.size(1):
        raise ValueError(f'`scores` has {scores.size(1)} heads but `values` has '
                         f'{values.size(1)}')
    rowptr, col = index_pair(rowptr, col)
    if validate:
        check_csr(rowptr, col, col.numel(), values.size(0))
        check_csc(csc, rowptr, col, values.size(0))
    squeeze = scores.dim() == 1
    if squeeze:
        scores, values = scores.unsqueeze(1), values.unsqueeze(1)
    out = attention(rowptr, col, values, a_edge=scores, negative_slope=1.0,
                    csc=csc)
    return out.squeeze(1) if squeeze else out

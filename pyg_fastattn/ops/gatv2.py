"""``gatv2_attention``: GATv2's fused score, row softmax and aggregation, and
its backward. Kernels: ``csrc/cpu/gatv2_cpu.cpp``, ``csrc/cuda/gatv2.cu``,
or :func:`pyg_fastattn.reference.gatv2_attention`."""
from typing import Optional, Tuple

from torch import Tensor

from ..reference import _opmath
from . import _lib
from ._checks import (cast_to, check_csc, check_csr, check_same_device,
                      check_tensor, index_pair)
from .csr import CSC, maybe_csc

# For each row i (destination) and edge e = (j -> i) in it, per head h and
# channel c:
#   z[e, h, c] = x_l[j, h, c] + x_r[i, h, c] + edge_term[e, h, c]  (if given)
#   s[e, h] = sum_c att[h, c] * leaky_relu(z[e, h, c], negative_slope)
#   alpha = softmax over the row of s;  p[e] = alpha[e] * mask[e]
#   out[i] = sum_e p[e] * x_l[j]                   -> out [N, H, C]
#   lse[i] = log sum_e exp(s[e])                   -> [N, H], float32 (float64)
# x_l [Ns, H, C], x_r [N, H, C], edge_term [E, H, C] and mask [E, H] in CSR
# order, att [H, C]. Empty rows give out = 0, lse = -inf. bias (H * C
# elements, x_l's dtype) is added to every row of out (empty ones too) in the
# same store. Nothing of size [E, H, C] is stored. colptr/csc_row/csc_perm:
# the transpose (csr_to_csc), read only by the backward (built there when
# absent). max_row_len / max_col_len: the longest CSR row / CSC column when
# known, else -1 (a hint: CUDA skips its long-row split path when no row
# needs it; results do not change).
_lib.define(
    'gatv2_attention(Tensor rowptr, Tensor col, Tensor x_l, Tensor x_r, '
    'Tensor? edge_term, Tensor att, Tensor? mask, float negative_slope, '
    'Tensor? bias, Tensor? colptr, Tensor? csc_row, Tensor? csc_perm, '
    'int max_row_len, int max_col_len) -> (Tensor, Tensor)')
# (No defaults: the dispatcher drops arguments equal to their defaults, and
# the autograd formula must see every input.)
# Gradients, alpha recomputed from lse:
#   g[e] = mask[e] * <grad_out[i, h], x_l[j, h]>
#   grad_s[e] = alpha[e] * (g[e] - <grad_out[i, h], out[i, h] - bias[h]>)
#   grad_z[e, h, c] = grad_s[e, h] * att[h, c] * leaky_relu'(z[e, h, c])
#   grad_x_r[i] = sum_{e in row i} grad_z[e];  grad_edge_term[e] = grad_z[e]
#   grad_att[h, c] = sum_e grad_s[e, h] * leaky_relu(z[e, h, c])
#   grad_x_l[j] = sum_{e = (j -> i)} p[e] * grad_out[i] + grad_z[e]
# Pass 1 by destination row (grad_s [E, H] kept, grad_x_r, grad_edge_term,
# grad_att as fixed partials), pass 2 over the transpose (colptr [Ns + 1],
# csc_row, csc_perm) for grad_x_l: every output has one writer, no atomics.
# Returns (grad_x_l [Ns, H, C], grad_x_r [N, H, C], grad_edge_term [E, H, C]
# in CSR order (0 outside every row; empty [0] unless need_edge), grad_att
# [H, C]). grad_bias (the column sum of grad_out) is left to the caller.
# max_row_len / max_col_len: as in the forward.
_lib.define(
    'gatv2_attention_backward(Tensor rowptr, Tensor col, Tensor colptr, '
    'Tensor csc_row, Tensor csc_perm, Tensor x_l, Tensor x_r, '
    'Tensor? edge_term, Tensor att, Tensor? mask, float negative_slope, '
    'Tensor? bias, Tensor out, Tensor lse, Tensor grad_out, bool need_edge, '
    'int max_row_len, int max_col_len) -> (Tensor, Tensor, Tensor, Tensor)')


def _fake(rowptr, col, x_l, x_r, edge_term, att, mask, negative_slope, bias,
          colptr, csc_row, csc_perm, max_row_len, max_col_len):
    N, H, C = rowptr.shape[0] - 1, x_l.shape[1], x_l.shape[2]
    out = x_l.new_empty((N, H, C))
    lse = x_l.new_empty((N, H), dtype=_opmath(x_l.dtype))
    return out, lse


def _fake_backward(rowptr, col, colptr, csc_row, csc_perm, x_l, x_r,
                   edge_term, att, mask, negative_slope, bias, out, lse,
                   grad_out, need_edge, max_row_len, max_col_len):
    g_edge = (x_l.new_empty(edge_term.shape) if need_edge
              and edge_term is not None else x_l.new_empty((0, )))
    return (x_l.new_empty(x_l.shape), x_l.new_empty(x_r.shape), g_edge,
            x_l.new_empty(att.shape))


def _setup_context(ctx, inputs, output):
    (rowptr, col, x_l, x_r, edge_term, att, mask, slope, bias, colptr,
     csc_row, csc_perm, *lengths) = inputs
    out, lse = output
    ctx.save_for_backward(rowptr, col, x_l, x_r, edge_term, att, mask, bias,
                          _lib.keep_output(ctx, out), lse, colptr, csc_row,
                          csc_perm)
    ctx.negative_slope = slope
    ctx.lengths = lengths
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # no zeros for lse's gradient


def _backward(ctx, grad_out, _grad_lse):
    if grad_out is None:
        return (None, ) * 14
    (rowptr, col, x_l, x_r, edge_term, att, mask, bias, out, lse,
     *csc) = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_edge = bool(need[4]) and edge_term is not None
    out = _lib.kept_output(ctx, out, lambda: _lib.op('gatv2_attention')(
        rowptr, col, x_l, x_r, edge_term, att, mask, ctx.negative_slope, bias,
        *csc, *ctx.lengths)[0])
    csc = maybe_csc(list(csc) + [None], rowptr, col, x_l.size(0))
    g_l, g_r, g_e, g_att = _lib.op('gatv2_attention_backward')(
        rowptr, col, csc.colptr, csc.row, csc.perm, x_l, x_r, edge_term, att,
        mask, ctx.negative_slope, bias, out, lse, grad_out.contiguous(),
        need_edge, *ctx.lengths)
    g_bias = None
    if need[8]:
        g_bias = _lib.op('column_sum')(
            grad_out.reshape(-1, bias.numel())).view(bias.shape)
    return (None, None, g_l if need[2] else None, g_r if need[3] else None,
            g_e if need_edge else None, g_att if need[5] else None, None,
            None, g_bias) + (None, ) * 5


_lib.register('gatv2_attention', fake=_fake, backward=_backward,
              setup_context=_setup_context, autocast=True,
              native_autograd=True)
_lib.register('gatv2_attention_backward', fake=_fake_backward)


def gatv2_attention(rowptr: Tensor, col: Tensor, x_l: Tensor, x_r: Tensor,
                    att: Tensor, edge_term: Optional[Tensor] = None,
                    mask: Optional[Tensor] = None,
                    negative_slope: float = 0.2, csc: Optional[CSC] = None,
                    return_lse: bool = False, validate: bool = True,
                    bias: Optional[Tensor] = None,
                    max_lengths: Tuple[int, int] = (-1, -1)):
    r"""GATv2 attention over a CSR graph (rows = destinations), fused.

    Per edge ``e = (j -> i)`` and head ``h``::

        z = x_l[j] + x_r[i] + edge_term[e]           (edge_term optional)
        s = sum_c att[h, c] * leaky_relu(z[h, c], negative_slope)
        alpha = softmax of s over row i
        out[i] = sum_e alpha * mask[e] * x_l[j] + bias

    Args:
        rowptr: [N + 1], col: [E] (int32/int64), edges sorted by row.
        x_l: [Ns, H, C] source features (also the values).
        x_r: [N, H, C] destination features.
        att: [H, C] or [1, H, C].
        edge_term: [E, H, C] in CSR order (``lin_edge(edge_attr)``).
        mask: [E, H] dropout multiplier in CSR order (no gradient).
        csc: the transpose (:func:`csr_to_csc`), reused by backward.
        validate: check ``rowptr``/``col`` values (one host sync).
        bias: H * C elements added to every row of ``out`` (empty rows
            too) as the kernel stores it.
        max_lengths: the longest row and column of the graph, or -1 where
            unknown (:attr:`PreparedGraph.max_lengths`); a hint that saves
            host time on CUDA, never changing the result. It must not
            understate them.

    Returns:
        ``out`` [N, H, C] (and the row log-sum-exp [N, H] when
        ``return_lse``). Differentiable in ``x_l``, ``x_r``, ``edge_term``,
        ``att`` and ``bias``; the scores are computed on the fly, nothing of
        size [E, H, C] is stored in forward or backward (besides the gradient
        of ``edge_term``).
    """
    check_tensor(rowptr, 'rowptr', dims=(1, ), floating=False)
    check_tensor(col, 'col', dims=(1, ), floating=False)
    check_tensor(x_l, 'x_l', dims=(3, ), floating=True)
    check_tensor(x_r, 'x_r', dims=(3, ), floating=True)
    check_tensor(att, 'att', dims=(2, 3), floating=True)
    check_same_device(rowptr=rowptr, col=col, x_l=x_l, x_r=x_r, att=att,
                      edge_term=edge_term, mask=mask, bias=bias)
    H, C = x_l.shape[1], x_l.shape[2]
    if tuple(att.shape[-2:]) != (H, C) or att.numel() != H * C:
        raise ValueError(f'`att` must be [H, C] or [1, H, C] = [{H}, {C}] '
                         f'(x_l\'s heads and channels), got shape '
                         f'{tuple(att.shape)}')
    if bias is not None and bias.numel() != H * C:
        raise ValueError(f'`bias` must have H * C = {H * C} elements, got '
                         f'shape {tuple(bias.shape)}')
    rowptr, col = index_pair(rowptr, col)
    if validate:
        check_csr(rowptr, col, col.numel(), x_l.size(0))
        check_csc(csc, rowptr, col, x_l.size(0))
    dt = x_l.dtype
    x_r, edge_term, att, mask, bias = cast_to(dt, x_r, edge_term,
                                              att.reshape(H, C), mask, bias)
    csc_args = tuple(csc)[:3] if csc is not None else (None, ) * 3
    out, lse = _lib.op('gatv2_attention')(rowptr, col, x_l, x_r, edge_term,
                                          att, mask, float(negative_slope),
                                          bias, *csc_args,
                                          int(max_lengths[0]),
                                          int(max_lengths[1]))
    return (out, lse) if return_lse else out

"""``gat_attention``: GAT's attention layer core as one op (what
``FastGATConv`` calls). Kernels: ``csrc/ops/gat_attention.cpp`` (CPU and
CUDA) or :func:`pyg_fastattn.reference.gat_attention`."""
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..reference import _opmath
from . import _lib
from .csr import CSC, maybe_csc

# Per edge e = (j -> i) and head h, with h_src = x @ weight.t() when weight
# is given (x may be float32 beside a float16/bfloat16 weight, as autocast
# passes it: x is cast inside, its gradient is float32):
# a_src[j] = <h_src[j, h], att_src[0, h]>, a_dst[i] likewise from
# h_dst (or from h_src with dst_is_src; absent when neither), then
# ``attention`` with values h_src and the bias added in its store.
# Returns (out [N, H, C], lse [N, H] float32/64, h_src [Ns, H, C] when
# computed from x (else empty), a_src [Ns, H], a_dst [N, H] (or empty)); the
# last three are saved for the backward. colptr/csc_row/csc_perm/csc_inv: the
# transpose (csr_to_csc) that the backward walks. max_row_len / max_col_len:
# the longest CSR row / CSC column when known, else -1 (a hint: CUDA skips
# its long-row split path when no row needs it; results do not change).
_lib.define(
    'gat_attention(Tensor rowptr, Tensor col, Tensor colptr, Tensor csc_row, '
    'Tensor csc_perm, Tensor csc_inv, Tensor? x, Tensor? weight, '
    'Tensor? h_src, Tensor att_src, Tensor? h_dst, Tensor att_dst, '
    'Tensor? a_edge, Tensor? mask, Tensor? bias, float negative_slope, '
    'bool dst_is_src, int max_row_len, int max_col_len) '
    '-> (Tensor, Tensor, Tensor, Tensor, Tensor)')
# Gradients of (x, weight, h_src, att_src, h_dst, att_dst, a_edge, bias), each
# empty where output_mask is false or the input was None. ``h`` is h_src
# (given or computed), ``a_edge``'s gradient is in CSR order.
_lib.define(
    'gat_attention_backward(Tensor grad_out, Tensor rowptr, Tensor col, '
    'Tensor colptr, Tensor csc_row, Tensor csc_perm, Tensor csc_inv, '
    'Tensor? x, Tensor? weight, Tensor h, Tensor att_src, Tensor? h_dst, '
    'Tensor att_dst, Tensor a_src, Tensor a_dst, Tensor? a_edge, '
    'Tensor? mask, Tensor? bias, Tensor out, Tensor lse, '
    'float negative_slope, bool dst_is_src, bool[8] output_mask, '
    'int max_row_len, int max_col_len) -> Tensor[]')


def _fake(rowptr, col, colptr, csc_row, csc_perm, csc_inv, x, weight, h_src,
          att_src, h_dst, att_dst, a_edge, mask, bias, negative_slope,
          dst_is_src, max_row_len, max_col_len):
    _, H, C = att_src.shape
    src = x if weight is not None else h_src
    Ns, N = src.shape[0], rowptr.shape[0] - 1
    dt = weight.dtype if weight is not None else src.dtype  # (x may be mixed)
    out = src.new_empty((N, H, C), dtype=dt)
    lse = src.new_empty((N, H), dtype=_opmath(dt))
    h = src.new_empty((Ns, H, C) if weight is not None else (0, ), dtype=dt)
    has_dst = dst_is_src or h_dst is not None
    return (out, lse, h, src.new_empty((Ns, H), dtype=dt),
            src.new_empty((N, H) if has_dst else (0, ), dtype=dt))


def _fake_backward(grad_out, rowptr, col, colptr, csc_row, csc_perm, csc_inv,
                   x, weight, h, att_src, h_dst, att_dst, a_src, a_dst, a_edge,
                   mask, bias, out, lse, negative_slope, dst_is_src,
                   output_mask, max_row_len, max_col_len):
    likes = (x, weight, None if weight is not None else h, att_src, h_dst,
             att_dst if (dst_is_src or h_dst is not None) else None, a_edge,
             bias)
    return [t.new_empty(t.shape) if want and t is not None else
            h.new_empty((0, )) for t, want in zip(likes, output_mask)]


def _setup_context(ctx, inputs, output):
    (rowptr, col, colptr, csc_row, csc_perm, csc_inv, x, weight, h_src,
     att_src, h_dst, att_dst, a_edge, mask, bias, slope, dst_is_src,
     *lengths) = inputs
    out, lse, h, a_src, a_dst = output
    ctx.save_for_backward(rowptr, col, colptr, csc_row, csc_perm, csc_inv, x,
                          weight, h if weight is not None else h_src, att_src,
                          h_dst, att_dst, a_src, a_dst, a_edge, mask, bias,
                          _lib.keep_output(ctx, out), lse)
    ctx.negative_slope, ctx.dst_is_src = slope, dst_is_src
    ctx.lengths = lengths
    ctx.mark_non_differentiable(lse, h, a_src, a_dst)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, _lse, _h, _a_src, _a_dst):
    if grad_out is None:
        return (None, ) * 19
    need = ctx.needs_input_grad
    output_mask = [need[6], need[7], need[8], need[9], need[10], need[11],
                   need[12], need[14]]
    s = list(ctx.saved_tensors)
    slope, dst_is_src = ctx.negative_slope, ctx.dst_is_src
    s[17] = _lib.kept_output(ctx, s[17], lambda: _lib.op('gat_attention')(
        *s[:8], None if s[7] is not None else s[8], s[9], s[10], s[11],
        *s[14:17], slope, dst_is_src, *ctx.lengths)[0])
    grads = _lib.op('gat_attention_backward')(
        grad_out, *s, slope, dst_is_src, output_mask, *ctx.lengths)
    # 1-D and empty: not needed, or the input takes no part (att_dst without
    # h_dst); an input without rows (x of a graph without nodes) gets its
    # empty gradient, as autograd gives PyG's layer
    g = [t if want and (t.numel() > 0 or t.dim() != 1) else None
         for t, want in zip(grads, output_mask)]
    return (None, ) * 6 + tuple(g[:7]) + (None, g[7]) + (None, ) * 4


_lib.register('gat_attention', fake=_fake, backward=_backward,
              setup_context=_setup_context, autocast=True,
              native_autograd=True)
_lib.register('gat_attention_backward', fake=_fake_backward)


def gat_attention(rowptr: Tensor, col: Tensor, csc: Optional[CSC],
                  h_src: Optional[Tensor], att_src: Tensor,
                  h_dst: Optional[Tensor], att_dst: Tensor,
                  a_edge: Optional[Tensor] = None,
                  mask: Optional[Tensor] = None, negative_slope: float = 0.2,
                  dst_is_src: bool = False, bias: Optional[Tensor] = None,
                  x: Optional[Tensor] = None,
                  weight: Optional[Tensor] = None,
                  max_lengths: Tuple[int, int] = (-1, -1)) -> Tensor:
    r"""GAT's attention layer core: :func:`attention` with
    ``a_src = (h_src * att_src).sum(-1)`` and ``a_dst = (h_dst *
    att_dst).sum(-1)`` computed inside one op.

    Args:
        rowptr, col: the CSR graph (rows = destinations), ``csc`` its
            transpose (built when None and autograd records; only the
            backward reads it).
        h_src: [Ns, H, C], the values; or None with ``x`` [Ns, F] and
            ``weight`` [H * C, F]: then ``h_src = x @ weight.t()`` inside the
            op (needs ``dst_is_src``).
        att_src, att_dst: [1, H, C].
        h_dst: [N, H, C], or None (no target term, or ``dst_is_src``: the
            targets are the sources).
        a_edge, mask: [E, H] in CSR order (edge score term, dropout
            multiplier).
        bias: H * C elements, added to the output by the kernel.
        max_lengths: the longest row and column of the graph, or -1 where
            unknown (:attr:`PreparedGraph.max_lengths`); a hint that saves
            host time on CUDA, never changing the result. It must not
            understate them.

    Returns:
        [N, H, C]. Indices are not validated here (see :func:`attention`).
    """
    if weight is not None and (h_src is not None or not dst_is_src):
        raise ValueError('gat_attention: `weight` computes h_src from `x` '
                         'and needs dst_is_src=True')
    src = x if weight is not None else h_src
    if csc is None and not torch.is_grad_enabled():  # no backward to read it
        csc = (rowptr.new_empty((0, )), ) * 4
    else:
        csc = maybe_csc(csc, rowptr, col, src.size(0))
    return _lib.op('gat_attention')(
        rowptr, col, *csc, x, weight, h_src, att_src, h_dst, att_dst, a_edge,
        mask, bias, float(negative_slope), bool(dst_is_src),
        int(max_lengths[0]), int(max_lengths[1]))[0]

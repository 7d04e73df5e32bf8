from typing import Optional

import torch
from torch import Tensor

from .. import _build
from ._checks import check_csr, check_same_device, check_tensor, index_pair
from .csr import CSC, csc_parts, maybe_csc


def _backward(K, rowptr, col, csc, a_src, a_dst, a_edge, mask, values, slope,
              out, lse, grad_out, need_dst: bool, need_edge: bool,
              bias=None):
    """The single CSC pass (no atomics): alpha recomputed from lse,
    grad_out[i] gathered once per edge for grad_values and the score
    gradient grad_z. Returns (grad_values, grad_a_src, grad_a_dst or None,
    grad_z in CSR order or None).

    grad_z comes in CSC order (coalesced writes) unless its per-edge values
    are needed: then the kernel writes it in CSR order (scattered writes),
    since a gather by ``inv`` afterwards costs more than the whole pass."""
    csc = maybe_csc(csc, rowptr, col, values.size(0))
    g_values, g_z, g_src = K.attention_backward(
        rowptr, col, csc.colptr, csc.row, csc.perm, a_src, a_dst, a_edge,
        mask, values, slope, out, lse, grad_out.contiguous(), need_edge, bias)
    g_dst = None
    if need_dst:  # CSR row sums; csc.inv maps CSR positions to CSC order
        g_dst = K.segment_sum(rowptr, None if need_edge else csc.inv, g_z)
    return g_values, g_src, g_dst, g_z if need_edge else None


class Attention(torch.autograd.Function):
    """Fused score + row softmax + aggregation; see ``attention``."""
    @staticmethod
    def forward(ctx, rowptr, col, colptr, row_t, perm, inv, a_src, a_dst,
                a_edge, mask, values, negative_slope):
        out, lse = _build.backend_for(values.device).attention(
            rowptr, col, a_src, a_dst, a_edge, mask, values, negative_slope)
        ctx.negative_slope = negative_slope
        ctx.save_for_backward(rowptr, col, colptr, row_t, perm, inv, a_src,
                              a_dst, a_edge, mask, values, out, lse)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zeros for lse's gradient
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        if grad_out is None:
            return (None, ) * 12
        (rowptr, col, *csc, a_src, a_dst, a_edge, mask, values, out,
         lse) = ctx.saved_tensors
        need = ctx.needs_input_grad
        g_values, g_src, g_dst, g_edge = _backward(
            _build.backend_for(values.device), rowptr, col, csc, a_src, a_dst,
            a_edge, mask, values, ctx.negative_slope, out, lse, grad_out,
            need_dst=need[7], need_edge=need[8])
        return (None, ) * 6 + (g_src if need[6] else None, g_dst, g_edge,
                               None, g_values if need[10] else None, None)


def _score_weight(att: Tensor) -> Tensor:
    """Block-diagonal [H * C, K * H] matrix B of the score vectors att
    [K, H, C], so that ``h.view(N, H * C) @ B`` = ``(h * att[k]).sum(-1)``
    for each k side by side (one GEMM reads h once)."""
    K, H, C = att.shape
    return torch.diag_embed(att.permute(2, 0, 1), dim1=0,
                            dim2=3).reshape(H * C, K * H)


def _score_weight_grad(P: Tensor, H: int, C: int, K: int) -> Tensor:
    """Gradient of att [K, H, C] in ``h.view(N, H*C) @ _score_weight(att)``
    from ``P = h.view(N, H*C).t() @ g`` [H*C, K*H] (g the output gradient;
    P comes from :func:`_flat_t_mm`, or through x when ``h = x @ W.t()``)."""
    gb = P.view(H, C, K, H)
    # contiguous: the parameters' AccumulateGrad then takes slices as they
    # are instead of copying each one into a new buffer (two more ops).
    return gb.diagonal(dim1=0, dim2=3).permute(1, 2, 0).contiguous()


def _flat_t_mm(h: Tensor, g: Tensor) -> Tensor:
    """``h.view(N, H*C).t() @ g`` for h [N, H, C]."""
    return h.reshape(h.size(0), -1).t().mm(g)


class GATAttention(torch.autograd.Function):
    """``Attention`` with GAT's per-node score terms computed inside:
    ``a_src = <h_src, att_src>``, ``a_dst = <h_dst, att_dst>`` per head, as
    one GEMM against a block-diagonal matrix B, and optionally the shared
    linear map ``h = x @ weight.t()`` and the bias. One autograd node per
    layer; backward is the CSC pass plus GEMMs for the score vectors.

    With ``weight``, no gradient for ``x`` (a first layer) and F <= 2 * H *
    C, the score terms' gradient is taken through x: ``M = x.t() @ g_a``
    [F, 2H] gives ``grad_weight = g_h.t() @ x + B @ M.t()`` and ``grad_att``
    from ``weight @ M``; one GEMM reading x replaces ``h.t() @ g_a`` and the
    update of g_h [N, H*C] by ``g_a @ B.t()`` (three passes over [N, H*C])."""
    @staticmethod
    def forward(ctx, rowptr, col, colptr, row_t, perm, inv, x, weight, h_src,
                att_src, h_dst, att_dst, a_edge, mask, bias, negative_slope,
                dst_is_src):
        _, H, C = att_src.shape
        if weight is not None:  # h = lin(x), shared by sources and targets
            h_src = x.mm(weight.t()).view(-1, H, C)
        Ns = h_src.size(0)
        if dst_is_src:  # one GEMM for both terms
            B = _score_weight(torch.cat([att_src, att_dst]))
            a = h_src.view(Ns, H * C).mm(B)
            a_src, a_dst = a[:, :H].contiguous(), a[:, H:].contiguous()
            B_dst = None
        else:
            B = _score_weight(att_src)
            a_src = h_src.view(Ns, H * C).mm(B)
            B_dst = a_dst = None
            if h_dst is not None:
                B_dst = _score_weight(att_dst)
                a_dst = h_dst.reshape(-1, H * C).mm(B_dst)
        out, lse = _build.backend_for(h_src.device).attention(
            rowptr, col, a_src, a_dst, a_edge, mask, h_src, negative_slope,
            bias)
        ctx.negative_slope, ctx.dst_is_src = negative_slope, dst_is_src
        ctx.save_for_backward(rowptr, col, colptr, row_t, perm, inv, x, weight,
                              h_src, h_dst, B, B_dst, a_src, a_dst, a_edge,
                              mask, bias, out, lse)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        if grad_out is None:
            return (None, ) * 17
        (rowptr, col, *csc, x, weight, h_src, h_dst, B, B_dst, a_src, a_dst,
         a_edge, mask, bias, out, lse) = ctx.saved_tensors
        need = ctx.needs_input_grad
        g_h, g_src, g_dst, g_edge = _backward(
            _build.backend_for(h_src.device), rowptr, col, csc, a_src, a_dst,
            a_edge, mask, h_src, ctx.negative_slope, out, lse, grad_out,
            need_dst=a_dst is not None, need_edge=need[12], bias=bias)
        Ns, H, C = h_src.shape
        g_h2 = g_h.view(Ns, H * C)
        g_x = g_w = g_h_dst = g_att_dst = None
        if ctx.dst_is_src:
            g_a = torch.cat([g_src, g_dst], dim=1)
            # through x (see above) when x is no wider than about h: a wide
            # x (Cora's 1433 features) costs more to read than g_h's update
            if (weight is not None and not need[6]
                    and x.size(1) <= 2 * H * C):
                M = x.t().mm(g_a)
                if need[7]:
                    g_w = g_h2.t().mm(x).addmm_(B, M.t())
                P = weight.mm(M)
            else:
                g_h2.addmm_(g_a, B.t())
                P = _flat_t_mm(h_src, g_a)
                if weight is not None:
                    g_x = g_h2.mm(weight) if need[6] else None
                    g_w = g_h2.t().mm(x) if need[7] else None
            g_att = _score_weight_grad(P, H, C, 2)
            g_att_src, g_att_dst = g_att[:1], g_att[1:]
        else:
            g_h2.addmm_(g_src, B.t())
            g_att_src = _score_weight_grad(_flat_t_mm(h_src, g_src), H, C, 1)
            if g_dst is not None:
                g_h_dst = g_dst.mm(B_dst.t()).view(h_dst.shape)
                g_att_dst = _score_weight_grad(_flat_t_mm(h_dst, g_dst), H,
                                               C, 1)
        g_bias = None
        if need[14]:  # a column sum as one mat-vec product
            g2 = grad_out.reshape(-1, H * C)
            g_bias = torch.mv(g2.t(), g2.new_ones(g2.size(0)))
        if weight is not None:
            g_h = None
        return (None, ) * 6 + (g_x, g_w, g_h, g_att_src, g_h_dst, g_att_dst,
                               g_edge, None, g_bias, None, None)


def gat_attention(rowptr: Tensor, col: Tensor, csc: Optional[CSC],
                  h_src: Optional[Tensor], att_src: Tensor,
                  h_dst: Optional[Tensor], att_dst: Tensor,
                  a_edge: Optional[Tensor] = None,
                  mask: Optional[Tensor] = None, negative_slope: float = 0.2,
                  dst_is_src: bool = False, bias: Optional[Tensor] = None,
                  x: Optional[Tensor] = None,
                  weight: Optional[Tensor] = None) -> Tensor:
    r"""GAT's attention layer core: :func:`attention` with
    ``a_src = (h_src * att_src).sum(-1)`` and ``a_dst = (h_dst *
    att_dst).sum(-1)`` computed inside one autograd node.

    ``h_src`` [Ns, H, C] (also the values), ``att_src``/``att_dst`` [1, H, C],
    ``h_dst`` [N, H, C] or None (no destination term, or ``dst_is_src``:
    the destinations are the sources, ``h_dst = h_src``). ``a_edge`` and
    ``mask`` [E, H] in CSR order, in ``h_src``'s dtype. ``bias`` (H * C
    elements in ``h_src``'s dtype, or None) is added to the output by the
    kernel. With ``x`` [Ns, F] and ``weight`` [H * C, F] (then ``h_src`` is
    None and ``dst_is_src``), ``h_src = x @ weight.t()`` is computed inside
    the same node. Returns [N, H, C]. Indices are not validated here (see
    :func:`attention`).
    """
    if weight is not None and (h_src is not None or not dst_is_src):
        raise ValueError('gat_attention: `weight` computes h_src from `x` '
                         'and needs dst_is_src=True')
    if h_src is not None:
        h_src = h_src.contiguous()
    out, _ = GATAttention.apply(rowptr, col, *csc_parts(csc), x, weight,
                                h_src, att_src.contiguous(), h_dst,
                                att_dst.contiguous(), a_edge, mask, bias,
                                float(negative_slope), bool(dst_is_src))
    return out


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
    args = [t.to(dt) if t is not None else None
            for t in (a_src, a_dst, a_edge, mask)]
    out, lse = Attention.apply(rowptr, col, *csc_parts(csc), *args, values,
                               float(negative_slope))
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
    squeeze = scores.dim() == 1
    if squeeze:
        scores, values = scores.unsqueeze(1), values.unsqueeze(1)
    out = attention(rowptr, col, values, a_edge=scores, negative_slope=1.0,
                    csc=csc)
    return out.squeeze(1) if squeeze else out

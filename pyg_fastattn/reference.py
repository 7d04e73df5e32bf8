"""Pure-PyTorch implementations of every native op.

They serve two roles:

* the fallback backend, used when the C++/CUDA extension cannot be built
  (same names, arguments and results as ``torch.ops.pyg_fastattn.*``);
* the test oracle: each forward is written with differentiable PyTorch ops,
  so ``torch.autograd`` through it (in float64) checks our backward kernels.

Shapes: ``rowptr`` [N + 1] and ``col`` [E] describe a CSR graph whose rows are
destination nodes. Per-edge tensors are [E, H] (H heads), node features
[N, H, C]. Positions ``e >= rowptr[N]`` lie outside every row: they
contribute nothing and get 0 in per-edge outputs. These functions assume
validated indices (see ``pyg_fastattn.ops.check_csr``) and materialize
[E, H, C] messages: they are for correctness, not speed.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rows_of(rowptr: Tensor, num_edges: int) -> Tensor:
    """Row id of each edge position (N for positions outside every row)."""
    pos = torch.arange(num_edges, device=rowptr.device, dtype=rowptr.dtype)
    return torch.searchsorted(rowptr[1:].contiguous(), pos, right=True,
                              out_int32=rowptr.dtype == torch.int32)


def _safe(index: Tensor, valid: Tensor) -> Tensor:
    """``index`` with positions outside every row pointed at entry 0 (their
    results are masked out), so gathers stay in bounds."""
    return torch.where(valid, index, torch.zeros_like(index))


def _pad_row(x: Tensor) -> Tensor:
    """Append one zero row, the slot of the out-of-row sentinel N."""
    return torch.cat([x, x.new_zeros((1, ) + tuple(x.shape[1:]))], dim=0)


def _backward_weights(s: Tensor, lse: Tensor, row: Tensor,
                      N: int) -> Tuple[Tensor, Tensor]:
    """The forward's weights again in a backward: ``alpha = exp(s - lse)``
    per entry [E, H], and where an entry has one (``weighted``): not in a
    row whose ``lse`` is -inf (empty or all -inf) nor past ``rowptr[N]``. A
    NaN or +inf ``lse`` gives NaN weights, so its NaN reaches the
    gradients as autograd through a softmax carries it."""
    lse_p = _pad_row(lse)[row]
    weighted = (lse_p != float('-inf')) & (row < N).view(-1, 1)
    alpha = torch.where(
        weighted, torch.exp(s - torch.where(weighted, lse_p, 0.)),
        torch.zeros_like(s))
    return weighted, alpha


def _row_softmax(rowptr: Tensor, row: Tensor,
                 s: Tensor) -> Tuple[Tensor, Tensor]:
    """Softmax of ``s`` [E, H] over each row; returns (alpha, lse [N, H]).

    Rows that are empty or all -inf give alpha 0 and lse -inf. NaN
    propagates through its row.
    """
    N = rowptr.numel() - 1
    E, H = s.shape
    idx = row.long().view(-1, 1).expand(E, H)  # scatter_reduce needs int64
    m = s.new_full((N + 1, H), float('-inf'))
    m = m.scatter_reduce(0, idx, s.detach(), reduce='amax', include_self=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    ex = torch.exp(s - m[row])
    den = s.new_zeros((N + 1, H)).index_add(0, row, ex)
    alpha = torch.where(den[row] > 0, ex / den[row], torch.zeros_like(ex))
    # NaN must not be hidden by the where above.
    alpha = torch.where(torch.isnan(den[row]), den[row], alpha)
    lse = torch.log(den) + m
    return alpha, lse[:N]


def edge_softmax(rowptr: Tensor, scores: Tensor) -> Tensor:
    E = scores.size(0)
    row = rows_of(rowptr, E)
    alpha, _ = _row_softmax(rowptr, row, scores.to(_opmath(scores.dtype)))
    alpha = alpha * (row < rowptr.numel() - 1).view(-1, 1)
    return alpha.to(scores.dtype)


def edge_softmax_backward(rowptr: Tensor, out: Tensor,
                          grad_out: Tensor) -> Tensor:
    N = rowptr.numel() - 1
    E, H = out.shape
    row = rows_of(rowptr, E)
    y, g = out.to(_opmath(out.dtype)), grad_out.to(_opmath(out.dtype))
    dot = y.new_zeros((N + 1, H)).index_add(0, row, y * g)
    grad = y * (g - dot[row]) * (row < N).view(-1, 1)
    return grad.to(out.dtype)


def sddmm_dot(a: Tensor, b: Tensor, a_idx: Tensor, b_idx: Tensor) -> Tensor:
    # An out-of-range index gives 0, as in the kernels (backward passes rows
    # that are N for positions outside every row).
    t = _opmath(a.dtype)
    ok = (a_idx >= 0) & (a_idx < a.size(0)) & (b_idx >= 0) & (b_idx < b.size(0))
    out = (a[_safe(a_idx, ok)].to(t) * b[_safe(b_idx, ok)].to(t)).sum(dim=-1)
    return (out * ok.view(-1, 1)).to(a.dtype)


def sddmm_csr(a: Tensor, b: Tensor, rowptr: Tensor, col: Tensor, row: Tensor,
              colptr: Tensor, csc_row: Tensor, csc_perm: Tensor) -> Tensor:
    return sddmm_dot(a, b, row, col)


def spmm(rowptr: Tensor, col: Tensor, weight: Optional[Tensor],
         weight_perm: Optional[Tensor], values: Tensor,
         colptr: Optional[Tensor] = None, csc_row: Optional[Tensor] = None,
         csc_perm: Optional[Tensor] = None) -> Tensor:
    N = rowptr.numel() - 1
    E = col.numel()
    _, H, C = values.shape
    t = _opmath(values.dtype)
    row = rows_of(rowptr, E)
    msg = values[_safe(col, row < N)].to(t)
    if weight is not None:
        w = weight[weight_perm] if weight_perm is not None else weight
        msg = msg * w.to(t).unsqueeze(-1)
    out = msg.new_zeros((N + 1, H, C)).index_add(0, row, msg)
    return out[:N].to(values.dtype)


def segment_sum(rowptr: Tensor, perm: Optional[Tensor], src: Tensor) -> Tensor:
    N = rowptr.numel() - 1
    x = src[perm] if perm is not None else src
    row = rows_of(rowptr, x.size(0))
    t = _opmath(src.dtype)
    out = x.new_zeros((N + 1, x.size(1)), dtype=t).index_add(0, row, x.to(t))
    return out[:N].to(src.dtype)


def _attention_scores(rowptr, col, a_src, a_dst, a_edge, negative_slope, t):
    """Pre-activation z [E, H] and score s = leaky_relu(z) in dtype t."""
    E = col.numel()
    row = rows_of(rowptr, E)
    col = _safe(col, row < rowptr.numel() - 1)
    z = None
    for term in (a_src[col] if a_src is not None else None,
                 _pad_row(a_dst)[row] if a_dst is not None else None, a_edge):
        if term is not None:
            z = term.to(t) if z is None else z + term.to(t)
    s = torch.where(z > 0, z, z * negative_slope)
    return row, z, s


def attention(rowptr: Tensor, col: Tensor, a_src: Optional[Tensor],
              a_dst: Optional[Tensor], a_edge: Optional[Tensor],
              mask: Optional[Tensor], values: Tensor, negative_slope: float,
              bias: Optional[Tensor] = None, colptr: Optional[Tensor] = None,
              csc_row: Optional[Tensor] = None,
              csc_perm: Optional[Tensor] = None,
              csc_inv: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    N = rowptr.numel() - 1
    _, H, C = values.shape
    t = _opmath(values.dtype)
    row, _, s = _attention_scores(rowptr, col, a_src, a_dst, a_edge,
                                  negative_slope, t)
    alpha, lse = _row_softmax(rowptr, row, s)
    p = alpha * mask.to(t) if mask is not None else alpha
    msg = p.unsqueeze(-1) * values[_safe(col, row < N)].to(t)
    out = msg.new_zeros((N + 1, H, C)).index_add(0, row, msg)[:N]
    if bias is not None:
        out = out + bias.to(t).view(H, C)
    return out.to(values.dtype), lse


def attention_backward(rowptr: Tensor, col: Tensor, colptr: Tensor,
                       row_t: Tensor, perm: Tensor, a_src: Optional[Tensor],
                       a_dst: Optional[Tensor], a_edge: Optional[Tensor],
                       mask: Optional[Tensor], values: Tensor,
                       negative_slope: float, out: Tensor, lse: Tensor,
                       grad_out: Tensor, grad_z_csr: bool = False,
                       bias: Optional[Tensor] = None
                       ) -> Tuple[Tensor, Tensor, Tensor]:
    N = rowptr.numel() - 1
    t = _opmath(values.dtype)
    row, z, s = _attention_scores(rowptr, col, a_src, a_dst, a_edge,
                                  negative_slope, t)
    weighted, alpha = _backward_weights(s, lse.to(t), row, N)
    m = mask.to(t) if mask is not None else torch.ones_like(alpha)
    go = _pad_row(grad_out.to(t))
    g = m * (go[row] * values[_safe(col, row < N)].to(t)).sum(-1)
    out = out.to(t)
    if bias is not None:  # out holds the forward's bias
        out = out - bias.to(t).view(out.shape[1:])
    delta = (go * _pad_row(out)).sum(-1)[row]
    grad_s = alpha * (g - delta)
    grad_z = torch.where(z > 0, grad_s, grad_s * negative_slope)
    grad_z = torch.where(weighted, grad_z, torch.zeros_like(grad_z))
    # Source side over the transpose (the kernels' single CSC pass).
    grad_values = spmm(colptr, row_t, alpha * m, perm, grad_out.to(t))
    grad_a_src = segment_sum(colptr, perm, grad_z)
    if not grad_z_csr:
        grad_z = grad_z[perm]  # CSC order
    dt = values.dtype
    return grad_values.to(dt), grad_z.to(dt), grad_a_src.to(dt)


def _x_as_weight(x: Tensor, weight: Tensor) -> Tensor:
    """x in weight's dtype where x is float32 beside a 16-bit weight (as
    autocast passes x to gat_attention and linear); else x as it is."""
    if x.dtype == torch.float32 and weight.dtype in (torch.float16,
                                                     torch.bfloat16):
        return x.to(weight.dtype)
    return x


def gat_attention(rowptr: Tensor, col: Tensor, colptr: Tensor, csc_row: Tensor,
                  csc_perm: Tensor, csc_inv: Tensor, x: Optional[Tensor],
                  weight: Optional[Tensor], h_src: Optional[Tensor],
                  att_src: Tensor, h_dst: Optional[Tensor], att_dst: Tensor,
                  a_edge: Optional[Tensor], mask: Optional[Tensor],
                  bias: Optional[Tensor], negative_slope: float,
                  dst_is_src: bool, max_row_len: int = -1,
                  max_col_len: int = -1):
    _, H, C = att_src.shape
    h = (_x_as_weight(x, weight) @ weight.t() if weight is not None
         else h_src).reshape(-1, H, C)
    a_src = (h * att_src).sum(-1)
    a_dst = None
    if dst_is_src:
        a_dst = (h * att_dst).sum(-1)
    elif h_dst is not None:
        a_dst = (h_dst.reshape(-1, H, C) * att_dst).sum(-1)
    out, lse = attention(rowptr, col, a_src, a_dst, a_edge, mask, h,
                         negative_slope, bias)
    empty = h.new_empty((0, ))
    return (out, lse, h if weight is not None else empty, a_src,
            empty if a_dst is None else a_dst)


def gat_attention_backward(grad_out: Tensor, rowptr: Tensor, col: Tensor,
                           colptr: Tensor, csc_row: Tensor, csc_perm: Tensor,
                           csc_inv: Tensor, x: Optional[Tensor],
                           weight: Optional[Tensor], h: Tensor,
                           att_src: Tensor, h_dst: Optional[Tensor],
                           att_dst: Tensor, a_src: Tensor, a_dst: Tensor,
                           a_edge: Optional[Tensor], mask: Optional[Tensor],
                           bias: Optional[Tensor], out: Tensor, lse: Tensor,
                           negative_slope: float, dst_is_src: bool,
                           output_mask, max_row_len: int = -1,
                           max_col_len: int = -1) -> list:
    _, H, C = att_src.shape
    h = h.reshape(-1, H, C)
    has_dst = a_dst.dim() > 1  # (absent: 1-D empty; [0, H] for 0 nodes)
    need_edge = bool(output_mask[6]) and a_edge is not None
    g_h, g_z, g_src = attention_backward(
        rowptr, col, colptr, csc_row, csc_perm, a_src,
        a_dst if has_dst else None, a_edge, mask, h, negative_slope, out, lse,
        grad_out, need_edge, bias)
    g_h = g_h + g_src.unsqueeze(-1) * att_src
    g_att_src = (g_src.unsqueeze(-1) * h).sum(0, keepdim=True)
    g_h_dst = g_att_dst = None
    if has_dst:
        g_dst = segment_sum(rowptr, None if need_edge else csc_inv, g_z)
        hd = h if dst_is_src else h_dst.reshape(-1, H, C)
        g_att_dst = (g_dst.unsqueeze(-1) * hd).sum(0, keepdim=True)
        if dst_is_src:
            g_h = g_h + g_dst.unsqueeze(-1) * att_dst
        else:
            g_h_dst = (g_dst.unsqueeze(-1) * att_dst).view(h_dst.shape)
    g_x = g_w = None
    if weight is not None:  # (x may be float32 beside a 16-bit weight)
        g_x = (g_h.flatten(1) @ weight).to(x.dtype)  # (flatten: no -1 for 0 nodes)
        g_w = g_h.flatten(1).t() @ _x_as_weight(x, weight)
        g_h = None
    g_bias = None
    if bias is not None:
        g_bias = grad_out.reshape(-1, bias.numel()).sum(0).view(bias.shape)
    grads = (g_x, g_w, g_h, g_att_src, g_h_dst, g_att_dst,
             g_z if need_edge else None, g_bias)
    empty = h.new_empty((0, ))
    return [g if want and g is not None else empty
            for g, want in zip(grads, output_mask)]


def _gatv2_scores(rowptr, col, x_l, x_r, edge_term, att, negative_slope, t):
    """(row, safe col, z [E, H, C], leaky_relu(z), s [E, H]) in dtype t."""
    N = rowptr.numel() - 1
    row = rows_of(rowptr, col.numel())
    j = _safe(col, row < N)
    z = x_l[j].to(t) + _pad_row(x_r)[row].to(t)
    if edge_term is not None:
        z = z + edge_term.to(t)
    lz = torch.where(z > 0, z, z * negative_slope)
    s = (lz * att.to(t)).sum(-1)
    return row, j, z, lz, s


def gatv2_attention(rowptr: Tensor, col: Tensor, x_l: Tensor, x_r: Tensor,
                    edge_term: Optional[Tensor], att: Tensor,
                    mask: Optional[Tensor], negative_slope: float,
                    bias: Optional[Tensor] = None,
                    colptr: Optional[Tensor] = None,
                    csc_row: Optional[Tensor] = None,
                    csc_perm: Optional[Tensor] = None,
                    max_row_len: int = -1, max_col_len: int = -1
                    ) -> Tuple[Tensor, Tensor]:
    N = rowptr.numel() - 1
    _, H, C = x_l.shape
    t = _opmath(x_l.dtype)
    row, j, _, _, s = _gatv2_scores(rowptr, col, x_l, x_r, edge_term, att,
                                    negative_slope, t)
    alpha, lse = _row_softmax(rowptr, row, s)
    p = alpha * mask.to(t) if mask is not None else alpha
    msg = p.unsqueeze(-1) * x_l[j].to(t)
    out = msg.new_zeros((N + 1, H, C)).index_add(0, row, msg)[:N]
    if bias is not None:
        out = out + bias.to(t).view(H, C)
    return out.to(x_l.dtype), lse


def gatv2_attention_backward(rowptr: Tensor, col: Tensor, colptr: Tensor,
                             csc_row: Tensor, csc_perm: Tensor, x_l: Tensor,
                             x_r: Tensor, edge_term: Optional[Tensor],
                             att: Tensor, mask: Optional[Tensor],
                             negative_slope: float, bias: Optional[Tensor],
                             out: Tensor, lse: Tensor, grad_out: Tensor,
                             need_edge: bool, max_row_len: int = -1,
                             max_col_len: int = -1
                             ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    N = rowptr.numel() - 1
    t = _opmath(x_l.dtype)
    row, j, z, lz, s = _gatv2_scores(rowptr, col, x_l, x_r, edge_term, att,
                                     negative_slope, t)
    weighted, alpha = _backward_weights(s, lse.to(t), row, N)
    p = alpha * mask.to(t) if mask is not None else alpha
    go = _pad_row(grad_out.to(t))[row]  # [E, H, C]
    g = (go * x_l[j].to(t)).sum(-1)
    if mask is not None:
        g = g * mask.to(t)
    out = out.to(t)
    if bias is not None:  # out holds the forward's bias
        out = out - bias.to(t).view(out.shape[1:])
    delta = _pad_row((grad_out.to(t) * out).sum(-1))[row]
    grad_s = torch.where(weighted, alpha * (g - delta), torch.zeros_like(s))
    dz = torch.where(z > 0, torch.ones_like(z), torch.full_like(z,
                                                                negative_slope))
    grad_z = grad_s.unsqueeze(-1) * att.to(t) * dz
    Ns, H, C = x_l.shape
    grad_x_r = grad_z.new_zeros((N + 1, H, C)).index_add(0, row, grad_z)[:N]
    grad_att = (grad_s.unsqueeze(-1) * lz).sum(0)
    # Source side: every valid edge adds to its source (the kernels walk the
    # transpose for this).
    valid = (row < N).view(-1, 1, 1)
    msg = torch.where(valid, p.unsqueeze(-1) * go + grad_z,
                      torch.zeros_like(grad_z))
    grad_x_l = msg.new_zeros((Ns, H, C)).index_add(0, j, msg)
    dt = x_l.dtype
    if need_edge and edge_term is not None:
        grad_edge = torch.where(valid, grad_z, torch.zeros_like(grad_z))
        grad_edge = grad_edge.to(dt)
    else:
        grad_edge = x_l.new_empty((0, ))
    return (grad_x_l.to(dt), grad_x_r.to(dt), grad_edge,
            grad_att.to(dt).view(att.shape))


def _transformer_terms(rowptr, col, query, key, value, edge_term, t):
    """(row, safe col, query[row] [E, H, C] (0 outside every row), k', v')
    in dtype t."""
    N = rowptr.numel() - 1
    row = rows_of(rowptr, col.numel())
    j = _safe(col, row < N)
    q = _pad_row(query)[row].to(t)
    k, v = key[j].to(t), value[j].to(t)
    if edge_term is not None:
        k = k + edge_term.to(t)
        v = v + edge_term.to(t)
    return row, j, q, k, v


def transformer_attention(rowptr: Tensor, col: Tensor, query: Tensor,
                          key: Tensor, value: Tensor,
                          edge_term: Optional[Tensor], mask: Optional[Tensor],
                          scale: float, colptr: Optional[Tensor] = None,
                          csc_row: Optional[Tensor] = None,
                          csc_perm: Optional[Tensor] = None,
                          max_row_len: int = -1, max_col_len: int = -1,
                          grads_in_place: bool = False
                          ) -> Tuple[Tensor, Tensor]:
    N = rowptr.numel() - 1
    _, H, C = key.shape
    t = _opmath(key.dtype)
    row, _, q, k, v = _transformer_terms(rowptr, col, query, key, value,
                                         edge_term, t)
    s = scale * (q * k).sum(-1)
    alpha, lse = _row_softmax(rowptr, row, s)
    p = alpha * mask.to(t) if mask is not None else alpha
    msg = p.unsqueeze(-1) * v
    out = msg.new_zeros((N + 1, H, C)).index_add(0, row, msg)[:N]
    return out.to(key.dtype), lse


def transformer_attention_backward(rowptr: Tensor, col: Tensor,
                                   colptr: Tensor, csc_row: Tensor,
                                   csc_perm: Tensor, query: Tensor,
                                   key: Tensor, value: Tensor,
                                   edge_term: Optional[Tensor],
                                   mask: Optional[Tensor], scale: float,
                                   out: Tensor, lse: Tensor, grad_out: Tensor,
                                   need_edge: bool, max_row_len: int = -1,
                                   max_col_len: int = -1
                                   ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    N = rowptr.numel() - 1
    Ns, H, C = key.shape
    t = _opmath(key.dtype)
    row, j, q, k, v = _transformer_terms(rowptr, col, query, key, value,
                                         edge_term, t)
    s = scale * (q * k).sum(-1)
    weighted, alpha = _backward_weights(s, lse.to(t), row, N)
    p = alpha * mask.to(t) if mask is not None else alpha
    go = _pad_row(grad_out.to(t))[row]  # [E, H, C]
    g = (go * v).sum(-1)
    if mask is not None:
        g = g * mask.to(t)
    delta = _pad_row((grad_out.to(t) * out.to(t)).sum(-1))[row]
    grad_s = torch.where(weighted, alpha * (g - delta), torch.zeros_like(s))
    gs = (scale * grad_s).unsqueeze(-1)
    msg_q = gs * k
    grad_q = msg_q.new_zeros((N + 1, H, C)).index_add(0, row, msg_q)[:N]
    # Source side: every valid edge adds to its source (the kernels walk the
    # transpose for this).
    valid = (row < N).view(-1, 1, 1)
    zero = torch.zeros_like(k)
    msg_k = torch.where(valid, gs * q, zero)
    msg_v = torch.where(valid, p.unsqueeze(-1) * go, zero)
    grad_k = zero.new_zeros((Ns, H, C)).index_add(0, j, msg_k)
    grad_v = zero.new_zeros((Ns, H, C)).index_add(0, j, msg_v)
    dt = key.dtype
    if need_edge and edge_term is not None:
        grad_edge = (msg_k + msg_v).to(dt)
    else:
        grad_edge = key.new_empty((0, ))
    return grad_q.to(dt), grad_k.to(dt), grad_v.to(dt), grad_edge


def transformer_attention_backward_(rowptr: Tensor, col: Tensor,
                                    colptr: Tensor, csc_row: Tensor,
                                    csc_perm: Tensor, query: Tensor,
                                    key: Tensor, value: Tensor,
                                    edge_term: Optional[Tensor],
                                    mask: Optional[Tensor], scale: float,
                                    out: Tensor, lse: Tensor,
                                    grad_out: Tensor, need_edge: bool,
                                    max_row_len: int = -1,
                                    max_col_len: int = -1) -> Tensor:
    g_q, g_k, g_v, g_e = transformer_attention_backward(
        rowptr, col, colptr, csc_row, csc_perm, query, key, value, edge_term,
        mask, scale, out, lse, grad_out, need_edge, max_row_len, max_col_len)
    out.copy_(g_q)
    key.copy_(g_k)
    value.copy_(g_v)
    return g_e


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    return torch.nn.functional.linear(_x_as_weight(x, weight), weight, bias)


def linear_backward(grad_out: Tensor, x: Tensor, weight: Tensor,
                    output_mask) -> list:
    def e():
        return x.new_empty((0, ))

    # (x may be float32 beside a 16-bit weight)
    return [grad_out.mm(weight).to(x.dtype) if output_mask[0] else e(),
            grad_out.t().mm(_x_as_weight(x, weight)) if output_mask[1] else e(),
            grad_out.sum(0) if output_mask[2] else e()]


def column_sum(src: Tensor) -> Tensor:
    return src.sum(0)

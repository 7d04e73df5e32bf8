"""``transformer_attention``: TransformerConv's fused score, row softmax and
aggregation, and its backward. Kernels: ``csrc/cpu/transformer_cpu.cpp``,
``csrc/cuda/``, or :func:`pyg_fastattn.reference.transformer_attention`."""
from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.graph import increment_version

from ..reference import _opmath
from . import _lib
from ._checks import (cast_to, check_csc, check_csr, check_same_device,
                      check_tensor, index_pair)
from .csr import CSC, maybe_csc

# For each row i (destination) and edge e = (j -> i) in it, per head h and
# channel c:
#   k'[e] = key[j] + edge_term[e];  v'[e] = value[j] + edge_term[e]  (if given)
#   s[e, h] = scale * sum_c query[i, h, c] * k'[e, h, c]
#   alpha = softmax over the row of s;  p[e] = alpha[e] * mask[e]
#   out[i] = sum_e p[e] * v'[e]                    -> out [N, H, C]
#   lse[i] = log sum_e exp(s[e])                   -> [N, H], float32 (float64)
# query [N, H, C], key and value [Ns, H, C], edge_term [E, H, C] and mask
# [E, H] in CSR order. Empty rows give out = 0, lse = -inf. Nothing of size
# [E, H, C] is stored. colptr/csc_row/csc_perm: the transpose (csr_to_csc),
# read only by the backward (built there when absent). max_row_len /
# max_col_len: the longest CSR row / CSC column when known, else -1 (a hint:
# CUDA skips its long-row split path when no row needs it; results do not
# change). grads_in_place: the caller holds no other reference to out, key
# and value, so the backward may write grad_query, grad_key and grad_value
# over them (transformer_attention_backward_, in a backward that frees the
# graph; the kernels ignore it).
_lib.define(
    'transformer_attention(Tensor rowptr, Tensor col, Tensor query, '
    'Tensor key, Tensor value, Tensor? edge_term, Tensor? mask, float scale, '
    'Tensor? colptr, Tensor? csc_row, Tensor? csc_perm, int max_row_len, '
    'int max_col_len, bool grads_in_place) -> (Tensor, Tensor)')
# (No defaults: the dispatcher drops arguments equal to their defaults, and
# the autograd formula must see every input.)
# Gradients, alpha recomputed from lse:
#   g[e] = mask[e] * <grad_out[i, h], v'[e, h]>
#   grad_s[e] = alpha[e] * (g[e] - <grad_out[i, h], out[i, h]>)
#   grad_query[i] = scale * sum_{e in row i} grad_s[e] * k'[e]
#   grad_key[j] = scale * sum_{e = (j -> i)} grad_s[e] * query[i]
#   grad_value[j] = sum_{e = (j -> i)} p[e] * grad_out[i]
#   grad_edge_term[e] = scale * grad_s[e] * query[i] + p[e] * grad_out[i]
# Pass 1 by destination row (grad_query, grad_edge_term; the CPU kernel
# keeps scale * grad_s and p in [E, H] for pass 2, the CUDA kernel
# recomputes them there), pass 2 over the transpose (colptr [Ns + 1],
# csc_row, csc_perm) for grad_key and grad_value: every output has one
# writer, no atomics. Returns (grad_query [N, H, C], grad_key [Ns, H, C], grad_value
# [Ns, H, C], grad_edge_term [E, H, C] in CSR order (0 outside every row;
# empty [0] unless need_edge and edge_term is given)). max_row_len /
# max_col_len: as in the forward.
_lib.define(
    'transformer_attention_backward(Tensor rowptr, Tensor col, '
    'Tensor colptr, Tensor csc_row, Tensor csc_perm, Tensor query, '
    'Tensor key, Tensor value, Tensor? edge_term, Tensor? mask, float scale, '
    'Tensor out, Tensor lse, Tensor grad_out, bool need_edge, '
    'int max_row_len, int max_col_len) -> (Tensor, Tensor, Tensor, Tensor)')
# The same gradients written over the forward's buffers: out becomes
# grad_query, key grad_key and value grad_value (on CUDA with no other
# memory: each pass reads a row's own out / key / value before it writes
# that row's gradient); returns grad_edge_term.
_lib.define(
    'transformer_attention_backward_(Tensor rowptr, Tensor col, '
    'Tensor colptr, Tensor csc_row, Tensor csc_perm, Tensor query, '
    'Tensor(a!) key, Tensor(b!) value, Tensor? edge_term, Tensor? mask, '
    'float scale, Tensor(c!) out, Tensor lse, Tensor grad_out, '
    'bool need_edge, int max_row_len, int max_col_len) -> Tensor')


def _fake(rowptr, col, query, key, value, edge_term, mask, scale, colptr,
          csc_row, csc_perm, max_row_len, max_col_len, grads_in_place):
    N, H, C = rowptr.shape[0] - 1, key.shape[1], key.shape[2]
    out = key.new_empty((N, H, C))
    lse = key.new_empty((N, H), dtype=_opmath(key.dtype))
    return out, lse


def _fake_backward(rowptr, col, colptr, csc_row, csc_perm, query, key, value,
                   edge_term, mask, scale, out, lse, grad_out, need_edge,
                   max_row_len, max_col_len):
    g_edge = (key.new_empty(edge_term.shape) if need_edge
              and edge_term is not None else key.new_empty((0, )))
    return (key.new_empty(query.shape), key.new_empty(key.shape),
            key.new_empty(value.shape), g_edge)


def _fake_backward_(rowptr, col, colptr, csc_row, csc_perm, query, key, value,
                    edge_term, mask, scale, out, lse, grad_out, need_edge,
                    max_row_len, max_col_len):
    return (key.new_empty(edge_term.shape) if need_edge
            and edge_term is not None else key.new_empty((0, )))


def _setup_context(ctx, inputs, output):
    (rowptr, col, query, key, value, edge_term, mask, scale, colptr, csc_row,
     csc_perm, max_row_len, max_col_len, grads_in_place) = inputs
    out, lse = output
    ctx.save_for_backward(rowptr, col, query, key, value, edge_term, mask,
                          _lib.keep_output(ctx, out), lse, colptr, csc_row,
                          csc_perm)
    ctx.scale = scale
    ctx.lengths = (max_row_len, max_col_len)
    ctx.in_place = grads_in_place
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # no zeros for lse's gradient


def _storage(t: Optional[Tensor]) -> int:
    return t.untyped_storage().data_ptr() if t is not None else 0


def _batched(t: Optional[Tensor]) -> bool:
    return t is not None and (
        torch._C._functorch.is_functorch_wrapped_tensor(t)
        or torch._C._functorch.is_legacy_batchedtensor(t))


def _may_overwrite(query, key, value, edge_term, out, grad_out) -> bool:
    """out, key and value are plain tensors (not traced: torch.compile gets
    the out-of-place op; none of the six batched: vmap, is_grads_batched),
    contiguous, of one dtype, and share memory with none of the other
    inputs."""
    if not all(type(t) is Tensor for t in (out, key, value)):
        return False
    if any(_batched(t) for t in (query, key, value, edge_term, out, grad_out)):
        return False
    if not (out.is_contiguous() and key.is_contiguous()
            and value.is_contiguous() and out.dtype == key.dtype == value.dtype):
        return False
    own = [_storage(t) for t in (out, key, value)]
    other = [_storage(t) for t in (query, edge_term, grad_out)]
    return len(set(own)) == 3 and not set(own) & set(other)


def _backward(ctx, grad_out, _grad_lse):
    if grad_out is None:
        return (None, ) * 14
    (rowptr, col, query, key, value, edge_term, mask, out, lse,
     *csc) = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_edge = bool(need[5]) and edge_term is not None
    out = _lib.kept_output(ctx, out, lambda: _lib.op('transformer_attention')(
        rowptr, col, query, key, value, edge_term, mask, ctx.scale, *csc,
        *ctx.lengths, ctx.in_place)[0])
    csc = maybe_csc(list(csc) + [None], rowptr, col, key.size(0))
    grad_out = grad_out.contiguous()
    args = (rowptr, col, csc.colptr, csc.row, csc.perm, query, key, value,
            edge_term, mask, ctx.scale, out, lse, grad_out, need_edge,
            *ctx.lengths)
    # in place only when autograd frees the graph after this backward
    if (ctx.in_place and not _lib.keep_graph()
            and _may_overwrite(query, key, value, edge_term, out, grad_out)):
        g_e = _lib.op('transformer_attention_backward_')(*args)
        for t in (out, key, value):  # other saved views of them now fail
            increment_version(t)
        g_q, g_k, g_v = out, key, value
    else:
        g_q, g_k, g_v, g_e = _lib.op('transformer_attention_backward')(*args)
    return (None, None, g_q if need[2] else None, g_k if need[3] else None,
            g_v if need[4] else None, g_e if need_edge else None) + (
                None, ) * 8


_lib.register('transformer_attention', fake=_fake, backward=_backward,
              setup_context=_setup_context, autocast=True,
              native_autograd=True)
_lib.register('transformer_attention_backward', fake=_fake_backward)
_lib.register('transformer_attention_backward_', fake=_fake_backward_)


def transformer_attention(rowptr: Tensor, col: Tensor, query: Tensor,
                          key: Tensor, value: Tensor,
                          edge_term: Optional[Tensor] = None,
                          mask: Optional[Tensor] = None, scale: float = 1.0,
                          csc: Optional[CSC] = None, return_lse: bool = False,
                          validate: bool = True,
                          max_lengths: Tuple[int, int] = (-1, -1),
                          grads_in_place: bool = False):
    r"""Dot-product (TransformerConv) attention over a CSR graph (rows =
    destinations), fused: flash-attention over each row's edges.

    Per edge ``e = (j -> i)`` and head ``h``::

        k = key[j] + edge_term[e]                    (edge_term optional)
        v = value[j] + edge_term[e]
        s = scale * <query[i, h], k[h]>
        alpha = softmax of s over row i
        out[i] = sum_e alpha * mask[e] * v

    Args:
        rowptr: [N + 1], col: [E] (int32/int64), edges sorted by row.
        query: [N, H, C] destination features.
        key: [Ns, H, C] source keys.
        value: [Ns, H, C] source values.
        edge_term: [E, H, C] in CSR order (``lin_edge(edge_attr)``), added
            to both the key and the value of its edge.
        mask: [E, H] dropout multiplier in CSR order (no gradient).
        scale: the score's factor (TransformerConv: ``1 / sqrt(C)``).
        csc: the transpose (:func:`csr_to_csc`), reused by backward.
        return_lse: also return the row log-sum-exp of the scores.
        validate: check ``rowptr``/``col`` values (one host sync).
        max_lengths: the longest row and column of the graph, or -1 where
            unknown (:attr:`PreparedGraph.max_lengths`); a hint that saves
            host time on CUDA, never changing the result. It must not
            understate them.
        grads_in_place: let the backward write the gradients of ``query``,
            ``key`` and ``value`` over ``out``, ``key`` and ``value`` (on
            CUDA it then allocates none of them). Only for callers that hold
            no other reference to those three: they are garbage after the
            backward. Ignored where they are not contiguous or share memory
            with another input, and in a backward that keeps the graph
            (``retain_graph`` or ``create_graph``).

    Returns:
        ``out`` [N, H, C] in ``key``'s dtype (empty rows: 0), and with
        ``return_lse`` the log-sum-exp [N, H] (float32; float64 for float64
        inputs; -inf for empty rows). Differentiable in ``query``, ``key``,
        ``value`` and ``edge_term``; the scores are computed on the fly,
        nothing of size [E, H, C] is stored in forward or backward (besides
        the gradient of ``edge_term``). ``query``, ``value``, ``edge_term``
        and ``mask`` are cast to ``key``'s dtype.
    """
    check_tensor(rowptr, 'rowptr', dims=(1, ), floating=False)
    check_tensor(col, 'col', dims=(1, ), floating=False)
    check_tensor(query, 'query', dims=(3, ), floating=True)
    check_tensor(key, 'key', dims=(3, ), floating=True)
    check_tensor(value, 'value', dims=(3, ), floating=True)
    check_same_device(rowptr=rowptr, col=col, query=query, key=key,
                      value=value, edge_term=edge_term, mask=mask)
    N, E = rowptr.numel() - 1, col.numel()
    Ns, H, C = key.shape
    shapes = (('query', query, (N, H, C)), ('value', value, (Ns, H, C)),
              ('edge_term', edge_term, (E, H, C)), ('mask', mask, (E, H)))
    for name, t, want in shapes:
        if t is not None and tuple(t.shape) != want:
            raise ValueError(f'`{name}` must have shape {list(want)}, got '
                             f'{list(t.shape)}')
    rowptr, col = index_pair(rowptr, col)
    if validate:
        check_csr(rowptr, col, E, Ns)
        check_csc(csc, rowptr, col, Ns)
    dt = key.dtype
    query, value, edge_term, mask = cast_to(dt, query, value, edge_term,
                                            mask)
    csc_args = tuple(csc)[:3] if csc is not None else (None, ) * 3
    out, lse = _lib.op('transformer_attention')(rowptr, col, query, key,
                                                value, edge_term, mask,
                                                float(scale), *csc_args,
                                                int(max_lengths[0]),
                                                int(max_lengths[1]),
                                                bool(grads_in_place))
    return (out, lse) if return_lse else out

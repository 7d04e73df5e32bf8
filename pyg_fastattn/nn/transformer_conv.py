"""``FastTransformerConv``: PyG's ``TransformerConv`` on the fused kernels."""
import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
from torch import Tensor
from torch_geometric.nn.conv import TransformerConv

from .. import ops
from ..ops import _lib
from .base import FusedAttentionConv, plain_linear
from .graph import PreparedGraph, _is_compiling

__all__ = ['FastTransformerConv']


@dataclass
class _TransformerScore:
    """The inputs of the in-kernel score: ``query`` [N, H, C], ``key``
    [Ns, H, C], ``edge_term`` (``lin_edge(edge_attr)``, [E', H, C] in CSR
    order, added to the keys and the values) or None, ``scale`` (1 /
    sqrt(C)), ``grads_in_place`` (the op may write the gradients over its
    out, key and value), ``value_edge`` (``edge_attr`` without ``lin_edge``,
    added to the values only; broadcasts to [E', H, C], CSR order where it
    has one row per edge) or None."""
    query: Tensor
    key: Tensor
    edge_term: Optional[Tensor]
    scale: float
    grads_in_place: bool = False
    value_edge: Optional[Tensor] = None


class FastTransformerConv(FusedAttentionConv, TransformerConv):
    r"""A drop-in :class:`torch_geometric.nn.conv.TransformerConv`: same
    constructor, parameters, ``state_dict``, ``reset_parameters`` (it
    subclasses it), forward and outputs, with the attention computed by the
    fused kernels:

    * the score ``q_i . (k_j + e_ij) / sqrt(C)`` (``q = lin_query(x_dst)``,
      ``k = lin_key(x_src)``, ``e = lin_edge(edge_attr)``), the softmax per
      destination, attention dropout (training only) and the sum of
      ``alpha_ij * (v_j + e_ij)`` (``v = lin_value(x_src)``) in one
      ``transformer_attention`` kernel, which stores no per-edge tensor
      (with ``edge_dim``, ``e`` is the one [E, H, C] tensor, as in
      TransformerConv);
    * then, as TransformerConv: concat or mean over heads, ``lin_skip``
      root term, ``beta`` gate.

    Shapes (``H`` heads, ``C = out_channels``):

    * ``x``: [N, F_in] or a pair ([N_src, F_src], [N_dst, F_dst]).
    * ``edge_index``: [2, E]; a sparse adjacency ``adj_t`` [N_dst, N_src]
      (torch.sparse, or ``torch_sparse.SparseTensor``); or a
      :class:`PreparedGraph` prepared with ``add_self_loops=False``.
    * ``edge_attr``: [E, edge_dim] in ``edge_index`` order; without
      ``edge_dim``, as TransformerConv, anything that broadcasts to [E, H,
      C], added to the values as it is (not to the keys); other shapes run
      TransformerConv's own code, which broadcasts them or raises. If
      None, a torch.sparse adjacency's [nnz, D] values, as PyG takes them.
    * output: [N_dst, H * C] if ``concat`` else [N_dst, C]; with
      ``return_attention_weights`` also the weights as TransformerConv
      returns them (before dropout): ``(edge_index, alpha [E, H])``, or the
      ``SparseTensor`` holding ``alpha``.

    The graph is prepared once per ``edge_index`` and cached (see
    :mod:`pyg_fastattn.nn.graph`). Backward walks the prepared transpose,
    uses no atomics and is bitwise reproducible. It writes the gradients of
    the queries, keys and values over the attention output and the keys and
    values, which only the layer holds (on CUDA it allocates none of them;
    with ``root_weight`` the skip term takes the attention output in place;
    not with ``beta``), when autograd frees the graph after that backward:
    with ``retain_graph=True`` (or ``create_graph``, ``gradcheck``) it
    allocates them, and a second backward works. ``grads_in_place = False``
    turns it off. Under ``torch.autocast``
    the fused ops run in the autocast dtype (float32 accumulation).
    ``torch.compile(fullgraph=True)`` traces it.

    Falls back to TransformerConv's own code for ``aggr`` other than
    ``'add'``, ``flow='target_to_source'`` and explain mode.
    """
    grads_in_place: bool = True

    def forward(  # noqa: F811
        self,
        x: Union[Tensor, Tuple[Tensor, Tensor]],
        edge_index,
        edge_attr: Optional[Tensor] = None,
        return_attention_weights: Optional[bool] = None,
    ):
        r"""Runs the layer; see the class docstring for shapes."""
        if not self.fused_path(edge_index):
            return super().forward(x, edge_index, edge_attr,
                                   return_attention_weights)

        H, C = self.heads, self.out_channels
        if isinstance(x, Tensor):
            x = (x, x)
        query, key, value, x_r, fresh = self._projections(x)
        query, key = query.view(-1, H, C), key.view(-1, H, C)
        value = value.view(-1, H, C)

        graph = self.prepare_graph(edge_index, key, query, None, edge_attr)
        edge_attr = self.adj_edge_attr(edge_index, edge_attr)
        value_edge = None
        if self.lin_edge is None:
            if edge_attr is not None:
                value_edge = self._value_edge(edge_attr, graph, edge_index)
                if value_edge is None:
                    return super().forward(x, edge_index, edge_attr,
                                           return_attention_weights)
            edge_attr = None
        elif edge_attr is None:
            raise ValueError("'edge_attr' is required when the layer has "
                             "'edge_dim' (as in TransformerConv)")
        # Only this op holds out (the skip term or the mean makes the
        # output a new tensor; beta's Mul would save it) and key and value
        # (fresh outputs of its own plain Linears; not with value_edge, whose
        # scores hold the keys). Not under torch.func transforms: vmap runs
        # the op on slices of shared buffers.
        compiling = _is_compiling()
        in_place = (self.grads_in_place and not compiling
                    and value_edge is None
                    and (self.root_weight or not self.concat)
                    and self.lin_beta is None and fresh[0]
                    and not torch._C._functorch.is_functorch_wrapped_tensor(
                        key))
        out, weights = self.fused_propagate(
            graph, value, (key, in_place, value_edge), query, edge_attr,
            edge_index, isinstance(return_attention_weights, bool),
            weights_after_dropout=False)

        if self.concat:
            out = out.view(-1, H * C)
        else:
            out = out.mean(dim=1)

        if self.root_weight:
            if self.lin_beta is not None:
                beta = self.lin_beta(torch.cat([out, x_r, out - x_r], dim=-1))
                beta = beta.sigmoid()
                out = beta * x_r + (1 - beta) * out
            elif not compiling and x_r.dtype == out.dtype and fresh[1]:
                out = x_r.add_(out)  # x_r is the Linear's fresh output
            else:
                out = out + x_r

        if isinstance(return_attention_weights, bool):
            return out, weights
        return out

    def _projections(self, x: Tuple[Tensor, Tensor]):
        """``(query, key, value, skip, fresh)``: the Linears' outputs [*, H *
        C] (``skip`` None without ``root_weight``); ``fresh``: (key and
        value, skip) are fresh tensors that only this layer holds.

        On one node set (``x`` a Tensor) the four run as one GEMM
        (:meth:`fused_linears`) where they can."""
        lins = [self.lin_query, self.lin_key, self.lin_value]
        if self.root_weight:
            lins.append(self.lin_skip)
        if x[0] is x[1]:
            ys = self.fused_linears(lins, x[0])
            if ys is not None:
                skip = ys[3] if self.root_weight else None
                return ys[0], ys[1], ys[2], skip, (True, True)
        query = self.run_linear(self.lin_query, x[1])
        key, plain_key = self.linear_plain(self.lin_key, x[0])
        value, plain_value = self.linear_plain(self.lin_value, x[0])
        skip, plain_skip = (self.linear_plain(self.lin_skip, x[1])
                            if self.root_weight else (None, False))
        return query, key, value, skip, (plain_key and plain_value,
                                         plain_skip)

    def _value_edge(self, edge_attr: Tensor, graph: PreparedGraph,
                    edge_index) -> Optional[Tensor]:
        """``edge_attr`` without ``lin_edge``, which TransformerConv adds to
        the values: in CSR order if it has one row per edge. None if it
        does not broadcast to [E, H, C] (TransformerConv's code then runs
        it or raises)."""
        shape = (graph.num_edges, self.heads, self.out_channels)
        try:
            fits = torch.broadcast_shapes(edge_attr.shape, shape) == shape
        except RuntimeError:
            fits = False
        if not fits:
            if isinstance(edge_index, PreparedGraph):
                raise ValueError(
                    f"without 'edge_dim', 'edge_attr' must broadcast to "
                    f"[E, heads, out_channels] = {list(shape)}, got "
                    f"{list(edge_attr.shape)}")
            return None
        if edge_attr.dim() == 3 and edge_attr.size(0) > 1:
            return edge_attr[graph.csr_perm]
        return edge_attr

    # Hooks ##################################################################

    def compute_score(self, graph: PreparedGraph,
                      key_args: Tuple[Tensor, bool, Optional[Tensor]],
                      query: Tensor,
                      edge_attr: Optional[Tensor]) -> _TransformerScore:
        """The score inputs; ``key_args``: ``(key [Ns, H, C],
        grads_in_place, value_edge)``, ``query`` [N, H, C], ``edge_attr``
        [E', D] (CSR order) or None."""
        key, in_place, value_edge = key_args
        edge_term = None
        if edge_attr is not None:
            self.materialize(self.lin_edge, edge_attr)
            edge_term = self.lin_edge(edge_attr).view(-1, self.heads,
                                                      self.out_channels)
        return _TransformerScore(query, key, edge_term,
                                 1.0 / math.sqrt(self.out_channels), in_place,
                                 value_edge)

    def attend(self, graph: PreparedGraph, values: Tensor, score,
               mask: Optional[Tensor]):
        """Score, softmax, dropout and aggregation in
        ``transformer_attention``; ``value_edge``'s term apart."""
        # The op itself (its wrapper's checks hold by construction here;
        # under autocast the op casts every input).
        dt = score.key.dtype
        query, values, edge_term, mask = [
            t if t is None or t.dtype == dt else t.to(dt)
            for t in (score.query, values, score.edge_term, mask)]
        csc = graph.transpose_if_needed()
        out, _ = _lib.op('transformer_attention')(
            graph.rowptr, graph.col, query, score.key, values, edge_term,
            mask, score.scale,
            *(tuple(csc)[:3] if csc is not None else (None, ) * 3),
            *graph.max_lengths, score.grads_in_place)
        if score.value_edge is not None:  # in value_j + edge_attr's dtype
            msg_dt = torch.promote_types(values.dtype, score.value_edge.dtype)
            out = out + self._value_edge_sum(graph, query, score,
                                             mask).to(msg_dt)
        return out

    def _value_edge_sum(self, graph: PreparedGraph, query: Tensor, score,
                        mask: Optional[Tensor]) -> Tensor:
        """``sum_j alpha_ij * mask_ij * value_edge_ij`` [N, H, C] (the
        softmax again, from sddmm: deterministic, no atomics)."""
        s = ops.sddmm_csr(graph.rowptr, graph.col, query, score.key,
                          csc=graph.csc, validate=False) * score.scale
        alpha = ops.edge_softmax(s, graph.rowptr, validate=False)
        if mask is not None:
            alpha = alpha * mask
        t = alpha.unsqueeze(-1) * torch.broadcast_to(
            score.value_edge, (s.size(0), self.heads, self.out_channels))
        out = ops.segment_sum(graph.rowptr, t.flatten(1), validate=False)
        return out.view(-1, self.heads, self.out_channels)

    def score_at(self, graph: PreparedGraph, score) -> Tensor:
        """Pre-softmax scores [K, H] of the graph's edges in CSR order
        (builds [K, H, C]: for ``return_attention_weights`` only)."""
        k = self.edge_rows(graph, score.key, 'src')
        if score.edge_term is not None:
            k = k + self.edge_rows(graph, score.edge_term, None)
        q = self.edge_rows(graph, score.query, 'dst')
        return (q * k).sum(dim=-1) * score.scale

    def format_attention_weights(self, graph: PreparedGraph, src: Tensor,
                                 dst: Tensor, alpha: Tensor, edge_index):
        """As TransformerConv: ``(edge_index, alpha)`` for tensors (dense or
        torch.sparse), the ``SparseTensor`` holding ``alpha``."""
        if isinstance(edge_index, Tensor):
            return edge_index, alpha
        if isinstance(edge_index, PreparedGraph):
            return torch.stack([src, dst]).to(graph.index_dtype), alpha
        return edge_index.set_value(alpha, layout='coo')

"""``FastTransformerConv``: PyG's ``TransformerConv`` on the fused kernels."""
import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
from torch import Tensor
from torch_geometric.nn.conv import TransformerConv

from .. import ops
from ..ops import CSC
from .base import AdditiveScore, FusedAttentionConv
from .graph import PreparedGraph

__all__ = ['FastTransformerConv']


@dataclass
class _TransformerScore(AdditiveScore):
    """The dot-product score (``a_edge`` [E, H], CSR order) and, with edge
    features, what they add to the output: ``sum_j alpha_ij * ev[e]``
    ([E, H, K] in CSR order), mapped by ``proj`` ([H, C, K] or None for
    K = C) onto the C channels of each head; ``edge_graph`` the graph whose
    row i holds CSR position e of the rows of i (col = arange(E), and its
    transpose), built once per forward for both passes over the edges."""
    edge_values: Optional[Tensor] = None
    proj: Optional[Tensor] = None
    edge_graph: Optional[Tuple[Tensor, CSC]] = None


class FastTransformerConv(FusedAttentionConv, TransformerConv):
    r"""A drop-in :class:`torch_geometric.nn.conv.TransformerConv`: same
    constructor, parameters, ``state_dict``, ``reset_parameters`` (it
    subclasses it), forward and outputs, with the attention computed by the
    fused kernels:

    * scores ``q_i . (k_j + e_ij) / sqrt(C)`` per edge by ``sddmm_csr``
      (``q = lin_query(x_dst)``, ``k = lin_key(x_src)``, ``e =
      lin_edge(edge_attr)``), one [E, H] tensor;
    * softmax per destination, attention dropout (training only) and the sum
      of ``alpha_ij * v_j`` (``v = lin_value(x_src)``) in one ``attention``
      kernel, which never builds [E, H, C];
    * with ``edge_dim``, the edge term of the values ``sum_j alpha_ij e_ij``
      by a second ``attention`` pass over the edges. ``lin_edge`` has no
      bias, so it is applied on whichever side is smaller: to the
      aggregated features ([N, H, D] -> [N, H, C]) when ``D = edge_dim <
      C``, with ``q`` mapped back through it for the score; else to the
      edge features (one [E, H, C] tensor). Either way one [E, H, min(D, C)]
      tensor is kept for backward;
    * then, as TransformerConv: concat or mean over heads, ``lin_skip``
      root term, ``beta`` gate.

    Shapes (``H`` heads, ``C = out_channels``):

    * ``x``: [N, F_in] or a pair ([N_src, F_src], [N_dst, F_dst]).
    * ``edge_index``: [2, E]; a sparse adjacency ``adj_t`` [N_dst, N_src]
      (torch.sparse, or ``torch_sparse.SparseTensor``); or a
      :class:`PreparedGraph` prepared with ``add_self_loops=False``.
    * ``edge_attr``: [E, edge_dim] in ``edge_index`` order.
    * output: [N_dst, H * C] if ``concat`` else [N_dst, C]; with
      ``return_attention_weights`` also the weights as TransformerConv
      returns them (before dropout): ``(edge_index, alpha [E, H])``, or the
      ``SparseTensor`` holding ``alpha``.

    The graph is prepared once per ``edge_index`` and cached (see
    :mod:`pyg_fastattn.nn.graph`). Backward walks the prepared transpose,
    uses no atomics and is bitwise reproducible. Under ``torch.autocast``
    the fused ops run in the autocast dtype (float32 accumulation).
    ``torch.compile(fullgraph=True)`` traces it.

    Falls back to TransformerConv's own code for ``aggr`` other than
    ``'add'``, ``flow='target_to_source'`` and explain mode.
    """
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
        query = self.lin_query(x[1]).view(-1, H, C)
        key = self.lin_key(x[0]).view(-1, H, C)
        value = self.lin_value(x[0]).view(-1, H, C)

        graph = self.prepare_graph(edge_index, key, query, None, edge_attr)
        if self.lin_edge is None:
            edge_attr = None
        elif edge_attr is None:
            raise ValueError("'edge_attr' is required when the layer has "
                             "'edge_dim' (as in TransformerConv)")
        out, weights = self.fused_propagate(
            graph, value, key, query, edge_attr, edge_index,
            isinstance(return_attention_weights, bool),
            weights_after_dropout=False)

        if self.concat:
            out = out.view(-1, H * C)
        else:
            out = out.mean(dim=1)

        if self.root_weight:
            x_r = self.lin_skip(x[1])
            if self.lin_beta is not None:
                beta = self.lin_beta(torch.cat([out, x_r, out - x_r], dim=-1))
                beta = beta.sigmoid()
                out = beta * x_r + (1 - beta) * out
            else:
                out = out + x_r

        if isinstance(return_attention_weights, bool):
            return out, weights
        return out

    # Hooks ##################################################################

    def compute_score(self, graph: PreparedGraph, key: Tensor, query: Tensor,
                      edge_attr: Optional[Tensor]) -> _TransformerScore:
        """``q_i . (k_j + e_ij) / sqrt(C)`` [E, H] by SDDMM over the CSR;
        ``key`` [Ns, H, C], ``query`` [N, H, C], ``edge_attr`` [E, D] (CSR
        order) or None."""
        H, C = self.heads, self.out_channels
        q = query * (1.0 / math.sqrt(C))
        row = _csr_rows(graph)
        s = ops.sddmm_csr(graph.rowptr, graph.col, q, key, csc=graph.csc,
                          row=row, validate=False)
        ev = proj = None
        if edge_attr is not None:
            self.materialize(self.lin_edge, edge_attr)
            E, D = edge_attr.size(0), edge_attr.size(1)
            w = self.lin_edge.weight.view(H, C, D)
            if D < C:  # q . (W ea) = (W^T q) . ea; values mapped after
                qk = torch.einsum('nhc,hcd->nhd', q, w)
                ev = edge_attr.unsqueeze(1).expand(E, H, D).contiguous()
                proj = w
            else:
                qk = q
                ev = self.lin_edge(edge_attr).view(E, H, C)
            edge_graph = (_arange(graph), _edges_csc(graph, row))
            s = s + ops.sddmm_csr(graph.rowptr, edge_graph[0], qk, ev,
                                  csc=edge_graph[1], row=row, validate=False)
            return _TransformerScore(a_edge=s, negative_slope=1.0,
                                     edge_values=ev, proj=proj,
                                     edge_graph=edge_graph)
        return _TransformerScore(a_edge=s, negative_slope=1.0)

    def attend(self, graph: PreparedGraph, values: Tensor, score,
               mask: Optional[Tensor], return_lse: bool):
        """The value aggregation, plus the edge term of the values."""
        out, lse = super().attend(graph, values, score, mask, return_lse)
        ev = score.edge_values
        if ev is not None:
            col_e, csc_e = score.edge_graph
            agg = ops.attention(graph.rowptr, col_e, ev,
                                a_edge=score.a_edge, mask=mask,
                                negative_slope=1.0, csc=csc_e)
            if score.proj is not None:  # [N, H, D] -> [N, H, C]
                agg = torch.einsum('nhd,hcd->nhc', agg, score.proj)
            out = out + agg
        return out, lse

    def format_attention_weights(self, graph: PreparedGraph, src: Tensor,
                                 dst: Tensor, alpha: Tensor, edge_index):
        """As TransformerConv: ``(edge_index, alpha)`` for tensors (dense or
        torch.sparse), the ``SparseTensor`` holding ``alpha``."""
        if isinstance(edge_index, Tensor):
            return edge_index, alpha
        if isinstance(edge_index, PreparedGraph):
            return torch.stack([src, dst]).to(graph.index_dtype), alpha
        return edge_index.set_value(alpha, layout='coo')


def _csr_rows(graph: PreparedGraph) -> Tensor:
    """[E] the row (destination) of each CSR position."""
    return graph.csc.row[graph.csc.inv]


def _arange(graph: PreparedGraph) -> Tensor:
    return torch.arange(graph.num_aug, device=graph.device,
                        dtype=graph.col.dtype)


def _edges_csc(graph: PreparedGraph, row: Tensor) -> CSC:
    """The transpose of the graph whose column ``e`` is CSR position ``e``
    (one entry each; the graph has no removed tail without self-loops)."""
    idx = torch.arange(graph.num_aug + 1, device=graph.device,
                       dtype=graph.rowptr.dtype)
    e = idx[:-1]
    return CSC(idx, row.to(idx.dtype), e, e)

"""``FastGATv2Conv``: PyG's ``GATv2Conv`` on the fused ``gatv2_attention``
kernel."""
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch_geometric.nn.conv import GATv2Conv

from .. import ops
from .base import FusedAttentionConv
from .graph import PreparedGraph

__all__ = ['FastGATv2Conv']


@dataclass
class GATv2Score:
    """GATv2's score inputs: ``att . leaky_relu(x_l[j] + x_r[i] +
    edge_term[e])`` per head, computed inside the kernel. ``x_l`` [Ns, H, C],
    ``x_r`` [N, H, C], ``edge_term`` [E', H, C] in CSR order or None."""
    x_l: Tensor
    x_r: Tensor
    edge_term: Optional[Tensor] = None


class FastGATv2Conv(FusedAttentionConv, GATv2Conv):
    r"""A drop-in :class:`torch_geometric.nn.conv.GATv2Conv`: same
    constructor, parameters, ``state_dict``, ``reset_parameters`` (it
    subclasses it), forward and outputs, with the attention computed by one
    fused kernel (``ops.gatv2_attention``):

    * per edge ``e = (j -> i)`` and head, ``s = att . leaky_relu(x_l[j] +
      x_r[i] + lin_edge(edge_attr)[e])`` (``x_l = lin_l(x_src)``, ``x_r =
      lin_r(x_dst)``, the same with ``share_weights``) is computed on the fly
      and never stored as [E, H, C];
    * softmax per destination (online, one pass), attention dropout
      (training only) and the weighted sum of ``x_l[j]`` in the same kernel;
    * backward: a pass by destination and one over the prepared transpose,
      no atomics, bitwise reproducible;
    * then, as GATv2Conv: concat or mean over heads, residual, bias (the
      bias is added by the kernel as it stores ``out`` when nothing comes
      between and it is in the op's dtype: no extra [N, H * C] tensor).

    Shapes (``H`` heads, ``C = out_channels``):

    * ``x``: [N, F_in] or a pair ([N_src, F_src], [N_dst, F_dst]).
    * ``edge_index``: [2, E]; a sparse adjacency ``adj_t`` [N_dst, N_src]
      (torch.sparse, or ``torch_sparse.SparseTensor``); or a
      :class:`PreparedGraph` (with the layer's ``add_self_loops``).
    * ``edge_attr``: [E, edge_dim] or [E] in ``edge_index`` order; the
      added self-loops get ``fill_value`` as in GATv2Conv. If None, a
      torch.sparse adjacency's [nnz, D] values, as PyG takes them.
    * output: [N_dst, H * C] if ``concat`` else [N_dst, C]; with
      ``return_attention_weights`` also ``(edge_index', alpha [E'', H])``
      (after dropout) as GATv2Conv returns them (a sparse adjacency holding
      ``alpha`` for sparse input).

    Only the edge term ``lin_edge(edge_attr)`` ([E, H, C], as in GATv2Conv)
    is per-edge and feature-sized. Under ``torch.autocast`` the fused op
    runs in the autocast dtype (float32 accumulation).

    Falls back to GATv2Conv's own code for ``aggr`` other than ``'add'``,
    ``flow='target_to_source'`` and explain mode.
    """
    # PyG's newer GATv2Conv keeps the last attention weights here (and its
    # tests check that they are not kept); the fused layer never keeps them.
    _alpha: Optional[Tensor] = None

    def forward(  # noqa: F811
        self,
        x: Union[Tensor, Tuple[Tensor, Optional[Tensor]]],
        edge_index,
        edge_attr: Optional[Tensor] = None,
        return_attention_weights: Optional[bool] = None,
    ):
        r"""Runs the layer; see the class docstring for shapes."""
        if not self.fused_path(edge_index):
            return super().forward(x, edge_index, edge_attr,
                                   return_attention_weights)

        H, C = self.heads, self.out_channels
        res: Optional[Tensor] = None
        x_l: Optional[Tensor] = None
        x_r: Optional[Tensor] = None
        if isinstance(x, Tensor):
            assert x.dim() == 2
            if self.res is not None:
                res = self.res(x)
            ys = (None if self.share_weights else
                  self.fused_linears([self.lin_l, self.lin_r], x))
            if ys is not None:
                x_l, x_r = ys[0].view(-1, H, C), ys[1].view(-1, H, C)
            else:
                x_l = self.run_linear(self.lin_l, x).view(-1, H, C)
                x_r = (x_l if self.share_weights else
                       self.run_linear(self.lin_r, x).view(-1, H, C))
        else:
            x_l, x_r = x[0], x[1]
            assert x[0].dim() == 2
            if x_r is not None and self.res is not None:
                res = self.res(x_r)
            x_l = self.run_linear(self.lin_l, x_l).view(-1, H, C)
            if x_r is not None:
                x_r = self.run_linear(self.lin_r, x_r).view(-1, H, C)

        assert x_l is not None
        assert x_r is not None
        graph = self.prepare_graph(edge_index, x_l, x_r, None, edge_attr)
        edge_attr = self.adj_edge_attr(edge_index, edge_attr)
        if edge_attr is not None:
            assert self.lin_edge is not None
        bias = self.bias
        fuse = self._fuse_bias(x_l, res)
        out, weights = self.fused_propagate(graph, x_l, x_l, x_r, edge_attr,
                                            edge_index,
                                            return_attention_weights,
                                            bias=bias if fuse else None)
        if fuse:
            bias = None

        out = self.combine_heads(out, res, bias)
        if return_attention_weights:
            return out, weights
        return out

    def _fuse_bias(self, x_l: Tensor, res: Optional[Tensor]) -> bool:
        """Whether the op adds the bias as it stores ``out``: nothing comes
        between (concat or one head, no residual) and the bias has the op's
        dtype, or autocast casts it to that dtype (as :meth:`combine_heads`
        would)."""
        bias = self.bias
        if bias is None or res is not None or not (self.concat
                                                   or self.heads == 1):
            return False
        dt = x_l.dtype
        dev = x_l.device.type
        if torch.is_autocast_enabled(dev) and dt != torch.float64:
            return bias.dtype != torch.float64
        return bias.dtype == dt

    # Hooks ##################################################################

    def compute_score(self, graph: PreparedGraph, x_l: Tensor, x_r: Tensor,
                      edge_attr: Optional[Tensor]) -> GATv2Score:
        """The score inputs; ``edge_attr`` [E', D] in CSR order or None."""
        edge_term = None
        if edge_attr is not None and self.lin_edge is not None:
            self.materialize(self.lin_edge, edge_attr)
            edge_term = self.lin_edge(edge_attr).view(-1, self.heads,
                                                      self.out_channels)
        return GATv2Score(x_l, x_r, edge_term)

    def attend(self, graph: PreparedGraph, values: Tensor, score,
               mask: Optional[Tensor], bias: Optional[Tensor] = None):
        """Score, softmax, dropout and aggregation (and ``bias``) in
        ``gatv2_attention`` (``values`` is ``score.x_l``)."""
        return ops.gatv2_attention(
            graph.rowptr, graph.col, score.x_l, score.x_r, self.att,
            score.edge_term, mask, self.negative_slope,
            csc=graph.transpose_if_needed(),
            validate=False, bias=bias, max_lengths=graph.max_lengths)

    def score_at(self, graph: PreparedGraph, score) -> Tensor:
        """Pre-softmax scores [K, H] of the graph's edges in CSR order
        (builds [K, H, C]: for ``return_attention_weights`` only)."""
        z = (self.edge_rows(graph, score.x_l, 'src')
             + self.edge_rows(graph, score.x_r, 'dst'))
        if score.edge_term is not None:
            z = z + self.edge_rows(graph, score.edge_term, None)
        z = F.leaky_relu(z, self.negative_slope)
        return (z * self.att).sum(dim=-1)

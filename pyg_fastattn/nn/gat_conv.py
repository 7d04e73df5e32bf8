"""``FastGATConv``: PyG's ``GATConv`` on the fused attention kernel."""
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor
from torch_geometric.nn.conv import GATConv

from .. import ops
from .base import AdditiveScore, FusedAttentionConv, plain_linear
from .graph import PreparedGraph

__all__ = ['FastGATConv']


class FastGATConv(FusedAttentionConv, GATConv):
    r"""A drop-in :class:`torch_geometric.nn.conv.GATConv` that runs the
    attention (scores, per-destination softmax, dropout, aggregation) in one
    fused kernel and never materializes per-edge messages.

    Same constructor, parameters (names and shapes), ``state_dict`` and
    ``reset_parameters`` as ``GATConv`` (it subclasses it), and the same
    forward semantics: self-loops removed then added (``num_nodes`` as
    GATConv computes it), ``fill_value`` for edge features, LeakyReLU,
    softmax per destination, attention dropout in training only, concat or
    mean over heads, then residual, then bias.

    Shapes (``H`` heads, ``C = out_channels``, ``E`` edges, ``D = edge_dim``):

    * ``x``: [N, F_in], or a pair ([N_src, F_src], [N_dst, F_dst] or None).
    * ``edge_index``: [2, E] (row 0 = source, row 1 = destination); a sparse
      adjacency ``adj_t`` [N_dst, N_src] (torch.sparse COO/CSR/CSC, or
      ``torch_sparse.SparseTensor`` when installed); or a
      :class:`PreparedGraph` from :func:`pyg_fastattn.prepare`.
    * ``edge_attr``: [E, D] or [E], in ``edge_index`` order; if None, a
      torch.sparse adjacency's [nnz, D] values, as PyG takes them.
    * ``size``: ``(N_src, N_dst)`` for bipartite graphs.
    * output: [N_dst, H * C] if ``concat`` else [N_dst, C]; with
      ``return_attention_weights=True`` also ``(edge_index', alpha)`` with
      ``edge_index'`` [2, E''] the edges attended over (input edges without
      self-loops in input order, then the loops) and ``alpha`` [E'', H]
      (after dropout), exactly as GATConv returns them (a sparse adjacency
      holding ``alpha`` for sparse input).

    Work and memory: the layer computes per-node scores
    ``a_src = <h_src, att_src>`` [N_src, H] and ``a_dst`` [N_dst, H] (one
    GEMM, inside the attention's autograd node together with ``lin`` and,
    when nothing comes between, the bias, which the kernel adds as it stores
    the output; backward is one pass over the transpose that recomputes the
    attention weights); edge
    features enter through ``edge_attr @ W_eff`` [E, H] with ``att_edge``
    folded into ``lin_edge``'s weight (``W_eff`` [D, H]), so nothing of size
    [E, H * C] exists in forward or backward. The graph (CSR by destination,
    its transpose, self-loop bookkeeping) is prepared and validated once per
    ``edge_index`` and cached (see :mod:`pyg_fastattn.nn.graph`); after that
    forward and backward do not synchronize with the host.

    ``torch.compile(fullgraph=True)`` traces the layer without graph breaks
    (the graph is then prepared inside the compiled graph; pass a
    :class:`PreparedGraph` to skip that work). ``return_attention_weights``
    costs one host sync (the number of kept edges depends on the data), so
    it is for analysis, not for compiled or CUDA-graph code. Under
    ``torch.autocast`` the fused op runs in the autocast dtype (float32
    accumulation) on CPU and CUDA.

    Falls back to GATConv's own code (same results, no speedup) for
    ``aggr`` other than ``'add'``, ``flow='target_to_source'`` and explain
    mode.
    """
    def compute_score(self, graph: PreparedGraph, x_src: Tensor,
                      x_dst: Optional[Tensor],
                      edge_attr: Optional[Tensor]) -> AdditiveScore:
        """GAT's additive score terms from ``x_src`` [Ns, H, C], ``x_dst``
        [N, H, C] or None and ``edge_attr`` [E', D] (CSR order). Used when
        attention weights are returned; otherwise the fused op computes the
        node terms itself."""
        a_edge = None
        if (edge_attr is not None and self.lin_edge is not None
                and graph.num_aug > 0):  # (as _edge_scores)
            a_edge = self.per_edge_cast(self._edge_terms(edge_attr)[0],
                                        x_src.dtype, x_src.device)
        return AdditiveScore(
            (x_src * self.att_src).sum(dim=-1),  # [Ns, H]
            None if x_dst is None else (x_dst * self.att_dst).sum(-1),
            a_edge, self.negative_slope)

    def forward(  # noqa: F811
        self,
        x: Union[Tensor, Tuple[Tensor, Optional[Tensor]]],
        edge_index,
        edge_attr: Optional[Tensor] = None,
        size: Optional[Tuple[int, int]] = None,
        return_attention_weights: Optional[bool] = None,
    ):
        r"""Runs the layer; see the class docstring for shapes."""
        if not self.fused_path(edge_index):
            return super().forward(x, edge_index, edge_attr, size,
                                   return_attention_weights)

        H, C = self.heads, self.out_channels
        res: Optional[Tensor] = None
        # lin(x) inside the fused op (x_src = x_dst then stand for x: only
        # their sizes, device and dtype are read before the op).
        lin_x: Optional[Tensor] = None

        # Node transforms, exactly as GATConv.
        if isinstance(x, Tensor):
            assert x.dim() == 2, "Static graphs not supported in 'GATConv'"
            if self.res is not None:
                res = self.res(x)
            if self._fused_lin(x, return_attention_weights):
                lin_x = x_src = x_dst = x
            elif self.lin is not None:
                x_src = x_dst = self.lin(x).view(-1, H, C)
            else:
                x_src = self.lin_src(x).view(-1, H, C)
                x_dst = self.lin_dst(x).view(-1, H, C)
        else:
            x_src, x_dst = x
            assert x_src.dim() == 2, "Static graphs not supported in 'GATConv'"
            if x_dst is not None and self.res is not None:
                res = self.res(x_dst)
            lin_src = self.lin if self.lin is not None else self.lin_src
            lin_dst = self.lin if self.lin is not None else self.lin_dst
            x_src = lin_src(x_src).view(-1, H, C)
            if x_dst is not None:
                x_dst = lin_dst(x_dst).view(-1, H, C)

        if (self.add_self_loops and isinstance(edge_index, Tensor)
                and size is not None and None in size):
            # GATConv takes min(size) as its node count: PyG's TypeError
            raise TypeError(f'`size` {tuple(size)} with a None is not '
                            f'supported with add_self_loops=True (GATConv '
                            f'counts the nodes as min(size))')
        graph = self.prepare_graph(edge_index, x_src, x_dst, size, edge_attr)
        edge_attr = self.adj_edge_attr(edge_index, edge_attr)
        bias, weights = self.bias, None
        if return_attention_weights:
            ea = edge_attr if self.lin_edge is not None else None
            out, weights = self.fused_propagate(graph, x_src, x_src, x_dst, ea,
                                                edge_index, True)
        else:
            out, fused_bias = self._gat_attention(
                graph, x_src, x_dst, lin_x, edge_attr, fuse_bias=res is None)
            if fused_bias:
                bias = None

        out = self.combine_heads(out, res, bias)
        if return_attention_weights:
            return out, weights
        return out

    # Helpers ################################################################

    def _gat_attention(self, graph: PreparedGraph, x_src: Tensor,
                       x_dst: Optional[Tensor], lin_x: Optional[Tensor],
                       edge_attr: Optional[Tensor], fuse_bias: bool):
        """The hot path: scores, softmax, dropout, aggregation (and lin(x)
        and the bias when they can go in) in one op."""
        H = self.heads
        # (parameters read from _parameters: Module.__getattr__ costs host
        # time on every call; pruned or parametrized ones are not there)
        params = self._parameters
        att_src, att_dst, bias = (
            params[k] if k in params else getattr(self, k)
            for k in ('att_src', 'att_dst', 'bias'))
        weight = None if lin_x is None else self.lin._parameters['weight']
        a_edge_aug = self._edge_scores(edge_attr, graph)  # [E', H] or None
        a_edge = None if a_edge_aug is None else a_edge_aug[graph.csr_perm]
        mask = self.dropout_mask(graph.num_aug, H, x_src)
        autocast = torch.is_autocast_enabled(x_src.device.type)
        dt = x_src.dtype if weight is None else weight.dtype
        a_edge = self.per_edge_cast(a_edge, dt, x_src.device)
        mask = self.per_edge_cast(mask, dt, x_src.device)
        shared = x_dst is x_src
        # out + bias is the same [N, H * C] sum when nothing comes between
        fuse = (fuse_bias and bias is not None
                and (autocast or bias.dtype == dt)
                and (self.concat or H == 1))
        return ops.gat_attention(
            graph.rowptr, graph.col, graph.transpose_if_needed(),
            None if lin_x is not None else x_src, att_src,
            None if shared else x_dst, att_dst, a_edge, mask,
            self.negative_slope, dst_is_src=shared,
            bias=bias if fuse else None, x=lin_x, weight=weight,
            max_lengths=graph.max_lengths), fuse

    def _fused_lin(self, x: Tensor, want_weights) -> bool:
        """Whether ``lin(x)`` can run inside the fused op: a bias-free
        :func:`plain_linear` (else ``lin`` runs, and raises what GATConv
        raises)."""
        lin = self._modules.get('lin')  # (None: lin_src / lin_dst)
        return (not want_weights and plain_linear(lin, x)
                and lin._parameters['bias'] is None)

    def _edge_terms(self, *edge_attrs: Tensor) -> List[Tensor]:
        """``<lin_edge(ea), att_edge>`` per head, [E_k, H], for each ``ea``
        [E_k, D]. For PyG's plain ``Linear`` (:func:`plain_linear`)
        ``att_edge`` is folded into its weight once (``W_eff`` [D, H]):
        nothing of size [E, H * C]; any other module (LoRA, hooks) is
        called."""
        first = edge_attrs[0]
        self.materialize(self.lin_edge, first)
        H, C = self.heads, self.out_channels
        if plain_linear(self.lin_edge, first):
            w = self.lin_edge.weight.view(H, C, -1)
            w_eff = (w * self.att_edge.view(H, C, 1)).sum(dim=1).t()
            return [ea @ w_eff for ea in edge_attrs]
        return [(self.lin_edge(ea).view(-1, H, C) * self.att_edge).sum(dim=-1)
                for ea in edge_attrs]

    def _edge_scores(self, edge_attr: Optional[Tensor],
                     graph: PreparedGraph) -> Optional[Tensor]:
        """Edge term of the scores in augmented order: [E', H] or None."""
        if edge_attr is None or self.lin_edge is None or graph.num_aug == 0:
            return None
        ea = self.check_edge_attr(edge_attr, graph)
        if graph.num_loops == 0:
            return self._edge_terms(ea)[0]
        loop = self.loop_edge_attr(ea, graph)
        if loop.dtype != ea.dtype:  # (integer features, a 'mean' fill)
            ea = ea.to(loop.dtype)  # as PyG's cat of the two
        return torch.cat(self._edge_terms(ea, loop), dim=0)

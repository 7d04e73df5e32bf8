"""``FastGATConv``: PyG's ``GATConv`` on the fused attention kernel."""
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.parameter import UninitializedParameter
from torch_geometric.nn.conv import GATConv
from torch_geometric.nn.dense.linear import Linear

from .. import ops
from .graph import PreparedGraph, _sparse_tensor_cls, get_graph, is_sparse_adj

__all__ = ['FastGATConv']


class FastGATConv(GATConv):
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
    * ``edge_attr``: [E, D] or [E], in ``edge_index`` order.
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
    def _fast_path(self) -> bool:
        return (self.aggr in ('add', 'sum') and self.flow == 'source_to_target'
                and not self._explain)

    def forward(  # noqa: F811
        self,
        x: Union[Tensor, Tuple[Tensor, Optional[Tensor]]],
        edge_index,
        edge_attr: Optional[Tensor] = None,
        size: Optional[Tuple[int, int]] = None,
        return_attention_weights: Optional[bool] = None,
    ):
        r"""Runs the layer; see the class docstring for shapes."""
        if not self._fast_path():
            if isinstance(edge_index, PreparedGraph):
                raise ValueError(
                    'a PreparedGraph needs the fused path (aggr="add", '
                    'flow="source_to_target", explain off); pass edge_index')
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

        graph = self._graph(edge_index, x_src, x_dst, size, edge_attr)
        if graph.device != x_src.device:
            raise ValueError(f'`edge_index` is on {graph.device} but `x` is '
                             f'on {x_src.device}')
        a_edge_aug = self._edge_scores(edge_attr, graph)  # [E', H] or None
        a_edge = None if a_edge_aug is None else a_edge_aug[graph.csr_perm]

        mask = None
        if self.training and self.dropout > 0:
            mask = self._dropout_mask(graph.num_aug, H, x_src)

        h_src, h_dst = x_src, x_dst
        att_src, att_dst = self.att_src, self.att_dst
        # Under autocast the ops cast every float input themselves.
        autocast = torch.is_autocast_enabled(x_src.device.type)
        dt = x_src.dtype if lin_x is None else self.lin.weight.dtype
        cast = lambda t: t if t is None or autocast else t.to(dt)  # noqa: E731
        a_edge, mask = cast(a_edge), cast(mask)

        bias = self.bias
        if return_attention_weights:
            a_src = (x_src * self.att_src).sum(dim=-1)  # [Ns, H]
            a_dst = None if x_dst is None else (x_dst * self.att_dst).sum(-1)
            out, lse = ops.attention(graph.rowptr, graph.col, h_src, a_src,
                                     a_dst, a_edge, mask, self.negative_slope,
                                     csc=graph.csc, return_lse=True)
        else:  # score terms (and the bias) inside the fused op: one node
            shared = h_dst is h_src
            # out + bias is the same [N, H * C] sum when nothing comes between
            fuse = (bias is not None and res is None
                    and (autocast or bias.dtype == dt)
                    and (self.concat or H == 1))
            out = ops.gat_attention(
                graph.rowptr, graph.col, graph.csc,
                None if lin_x is not None else h_src, att_src,
                None if shared else h_dst, att_dst, a_edge, mask,
                self.negative_slope, dst_is_src=shared,
                bias=bias if fuse else None, x=lin_x,
                weight=None if lin_x is None else self.lin.weight)
            if fuse:
                bias = None

        if self.concat or H == 1:  # the mean of one head is that head
            out = out.view(-1, H * C)
        else:
            out = out.mean(dim=1)
        if res is not None:
            out = out + res
        if bias is not None:
            out = out + bias

        if return_attention_weights:
            return out, self._attention_weights(graph, a_src, a_dst, a_edge,
                                                mask, lse, edge_index)
        return out

    # Helpers ################################################################

    def _fused_lin(self, x: Tensor, want_weights) -> bool:
        """Whether ``lin(x)`` can run inside the fused op: PyG's own bias-free
        ``Linear`` (not a subclass: LoRA, quantized), without hooks, with x
        in its dtype or under autocast."""
        lin = self.lin
        return (not want_weights and type(lin) is Linear and lin.bias is None
                and not isinstance(lin.weight, UninitializedParameter)
                and not lin._forward_hooks and not lin._forward_pre_hooks
                and (x.dtype == lin.weight.dtype
                     or torch.is_autocast_enabled(x.device.type)))

    def _graph(self, edge_index, x_src: Tensor, x_dst: Optional[Tensor],
               size, edge_attr: Optional[Tensor]) -> PreparedGraph:
        """Resolve the prepared graph and check node counts as PyG does."""
        Ns = x_src.size(0)
        if is_sparse_adj(edge_index):
            is_torch_sparse = isinstance(edge_index, Tensor)
            if self.add_self_loops and (
                    edge_attr is not None if is_torch_sparse else
                    self.edge_dim is not None):
                raise NotImplementedError(
                    "The usage of 'edge_attr' and 'add_self_loops' "
                    "simultaneously is currently not yet supported for "
                    "'edge_index' in a sparse form (as in GATConv)")
            if (self.add_self_loops and is_torch_sparse
                    and edge_index.layout == torch.sparse_csc):
                raise ValueError(
                    "add_self_loops=True needs a COO or CSR adjacency "
                    "(as in GATConv); got a CSC tensor")
            Nd = x_dst.size(0) if x_dst is not None else edge_index.size(0)
            return get_graph(edge_index, Ns, Nd, self.add_self_loops)

        if size is not None:
            if size[0] is not None and size[0] != Ns:
                raise ValueError(f'Encountered tensor with size {Ns} in '
                                 f'dimension 0, but expected size {size[0]}.')
            if (x_dst is not None and size[1] is not None
                    and size[1] != x_dst.size(0)):
                raise ValueError(f'Encountered tensor with size '
                                 f'{x_dst.size(0)} in dimension 0, but '
                                 f'expected size {size[1]}.')

        if isinstance(edge_index, PreparedGraph):
            g = edge_index
            Nd = (x_dst.size(0) if x_dst is not None else
                  size[1] if size is not None else g.num_dst)
            if g.num_src != Ns or g.num_dst != Nd:
                raise ValueError(
                    f'the PreparedGraph has {g.num_src} source and '
                    f'{g.num_dst} destination nodes, but the inputs have '
                    f'{Ns} and {Nd}')
            if g.add_self_loops != bool(self.add_self_loops):
                raise ValueError(
                    f'the PreparedGraph was prepared with add_self_loops='
                    f'{g.add_self_loops} but the layer has add_self_loops='
                    f'{self.add_self_loops}')
            return g

        if isinstance(edge_index, Tensor):
            Nd = (x_dst.size(0) if x_dst is not None else
                  size[1] if size is not None and size[1] is not None else Ns)
            return get_graph(edge_index, Ns, Nd, self.add_self_loops)

        raise TypeError(
            '`edge_index` must be a [2, E] integer tensor, a torch.sparse '
            'adjacency (COO/CSR/CSC, rows = destinations), a '
            'torch_sparse.SparseTensor (when torch_sparse is installed) or a '
            f'pyg_fastattn.PreparedGraph; got {type(edge_index).__name__}')

    def _edge_scores(self, edge_attr: Optional[Tensor],
                     graph: PreparedGraph) -> Optional[Tensor]:
        """Edge term of the scores in augmented order: [E', H] or None."""
        if edge_attr is None or self.lin_edge is None or graph.num_aug == 0:
            return None
        ea = edge_attr.view(-1, 1) if edge_attr.dim() == 1 else edge_attr
        if ea.size(0) != graph.num_edges:
            raise ValueError(f'`edge_attr` must have one row per edge '
                             f'({graph.num_edges}), got {ea.size(0)}')
        if isinstance(self.lin_edge.weight, UninitializedParameter):
            self.lin_edge(ea[:0])  # materialize the lazy weight
        H, C = self.heads, self.out_channels
        # Fold att_edge into lin_edge: W_eff [D, H].
        w = self.lin_edge.weight.view(H, C, -1)
        w_eff = (w * self.att_edge.view(H, C, 1)).sum(dim=1).t()
        a_edge = ea @ w_eff
        if graph.num_loops > 0:
            a_loop = self._loop_attr(ea, graph) @ w_eff
            a_edge = torch.cat([a_edge, a_loop], dim=0)
        return a_edge

    def _loop_attr(self, ea: Tensor, graph: PreparedGraph) -> Tensor:
        """Edge features of the added loops, as ``add_self_loops`` computes
        them, without data-dependent shapes: [L, D]."""
        L, D = graph.num_loops, ea.size(1)
        fv = self.fill_value
        if fv is None:
            return ea.new_ones((L, D))
        if isinstance(fv, (int, float)):
            return ea.new_full((L, D), fv)
        if isinstance(fv, Tensor):
            return fv.to(ea.device, ea.dtype).expand(L, D)
        if not isinstance(fv, str):
            raise AttributeError("No valid 'fill_value' provided")
        idx = graph.fill_index  # [E]; L = does not count (extra slot)
        if fv in ('add', 'sum', 'mean'):
            # Deterministic (no atomics): sum each CSR row of the kept input
            # edges; the row's own added loop contributes a zero row.
            ea_aug = torch.cat([ea, ea.new_zeros((L, D))])
            out = ops.segment_sum(graph.rowptr, ea_aug, graph.csr_perm)[:L]
            if fv == 'mean':  # each of the first L rows holds one added loop
                cnt = (graph.rowptr[1:L + 1] - graph.rowptr[:L] - 1).clamp(min=1)
                out = out / cnt.to(ea.dtype).view(-1, 1)
            return out
        elif fv in ('max', 'min', 'amax', 'amin'):
            out = ea.new_zeros((L + 1, D)).scatter_reduce(
                0, idx.view(-1, 1).expand_as(ea), ea, f'a{fv[-3:]}',
                include_self=False)
        elif fv == 'mul':
            out = ea.new_ones((L + 1, D)).scatter_reduce(
                0, idx.view(-1, 1).expand_as(ea), ea, 'prod',
                include_self=True)
        else:
            raise ValueError(f"Encountered invalid `fill_value` '{fv}'")
        return out[:L]

    def _dropout_mask(self, E: int, H: int, like: Tensor) -> Tensor:
        """Dropout multiplier [E, H]: keep / (1 - p), fresh on every
        CUDA-graph replay."""
        p = float(self.dropout)
        if p >= 1.0:
            return like.new_zeros((E, H))
        scale = 1.0 / (1.0 - p)
        if like.device.type == 'cpu':  # torch's CPU bernoulli_ is ~2.5x slower
            mask = torch.rand((E, H)).ge_(p).mul_(scale)  # float32
            return mask if like.dtype == torch.float32 else mask.to(like.dtype)
        # GPU: two kernels on one [E, H] buffer (rand + ge_ + mul_ take three).
        mask = torch.empty((E, H), device=like.device, dtype=like.dtype)
        return mask.bernoulli_(1.0 - p).mul_(scale)

    def _attention_weights(self, graph: PreparedGraph, a_src: Tensor,
                           a_dst: Optional[Tensor], a_edge: Optional[Tensor],
                           mask: Optional[Tensor], lse: Tensor, edge_index):
        """(edge_index', alpha) in GATConv's order; only [E'', H] memory."""
        H = self.heads
        pos = graph.kept_positions()  # CSR positions, GATConv order
        src, dst = graph.col[pos].long(), graph.dst_of(pos)
        z = a_src[src]
        if a_dst is not None:
            z = z + a_dst[dst]
        if a_edge is not None:
            z = z + a_edge[pos]
        s = F.leaky_relu(z, self.negative_slope)
        # Softmax per destination, shifted by the kernel's row log-sum-exp
        # (any per-row shift is exact; the normalization keeps it
        # differentiable).
        t = lse.dtype
        ex = torch.exp(s.to(t) - lse.detach()[dst])
        den = ex.new_zeros((graph.num_dst, H)).index_add(0, dst, ex)
        alpha = (ex / den[dst]).to(a_src.dtype)
        if mask is not None:
            alpha = alpha * mask[pos]
        return _format_weights(graph, src, dst, alpha, edge_index)


def _format_weights(graph: PreparedGraph, src: Tensor, dst: Tensor,
                    alpha: Tensor, edge_index):
    """Shape the attention weights like GATConv for the input's form."""
    layout = graph.layout
    if layout == 'edge_index':
        dtype = torch.int64 if graph.add_self_loops else graph.index_dtype
        return torch.stack([src, dst]).to(dtype), alpha
    Nd, Ns = graph.num_dst, graph.num_src
    if graph.add_self_loops:  # GATConv coalesces: sort by (dst, src)
        order = torch.argsort(dst * max(Ns, 1) + src, stable=True)
        src, dst, alpha = src[order], dst[order], alpha[order]
    size = (Nd, Ns) + tuple(alpha.shape[1:])
    if layout == 'sparse_tensor':
        SparseTensor = _sparse_tensor_cls()
        adj = SparseTensor(row=dst, col=src, value=alpha,
                           sparse_sizes=(Nd, Ns), is_sorted=True)
        return adj
    coo = torch.sparse_coo_tensor(torch.stack([dst, src]), alpha, size)
    if layout == 'coo':
        adj = coo.coalesce()
    elif layout == 'csr' and graph.add_self_loops:
        adj = torch.sparse_csr_tensor(
            torch.ops.aten._convert_indices_from_coo_to_csr(dst, Nd),
            src, alpha, size)
    elif layout == 'csr':  # keep the input's CSR structure
        adj = torch.sparse_csr_tensor(edge_index.crow_indices(),
                                      edge_index.col_indices(), alpha, size)
    else:  # csc, no self-loops (GATConv cannot add loops to CSC)
        adj = torch.sparse_csc_tensor(edge_index.ccol_indices(),
                                      edge_index.row_indices(), alpha, size)
    return adj, alpha

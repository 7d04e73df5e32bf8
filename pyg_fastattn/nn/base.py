"""``FusedAttentionConv``: the part of a fused attention layer that is not
its score.

A layer built on it supplies how edges are scored; the base owns the graph
(preparation, caching, self-loop removal and addition with ``fill_value``),
attention dropout, the dtype/autocast policy, the call into the fused
softmax + aggregation kernels and ``return_attention_weights``.
"""
import contextlib
import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.parameter import UninitializedParameter, UninitializedTensorMixin
from torch_geometric.nn.conv import MessagePassing
from torch_geometric.nn.dense.linear import Linear
from torch_geometric.utils import scatter

from .. import ops
from .graph import (PreparedGraph, _EdgeIndex, _is_compiling,
                    _sparse_tensor_cls, default_num_dst, get_graph,
                    is_sparse_adj)

__all__ = ['FusedAttentionConv', 'AdditiveScore', 'plain_linear']


def plain_linear(lin, x: Tensor) -> bool:
    """Whether an op may compute ``lin(x)`` in place of calling ``lin``:
    it is PyG's own ``Linear`` (not a subclass: LoRA, quantized),
    initialized, without module hooks (forward or backward, its own or
    global), and ``x`` is a 2-D tensor, of its width and device, in its
    dtype or under autocast. Otherwise ``lin`` is called (and raises what
    PyG raises)."""
    if type(lin) is not Linear:
        return False
    # (_parameters: Module.__getattr__ costs host time; None where a hook
    # computes the weight, as torch.nn.utils.prune does)
    w = lin._parameters.get('weight')
    hooks = torch.nn.modules.module
    # (the mixin: Parameter's metaclass makes isinstance() slow)
    return (w is not None and not isinstance(w, UninitializedTensorMixin)
            and isinstance(x, Tensor) and x.dim() == 2
            and x.size(-1) == w.size(1) and x.device == w.device
            and (x.dtype == w.dtype
                 or torch.is_autocast_enabled(x.device.type))
            and not lin._forward_hooks and not lin._forward_pre_hooks
            and not lin._backward_hooks and not lin._backward_pre_hooks
            and not hooks._global_forward_hooks
            and not hooks._global_forward_pre_hooks
            and not hooks._global_backward_hooks
            and not hooks._global_backward_pre_hooks)


try:  # torch's functorch interpreter stack (private; present in 2.x)
    from torch._C._functorch import TransformType as _TransformType
    from torch._C._functorch import get_interpreter_stack as _interpreters
    _AUTODIFF_TRANSFORMS = (_TransformType.Grad, _TransformType.Jvp)
except ImportError:  # pragma: no cover
    _interpreters, _AUTODIFF_TRANSFORMS = (lambda: None), ()


# (torch.compile calls it once while tracing and keeps the answer: the
# interpreter stack is not traceable, and a graph compiled under a transform
# is guarded on that stack)
@torch.compiler.assume_constant_result
def _autodiff_transform() -> bool:
    """Whether a torch.func gradient transform (grad, vjp, jacrev, jvp,
    jacfwd) or a forward-mode AD level is active: the fused ops' autograd
    (a C++ autograd Function) runs under neither. (vmap alone runs them.)"""
    stack = _interpreters()
    if stack and any(i.key() in _AUTODIFF_TRANSFORMS for i in stack):
        return True
    return torch.autograd.forward_ad._current_level >= 0


class _EdgeRows(torch.autograd.Function):
    """``t[idx]``, with the gradient summed per segment of ``rowptr`` (in
    ``perm``'s order when given) by ``segment_sum``: no atomics."""
    generate_vmap_rule = True

    @staticmethod
    def forward(t: Tensor, idx: Tensor, rowptr: Tensor,
                perm: Optional[Tensor]) -> Tensor:
        return t[idx]

    @staticmethod
    def setup_context(ctx, inputs, output):
        t, _, rowptr, perm = inputs
        ctx.save_for_backward(rowptr, perm)
        ctx.shape = t.shape

    @staticmethod
    def backward(ctx, grad):
        rowptr, perm = ctx.saved_tensors
        g = ops.segment_sum(rowptr, grad.flatten(1), perm, validate=False)
        return g.view(ctx.shape), None, None, None


@dataclass
class AdditiveScore:
    r"""A score the fused ``attention`` kernel computes itself, per edge
    ``e = (j -> i)`` and head ``h``::

        s[e, h] = leaky_relu(a_src[j, h] + a_dst[i, h] + a_edge[e, h],
                             negative_slope)

    Absent terms are 0; ``negative_slope=1.0`` is the identity, so a
    precomputed per-edge score (a dot product from ``sddmm``, say) is
    ``AdditiveScore(a_edge=s, negative_slope=1.0)``.

    Shapes (``Ns`` sources, ``N`` destinations, ``E' = graph.num_aug``):
    ``a_src`` [Ns, H], ``a_dst`` [N, H], ``a_edge`` [E', H] in CSR order
    (``graph.csr_perm`` maps augmented to CSR order). All are differentiable.
    """
    a_src: Optional[Tensor] = None
    a_dst: Optional[Tensor] = None
    a_edge: Optional[Tensor] = None
    negative_slope: float = 1.0


class FusedAttentionConv(MessagePassing):
    r"""Base of attention layers that run on the fused kernels: softmax over
    each destination's in-edges and the weighted sum of source values in one
    pass, without per-edge messages.

    A subclass computes its projections and its score; the base does the
    rest. The usual forward of a subclass is::

        graph = self.prepare_graph(edge_index, x_src, x_dst, size, edge_attr)
        out, weights = self.fused_propagate(graph, values, x_src, x_dst,
                                            edge_attr, edge_index,
                                            return_attention_weights)

    which calls the hooks below. Shapes: ``H`` heads, ``C`` channels per
    head, ``Ns``/``N`` source/destination nodes, ``E`` input edges,
    ``E' = E + L`` with ``L`` added self-loops (``graph.num_aug``), ``D``
    edge features.

    Hooks a subclass implements:

    * :meth:`compute_score` ``(graph, x_src, x_dst, edge_attr) -> score``:
      ``x_src`` [Ns, ...] and ``x_dst`` [N, ...] or None are whatever the
      subclass passed to :meth:`fused_propagate`; ``edge_attr`` is [E', D]
      in CSR order with the added loops' features filled in (or None).
      Returns a score object; an :class:`AdditiveScore` covers per-node
      additive terms (GAT) and precomputed per-edge scores (dot products).
    * :meth:`attend` ``(graph, values, score, mask) -> out``: only needed
      for a score that is not an :class:`AdditiveScore`, e.g. one whose
      per-edge nonlinearity is computed inside its own fused kernel.
      ``values`` [Ns, H, C], ``mask`` [E', H] (CSR order) or None; ``out``
      [N, H, C] (already multiplied by ``mask``). Called with a keyword
      ``bias`` (H * C elements, to add to every row of ``out``) only when
      the subclass passes one to :meth:`fused_propagate`.
    * :meth:`score_at` ``(graph, score) -> [K, H]``: the pre-softmax
      scores of the graph's ``K = graph.num_kept()`` edges in CSR order;
      only for ``return_attention_weights``, and only needed for a score
      that is not an :class:`AdditiveScore`. :meth:`edge_rows` gathers
      per-node tensors to the edges with a backward free of atomics.

    Attributes the base reads (PyG's layers have them): ``heads``,
    ``dropout`` (attention dropout, training only), ``add_self_loops`` and
    ``fill_value`` (default False and ``'mean'``), ``aggr``/``flow`` (the
    fused path needs ``'add'`` and ``'source_to_target'``, see
    :meth:`fused_path`).
    """
    #: Up to this many output elements (nodes x total width), the
    #: projections of one node set run as one GEMM (:meth:`fused_linears`);
    #: 0 turns it off.
    fuse_projections_max_elems: int = 1 << 23

    # PyG's first instance of a class keeps the class's ``propagate`` as its
    # ``_orig_propagate`` (explain mode runs it). Built after an instance of
    # the PyG parent, ours would keep the parent's generated propagate,
    # which ignores edge masks: the originals, ahead of the parent's.
    propagate = MessagePassing.propagate
    edge_updater = MessagePassing.edge_updater

    # Hooks ##################################################################

    def compute_score(self, graph: PreparedGraph, x_src, x_dst,
                      edge_attr: Optional[Tensor]):
        """The subclass's score; see the class docstring."""
        raise NotImplementedError(
            f'{type(self).__name__} must implement compute_score()')

    def attend(self, graph: PreparedGraph, values: Tensor, score,
               mask: Optional[Tensor]) -> Tensor:
        """Softmax + aggregation: ``out`` [N, H, C]."""
        if not isinstance(score, AdditiveScore):
            raise NotImplementedError(
                f'{type(self).__name__}.attend() must handle a '
                f'{type(score).__name__} score')
        return ops.attention(graph.rowptr, graph.col, values, score.a_src,
                             score.a_dst, score.a_edge, mask,
                             score.negative_slope,
                             csc=graph.transpose_if_needed())

    def score_at(self, graph: PreparedGraph, score) -> Tensor:
        """Pre-softmax scores [K, H] of the graph's edges in CSR order."""
        if not isinstance(score, AdditiveScore):
            raise NotImplementedError(
                f'{type(self).__name__}.score_at() must handle a '
                f'{type(score).__name__} score')
        z = None
        for t, end in ((score.a_src, 'src'), (score.a_dst, 'dst'),
                       (score.a_edge, None)):
            if t is not None:
                t = self.edge_rows(graph, t, end)
                z = t if z is None else z + t
        if score.negative_slope == 1.0:
            return z
        return F.leaky_relu(z, score.negative_slope)

    @staticmethod
    def edge_rows(graph: PreparedGraph, t: Tensor,
                  end: Optional[str]) -> Tensor:
        """``t``'s rows for the graph's ``K`` edges in CSR order: of each
        edge's source (``end='src'``, ``t`` [Ns, ...]), of its destination
        (``'dst'``, ``t`` [N, ...]), or ``t[:K]`` itself (``None``, ``t``
        per edge in CSR order). The gradient sums per node in a fixed order
        (``segment_sum`` over the CSC or CSR rows), so it is bitwise
        reproducible, where indexing's backward is not on every device."""
        K = graph.num_kept()
        if end is None:
            return t[:K]
        if end == 'src':
            csc = graph.csc
            return _EdgeRows.apply(t, graph.col[:K], csc.colptr, csc.perm[:K])
        return _EdgeRows.apply(t, graph.dst_of(
            torch.arange(K, device=t.device)), graph.rowptr, None)

    # The fused path #########################################################

    def fused_path(self, edge_index=None) -> bool:
        """Whether the fused kernels compute this layer: ``aggr='add'``,
        ``flow='source_to_target'``, explain mode off, no message-passing
        hooks (``register_message_forward_hook`` and the like: PyG's
        ``AttentionExplainer`` reads ``alpha`` through one) and no
        parameter still lazy (PyG's forward initializes them, in its order,
        so that a seed gives PyG's weights), and no differentiation the
        fused ops' autograd cannot run under (:func:`_autodiff_transform`).
        Else the subclass falls back to PyG's message passing, which cannot
        take a :class:`PreparedGraph` ``edge_index``: that raises."""
        fused = (self.aggr in ('add', 'sum')
                 and self.flow == 'source_to_target' and not self._explain
                 and not self._has_message_passing_hooks()
                 and self._materialized() and not _autodiff_transform())
        if not fused and isinstance(edge_index, PreparedGraph):
            raise ValueError(
                'a PreparedGraph needs the fused path (aggr="add", '
                'flow="source_to_target", explain off, no message-passing '
                'hooks, parameters initialized, no torch.func grad/jvp '
                'transform or forward-mode AD); pass edge_index')
        return fused

    def _has_message_passing_hooks(self) -> bool:
        return bool(
            self._propagate_forward_pre_hooks or self._propagate_forward_hooks
            or self._message_forward_pre_hooks or self._message_forward_hooks
            or self._aggregate_forward_pre_hooks
            or self._aggregate_forward_hooks
            or self._message_and_aggregate_forward_pre_hooks
            or self._message_and_aggregate_forward_hooks
            or self._edge_update_forward_pre_hooks
            or self._edge_update_forward_hooks)

    def _materialized(self) -> bool:
        """No parameter is an uninitialized lazy one (checked until true)."""
        if self.__dict__.get('_all_materialized', False):
            return True
        if any(isinstance(p, UninitializedParameter)
               for p in self.parameters()):
            return False
        self.__dict__['_all_materialized'] = True
        return True

    def fused_propagate(self, graph: PreparedGraph, values: Tensor, x_src,
                        x_dst, edge_attr: Optional[Tensor], edge_index,
                        return_attention_weights=None, weights_after_dropout:
                        bool = True, bias: Optional[Tensor] = None):
        r"""Score, softmax, dropout and aggregation over ``graph``.

        Args:
            graph: from :meth:`prepare_graph`.
            values: [Ns, H, C], aggregated per destination.
            x_src, x_dst: passed to :meth:`compute_score` as they are.
            edge_attr: [E, D] or [E] in input order, or None.
            edge_index: the ``edge_index`` the layer got (shapes the
                returned attention weights).
            return_attention_weights: also return the attention weights.
            weights_after_dropout: the returned weights include the dropout
                mask (GATConv) or not (TransformerConv).
            bias: H * C elements for :meth:`attend` to add to ``out`` (the
                subclass's ``attend`` must take it), or None.

        Returns:
            ``(out [N, H, C], weights or None)``.
        """
        ea = self.edge_attr_csr(edge_attr, graph)
        score = self.compute_score(graph, x_src, x_dst, ea)
        mask = self.dropout_mask(graph.num_aug, values.size(1), values)
        mask = self.per_edge_cast(mask, values.dtype, values.device)
        if bias is None:
            out = self.attend(graph, values, score, mask)
        else:
            out = self.attend(graph, values, score, mask, bias=bias)
        weights = None
        if return_attention_weights:
            weights = self.attention_weights(
                graph, score, edge_index,
                mask if weights_after_dropout else None)
        return out, weights

    def combine_heads(self, out: Tensor, res: Optional[Tensor],
                      bias: Optional[Tensor]) -> Tensor:
        """The layer output from ``out`` [N, H, C], as PyG's GAT layers: heads
        concatenated (or averaged with ``concat=False``), then the residual
        ``res``, then ``bias`` (None when the op added it already). Under
        autocast the output keeps the autocast dtype (the bias is cast to
        it, as the fused ops cast theirs)."""
        H, C = self.heads, self.out_channels
        if self.concat or H == 1:  # the mean of one head is that head
            out = out.view(-1, H * C)
        else:
            out = out.mean(dim=1)
        if res is not None:
            out = out + res
        if bias is not None:
            out = out + self.autocast_like(bias, out)
        return out

    @staticmethod
    def autocast_like(t: Tensor, out: Tensor) -> Tensor:
        """``t`` in ``out``'s dtype where ``out`` has the autocast dtype
        (inside ``torch.autocast``), else ``t``: a float32 parameter added
        to a half-precision output would make it float32."""
        dev = out.device.type
        if (t.dtype != out.dtype and torch.is_autocast_enabled(dev)
                and out.dtype == torch.get_autocast_dtype(dev)):
            return t.to(out.dtype)
        return t

    @staticmethod
    def per_edge_cast(t: Optional[Tensor], dtype: torch.dtype,
                      device: torch.device) -> Optional[Tensor]:
        """The dtype policy for per-edge inputs of the fused ops: under
        autocast they stay as they are (the ops cast every float input to
        the autocast dtype themselves); else they take the values' dtype."""
        if t is None or torch.is_autocast_enabled(device.type):
            return t
        return t.to(dtype)

    # Graph ##################################################################

    def prepare_graph(self, edge_index, x_src: Tensor,
                      x_dst: Optional[Tensor], size=None,
                      edge_attr: Optional[Tensor] = None) -> PreparedGraph:
        """The prepared (cached) graph for ``edge_index``, with node counts
        checked as PyG does. ``x_src`` [Ns, ...], ``x_dst`` [N, ...] or None
        (then ``N`` comes from ``size``, the sparse adjacency, or is Ns)."""
        graph = self._graph(edge_index, x_src, x_dst, size, edge_attr)
        if graph.device != x_src.device:
            raise ValueError(f'`edge_index` is on {graph.device} but `x` is '
                             f'on {x_src.device}')
        if (edge_attr is not None and graph.add_self_loops
                and graph.layout == 'edge_index'
                and (edge_attr.dim() == 0
                     or edge_attr.size(0) != graph.num_edges)):
            # PyG's remove_self_loops indexes edge_attr with an [E] mask,
            # edge_dim or not
            raise IndexError(f'`edge_attr` must have one row per edge '
                             f'({graph.num_edges}), got '
                             f'{tuple(edge_attr.shape)}')
        return graph

    def _graph(self, edge_index, x_src: Tensor, x_dst: Optional[Tensor],
               size, edge_attr: Optional[Tensor]) -> PreparedGraph:
        loops = bool(getattr(self, 'add_self_loops', False))
        Ns = x_src.size(0)
        if is_sparse_adj(edge_index):
            is_torch_sparse = isinstance(edge_index, Tensor)
            if loops and (edge_attr is not None if is_torch_sparse else
                          getattr(self, 'edge_dim', None) is not None):
                raise NotImplementedError(
                    "The usage of 'edge_attr' and 'add_self_loops' "
                    "simultaneously is currently not yet supported for "
                    "'edge_index' in a sparse form "
                    f"(as in {self._pyg_name()})")
            if (loops and is_torch_sparse
                    and edge_index.layout == torch.sparse_csc):
                raise ValueError(
                    "add_self_loops=True needs a COO or CSR adjacency "
                    f"(as in {self._pyg_name()}); got a CSC tensor")
            Nd = x_dst.size(0) if x_dst is not None else edge_index.size(0)
            return get_graph(edge_index, Ns, Nd, loops)

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
            if g.add_self_loops != loops:
                raise ValueError(
                    f'the PreparedGraph was prepared with add_self_loops='
                    f'{g.add_self_loops} but the layer has add_self_loops='
                    f'{loops}')
            return g

        if isinstance(edge_index, Tensor):
            Nd = (x_dst.size(0) if x_dst is not None else
                  size[1] if size is not None and size[1] is not None else
                  default_num_dst(edge_index, Ns, loops))
            return get_graph(edge_index, Ns, Nd, loops)

        raise ValueError(  # (PyG's propagate: a ValueError)
            '`edge_index` must be a [2, E] integer tensor, a torch.sparse '
            'adjacency (COO/CSR/CSC, rows = destinations), a '
            'torch_sparse.SparseTensor (when torch_sparse is installed) or a '
            f'pyg_fastattn.PreparedGraph; got {type(edge_index).__name__}')

    def _pyg_name(self) -> str:
        """The PyG layer this one stands in for (for messages)."""
        for cls in type(self).__mro__:
            if cls.__module__.startswith('torch_geometric.nn.conv.'):
                return cls.__name__
        return type(self).__name__

    def __repr__(self) -> str:
        # A drop-in prints as the PyG layer it stands in for (printouts and
        # PyG's own tests read the same); a layer of its own prints its name.
        name = self._pyg_name()
        if name == type(self).__name__ or not hasattr(self, 'heads'):
            return super().__repr__()
        return (f'{name}({self.in_channels}, {self.out_channels}, '
                f'heads={self.heads})')

    # Edge features ##########################################################

    @staticmethod
    def adj_edge_attr(edge_index,
                      edge_attr: Optional[Tensor]) -> Optional[Tensor]:
        """``edge_attr``, or where it is None and ``edge_index`` is a sparse
        adjacency, the adjacency's values where PyG's message passing takes
        them as ``edge_attr``: values with feature dimensions ([nnz, D]),
        of a torch.sparse tensor or a ``SparseTensor``, in its nnz order.
        Call it after :meth:`prepare_graph` (which rejects only a given
        ``edge_attr`` beside self-loops, as PyG)."""
        if edge_attr is not None or not is_sparse_adj(edge_index):
            return edge_attr
        if isinstance(edge_index, Tensor):
            values = (edge_index._values()
                      if edge_index.layout == torch.sparse_coo
                      and not edge_index.is_coalesced()
                      else edge_index.values())
        else:
            values = edge_index.storage.value()
        return values if values is not None and values.dim() > 1 else None

    @staticmethod
    def check_edge_attr(edge_attr: Tensor, graph: PreparedGraph) -> Tensor:
        """``edge_attr`` as [E, D] (a 1-D one becomes [E, 1], an [E, 1, ...,
        D] one [E, D], one row without self-loops is broadcast to every
        edge, as PyG's layers take them), checked."""
        ea = edge_attr.view(-1, 1) if edge_attr.dim() == 1 else edge_attr
        if ea.dim() > 2 and math.prod(ea.shape[1:-1]) == 1:
            ea = ea.reshape(ea.size(0), ea.size(-1))
        if ea.size(0) == 1 and not graph.add_self_loops:
            ea = ea.expand(graph.num_edges, -1)
        if ea.size(0) != graph.num_edges:  # (PyG: a broadcast error)
            raise RuntimeError(f'`edge_attr` must have one row per edge '
                               f'({graph.num_edges}), got {ea.size(0)}')
        return ea

    def edge_attr_csr(self, edge_attr: Optional[Tensor],
                      graph: PreparedGraph) -> Optional[Tensor]:
        """Edge features of every augmented edge, in CSR order: [E', D]
        (input edges, then the added loops filled as ``fill_value`` says),
        or None without ``edge_attr``."""
        if edge_attr is None:
            return None
        ea = self.check_edge_attr(edge_attr, graph)
        if graph.num_loops > 0:
            ea = torch.cat([ea, self.loop_edge_attr(ea, graph)], dim=0)
        return ea[graph.csr_perm]

    def loop_edge_attr(self, ea: Tensor, graph: PreparedGraph) -> Tensor:
        """Edge features of the added loops, as PyG's ``add_self_loops``
        computes them from ``self.fill_value``, without data-dependent
        shapes: [L, D]. ``ea`` [E, D] in input order."""
        L, D = graph.num_loops, ea.size(1)
        fv = getattr(self, 'fill_value', 'mean')
        if fv is None:
            return ea.new_ones((L, D))
        if isinstance(fv, (int, float)):
            return ea.new_full((L, D), fv)
        if isinstance(fv, Tensor):
            return fv.to(ea.device, ea.dtype).expand(L, D)
        if not isinstance(fv, str):
            raise AttributeError("No valid 'fill_value' provided")
        idx = graph.fill_index  # [E]; L = does not count (extra slot)
        if fv in ('add', 'sum', 'mean') and not ea.is_floating_point():
            # Integer features (a module in place of lin_edge may take
            # them; segment_sum takes floating point only): PyG's own
            # scatter, as its add_self_loops calls it (a mean is floating)
            out = scatter(ea, idx, 0, L + 1, reduce=fv)
        elif fv in ('add', 'sum', 'mean'):
            # Deterministic (no atomics): sum each CSR row of the kept input
            # edges; the row's own added loop contributes a zero row.
            ea_aug = torch.cat([ea, ea.new_zeros((L, D))])
            out = ops.segment_sum(graph.rowptr, ea_aug, graph.csr_perm,
                                  validate=False)[:L]
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

    @staticmethod
    def run_linear(lin: torch.nn.Module, x: Tensor) -> Tensor:
        """``lin(x)``. PyG's plain ``Linear`` with a bias runs as
        :func:`ops.linear` (the same product; its bias gradient a column sum
        that is several times faster on CUDA for large ``x``), except under
        ``torch.compile``, which gets ``lin`` itself."""
        return FusedAttentionConv.linear_plain(lin, x)[0]

    @staticmethod
    def linear_plain(lin: torch.nn.Module, x: Tensor) -> Tuple[Tensor, bool]:
        """``(run_linear(lin, x), plain_linear(lin, x))``: with True, the
        result is a fresh tensor that nothing else holds."""
        plain = plain_linear(lin, x)
        if (plain and getattr(lin, 'bias', None) is not None
                and not _is_compiling()):
            return ops.linear(x, lin.weight, lin.bias), True
        return lin(x), plain

    def fused_linears(self, lins, x: Tensor) -> Optional[List[Tensor]]:
        """``[lin(x) for lin in lins]`` as one GEMM over the concatenated
        weights and one split into contiguous parts, or None (then the
        caller runs each Linear). It applies to PyG's plain Linears
        (:func:`plain_linear`), all with a bias or all without, outside
        ``torch.compile``, for at most :attr:`fuse_projections_max_elems`
        outputs: a small graph's layer is bound by the host, where one GEMM
        and its backward cost about half of two. Larger inputs keep one
        GEMM each (no weight copies, no concatenated output)."""
        biased = [getattr(lin, 'bias', None) is not None for lin in lins]
        if (len(lins) < 2 or _is_compiling() or any(biased) != all(biased)
                or not all(plain_linear(lin, x) for lin in lins)):
            return None
        sizes = [lin.weight.size(0) for lin in lins]
        if x.size(0) * sum(sizes) > self.fuse_projections_max_elems:
            return None
        dev = x.device.type
        # (the concatenations in the parameters' dtype: autocast's rule for
        # cat rejects a float16 list under bfloat16; ops.linear casts)
        with (torch.autocast(dev, enabled=False)
              if torch.is_autocast_enabled(dev) else contextlib.nullcontext()):
            w = torch.cat([lin.weight for lin in lins])
            b = torch.cat([lin.bias for lin in lins]) if biased[0] else None
        y = ops.linear(x, w, b)
        return list(torch.split_with_sizes_copy(y, sizes, dim=1))

    @staticmethod
    def materialize(lin: torch.nn.Module, x: Tensor) -> None:
        """Initialize a lazy ``Linear`` (``in_channels=-1``) from ``x``."""
        if isinstance(getattr(lin, 'weight', None), UninitializedParameter):
            lin(x[:0])

    # Dropout ################################################################

    def dropout_mask(self, E: int, H: int, like: Tensor) -> Optional[Tensor]:
        """Attention dropout multiplier [E, H] (keep / (1 - p)) in training
        with ``dropout > 0``, else None; fresh on every CUDA-graph replay."""
        p = float(self.dropout)
        if not 0.0 <= p <= 1.0:  # F.dropout's check, met by PyG's layers
            raise ValueError(f'dropout probability has to be between 0 and '
                             f'1, but got {p}')
        if not self.training or p <= 0:
            return None
        if p >= 1.0:
            return like.new_zeros((E, H))
        scale = 1.0 / (1.0 - p)
        if like.device.type == 'cpu':  # torch's CPU bernoulli_ is ~2.5x slower
            mask = torch.rand((E, H)).ge_(p).mul_(scale)  # float32
            return mask if like.dtype == torch.float32 else mask.to(like.dtype)
        # GPU: two kernels on one [E, H] buffer (rand + ge_ + mul_ take three).
        mask = torch.empty((E, H), device=like.device, dtype=like.dtype)
        return mask.bernoulli_(1.0 - p).mul_(scale)

    # Attention weights ######################################################

    def attention_weights(self, graph: PreparedGraph, score, edge_index,
                          mask: Optional[Tensor] = None):
        """The attention weights of the edges attended over, in PyG's edge
        order (input edges without removed self-loops, then the added
        loops); [E'', H] memory only. The softmax runs over the CSR rows
        (``edge_softmax``: no atomics, so the weights and the gradients
        through them are bitwise reproducible). Shaped by
        :meth:`format_attention_weights`."""
        pos = graph.kept_positions()  # CSR positions, PyG's order
        s = self.score_at(graph, score)
        alpha = ops.edge_softmax(s, graph.rowptr, validate=False)
        alpha = alpha.to(s.dtype)[pos]
        src, dst = graph.col[pos].long(), graph.dst_of(pos)
        if mask is not None:
            alpha = alpha * mask[pos]
        return self.format_attention_weights(graph, src, dst, alpha,
                                             edge_index)

    def format_attention_weights(self, graph: PreparedGraph, src: Tensor,
                                 dst: Tensor, alpha: Tensor, edge_index):
        """Shape the weights as GATConv does for the input's form: an
        ``(edge_index', alpha)`` pair, a torch.sparse adjacency with ``alpha``
        values (paired with ``alpha``), or a ``SparseTensor``."""
        return _format_weights(graph, src, dst, alpha, edge_index)


def _format_weights(graph: PreparedGraph, src: Tensor, dst: Tensor,
                    alpha: Tensor, edge_index):
    """Shape the attention weights like GATConv for the input's form."""
    layout = graph.layout
    if layout == 'edge_index':
        if not graph.add_self_loops and isinstance(edge_index, Tensor):
            return edge_index, alpha  # GATConv returns its input
        dtype = torch.int64 if graph.add_self_loops else graph.index_dtype
        ei = torch.stack([src, dst]).to(dtype)
        if _EdgeIndex is not None and isinstance(edge_index, _EdgeIndex):
            # GATConv's cat of the kept edges and the loops: unsorted, each
            # known size at least the loops'
            size = tuple(None if n is None else max(n, graph.num_loops)
                         for n in edge_index.sparse_size())
            ei = _EdgeIndex(ei, sparse_size=size,
                            is_undirected=edge_index.is_undirected)
        return ei, alpha
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

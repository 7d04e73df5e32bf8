"""Graph preparation for :class:`FastGATConv`: one CSR build per graph.

The edge list that GATConv attends over is, with ``add_self_loops=True``, the
input edges minus their self-loops plus one loop per node. We keep shapes
static instead (``torch.compile`` and CUDA-graph friendly, no host sync):

* the *augmented* edge list is the ``E`` input edges followed by ``L`` added
  loops ``(i, i)``, ``i < L`` (``L = min(num_src, num_dst)``, GATConv's
  ``num_nodes``), so ``E' = E + L``;
* existing self-loops are not deleted but marked *removed* and sorted to the
  tail of the CSR (sort key = destination, or ``num_dst`` when removed;
  stable), so ``rowptr`` covers only kept edges and ``rowptr[N] <= E'``.

Per-edge inputs (edge features, dropout) are built in augmented order and
gathered into CSR order with ``csr_perm``. Indices are validated once, here
(one host sync), never in the layer's hot path.
"""
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..ops import CSC, csr_to_csc

__all__ = ['PreparedGraph', 'prepare', 'clear_cache', 'cache_info']

_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc)


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


try:
    import torch_geometric.typing as _pyg_typing
    _SparseTensor = (_pyg_typing.SparseTensor
                     if _pyg_typing.WITH_TORCH_SPARSE else None)
except ImportError:  # pragma: no cover
    _SparseTensor = None


def _sparse_tensor_cls():
    """``torch_sparse.SparseTensor`` when importable, else None."""
    return _SparseTensor


def is_sparse_adj(adj) -> bool:
    """``adj`` is a torch.sparse tensor or a ``torch_sparse.SparseTensor``."""
    if isinstance(adj, Tensor):
        return adj.layout in _SPARSE_LAYOUTS
    return _SparseTensor is not None and isinstance(adj, _SparseTensor)


@dataclass(eq=False)
class PreparedGraph:
    r"""A graph in the form :class:`FastGATConv` consumes, built by
    :func:`prepare` (and cached by the layer). Pass it instead of
    ``edge_index`` to skip the cache lookup.

    ``E`` input edges, ``L`` added self-loops, ``E' = E + L``, ``N`` =
    ``num_dst``; the *augmented order* is the input edges then the loops.

    Attributes:
        rowptr: [N + 1] CSR row pointer over the kept edges (rows =
            destinations); ``rowptr[N] <= E'``.
        col: [E'] source node of each CSR position (removed self-loops last).
        csc: the transpose (:func:`pyg_fastattn.ops.csr_to_csc`) that the
            backward pass walks; it skips the removed tail.
        csr_perm: [E'] int64, augmented position of each CSR position.
        removed: [E'] bool, in augmented order: input self-loops that GATConv
            removes (they are replaced by the added loops).
        fill_index: [E] int64 or None: destination of each input edge for the
            self-loop ``fill_value`` reduction (``L`` where it does not count).
        num_src, num_dst, num_edges (E), num_loops (L): sizes.
        add_self_loops: whether loops were removed/added.
        layout: the input form ('edge_index', 'coo', 'csr', 'csc',
            'sparse_tensor'), used to shape returned attention weights.
        index_dtype: dtype of the input indices.
    """
    rowptr: Tensor
    col: Tensor
    csc: CSC
    csr_perm: Tensor
    removed: Tensor
    fill_index: Optional[Tensor]
    num_src: int
    num_dst: int
    num_edges: int
    num_loops: int
    add_self_loops: bool
    layout: str = 'edge_index'
    index_dtype: torch.dtype = torch.int64

    @property
    def num_aug(self) -> int:
        """E' = E + L."""
        return self.num_edges + self.num_loops

    @property
    def device(self) -> torch.device:
        return self.col.device

    def num_kept(self) -> int:
        """Edges GATConv attends over (``rowptr[N]``; one host sync)."""
        return int(self.rowptr[-1])

    def kept_positions(self) -> Tensor:
        """CSR positions of the kept edges, in GATConv's edge order (input
        edges without self-loops in input order, then the added loops)."""
        K = self.num_kept()
        return torch.argsort(self.csr_perm[:K], stable=True)

    def dst_of(self, pos: Tensor) -> Tensor:
        """Destination (CSR row) of CSR positions ``pos`` (int64)."""
        return torch.searchsorted(self.rowptr[1:].long().contiguous(),
                                  pos.long(), right=True)

    def edge_index(self) -> Tensor:
        """[2, K] the edges GATConv attends over, in its order."""
        pos = self.kept_positions()
        return torch.stack([self.col[pos].long(), self.dst_of(pos)])

    def to(self, device, non_blocking: bool = False) -> 'PreparedGraph':
        def mv(t):
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return PreparedGraph(
            mv(self.rowptr), mv(self.col), CSC(*(mv(t) for t in self.csc)),
            mv(self.csr_perm), mv(self.removed), mv(self.fill_index),
            self.num_src, self.num_dst, self.num_edges, self.num_loops,
            self.add_self_loops, self.layout, self.index_dtype)

    def __repr__(self) -> str:
        return (f'PreparedGraph(num_src={self.num_src}, num_dst='
                f'{self.num_dst}, num_edges={self.num_edges}, num_loops='
                f'{self.num_loops}, layout={self.layout!r}, device='
                f'{self.device})')


# Building ###################################################################


def _check_edge_index(edge_index) -> None:
    if not isinstance(edge_index, Tensor):
        raise TypeError(
            '`edge_index` must be a [2, E] integer tensor, a torch.sparse '
            'adjacency (COO/CSR/CSC, rows = destinations), a '
            'torch_sparse.SparseTensor (if torch_sparse is installed) or a '
            f'PreparedGraph; got {type(edge_index).__name__}')
    if edge_index.dtype not in _INT_DTYPES:
        raise ValueError(f'`edge_index` must hold integers, got '
                         f'{edge_index.dtype}')
    if edge_index.dim() != 2 or edge_index.size(0) != 2:
        raise ValueError(f'`edge_index` must have shape [2, E], got '
                         f'{tuple(edge_index.shape)}')


def _validate_range(src: Tensor, dst: Tensor, num_src: Optional[int],
                    num_dst: Optional[int]) -> Tuple[int, int]:
    """Check indices (one host sync); infer missing sizes as max + 1."""
    if src.numel() == 0:
        return num_src or 0, num_dst or 0
    smin, dmin, smax, dmax = torch.stack(
        [src.min(), dst.min(), src.max(), dst.max()]).tolist()
    if num_src is None:
        num_src = max(smax + 1, 0)
    if num_dst is None:
        num_dst = max(dmax + 1, 0)
    for what, lo, hi, n in (('source (row 0)', smin, smax, num_src),
                            ('destination (row 1)', dmin, dmax, num_dst)):
        if lo < 0 or hi >= n:
            raise IndexError(
                f'`edge_index` has {what} indices out of range: min {lo}, max '
                f'{hi}, but they must lie in [0, {n}) (the number of '
                f'{"source" if "source" in what else "destination"} nodes)')
    return num_src, num_dst


def _sparse_edges(adj, add_self_loops: bool):
    """(src, dst, num_src, num_dst, layout) of an adjacency ``adj_t`` (rows =
    destinations). With self-loops, edges are coalesced (sorted, unique) as
    GATConv's ``add_self_loops`` does for sparse input."""
    if isinstance(adj, Tensor):
        layout = {torch.sparse_coo: 'coo', torch.sparse_csr: 'csr',
                  torch.sparse_csc: 'csc'}[adj.layout]
        if adj.dim() < 2 or adj.sparse_dim() != 2:
            raise ValueError(f'sparse `edge_index` must be a 2-D adjacency, '
                             f'got sparse_dim {adj.sparse_dim()}')
        num_dst, num_src = adj.size(0), adj.size(1)
        if layout == 'coo':
            idx = adj.indices() if adj.is_coalesced() else adj._indices()
            row, col = idx[0], idx[1]
        elif layout == 'csr':
            crow = adj.crow_indices().long()
            row = torch.repeat_interleave(
                torch.arange(num_dst, device=crow.device), crow.diff())
            col = adj.col_indices()
        else:
            ccol = adj.ccol_indices().long()
            col = torch.repeat_interleave(
                torch.arange(num_src, device=ccol.device), ccol.diff())
            row = adj.row_indices()
    else:  # torch_sparse.SparseTensor
        layout = 'sparse_tensor'
        row, col, _ = adj.coo()
        num_dst, num_src = adj.size(0), adj.size(1)
    row, col = row.long(), col.long()
    if add_self_loops and row.numel() > 0:
        key = torch.unique(row * max(num_src, 1) + col)  # sorted, no dups
        row, col = key // max(num_src, 1), key % max(num_src, 1)
    return col, row, num_src, num_dst, layout


def _index_dtype(num_aug, num_src, num_dst) -> torch.dtype:
    big = max(num_aug, num_src, num_dst) >= 2**31 - 1
    return torch.int64 if big else torch.int32


# One opaque op for torch.compile: traced inline, inductor's lowering of the
# sorts and searches gave a wrong graph on CUDA.
@torch.library.custom_op('pyg_fastattn::build_csr', mutates_args=())
def _build_csr(src: Tensor, dst: Tensor, num_src: int, num_dst: int,
               add_self_loops: bool
               ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                          Tensor, Tensor, Tensor]:
    """(rowptr, col, csr_perm, removed, fill_index (empty without loops),
    colptr, csc_row, csc_perm, csc_inv) of the augmented edge list."""
    device = src.device
    src, dst = src.long(), dst.long()
    E = src.numel()
    L = min(num_src, num_dst) if add_self_loops else 0
    if L > 0:
        loop = torch.arange(L, device=device)
        is_loop = src == dst
        src_a, dst_a = torch.cat([src, loop]), torch.cat([dst, loop])
        removed = torch.cat([is_loop, is_loop.new_zeros(L)])
        key = dst_a.masked_fill(removed, num_dst)
        # Input edges feeding the loop fill value: kept, and dst < L.
        fill_index = dst.masked_fill(is_loop | (dst >= L), L)
    else:
        src_a, key = src, dst
        fill_index = src.new_empty((0, ))
        removed = torch.zeros(E, dtype=torch.bool, device=device)
    idx = _index_dtype(E + L, num_src, num_dst)
    perm = torch.argsort(key, stable=True)
    bounds = torch.arange(num_dst + 1, device=device)
    rowptr = torch.searchsorted(key[perm].contiguous(), bounds).to(idx)
    col = src_a[perm].to(idx)
    csc = csr_to_csc(rowptr, col, num_src, validate=False)
    return (rowptr, col, perm, removed, fill_index, *csc)


@_build_csr.register_fake
def _(src, dst, num_src, num_dst, add_self_loops):
    E = src.shape[0]
    L = min(num_src, num_dst) if add_self_loops else 0
    idx = _index_dtype(E + L, num_src, num_dst)
    new = lambda n, dt: src.new_empty((n, ), dtype=dt)  # noqa: E731
    return (new(num_dst + 1, idx), new(E + L, idx), new(E + L, torch.int64),
            new(E + L, torch.bool), new(E if L > 0 else 0, torch.int64),
            new(num_src + 1, idx), new(E + L, idx), new(E + L, idx),
            new(E + L, idx))


def _build(src: Tensor, dst: Tensor, num_src: int, num_dst: int,
           add_self_loops: bool, layout: str,
           index_dtype: torch.dtype) -> PreparedGraph:
    """The CSR of the augmented edge list; no host sync."""
    (rowptr, col, perm, removed, fill_index, *csc) = _build_csr(
        src, dst, num_src, num_dst, add_self_loops)
    L = min(num_src, num_dst) if add_self_loops else 0
    return PreparedGraph(rowptr, col, CSC(*csc), perm, removed,
                         fill_index if L > 0 else None, num_src, num_dst,
                         src.numel(), L, add_self_loops, layout, index_dtype)


def _prepare(edge_index, num_src: Optional[int], num_dst: Optional[int],
             add_self_loops: bool, validate: bool) -> PreparedGraph:
    if is_sparse_adj(edge_index):
        src, dst, ns, nd, layout = _sparse_edges(edge_index, add_self_loops)
        for name, want, got in (('source', num_src, ns),
                                ('destination', num_dst, nd)):
            if want is not None and want != got:
                raise ValueError(
                    f'the sparse adjacency has {got} {name} nodes '
                    f'(size {tuple(edge_index.size()[:2])}, rows = '
                    f'destinations) but the node features have {want}')
        if validate:
            _validate_range(src, dst, ns, nd)
        return _build(src, dst, ns, nd, add_self_loops, layout, src.dtype)
    _check_edge_index(edge_index)
    if type(edge_index) is not Tensor and not _is_compiling():
        edge_index = edge_index.as_subclass(Tensor)  # e.g. PyG's EdgeIndex
    src, dst = edge_index[0], edge_index[1]
    if validate or num_src is None or num_dst is None:
        num_src, num_dst = _validate_range(src, dst, num_src, num_dst)
    return _build(src, dst, num_src, num_dst, add_self_loops, 'edge_index',
                  edge_index.dtype)


def prepare(edge_index, num_nodes: Optional[int] = None,
            size: Optional[Tuple[int, int]] = None,
            add_self_loops: bool = True) -> PreparedGraph:
    r"""Prepare a graph once for :class:`FastGATConv` layers.

    Args:
        edge_index: [2, E] integer tensor (row 0 = sources, row 1 =
            destinations), or a sparse adjacency ``adj_t`` (torch.sparse
            COO/CSR/CSC or ``torch_sparse.SparseTensor``, rows =
            destinations).
        num_nodes: node count of a non-bipartite graph.
        size: ``(num_src, num_dst)`` of a bipartite graph. Without
            ``num_nodes`` or ``size``, sizes are ``max index + 1``.
        add_self_loops: must match the layers' ``add_self_loops``.

    Returns:
        a :class:`PreparedGraph`; pass it as ``edge_index`` to layers whose
        node counts match. Validates indices (``IndexError`` when out of
        range or negative, ``ValueError`` for a wrong shape): one host sync.
    """
    if size is not None and num_nodes is not None:
        raise ValueError('pass either `num_nodes` or `size`, not both')
    ns, nd = (size if size is not None else (num_nodes, num_nodes))
    return _prepare(edge_index, ns, nd, add_self_loops, validate=True)


# Cache ######################################################################


class _Entry:
    __slots__ = ('ref', 'version', 'graph')

    def __init__(self, ref, version, graph):
        self.ref, self.version, self.graph = ref, version, graph


class _GraphCache:
    """A small LRU of prepared graphs, shared by all layers.

    Keyed on the identity of the ``edge_index`` tensor (checked through a
    weakref, so a freed tensor whose id or memory is reused never hits), its
    ``_version`` (in-place mutation invalidates), shape, dtype, device, the
    node counts and ``add_self_loops``. Entries die with their tensor.

    Writes that bypass the version counter are not seen: through
    ``edge_index.data``, through NumPy (``edge_index.numpy()``), or into a
    tensor made under ``torch.inference_mode()`` (cached by identity).
    After such a write call :func:`clear_cache`, or pass a new tensor.
    """
    def __init__(self, max_size: int = 8):
        self.max_size = max_size
        self._d: 'OrderedDict[tuple, _Entry]' = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def _drop(self, key, ref):
        with self._lock:
            e = self._d.get(key)
            if e is not None and e.ref is ref:
                del self._d[key]

    def get(self, edge_index, num_src, num_dst, add_self_loops) -> PreparedGraph:
        if isinstance(edge_index, Tensor):
            # Inference tensors track no version: they are cached by
            # identity alone (an in-place write to one is not seen).
            version = (None if edge_index.is_inference() else
                       edge_index._version)
            meta = (tuple(edge_index.shape), edge_index.dtype,
                    edge_index.layout, edge_index.device)
        else:  # torch_sparse.SparseTensor: immutable
            version, meta = None, (tuple(edge_index.sizes()), edge_index.nnz())
        key = (id(edge_index), meta, num_src, num_dst, bool(add_self_loops))
        with self._lock:
            e = self._d.get(key)
            if (e is not None and e.ref() is edge_index
                    and e.version == version):
                self._d.move_to_end(key)
                self.hits += 1
                return e.graph
        graph = _prepare(edge_index, num_src, num_dst, add_self_loops, True)
        try:
            ref = weakref.ref(edge_index, lambda r, k=key: self._drop(k, r))
        except TypeError:  # pragma: no cover (not weak-referenceable)
            return graph
        with self._lock:
            self.misses += 1
            self._d[key] = _Entry(ref, version, graph)
            self._d.move_to_end(key)
            while len(self._d) > self.max_size:
                self._d.popitem(last=False)
        return graph

    def clear(self):
        with self._lock:
            self._d.clear()
            self.hits = self.misses = 0

    def info(self) -> dict:
        return {'hits': self.hits, 'misses': self.misses,
                'size': len(self._d), 'max_size': self.max_size}


_cache = _GraphCache()


def clear_cache() -> None:
    """Forget every cached prepared graph."""
    _cache.clear()


def cache_info() -> dict:
    """``{'hits', 'misses', 'size', 'max_size'}`` of the prepared-graph cache."""
    return _cache.info()


def set_cache_size(max_size: int) -> None:
    """Set how many prepared graphs are kept (default 8)."""
    _cache.max_size = int(max_size)


def get_graph(edge_index, num_src: Optional[int], num_dst: Optional[int],
              add_self_loops: bool) -> PreparedGraph:
    """The prepared graph for a layer call: cached eagerly; built inline,
    unvalidated and uncached while ``torch.compile`` traces."""
    if _is_compiling():
        return _prepare(edge_index, num_src, num_dst, add_self_loops, False)
    return _cache.get(edge_index, num_src, num_dst, add_self_loops)

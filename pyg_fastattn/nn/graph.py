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
gathered into CSR order with ``csr_perm``. Input already grouped by
destination (``sorted=True``, a ``torch_geometric.EdgeIndex`` sorted by
``col``, or detected on CPU) skips the sort. The transpose that backward
passes walk is built on first access. Both are built by the compiled
``csr_build`` / ``csc_build`` (csrc/) where the extension serves the device,
else by the PyTorch ops below (same result; also the tests' oracle).
Indices are validated here, never in the layer's kernels (see
:func:`set_validation`); nothing here waits for the GPU unless node counts
must be read from the indices or ``'sync'`` validation is asked for.
"""
import contextlib
import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from .. import _build as _ext
from ..ops import CSC, csr_to_csc
from ..ops._checks import index_pair

__all__ = ['PreparedGraph', 'prepare', 'clear_cache', 'cache_info',
           'set_validation', 'get_validation']

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

try:
    from torch_geometric import EdgeIndex as _EdgeIndex
except ImportError:  # pragma: no cover
    _EdgeIndex = None


def _sparse_tensor_cls():
    """``torch_sparse.SparseTensor`` when importable, else None."""
    return _SparseTensor


def is_sparse_adj(adj) -> bool:
    """``adj`` is a torch.sparse tensor or a ``torch_sparse.SparseTensor``."""
    if isinstance(adj, Tensor):
        return adj.layout in _SPARSE_LAYOUTS
    return _SparseTensor is not None and isinstance(adj, _SparseTensor)


def _normal_tensors():
    """Inside ``torch.inference_mode()``, a block that makes normal tensors
    (also from inference tensors): a graph prepared (and cached) there must
    serve training calls later (autograd cannot save inference tensors).
    Under ``torch.compile`` (which traces neither query) nothing is kept: no
    block."""
    if not _is_compiling() and torch.is_inference_mode_enabled():
        return torch.inference_mode(False)
    return contextlib.nullcontext()


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
            backward pass walks; it skips the removed tail. Built on first
            access (or by :func:`prepare`) and kept; under
            ``torch.compile`` built in the compiled graph and not kept.
        csr_perm: [E'] int64, augmented position of each CSR position.
        removed: [E'] bool, in augmented order: input self-loops that GATConv
            removes (they are replaced by the added loops).
        fill_index: [E] int64 or None (no loops): destination of each input
            edge for the self-loop ``fill_value`` reduction (``L`` where it
            does not count: a removed self-loop or a destination >= L).
            Computed from the CSR on first access and kept (not kept under
            ``torch.compile``).
        num_src, num_dst, num_edges (E), num_loops (L): sizes.
        add_self_loops: whether loops were removed/added.
        layout: the input form ('edge_index', 'coo', 'csr', 'csc',
            'sparse_tensor'), used to shape returned attention weights.
        index_dtype: dtype of the input indices.
        max_lengths: (longest CSR row, longest CSC column) once known, else
            -1 each (see the property).
    """
    rowptr: Tensor
    col: Tensor
    _csc: Optional[CSC]
    csr_perm: Tensor
    removed: Tensor
    _fill_index: Optional[Tensor]
    num_src: int
    num_dst: int
    num_edges: int
    num_loops: int
    add_self_loops: bool
    layout: str = 'edge_index'
    index_dtype: torch.dtype = torch.int64
    # None (not queued), (pinned host copy, event, with columns) or (rows,
    # cols), cols -1 when the reduction ran before the transpose existed
    _lengths: Any = None
    _num_kept: Optional[int] = None

    @property
    def max_lengths(self) -> Tuple[int, int]:
        """(longest CSR row, longest CSC column), each -1 while unknown: a
        hint for the CUDA kernels, which then skip their long-row split
        launches on graphs without long rows (host time). No host sync: the
        reduction and a copy to pinned memory are queued when the transpose
        is built (or on the first access, if that comes first: then for the
        rows alone, and again for both once the transpose exists); accesses
        read it once the copy has landed. (-1, -1) on the CPU and with
        ``PYG_FASTATTN_LENGTH_HINT=0``; under ``torch.compile`` or CUDA-graph
        capture nothing is queued or read (a graph resolved before keeps its
        numbers)."""
        st = self._lengths
        if isinstance(st, tuple) and isinstance(st[0], int):
            if st[1] < 0 and self._csc is not None and self._may_queue():
                self._queue_lengths()  # now with the transpose's columns
            return st
        if not self._may_queue():
            return (-1, -1)
        if st is None:
            self._queue_lengths()
            return (-1, -1)
        host, event, with_cols = st
        if not event.query():
            return (-1, -1)
        rows, cols = host.tolist()
        self._lengths = (rows, cols if with_cols else -1)
        return self._lengths

    def _may_queue(self) -> bool:
        return (self.rowptr.device.type == 'cuda' and not _is_compiling()
                and not torch.cuda.is_current_stream_capturing()
                and os.environ.get('PYG_FASTATTN_LENGTH_HINT') != '0')

    def _queue_lengths(self) -> None:
        """Queue the reduction behind :attr:`max_lengths` (:meth:`_may_queue`
        true: the callers check); without the transpose, of the rows alone
        (its column count is then dropped)."""
        with_cols = self._csc is not None
        dev = self.rowptr.device
        colptr = self._csc.colptr if with_cols else self.rowptr
        if _ext.native_available(dev):  # one launch and a copy
            host = torch.ops.pyg_fastattn.graph_lengths(self.rowptr, colptr)
        else:
            d = torch.stack([p.diff().amax() if p.numel() > 1 else
                             p.new_zeros(()) for p in (self.rowptr, colptr)])
            host = torch.full((2, ), -1, dtype=d.dtype, pin_memory=True)
            host.copy_(d, non_blocking=True)
        self._lengths = (host, torch.cuda.current_stream(dev).record_event(),
                         with_cols)

    def _cols_queued(self) -> bool:
        """Whether the reduction of the transpose's columns is queued or
        done."""
        st = self._lengths
        if st is None:
            return False
        return st[1] >= 0 if isinstance(st[0], int) else st[2]

    def transpose_if_needed(self) -> Optional[CSC]:
        """The transpose for a fused op: :attr:`csc` (built now if missing)
        when autograd records (a backward may walk it), else the one already
        built or None: a forward under ``torch.no_grad()`` never builds
        it."""
        if torch.is_grad_enabled():
            return self.csc
        return self._csc

    @property
    def fill_index(self) -> Optional[Tensor]:
        if self.num_loops == 0:
            return None
        if self._fill_index is not None:
            return self._fill_index
        # Each CSR position's row (the tail past rowptr[N]: N), scattered to
        # its augmented position; the added loops' slots are cut off.
        E, L = self.num_edges, self.num_loops
        with _normal_tensors():
            pos = torch.arange(E + L, device=self.rowptr.device)
            fill = torch.empty_like(pos).scatter_(
                0, self.csr_perm, self.dst_of(pos).clamp_(max=L))[:E]
        if not _is_compiling():
            self._fill_index = fill
        return fill

    @property
    def csc(self) -> CSC:
        if self._csc is not None:
            return self._csc
        build = _build_csc if _is_compiling() else _csc_of
        with _normal_tensors():
            csc = CSC(*build(self.rowptr, self.col, self.num_src))
        # Kept only when built eagerly: a compiled graph's outputs may live
        # in memory that later replays (CUDA graphs) overwrite.
        if not _is_compiling():
            self._csc = csc
            if not self._cols_queued() and self._may_queue():
                self._queue_lengths()  # lands before the layers ask
        return csc

    @property
    def num_aug(self) -> int:
        """E' = E + L."""
        return self.num_edges + self.num_loops

    @property
    def device(self) -> torch.device:
        return self.col.device

    def num_kept(self) -> int:
        """Edges GATConv attends over (``rowptr[N]``; one host sync, then
        kept, except under ``torch.compile``)."""
        if self._num_kept is not None:
            return self._num_kept
        k = int(self.rowptr[-1])
        if not _is_compiling():
            self._num_kept = k
        return k

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

        csc = None if self._csc is None else CSC(*(mv(t) for t in self._csc))
        return PreparedGraph(
            mv(self.rowptr), mv(self.col), csc,
            mv(self.csr_perm), mv(self.removed), mv(self._fill_index),
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


_VALIDATION_MODES = ('auto', 'sync', 'async', 'off')
_validation = 'auto'


def set_validation(mode: str) -> None:
    r"""How graph preparation checks indices (for every layer and
    :func:`prepare` call without its own ``validate``):

    * ``'auto'`` (default): ``'sync'`` for CPU tensors (nothing to wait
      for), ``'async'`` for GPU tensors;
    * ``'sync'``: an ``IndexError`` that names the bad range. On a GPU, one
      host synchronization per prepared graph;
    * ``'async'``: a device-side assertion (``torch._assert_async``): no
      host sync; a bad graph fails at a later synchronization with a CUDA
      error, after which the process's CUDA context is unusable (as with an
      out-of-range index in any CUDA op);
    * ``'off'``: no check. Kernels clamp every index they read, so bad input
      gives wrong numbers, never out-of-bounds memory access.

    Under ``torch.compile`` (and ``torch.export``) every mode but ``'off'``
    checks with the assertion, which the compiled graph runs on each call
    (on CPU it raises a ``RuntimeError`` at once).

    A claimed sort order (``sorted=True``, an ``EdgeIndex``'s) is checked
    with the ranges.
    """
    global _validation
    if mode not in _VALIDATION_MODES:
        raise ValueError(f'validation mode must be one of '
                         f'{_VALIDATION_MODES}, got {mode!r}')
    _validation = mode


def get_validation() -> str:
    """The mode set by :func:`set_validation`."""
    return _validation


def _validation_mode(validate, device: torch.device) -> str:
    if validate is None:
        mode = _validation
    elif isinstance(validate, bool):
        mode = 'sync' if validate else 'off'
    else:
        mode = validate
        if mode not in _VALIDATION_MODES:
            raise ValueError(f'`validate` must be a bool or one of '
                             f'{_VALIDATION_MODES}, got {mode!r}')
    if mode == 'auto':
        mode = 'async' if device.type == 'cuda' else 'sync'
    if _is_compiling():  # traced: a runtime assertion, never a host sync
        return 'off' if mode == 'off' else 'async'
    if mode == 'async' and device.type == 'cpu':
        mode = 'sync'  # the same check, and nothing to wait for
    return mode


def _range_error(src: Tensor, dst: Tensor, num_src: int,
                 num_dst: int) -> None:
    """Raise the IndexError that names the bad range, if any (host sync)."""
    smin, dmin, smax, dmax = torch.stack(
        [src.min(), dst.min(), src.max(), dst.max()]).tolist()
    for what, lo, hi, n in (('source (row 0)', smin, smax, num_src),
                            ('destination (row 1)', dmin, dmax, num_dst)):
        if lo < 0 or hi >= n:
            raise IndexError(
                f'`edge_index` has {what} indices out of range: min {lo}, max '
                f'{hi}, but they must lie in [0, {n}) (the number of '
                f'{"source" if "source" in what else "destination"} nodes)')


def _infer_sizes(src: Tensor, dst: Tensor, num_src: Optional[int],
                 num_dst: Optional[int]) -> Tuple[int, int]:
    """Missing node counts as max index + 1 (one host sync)."""
    if src.numel() == 0:
        return num_src or 0, num_dst or 0
    smax, dmax = torch.stack([src.max(), dst.max()]).tolist()
    return (max(smax + 1, 0) if num_src is None else num_src,
            max(dmax + 1, 0) if num_dst is None else num_dst)


_SORTED_MESSAGE = ('`edge_index` was declared sorted by destination (row 1) '
                   'but is not')
_ASYNC_MESSAGE = ('pyg_fastattn: `edge_index` has indices out of range (or is '
                  'not sorted by destination as declared)')


def _validate(src: Tensor, dst: Tensor, num_src: int, num_dst: int,
              is_sorted: bool, mode: str) -> None:
    """Check index ranges (and a claimed order by destination)."""
    if mode == 'off' or src.numel() == 0:
        return
    if mode == 'sync':
        _range_error(src, dst, num_src, num_dst)
        if is_sorted and src.numel() > 1 and not bool(
                (dst[1:] >= dst[:-1]).all()):
            raise ValueError(_SORTED_MESSAGE)
        return
    smin, smax = torch.aminmax(src)
    if is_sorted:  # once the order holds, dst's range is its ends'
        dmin, dmax = dst[0], dst[-1]
    else:
        dmin, dmax = torch.aminmax(dst)
    ok = (smin >= 0) & (smax < num_src) & (dmin >= 0) & (dmax < num_dst)
    if is_sorted and src.numel() > 1:
        ok = ok & (dst[1:] >= dst[:-1]).all()
    torch._assert_async(ok, _ASYNC_MESSAGE)


# csr_build's status bits (kGraphBad* in csrc/common.h).
_BAD_RANGE, _UNSORTED = 1 | 2, 4


def _check_status(status: Tensor, src: Tensor, dst: Tensor, num_src: int,
                  num_dst: int, is_sorted: bool, mode: str) -> None:
    """:func:`_validate` from the native build's status bits (what its
    kernels saw; no extra pass over the input)."""
    if mode == 'off' or src.numel() == 0:
        return
    if mode == 'async':  # CUDA sets the order bit only for sorted input
        torch._assert_async(status.eq(0), _ASYNC_MESSAGE)
        return
    bad = int(status.item())
    if bad & _BAD_RANGE:
        _range_error(src, dst, num_src, num_dst)
    if is_sorted and bad & _UNSORTED:
        raise ValueError(_SORTED_MESSAGE)


def _is_sorted_cpu(dst: Tensor) -> bool:
    """Whether CPU indices are non-decreasing (one pass, no device wait)."""
    return dst.numel() < 2 or bool((dst[1:] >= dst[:-1]).all())


def _sparse_edges(adj, add_self_loops: bool):
    """(src, dst, num_src, num_dst, layout) of an adjacency ``adj_t`` (rows =
    destinations). With self-loops, a torch.sparse tensor's edges are
    coalesced (sorted, unique) as GATConv's ``add_self_loops`` does for it;
    a ``SparseTensor``'s are kept, repeats included, as ``set_diag`` does."""
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
    if add_self_loops and row.numel() > 0 and layout != 'sparse_tensor':
        key = torch.unique(row * max(num_src, 1) + col)  # sorted, no dups
        row, col = key // max(num_src, 1), key % max(num_src, 1)
    return col, row, num_src, num_dst, layout


def _index_dtype(num_aug, num_src, num_dst) -> torch.dtype:
    """int32 below 2^31 - 1 edges and nodes, else int64. Symbolic sizes
    are compared one by one with the limit (no guard that relates them);
    while exporting they get no guard at all: int64 unless their bounds
    keep them below the limit."""
    lim = 2**31 - 1
    sizes = (num_aug, num_src, num_dst)
    if (not all(isinstance(n, int) for n in sizes)
            and torch.compiler.is_exporting()):
        from torch.fx.experimental.symbolic_shapes import statically_known_true
        small = all(statically_known_true(n < lim) for n in sizes)
        return torch.int32 if small else torch.int64
    return torch.int64 if any(n >= lim for n in sizes) else torch.int32


def _ptr_of_sorted(index: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    """[n + 1] pointer of a non-decreasing ``index`` (like PyG's index2ptr)."""
    bounds = torch.arange(n + 1, device=index.device, dtype=index.dtype)
    return torch.searchsorted(index.contiguous(), bounds,
                              out_int32=dtype == torch.int32).to(dtype)


def _csr_sorted(src: Tensor, dst: Tensor, num_src: int, num_dst: int, L: int,
                idx: torch.dtype, dst_ptr: Optional[Tensor]):
    """The augmented CSR of edges already grouped by destination (``dst``
    non-decreasing), without a sort: each edge's CSR position is counted.
    Garbage in (unsorted, out of range) gives a garbage graph whose indices
    all stay in range."""
    device = src.device
    E = src.numel()
    if dst_ptr is None or dst_ptr.numel() != num_dst + 1:
        dst_ptr = _ptr_of_sorted(dst, num_dst, torch.int64)
    if L == 0:
        perm = torch.arange(E, device=device)
        removed = torch.zeros(E, dtype=torch.bool, device=device)
        return (dst_ptr.to(idx, copy=True), src.to(idx, copy=True), perm,
                removed)
    is_loop = src == dst
    keep = ~is_loop
    ck = torch.zeros(E + 1, dtype=torch.int64, device=device)
    torch.cumsum(keep, 0, out=ck[1:])  # ck[e]: kept edges before e
    ck_excl = ck[:-1]
    kept_ptr = ck[dst_ptr.long().clamp(0, E)]  # [N + 1] kept edges per row
    loops_before = torch.arange(num_dst + 1, device=device).clamp_(max=L)
    rowptr = (kept_ptr + loops_before).to(idx)
    # CSR position of each augmented edge. Row d: its kept edges in input
    # order, then the loop (d, d) if d < L; removed self-loops after every
    # row, in input order.
    pos = torch.empty(E + L, dtype=torch.int64, device=device)
    pos_in = pos[:E]
    torch.add(ck_excl, dst.clamp(0, L), out=pos_in)
    pos_removed = torch.arange(E, device=device).sub_(ck_excl).add_(
        ck[-1] + L)
    torch.where(keep, pos_in, pos_removed, out=pos_in)
    torch.add(kept_ptr[1:L + 1], torch.arange(L, device=device),
              out=pos[E:])
    perm = torch.zeros(E + L, dtype=torch.int64, device=device)
    perm.scatter_(0, pos, torch.arange(E + L, device=device))
    loop = torch.arange(L, device=device)
    col = torch.cat([src, loop])[perm].to(idx)
    removed = torch.cat([is_loop, is_loop.new_zeros(L)])
    return rowptr, col, perm, removed


def _csr_sort(src: Tensor, dst: Tensor, num_src: int, num_dst: int, L: int,
              idx: torch.dtype):
    """The augmented CSR of edges in any order: one stable sort by
    destination (removed self-loops keyed past the last row)."""
    device = src.device
    E = src.numel()
    # 32-bit keys halve the radix passes of the sort.
    kdt = torch.int32 if num_dst < 2**31 - 1 else torch.int64
    if L > 0:
        loop = torch.arange(L, device=device)
        is_loop = src == dst
        src_a = torch.cat([src, loop])
        removed = torch.cat([is_loop, is_loop.new_zeros(L)])
        key = torch.cat([dst, loop]).masked_fill_(removed, num_dst).to(kdt)
    else:
        src_a, key = src, dst.to(kdt)
        removed = torch.zeros(E, dtype=torch.bool, device=device)
    key_sorted, perm = torch.sort(key, stable=True)
    rowptr = _ptr_of_sorted(key_sorted, num_dst, idx)
    col = src_a[perm].to(idx)
    return rowptr, col, perm, removed


def _build_csr_torch(src: Tensor, dst: Tensor, num_src: int, num_dst: int,
                     add_self_loops: bool, is_sorted: bool,
                     dst_ptr: Optional[Tensor]):
    """:func:`_build_csr` in PyTorch ops (fallback and test oracle)."""
    src, dst = src.long(), dst.long()
    L = min(num_src, num_dst) if add_self_loops else 0
    idx = _index_dtype(src.numel() + L, num_src, num_dst)
    if is_sorted:
        return _csr_sorted(src, dst, num_src, num_dst, L, idx, dst_ptr)
    return _csr_sort(src, dst, num_src, num_dst, L, idx)


def _use_native(device: torch.device, *sizes: int) -> bool:
    """Whether the compiled ``csr_build`` / ``csc_build`` serve ``device``
    for these sizes (edges, node counts): they write int32 indices, so
    graphs with 2^31 - 1 or more edges or nodes take the PyTorch path."""
    return max(sizes, default=0) < 2**31 - 1 and _ext.native_available(device)


def _csr_build_native(src, dst, num_src, num_dst, add_self_loops, is_sorted):
    return torch.ops.pyg_fastattn.csr_build(src, dst, num_src, num_dst,
                                            add_self_loops, is_sorted)


def _csc_build_native(rowptr, col, num_cols):
    return torch.ops.pyg_fastattn.csc_build(rowptr, col, num_cols)


def _csr_of(src: Tensor, dst: Tensor, num_src: int, num_dst: int,
            add_self_loops: bool, is_sorted: bool, dst_ptr: Optional[Tensor],
            mode: str = 'off'
            ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(rowptr, col, csr_perm, removed) of
    the augmented edge list. ``is_sorted``: ``dst`` is non-decreasing (no
    sort); ``dst_ptr``: its [num_dst + 1] pointer when known (the native
    build finds the row starts itself). The input is validated per ``mode``
    (:func:`_validation_mode`): from the native build's status bits, or
    before the PyTorch build."""
    L = min(num_src, num_dst) if add_self_loops else 0
    if _use_native(src.device, src.numel() + L, num_src, num_dst):
        if src.dtype not in (torch.int32, torch.int64) or \
                dst.dtype != src.dtype:
            src, dst = src.long(), dst.long()
        *parts, status = _csr_build_native(src, dst, num_src, num_dst,
                                           add_self_loops, is_sorted)
        _check_status(status, src, dst, num_src, num_dst, is_sorted, mode)
        return tuple(parts)
    _validate(src, dst, num_src, num_dst, is_sorted, mode)
    return _build_csr_torch(src, dst, num_src, num_dst, add_self_loops,
                            is_sorted, dst_ptr)


def _csc_of(rowptr: Tensor, col: Tensor, num_src: int
            ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(colptr, csc_row, csc_perm, csc_inv): :func:`csr_to_csc`."""
    if _use_native(col.device, col.numel(), num_src):
        return tuple(_csc_build_native(*index_pair(rowptr, col), num_src))
    return tuple(csr_to_csc(rowptr, col, num_src, validate=False))


# Opaque ops for torch.compile (traced inline, inductor's lowering of the
# sorts and searches gave a wrong graph on CUDA). Eager code calls _csr_of /
# _csc_of directly: the custom-op wrapper costs more host time than the
# native build of a small graph.
@torch.library.custom_op('pyg_fastattn::build_csr', mutates_args=())
def _build_csr(src: Tensor, dst: Tensor, num_src: int, num_dst: int,
               add_self_loops: bool, is_sorted: bool,
               dst_ptr: Optional[Tensor], index64: bool = False
               ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`_csr_of` as one op; ``index64``: int64 rowptr and col
    whatever the size (an exported program's choice for sizes it cannot
    bound)."""
    parts = _csr_of(src, dst, num_src, num_dst, add_self_loops, is_sorted,
                    dst_ptr)
    if index64:
        parts = (parts[0].long(), parts[1].long(), parts[2], parts[3])
    return parts


@_build_csr.register_fake
def _(src, dst, num_src, num_dst, add_self_loops, is_sorted, dst_ptr,
      index64=False):
    E = src.shape[0]
    L = min(num_src, num_dst) if add_self_loops else 0
    idx = torch.int64 if index64 else _index_dtype(E + L, num_src, num_dst)
    new = lambda n, dt: src.new_empty((n, ), dtype=dt)  # noqa: E731
    return (new(num_dst + 1, idx), new(E + L, idx), new(E + L, torch.int64),
            new(E + L, torch.bool))


@torch.library.custom_op('pyg_fastattn::build_csc', mutates_args=())
def _build_csc(rowptr: Tensor, col: Tensor, num_src: int
               ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`_csc_of` as one op."""
    return _csc_of(rowptr, col, num_src)


@_build_csc.register_fake
def _(rowptr, col, num_src):
    E = col.shape[0]
    new = lambda n: col.new_empty((n, ), dtype=rowptr.dtype)  # noqa: E731
    return new(num_src + 1), new(E), new(E), new(E)


def _build(src: Tensor, dst: Tensor, num_src: int, num_dst: int,
           add_self_loops: bool, layout: str, index_dtype: torch.dtype,
           mode: str, is_sorted: bool = False,
           dst_ptr: Optional[Tensor] = None,
           csc: Optional[CSC] = None) -> PreparedGraph:
    """The CSR of the augmented edge list, the input validated per ``mode``;
    no host sync unless ``mode`` is 'sync'."""
    L = min(num_src, num_dst) if add_self_loops else 0
    if _is_compiling():
        _validate(src, dst, num_src, num_dst, is_sorted, mode)
        index64 = _index_dtype(src.shape[0] + L, num_src,
                               num_dst) == torch.int64
        parts = _build_csr(src, dst, num_src, num_dst, add_self_loops,
                           is_sorted, dst_ptr, index64)
    else:
        parts = _csr_of(src, dst, num_src, num_dst, add_self_loops,
                        is_sorted, dst_ptr, mode)
    (rowptr, col, perm, removed) = parts
    return PreparedGraph(rowptr, col, csc, perm, removed, None, num_src,
                         num_dst, src.numel(), L, add_self_loops, layout,
                         index_dtype)


def _edge_index_meta(edge_index, num_src, num_dst, add_self_loops=False):
    """Sizes, sort order and cached pointers of a ``torch_geometric.EdgeIndex``
    (what it knows without computing): (num_src, num_dst, sorted_by_dst,
    dst_ptr, csc parts ``(colptr, perm)`` or None). Node counts that
    disagree with its sparse size raise, as PyG's layers do; with
    self-loops a size grows to the ``min(num_src, num_dst)`` nodes that get
    loops, as PyG's ``add_self_loops`` grows it."""
    ns, nd = edge_index.sparse_size()
    L = (min(num_src, num_dst) if add_self_loops and None not in
         (num_src, num_dst) else 0)
    for want, got in ((num_src, ns), (num_dst, nd)):
        if (want is not None and got is not None and want != got
                and not (got < want == L)):
            raise ValueError(f'Encountered tensor with size {want} in '
                             f'dimension 0, but expected size {got}.')
    num_src = ns if num_src is None else num_src
    num_dst = nd if num_dst is None else num_dst
    by_dst = edge_index.is_sorted_by_col
    dst_ptr = edge_index._indptr if by_dst else None
    T = None
    if by_dst and edge_index._T_perm is not None and \
            edge_index._T_indptr is not None:
        T = (edge_index._T_indptr, edge_index._T_perm)
    return num_src, num_dst, by_dst, dst_ptr, T


def default_num_dst(edge_index, num_src: int, add_self_loops: bool) -> int:
    """The destination count of a layer call without ``x_dst`` or
    ``size[1]``, as PyG's layers take it: an ``EdgeIndex``'s own (grown to
    ``num_src`` by added self-loops), else ``num_src``."""
    if _EdgeIndex is not None and isinstance(edge_index, _EdgeIndex):
        # (the attribute, not sparse_size(): torch.compile traces it)
        sizes = getattr(edge_index, '_sparse_size', None)
        nd = (sizes[1] if sizes is not None else
              None if _is_compiling() else edge_index.sparse_size(1))
        if nd is not None:
            return max(nd, num_src) if add_self_loops else nd
    return num_src


def _plain(t: Tensor) -> Tensor:
    """A subclass tensor's data as a plain ``Tensor`` (zero-copy). PyG's
    ``EdgeIndex`` keeps itself through ``as_subclass`` and routes every op
    through its ``__torch_dispatch__`` (tens of microseconds each on the
    host); ``as_tensor()`` gives its data."""
    as_tensor = getattr(t, 'as_tensor', None)
    t = as_tensor() if callable(as_tensor) else t
    return t if type(t) is Tensor else t.as_subclass(Tensor)


def _csc_from_transpose(T, src, dst, rowptr_dtype, num_src) -> Optional[CSC]:
    """An ``EdgeIndex``'s cached transpose (sorted by source) as the CSC of a
    graph without added loops (CSR positions = input positions)."""
    colptr, perm = T
    if colptr.numel() != num_src + 1:
        return None
    if colptr.is_inference():  # the EdgeIndex's caches, made for inference
        colptr, perm = colptr.clone(), perm.clone()
    perm = perm.long()
    inv = torch.empty_like(perm).scatter_(
        0, perm, torch.arange(perm.numel(), device=perm.device))
    dt = rowptr_dtype
    return CSC(colptr.to(dt), dst.long()[perm].to(dt), perm.to(dt),
               inv.to(dt))


def _prepare(edge_index, num_src: Optional[int], num_dst: Optional[int],
             add_self_loops: bool, validate=None,
             sorted: Optional[bool] = None) -> PreparedGraph:
    if is_sparse_adj(edge_index):
        src, dst, ns, nd, layout = _sparse_edges(edge_index, add_self_loops)
        for name, want, got in (('source', num_src, ns),
                                ('destination', num_dst, nd)):
            if want is not None and want != got:
                raise ValueError(
                    f'the sparse adjacency has {got} {name} nodes '
                    f'(size {(nd, ns)}, rows = destinations) but the node '
                    f'features have {want}')
        return _build(src, dst, ns, nd, add_self_loops, layout, src.dtype,
                      _validation_mode(validate, src.device))
    _check_edge_index(edge_index)
    dst_ptr = T = None
    if (_EdgeIndex is not None and isinstance(edge_index, _EdgeIndex)
            and not _is_compiling()):
        num_src, num_dst, by_dst, dst_ptr, T = _edge_index_meta(
            edge_index, num_src, num_dst, add_self_loops)
        if sorted is None:
            sorted = by_dst
    if type(edge_index) is not Tensor and not _is_compiling():
        edge_index = _plain(edge_index)
    src, dst = edge_index[0], edge_index[1]
    mode = _validation_mode(validate, src.device)
    if num_src is None or num_dst is None:
        if _is_compiling():
            raise ValueError(
                'under torch.compile, pass the node counts (prepare(..., '
                'num_nodes=) or size=): reading them from the indices needs '
                'a host sync')
        num_src, num_dst = _infer_sizes(src, dst, num_src, num_dst)
        if mode == 'async':
            mode = 'sync'  # synchronized already: name the error
    if sorted is None:
        sorted = (src.device.type == 'cpu' and not _is_compiling()
                  and _is_sorted_cpu(dst))
    if not sorted:
        dst_ptr = T = None
    csc = None
    if T is not None and not add_self_loops and not _is_compiling():
        idx = _index_dtype(src.numel(), num_src, num_dst)
        csc = _csc_from_transpose(T, src, dst, idx, num_src)
    return _build(src, dst, num_src, num_dst, add_self_loops, 'edge_index',
                  edge_index.dtype, mode, sorted, dst_ptr, csc)


def prepare(edge_index, num_nodes: Optional[int] = None,
            size: Optional[Tuple[int, int]] = None,
            add_self_loops: bool = True, validate=None,
            sorted: Optional[bool] = None,
            transpose: bool = True) -> PreparedGraph:
    r"""Prepare a graph once for :class:`FastGATConv` layers.

    Args:
        edge_index: [2, E] integer tensor (row 0 = sources, row 1 =
            destinations), a ``torch_geometric.EdgeIndex`` (its sparse size,
            sort order and cached pointers are used), or a sparse adjacency
            ``adj_t`` (torch.sparse COO/CSR/CSC or
            ``torch_sparse.SparseTensor``, rows = destinations).
        num_nodes: node count of a non-bipartite graph.
        size: ``(num_src, num_dst)`` of a bipartite graph. Without
            ``num_nodes`` or ``size`` (or an ``EdgeIndex``'s sparse size),
            sizes are ``max index + 1``: one host sync.
        add_self_loops: must match the layers' ``add_self_loops``.
        validate: ``True`` (``'sync'``), ``False`` (``'off'``), a mode of
            :func:`set_validation`, or None for the mode set there
            (``'auto'``: an exact ``IndexError`` on CPU, a device-side
            assertion without host sync on GPU).
        sorted: ``True`` when ``edge_index[1]`` is non-decreasing (grouped
            by destination, as a sampler's output): the sort is skipped.
            None: an ``EdgeIndex``'s sort order; else checked on CPU
            tensors, assumed unsorted on GPU (checking would need a sync).
        transpose: build the transpose that backward passes walk now (it
            keeps that work out of compiled steps); False builds it on
            first access.

    Returns:
        a :class:`PreparedGraph`; pass it as ``edge_index`` to layers whose
        node counts match. ``ValueError`` for a wrong shape or dtype.
    """
    if size is not None and num_nodes is not None:
        raise ValueError('pass either `num_nodes` or `size`, not both')
    ns, nd = (size if size is not None else (num_nodes, num_nodes))
    with _normal_tensors():  # (a graph prepared for inference may train)
        graph = _prepare(edge_index, ns, nd, add_self_loops, validate, sorted)
        if transpose and not _is_compiling():
            graph.csc  # noqa: B018 (builds and keeps the transpose)
    return graph


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
    After such a write call :func:`clear_cache`, or pass a new tensor. (An
    ``EdgeIndex`` is keyed on its data's counter too: writes through its
    ``as_tensor()`` are seen.) Under ``torch.inference_mode()`` the graph
    is built from ordinary tensors (also for an ``edge_index`` made there),
    so that training calls can reuse it.
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
            if type(edge_index) is not Tensor and version is not None:
                # an EdgeIndex's data (as_tensor()) has its own counter
                version = (version, _plain(edge_index)._version)
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
        with _normal_tensors():
            graph = _prepare(edge_index, num_src, num_dst, add_self_loops)
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
    """The prepared graph for a layer call: cached eagerly; built inline and
    uncached while ``torch.compile`` traces (validated by a device-side
    assertion in the compiled graph unless validation is ``'off'``)."""
    if _is_compiling():
        return _prepare(edge_index, num_src, num_dst, add_self_loops)
    return _cache.get(edge_index, num_src, num_dst, add_self_loops)

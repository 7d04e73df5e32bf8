"""Input checks done in Python, before the kernels run.

The C++ entry points check metadata (ranks, dtypes, devices, sizes) and the
kernels clamp every index they read, so bad input can never touch memory out
of bounds. What needs the *values* of index tensors (range, order,
``rowptr[-1] == E``) is checked here with one host synchronization per call.
``FastGATConv`` runs these checks once, when a graph is prepared and cached,
and then calls the kernels without them; the public ops run them on every call
unless ``validate=False``. They are skipped while ``torch.compile`` traces.
"""
from typing import Optional

import torch
from torch import Tensor

from ..reference import rows_of


def _tracing() -> bool:
    compiler = getattr(torch, 'compiler', None)
    if compiler is not None and hasattr(compiler, 'is_compiling'):
        if compiler.is_compiling():
            return True
    return torch.jit.is_tracing() or torch.jit.is_scripting()


def _check_unbatched(name: str, t: Optional[Tensor]):
    """Index values batched by vmap cannot be read per sample: say so."""
    if t is not None and (torch._C._functorch.is_batchedtensor(t) or
                          torch._C._functorch.is_legacy_batchedtensor(t)):
        raise ValueError(f'`{name}` is batched by torch.vmap: its values '
                         f'cannot be checked; pass validate=False (the '
                         f'kernels clamp every index)')


def check_tensor(t, name: str, dims=None, floating: Optional[bool] = None):
    if not isinstance(t, Tensor):
        raise TypeError(f'`{name}` must be a torch.Tensor, got {type(t).__name__}')
    if dims is not None and t.dim() not in dims:
        want = ' or '.join(f'{d}-D' for d in dims)
        raise ValueError(f'`{name}` must be {want}, got shape {tuple(t.shape)}')
    if floating is True and not t.is_floating_point():
        raise TypeError(f'`{name}` must be a floating-point tensor, got {t.dtype}')
    if floating is False and t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f'`{name}` must be an int32 or int64 tensor, got {t.dtype}')


def check_same_device(**tensors):
    items = [(k, v) for k, v in tensors.items() if v is not None]
    k0, v0 = items[0]
    for k, v in items[1:]:
        if v.device != v0.device:
            raise ValueError(f'`{k}` is on {v.device} but `{k0}` is on '
                             f'{v0.device}; all tensors must be on one device')


def cast_to(dtype: torch.dtype, *tensors: Optional[Tensor]) -> list:
    """Each tensor in ``dtype`` (None stays None). A tensor already in it is
    passed as it is, without the call of ``.to()`` (host time; the same
    tensor either way)."""
    return [t if t is None or t.dtype == dtype else t.to(dtype)
            for t in tensors]


def index_pair(rowptr: Tensor, col: Tensor):
    """Give rowptr and col one dtype (int64 if they differ)."""
    if rowptr.dtype != col.dtype:
        return rowptr.long(), col.long()
    return rowptr, col


def check_csr(rowptr: Tensor, col: Optional[Tensor], num_edges: int,
              num_cols: Optional[int] = None, rowptr_name: str = 'rowptr',
              col_name: str = 'col', tail: bool = False):
    """Validate a CSR structure: rowptr starts at 0, never decreases, ends at
    ``num_edges`` (at most, with ``tail``: entries past it are unused);
    ``col`` holds indices in ``[0, num_cols)``. One sync."""
    if _tracing():
        return
    _check_unbatched(rowptr_name, rowptr)
    _check_unbatched(col_name, col)
    if rowptr.numel() == 0:
        raise ValueError(f'`{rowptr_name}` must hold N + 1 >= 1 entries, got 0')
    flags = [rowptr[0] != 0,
             rowptr[-1] > num_edges if tail else rowptr[-1] != num_edges]
    flags.append((rowptr[1:] < rowptr[:-1]).any() if rowptr.numel() > 1 else
                 rowptr.new_zeros((), dtype=torch.bool))
    check_col = col is not None and num_cols is not None and col.numel() > 0
    if check_col:
        flags += [col.min() < 0, col.max() >= num_cols]
    bad = torch.stack([f.reshape(()) for f in flags]).tolist()
    if bad[0]:
        raise ValueError(f'`{rowptr_name}` must start at 0, got '
                         f'{int(rowptr[0])}')
    if bad[1]:
        raise ValueError(f'`{rowptr_name}[-1]` must '
                         f'{"be at most" if tail else "equal"} the number of '
                         f'edges ({num_edges}), got {int(rowptr[-1])}')
    if bad[2]:
        raise ValueError(f'`{rowptr_name}` must be non-decreasing')
    if check_col and (bad[3] or bad[4]):
        raise IndexError(f'`{col_name}` holds indices out of range [0, '
                         f'{num_cols}): min {int(col.min())}, max '
                         f'{int(col.max())}')


def check_csc(csc, rowptr: Tensor, col: Tensor, num_cols: int):
    """Validate a given transpose (``csr_to_csc``'s CSC, or None) of a CSR
    graph that :func:`check_csr` passed: each CSR position once, in its
    column, with its row (and ``inv`` its inverse). Host syncs."""
    if csc is None or csc[0] is None or _tracing():
        return
    E = col.numel()
    parts = [('csc.colptr', csc[0], num_cols + 1), ('csc.row', csc[1], E),
             ('csc.perm', csc[2], E)]
    if len(csc) > 3 and csc[3] is not None:
        parts.append(('csc.inv', csc[3], E))
    for name, t, n in parts:
        check_tensor(t, name, dims=(1, ), floating=False)
        if t.numel() != n:
            raise ValueError(f'`{name}` must hold {n} entries, got '
                             f'{t.numel()}')
    check_csr(csc[0], None, E, rowptr_name='csc.colptr')
    if E == 0:
        return
    p = csc[2].long()
    if bool(((p < 0) | (p >= E)).any()) or bool(
            torch.bincount(p, minlength=E).ne(1).any()):
        raise ValueError(f'`csc.perm` must be a permutation of the {E} CSR '
                         f'positions')
    col_k = torch.repeat_interleave(
        torch.arange(num_cols, device=col.device), csc[0].diff().long(),
        output_size=E)
    ok = [col.long()[p].eq(col_k).all(),
          rows_of(rowptr, E).long()[p].eq(csc[1].long()).all()]
    if len(parts) > 3:
        ok.append(csc[3].long()[p].eq(torch.arange(E, device=p.device)).all())
    if not bool(torch.stack(ok).all()):
        raise ValueError('`csc` is not the transpose of `rowptr` / `col` '
                         '(build it with csr_to_csc)')

def check_index(index: Tensor, size: int, name: str):
    """Validate that ``index`` lies in ``[0, size)``. One sync."""
    if _tracing() or index.numel() == 0:
        return
    _check_unbatched(name, index)
    lo, hi = torch.stack([index.min(), index.max()]).tolist()
    if lo < 0 or hi >= size:
        raise IndexError(f'`{name}` holds indices out of range [0, {size}): '
                         f'min {lo}, max {hi}')

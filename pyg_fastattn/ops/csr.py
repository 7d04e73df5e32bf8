"""CSR helpers: the transpose (CSC) that backward passes walk."""
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..reference import rows_of
from ._checks import check_csr, check_tensor, index_pair

__all__ = ['CSC', 'csr_to_csc', 'rows_of']


class CSC(NamedTuple):
    """The transpose of a CSR graph.

    ``colptr`` [num_cols + 1], ``row`` [E] (the CSR row of each CSC entry),
    ``perm`` [E] (the CSR position of each CSC entry), so that
    ``col[perm[k]]`` is the column of CSC entry ``k``, and ``inv`` [E] (its
    inverse: the CSC position of each CSR position).
    """
    colptr: Tensor
    row: Tensor
    perm: Tensor
    inv: Tensor


def csr_to_csc(rowptr: Tensor, col: Tensor, num_cols: int,
               validate: bool = True) -> CSC:
    """Transpose a CSR graph (``rowptr`` [N + 1], ``col`` [E]) into a
    :class:`CSC` with ``num_cols`` columns.

    Stable: within a column, entries keep their CSR order, so the result is
    deterministic. Positions ``e >= rowptr[N]`` (outside every row) are left
    out of every column. No host synchronization when ``validate=False``.
    """
    check_tensor(rowptr, 'rowptr', dims=(1, ), floating=False)
    check_tensor(col, 'col', dims=(1, ), floating=False)
    if num_cols < 0:
        raise ValueError(f'`num_cols` must be >= 0, got {num_cols}')
    rowptr, col = index_pair(rowptr, col)
    if validate:
        check_csr(rowptr, col, col.numel(), num_cols)
    N, E = rowptr.numel() - 1, col.numel()
    row = rows_of(rowptr, E)
    key = col.masked_fill(row >= N, num_cols) if E > 0 else col
    perm = torch.argsort(key, stable=True)
    bounds = torch.arange(num_cols + 1, device=col.device, dtype=key.dtype)
    colptr = torch.searchsorted(key[perm], bounds).to(rowptr.dtype)
    inv = torch.empty_like(perm).scatter_(
        0, perm, torch.arange(E, device=col.device))
    dt = rowptr.dtype
    return CSC(colptr, row[perm].to(dt), perm.to(dt), inv.to(dt))


def maybe_csc(csc: Optional[CSC], rowptr: Tensor, col: Tensor,
              num_cols: int) -> CSC:
    """The given CSC, or the transpose built now (for backward)."""
    if csc is not None and csc[0] is not None:
        return CSC(*csc)
    return csr_to_csc(rowptr, col, num_cols, validate=False)

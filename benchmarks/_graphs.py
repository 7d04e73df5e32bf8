"""Seeded random data for the benchmarks, built on the device: CSR
graphs, normal tensors, byte counts."""
from typing import Optional, Sequence

import torch


def generator(device: torch.device, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def random_csr(num_rows: int, device: torch.device, *, deg: Optional[int] = None,
               deg_range: Optional[Sequence[int]] = None,
               num_edges: Optional[int] = None, num_cols: Optional[int] = None,
               seed: int = 0, index_dtype: torch.dtype = torch.long):
    """A random CSR graph built on ``device`` (rows = destinations).

    Exactly one of ``deg`` (fixed degree), ``deg_range`` (uniform degrees in
    ``[lo, hi]``) or ``num_edges`` (uniformly random edges, sorted by row).
    Columns are uniform in ``[0, num_cols)``. Returns (rowptr, col, row).
    """
    g = generator(device, seed)
    N = num_rows
    num_cols = num_cols or N
    if deg is not None:
        E = N * deg
        rowptr = torch.arange(0, E + 1, deg, device=device)
        row = torch.arange(N, device=device).repeat_interleave(deg)
    else:
        if deg_range is not None:
            lo, hi = deg_range
            counts = torch.randint(lo, hi + 1, (N, ), device=device, generator=g)
            row = torch.repeat_interleave(torch.arange(N, device=device), counts)
        else:
            row = torch.randint(N, (num_edges, ), device=device, generator=g)
            row = row.sort().values
            counts = torch.bincount(row, minlength=N)
        rowptr = torch.zeros(N + 1, dtype=torch.long, device=device)
        rowptr[1:] = counts.cumsum(0)
    E = row.numel()
    col = torch.randint(num_cols, (E, ), device=device, generator=g)
    return rowptr.to(index_dtype), col.to(index_dtype), row.to(index_dtype)


def randn(shape, device, seed, requires_grad=False, dtype=torch.float32):
    t = torch.randn(shape, device=device, generator=generator(device, seed),
                    dtype=dtype)
    return t.requires_grad_(requires_grad)


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)

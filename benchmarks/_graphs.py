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


def skewed_csr(kind: str, num_rows: int, num_edges: int, device: torch.device,
               *, s: float = 1.0, seed: int = 0,
               index_dtype: torch.dtype = torch.long):
    """Graphs with hubs, built on ``device`` (rows = destinations); columns
    (sources) uniform in ``[0, num_rows)``. Returns (rowptr, col, row).

    * ``'power'``: each edge's row drawn independently with probability
      proportional to ``1 / (i + 1) ** s`` (row 0 is the largest hub;
      s = 1.0 at 1M rows / 20M edges gives a row of about 1.4M edges);
    * ``'hub'``: all edges in row 0, the other rows empty;
    * ``'rows20'``: the same number of edges in rows of 20 (the balanced
      counterpart of ``'hub'``; rows past ``num_edges / 20`` empty).
    """
    g = generator(device, seed)
    N, E = num_rows, num_edges
    if kind == 'power':
        w = torch.arange(1, N + 1, device=device, dtype=torch.float64).pow(-s)
        parts, left = [], E
        while left > 0:  # multinomial draws at most 2^24 samples per call
            n = min(left, 1 << 24)
            parts.append(torch.multinomial(w, n, replacement=True, generator=g))
            left -= n
        row = torch.cat(parts).sort().values
    elif kind == 'hub':
        row = torch.zeros(E, dtype=torch.long, device=device)
    elif kind == 'rows20':
        row = torch.arange(E, device=device) // 20
        assert int(row[-1]) < N, 'rows20 needs num_rows >= num_edges / 20'
    else:
        raise ValueError(kind)
    counts = torch.bincount(row, minlength=N)
    rowptr = torch.zeros(N + 1, dtype=torch.long, device=device)
    rowptr[1:] = counts.cumsum(0)
    col = torch.randint(N, (E, ), device=device, generator=g)
    return rowptr.to(index_dtype), col.to(index_dtype), row.to(index_dtype)


SKEWED_DOC = ("power law: each edge's destination drawn with weight "
              "1/(i+1)^s, sources uniform; hub: all edges into node 0; "
              "rows20: the same edges in rows of 20 (benchmarks/_graphs.py "
              "skewed_csr)")

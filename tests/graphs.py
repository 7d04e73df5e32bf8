"""Random CSR graphs for the tests (rows = destination nodes)."""
import torch


def csr_from_degrees(deg, num_cols, idx_dtype=torch.int64, device='cpu'):
    deg = torch.as_tensor(deg, dtype=torch.long)
    rowptr = torch.zeros(deg.numel() + 1, dtype=torch.long)
    rowptr[1:] = deg.cumsum(0)
    E = int(rowptr[-1])
    col = torch.randint(0, max(num_cols, 1), (E, )) if num_cols > 0 else \
        torch.zeros(0, dtype=torch.long)
    return rowptr.to(device, idx_dtype), col.to(device, idx_dtype)


def hub_rows(num_rows, num_cols, seed, device, idx_dtype=torch.int32):
    """``num_rows`` rows of 0-8 edges (seeded) but row 7, a hub of 3000
    edges, with uniform random columns below ``num_cols``. Returns (rowptr,
    col)."""
    g = torch.Generator().manual_seed(seed)
    deg = torch.randint(0, 9, (num_rows, ), generator=g)
    deg[7] = 3000
    return csr_from_degrees(deg, num_cols, idx_dtype, device)


def make_graph(kind, idx_dtype=torch.int64, device='cpu'):
    """Named graph shapes that cover the edge cases.

    Returns (rowptr, col, num_cols).
    """
    if kind == 'mixed':  # empty rows, degree-1 rows, a few larger rows
        deg = torch.tensor([0, 1, 3, 0, 1, 7, 2, 0, 5, 1, 12, 0, 4, 1])
        num_cols = 9
    elif kind == 'huge':  # one 5000-edge row among small ones
        deg = torch.tensor([2, 0, 5000, 1, 3, 0])
        num_cols = 300
    elif kind == 'empty':  # E = 0
        deg = torch.zeros(5, dtype=torch.long)
        num_cols = 4
    elif kind == 'single':  # N = 1
        deg = torch.tensor([3])
        num_cols = 2
    elif kind == 'deg1':
        deg = torch.ones(17, dtype=torch.long)
        num_cols = 17
    else:
        raise ValueError(kind)
    rowptr, col = csr_from_degrees(deg, num_cols, idx_dtype, device)
    return rowptr, col, num_cols


def hub_graph(monkeypatch, split, idx_dtype, many_rows=False):
    """A CUDA graph for comparing kernel variants: empty rows and a
    5000-edge hub row half of whose edges come from node 0 (a hub column),
    with the split threshold PYG_FASTATTN_SPLIT_EDGES set to ``split``
    (None: unset). many_rows: 20,000 more rows of 0-4 edges, so that the
    kernels that stride over rows give a warp several. Returns (rowptr, col,
    num_cols, a seeded CUDA generator)."""
    if split is None:
        monkeypatch.delenv('PYG_FASTATTN_SPLIT_EDGES', raising=False)
    else:
        monkeypatch.setenv('PYG_FASTATTN_SPLIT_EDGES', split)
    if many_rows:
        deg = torch.cat([torch.tensor([2, 0, 5000, 1, 3, 0]),
                         torch.randint(0, 5, (20000, ))])
        num_cols = 300
        rowptr, col = csr_from_degrees(deg, num_cols, idx_dtype, 'cuda')
    else:
        rowptr, col, num_cols = make_graph('huge', idx_dtype, 'cuda')
    col[:2500] = 0  # half of the hub row's edges come from node 0
    return rowptr, col, num_cols, torch.Generator(device='cuda').manual_seed(0)


def noncontig(t):
    """A non-contiguous tensor equal to ``t`` (strided view of a bigger one)."""
    big = torch.empty(t.shape + (2, ), dtype=t.dtype, device=t.device)
    big[..., 0] = t
    out = big[..., 0]
    assert not out.is_contiguous() or t.numel() <= 1
    return out


def assert_bitwise(xs, ys, what):
    """Every tensor of xs equals its partner in ys to the bit."""
    for k, (x, y) in enumerate(zip(xs, ys)):
        assert torch.equal(x, y), f'{what}: output {k} differs'


def assert_deterministic(run, device):
    """run() (a list of tensors) twice bitwise equal, and on the CPU also
    with 1 and 2 threads."""
    first = run()
    assert_bitwise(first, run(), 'second run')
    if device == 'cpu':
        threads = torch.get_num_threads()
        try:
            for n in (1, 2):
                torch.set_num_threads(n)
                assert_bitwise(first, run(), f'{n} thread(s)')
        finally:
            torch.set_num_threads(threads)

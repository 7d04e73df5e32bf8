"""Hub graphs: rows (and CSC columns) long enough to take the split path of
the kernels (chunks of a long row processed by separate workers, partials
combined in chunk order), against the float64 reference, and bitwise
determinism of the split path.

``PYG_FASTATTN_SPLIT_EDGES=16`` (read by the kernels at every launch) sets
the split threshold to 16 edges and the chunk to 8, so that small graphs
have rows just below / at / above the threshold and rows of many chunks;
'default' keeps the built-in threshold with a hub row and a hub column
above it."""
import pytest
import torch

from pyg_fastattn import _build, ops, reference as R

from conftest import DEVICES, requires_cuda
from graphs import assert_bitwise, assert_deterministic, csr_from_degrees
from test_gatv2 import _bias, _check as _check_gatv2
from test_ops import TOL, _check, _leaf
from test_transformer_attention import _check as _check_transformer

SPLIT_ENV = 'PYG_FASTATTN_SPLIT_EDGES'
DEFAULT_SPLIT = 4096  # kSplitEdges in csrc/common.h
GATV2_SPLIT = 2048  # kGatv2SplitEdges (gatv2 and transformer kernels)


@pytest.fixture(params=['small', 'default'])
def split(request, monkeypatch):
    if not _build.load().native:
        pytest.skip(f'native kernels unavailable: {_build.load().error}')
    if request.param == 'small':
        monkeypatch.setenv(SPLIT_ENV, '16')
    else:
        monkeypatch.delenv(SPLIT_ENV, raising=False)
    return request.param


def hub_graph(split, idx, device):
    """(rowptr, col, Ns): empty, degree-1 and small rows, rows at the split
    threshold and one above it, a hub row of several chunks, and a hub
    column (source node 0 of about half of all edges)."""
    g = torch.Generator().manual_seed(7)
    if split == 'small':
        T, hub, Ns = 16, 600, 40
    else:
        T, hub, Ns = DEFAULT_SPLIT, 20000, 300
    small = torch.randint(0, 6, (60, ), generator=g)
    deg = torch.cat([torch.tensor([0, 1, T - 1, T, T + 1, 3 * T + 5, 0]), small[:30],
                     torch.tensor([hub, 1, 0]), small[30:], torch.tensor([2 * T + 1])])
    rowptr, col = csr_from_degrees(deg, Ns)
    E = col.numel()
    to_hub = torch.rand(E, generator=g) < 0.5
    col[to_hub] = 0  # column 0: a CSC hub of about E / 2 entries
    return rowptr.to(device, idx), col.to(device, idx), Ns


IDX = [torch.int32, torch.int64]
DTYPES = [torch.float64, torch.float32]


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('idx', IDX)
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('heads', [1, 4, 8])
def test_hub_edge_softmax(split, device, idx, dtype, heads):
    rowptr, col, _ = hub_graph(split, idx, device)
    s = _leaf(torch.randn(col.numel(), heads, device=device) * 3, dtype,
              contiguous=heads != 4)
    _check(lambda s: ops.edge_softmax(s, rowptr),
           lambda s: R.edge_softmax(rowptr, s), [s], dtype)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('heads', [8, 16])
def test_edge_softmax_split_by_elements(device, heads):
    """CUDA edge_softmax splits rows of more than 16384 / heads edges
    (kSoftmaxSplitElems, clamped to [2048, 4096]): rows just below, at and
    above that threshold, among short rows, forward and backward."""
    if not _build.load().native:
        pytest.skip(f'native kernels unavailable: {_build.load().error}')
    T = min(DEFAULT_SPLIT, max(2048, 16384 // heads))
    deg = torch.tensor([3, T - 1, 0, T, 20, T + 1, 1, 2 * T + 3, 7])
    rowptr, _ = csr_from_degrees(deg, 1, device=device)
    s = _leaf(torch.randn(int(deg.sum()), heads, device=device) * 3,
              torch.float32)
    _check(lambda s: ops.edge_softmax(s, rowptr),
           lambda s: R.edge_softmax(rowptr, s), [s], torch.float32)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('idx', IDX)
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('heads,C', [(1, 8), (4, 7), (8, 16), (2, 160)])
def test_hub_softmax_aggregate(split, device, idx, dtype, heads, C):
    rowptr, col, Ns = hub_graph(split, idx, device)
    s = _leaf(torch.randn(col.numel(), heads, device=device), dtype)
    v = _leaf(torch.randn(Ns, heads, C, device=device), dtype,
              contiguous=C != 7)
    _check(lambda s, v: ops.softmax_aggregate(rowptr, col, s, v),
           lambda s, v: R.attention(rowptr, col, None, None, s, None, v, 1.0)[0],
           [s, v], dtype)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('idx', IDX)
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('terms', ['src,dst', 'src,dst,edge,mask'])
@pytest.mark.parametrize('heads,C', [(4, 8), (1, 6), (8, 33)])
def test_hub_attention(split, device, idx, dtype, terms, heads, C):
    """The GAT path (a_src + a_dst [+ a_edge], leaky relu [, dropout mask]),
    forward and backward: the backward's CSC pass sees the hub column."""
    rowptr, col, Ns = hub_graph(split, idx, device)
    N, E, H = rowptr.numel() - 1, col.numel(), heads
    mk = lambda *shape: _leaf(torch.randn(*shape, device=device), dtype)
    with_edge = 'edge' in terms
    a_src, a_dst, v = mk(Ns, H), mk(N, H), mk(Ns, H, C)
    a_edge = mk(E, H) if with_edge else None
    mask = ((torch.rand(E, H, device=device) > 0.3).to(dtype) / 0.7
            if 'mask' in terms else None)

    def fn(a_src, a_dst, a_edge, v):
        return ops.attention(rowptr, col, v, a_src, a_dst, a_edge, mask, 0.2)

    def ref(a_src, a_dst, a_edge, v):
        m = mask.double() if mask is not None else None
        return R.attention(rowptr, col, a_src, a_dst, a_edge, m, v, 0.2)[0]

    _check(fn, ref, [a_src, a_dst, a_edge, v], dtype)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('idx', IDX)
@pytest.mark.parametrize('dtype', DTYPES)
def test_hub_attention_backward_kernel(split, device, idx, dtype):
    """attention_backward directly, in both grad_z orders, with -inf scores
    (a row whose scores are all -inf has no weight) and lse from the
    forward kernel."""
    K = torch.ops.pyg_fastattn
    rowptr, col, Ns = hub_graph(split, idx, device)
    N, E, H, C = rowptr.numel() - 1, col.numel(), 4, 8
    d = dict(dtype=dtype, device=device)
    a_src, a_dst = torch.randn(Ns, H, **d), torch.randn(N, H, **d)
    a_edge, v = torch.randn(E, H, **d), torch.randn(Ns, H, C, **d)
    a_edge[::5, 1] = float('-inf')
    mask = (torch.rand(E, H, **d) > 0.3).to(dtype) * 1.5
    out, lse = K.attention(rowptr, col, a_src, a_dst, a_edge, mask, v, 0.2,
                           None, None, None, None, None)
    ref_out, ref_lse = R.attention(rowptr, col, a_src.double(), a_dst.double(),
                                   a_edge.double(), mask.double(), v.double(), 0.2)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else {}
    torch.testing.assert_close(out.double(), ref_out, **tol)
    torch.testing.assert_close(lse.double(), ref_lse, **tol)
    go = torch.randn_like(out)
    csc = ops.csr_to_csc(rowptr, col, Ns)
    for csr_order in (False, True):
        args = (rowptr, col, *csc[:3], a_src, a_dst, a_edge, mask, v, 0.2, out,
                lse, go, csr_order)
        got = K.attention_backward(*args)
        want = R.attention_backward(*[a.double() if torch.is_tensor(a)
                                      and a.is_floating_point() else a
                                      for a in args])
        for g, w in zip(got, want):
            scale = max(1.0, w.abs().max().item())
            torch.testing.assert_close(g.double(), w, atol=(tol.get('atol', 1e-10)) * scale,
                                       rtol=tol.get('rtol', 1e-10))


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('idx', IDX)
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('heads,C', [(1, 8), (4, 7), (2, 40)])
def test_hub_spmm(split, device, idx, dtype, heads, C):
    rowptr, col, Ns = hub_graph(split, idx, device)
    E = col.numel()
    w = _leaf(torch.randn(E, heads, device=device), dtype)
    v = _leaf(torch.randn(Ns, heads, C, device=device), dtype)
    _check(lambda w, v: ops.spmm(rowptr, col, w, v),
           lambda w, v: R.spmm(rowptr, col, w, None, v), [w, v], dtype)
    _check(lambda v: ops.spmm(rowptr, col, None, v),
           lambda v: R.spmm(rowptr, col, None, None, v), [v], dtype)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('idx', IDX)
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('heads', [1, 4, 8, 24])
def test_hub_segment_sum(split, device, idx, dtype, heads):
    """segment_sum (grad_a_dst's CSR row sums in the GAT backward), with and
    without perm; 24 heads of float64 take the wide (spmm) kernel on CUDA."""
    rowptr, col, _ = hub_graph(split, idx, device)
    E = col.numel()
    src = _leaf(torch.randn(E, heads, device=device), dtype)
    perm = torch.randperm(E, device=device).to(idx)
    _check(lambda s: ops.segment_sum(rowptr, s, perm),
           lambda s: R.segment_sum(rowptr, perm, s), [src], dtype)
    _check(lambda s: ops.segment_sum(rowptr, s),
           lambda s: R.segment_sum(rowptr, None, s), [src], dtype)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('idx', IDX)
def test_hub_sddmm(split, device, idx):
    """sddmm is edge-parallel (no rows): hub graphs need nothing special; the
    hub's edges still must come out right."""
    rowptr, col, Ns = hub_graph(split, idx, device)
    N = rowptr.numel() - 1
    row = torch.repeat_interleave(torch.arange(N, device=device),
                                  (rowptr[1:] - rowptr[:-1]).long()).to(idx)
    a = _leaf(torch.randn(N, 4, 8, device=device), torch.float64)
    b = _leaf(torch.randn(Ns, 4, 8, device=device), torch.float64)
    _check(lambda a, b: ops.sddmm(a, b, row, col),
           lambda a, b: (a[row] * b[col]).sum(-1), [a, b], torch.float64)


def _deterministic_inputs(split, device, dtype):
    """The hub graph (int64) and a seeded rn(*shape) of dtype (bfloat16
    for float16 on the CPU)."""
    if dtype == torch.float16 and device == 'cpu':
        dtype = torch.bfloat16
    rowptr, col, Ns = hub_graph(split, torch.int64, device)
    g = torch.Generator(device=device).manual_seed(3)

    def rn(*shape):
        return torch.randn(*shape, device=device, generator=g,
                           dtype=torch.float32).to(dtype)
    return rowptr, col, Ns, rn


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('dtype', [torch.float32, torch.float16])
def test_hub_deterministic(split, device, dtype):
    """Two runs of the attention forward and backward and of edge_softmax
    (forward and backward) on a hub graph are bitwise equal; on the CPU also
    with 1 and with 2 threads (the split into chunks does not depend on the
    thread count)."""
    rowptr, col, Ns, rn = _deterministic_inputs(split, device, dtype)
    N, E, H, C = rowptr.numel() - 1, col.numel(), 4, 16
    a_src, a_dst, a_edge, v = rn(Ns, H), rn(N, H), rn(E, H), rn(Ns, H, C)
    mask = (rn(E, H) > 0).to(rn(1).dtype) * 2
    scores, gy = rn(E, H), rn(E, H)
    go = rn(N, H, C)

    def run():
        leaves = [t.clone().requires_grad_() for t in (a_src, a_dst, a_edge, v)]
        out = ops.attention(rowptr, col, leaves[3], *leaves[:3], mask, 0.2)
        grads = torch.autograd.grad(out, leaves, go)
        s = scores.clone().requires_grad_()
        y = ops.edge_softmax(s, rowptr)
        gs, = torch.autograd.grad(y, s, gy)
        return [out, *grads, y, gs]

    assert_deterministic(run, device)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('idx', IDX)
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('terms', ['plain', 'edge,mask,bias'])
@pytest.mark.parametrize('heads,C', [(1, 8), (4, 7), (8, 16), (2, 40)])
def test_hub_gatv2(split, device, idx, dtype, terms, heads, C):
    """gatv2_attention: out, lse and every gradient against the float64
    reference. The forward and the backward's row pass see the hub row, the
    backward's CSC pass the hub column; the 'default' hub row and column
    are above the CPU and the CUDA split thresholds (CUDA's gatv2 kernels
    use their own), so the test assumes neither."""
    rowptr, col, Ns = hub_graph(split, idx, device)
    N, E = rowptr.numel() - 1, col.numel()
    d = dict(dtype=dtype, device=device)
    x_l, x_r = torch.randn(Ns, heads, C, **d), torch.randn(N, heads, C, **d)
    att = torch.randn(heads, C, **d)
    e_t = torch.randn(E, heads, C, **d) if 'edge' in terms else None
    mask = ((torch.rand(E, heads, device=device) > 0.3).to(dtype) / 0.7
            if 'mask' in terms else None)
    t = (rowptr, col, x_l, x_r, e_t, att, mask)
    bias = _bias(t) if 'bias' in terms else None
    tol = TOL[dtype]
    _check_gatv2(*t, tol=tol, bias=bias)
    _, lse = ops.gatv2_attention(rowptr, col, x_l, x_r, att, e_t, mask,
                                 return_lse=True, bias=bias)
    dbl = lambda u: u.double() if u is not None else None
    _, lse_ref = R.gatv2_attention(rowptr, col, x_l.double(), x_r.double(),
                                   dbl(e_t), att.double(), dbl(mask), 0.2)
    torch.testing.assert_close(lse.double(), lse_ref, atol=tol, rtol=tol)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('dtype', [torch.float32, torch.float16])
def test_hub_gatv2_deterministic(split, device, dtype):
    """Two runs of gatv2_attention's forward (out, lse) and backward on a
    hub graph are bitwise equal; on the CPU also with 1 and with 2 threads.
    (The bias is an input but not differentiated: its gradient is a plain
    torch sum, not a kernel of this package.)"""
    rowptr, col, Ns, rn = _deterministic_inputs(split, device, dtype)
    N, E, H, C = rowptr.numel() - 1, col.numel(), 4, 16
    x_l, x_r, att, e_t = rn(Ns, H, C), rn(N, H, C), rn(H, C), rn(E, H, C)
    bias, go = rn(H * C), rn(N, H, C)
    mask = (rn(E, H) > 0).to(rn(1).dtype) * 2
    csc = ops.csr_to_csc(rowptr, col, Ns)

    def run():
        leaves = [u.clone().requires_grad_() for u in (x_l, x_r, att, e_t)]
        out, lse = ops.gatv2_attention(rowptr, col, *leaves, mask, csc=csc,
                                       return_lse=True, bias=bias)
        return [out, lse, *torch.autograd.grad(out, leaves, go)]

    assert_deterministic(run, device)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('idx', IDX)
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('terms', ['plain', 'edge,mask'])
@pytest.mark.parametrize('heads,C', [(1, 8), (4, 7), (8, 16), (2, 40)])
def test_hub_transformer(split, device, idx, dtype, terms, heads, C):
    """transformer_attention: out, lse and every gradient against the
    float64 reference. The forward and the backward's row pass see the hub
    row, the backward's CSC pass (grad_key, grad_value) the hub column."""
    rowptr, col, Ns = hub_graph(split, idx, device)
    N, E = rowptr.numel() - 1, col.numel()
    d = dict(dtype=dtype, device=device)
    q = torch.randn(N, heads, C, **d)
    k, v = torch.randn(Ns, heads, C, **d), torch.randn(Ns, heads, C, **d)
    e_t = torch.randn(E, heads, C, **d) if 'edge' in terms else None
    mask = ((torch.rand(E, heads, device=device) > 0.3).to(dtype) / 0.7
            if 'mask' in terms else None)
    scale = C ** -0.5
    tol = TOL[dtype]
    _check_transformer(rowptr, col, q, k, v, e_t, mask, tol=tol, scale=scale)
    _, lse = ops.transformer_attention(rowptr, col, q, k, v, e_t, mask, scale,
                                       return_lse=True)
    dbl = lambda u: u.double() if u is not None else None  # noqa: E731
    _, lse_ref = R.transformer_attention(rowptr, col, q.double(), k.double(),
                                         v.double(), dbl(e_t), dbl(mask),
                                         scale)
    torch.testing.assert_close(lse.double(), lse_ref, atol=tol, rtol=tol)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('dtype', [torch.float32, torch.float16])
def test_hub_transformer_deterministic(split, device, dtype):
    """Two runs of transformer_attention's forward (out, lse) and backward
    on a hub graph are bitwise equal; on the CPU also with 1 and with 2
    threads."""
    rowptr, col, Ns, rn = _deterministic_inputs(split, device, dtype)
    N, E, H, C = rowptr.numel() - 1, col.numel(), 4, 16
    q, k, v, e_t = rn(N, H, C), rn(Ns, H, C), rn(Ns, H, C), rn(E, H, C)
    go = rn(N, H, C)
    mask = (rn(E, H) > 0).to(rn(1).dtype) * 2
    csc = ops.csr_to_csc(rowptr, col, Ns)

    def run():
        leaves = [u.clone().requires_grad_() for u in (q, k, v, e_t)]
        out, lse = ops.transformer_attention(rowptr, col, *leaves, mask, 0.25,
                                             csc=csc, return_lse=True)
        return [out, lse, *torch.autograd.grad(out, leaves, go)]

    assert_deterministic(run, device)


def _lengths(rowptr, colptr):
    return tuple(int(p.diff().max()) if p.numel() > 1 else 0
                 for p in (rowptr, colptr))


def _hint_graph(split, graph, device, T):
    """(rowptr, col, N, csc, lengths) of a square graph: the hub graph (a
    row and a column above the threshold T) or one of short rows and
    columns (at most T) with more than T edges."""
    g = torch.Generator().manual_seed(5)
    if graph == 'hub':
        rowptr, col, Ns = hub_graph(split, torch.int64, 'cpu')
        N = rowptr.numel() - 1
        col = col % N
    else:
        N = 300 if split == 'small' else 1200
        deg = torch.randint(0, min(T, 20) + 1, (N, ), generator=g)
        rowptr, col = csr_from_degrees(deg, N)
    rowptr, col = rowptr.to(device), col.to(device)
    csc = ops.csr_to_csc(rowptr, col, N)
    lengths = _lengths(rowptr, csc.colptr)
    if graph == 'short':
        assert col.numel() > T and max(lengths) <= T
    else:
        assert max(lengths) > T
    return rowptr, col, N, csc, lengths


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('graph', ['hub', 'short'])
def test_gat_length_hint_changes_nothing(split, device, graph):
    """gat_attention's max_lengths hint (CUDA skips the split launches when
    no row or column is above the threshold) leaves the output and every
    gradient bitwise unchanged: on the hub graph (the split path still
    runs) and on a graph of short rows and columns with more edges than the
    threshold (the split path is skipped)."""
    T = 16 if split == 'small' else DEFAULT_SPLIT
    rowptr, col, N, csc, lengths = _hint_graph(split, graph, device, T)
    H, C, F = 4, 8, 12
    d = dict(device=device, dtype=torch.float32)
    x, w = torch.randn(N, F, **d), torch.randn(H * C, F, **d)
    att_s, att_d = torch.randn(1, H, C, **d), torch.randn(1, H, C, **d)
    bias, go = torch.randn(H * C, **d), torch.randn(N, H, C, **d)
    mask = (torch.rand(col.numel(), H, **d) > 0.3).float() * 1.5

    def run(hint):
        leaves = [t.clone().requires_grad_() for t in (x, w, att_s, att_d, bias)]
        out = ops.gat_attention(rowptr, col, csc, None, leaves[2], None,
                                leaves[3], None, mask, 0.2, dst_is_src=True,
                                bias=leaves[4], x=leaves[0], weight=leaves[1],
                                max_lengths=hint)
        return [out, *torch.autograd.grad(out, leaves, go)]

    assert_bitwise(run((-1, -1)), run(lengths), 'with the length hint')


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('graph', ['hub', 'short'])
@pytest.mark.parametrize('op', ['gatv2', 'transformer'])
def test_gatv2_transformer_length_hint_changes_nothing(split, device, graph,
                                                       op):
    """As for gat_attention: the max_lengths hint of gatv2_attention and
    transformer_attention leaves out, lse and every gradient bitwise
    unchanged, on the hub graph and on a graph of short rows and columns
    with more edges than their split threshold."""
    T = 16 if split == 'small' else GATV2_SPLIT
    rowptr, col, N, csc, lengths = _hint_graph(split, graph, device, T)
    E, H, C = col.numel(), 4, 8
    d = dict(device=device, dtype=torch.float32)
    a, b, v = (torch.randn(N, H, C, **d) for _ in range(3))
    e_t, att = torch.randn(E, H, C, **d), torch.randn(H, C, **d)
    bias, go = torch.randn(H * C, **d), torch.randn(N, H, C, **d)
    mask = (torch.rand(E, H, **d) > 0.3).float() * 1.5

    def run(hint):
        if op == 'gatv2':
            leaves = [t.clone().requires_grad_() for t in (a, b, att, e_t, bias)]
            out, lse = ops.gatv2_attention(
                rowptr, col, leaves[0], leaves[1], leaves[2], leaves[3], mask,
                0.2, csc=csc, return_lse=True, bias=leaves[4],
                max_lengths=hint)
        else:
            leaves = [t.clone().requires_grad_() for t in (b, a, v, e_t)]
            out, lse = ops.transformer_attention(
                rowptr, col, *leaves, mask, 0.25, csc=csc, return_lse=True,
                max_lengths=hint)
        return [out, lse, *torch.autograd.grad(out, leaves, go)]

    assert_bitwise(run((-1, -1)), run(lengths), 'with the length hint')


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('idx', IDX)
@pytest.mark.parametrize('kind', ['square', 'bipartite', 'no_edges'])
def test_prepared_graph_max_lengths(device, idx, kind):
    """PreparedGraph.max_lengths: (-1, -1) on the CPU; on CUDA the longest
    row and column once the device copy has landed (no host sync)."""
    from pyg_fastattn import prepare
    ei = torch.tensor([[0, 1, 2, 3, 3, 3, 4], [1, 1, 1, 0, 2, 0, 2]])
    if kind == 'square':
        graph = prepare(ei.to(device, idx), num_nodes=5)
    elif kind == 'bipartite':
        graph = prepare(ei.to(device, idx), size=(5, 3), add_self_loops=False)
    else:
        graph = prepare(ei[:, :0].to(device, idx), size=(4, 0),
                        add_self_loops=False)
    exact = _lengths(graph.rowptr, graph.csc.colptr)
    got = graph.max_lengths  # CUDA: queued when prepare built the transpose
    if device == 'cpu':
        assert got == (-1, -1)
        return
    assert got in ((-1, -1), exact)  # read once the copy has landed
    torch.cuda.synchronize()
    assert graph.max_lengths == exact


def _hint_layer_case(device, conv):
    """(N, edge_index, x, layer class) of the length-hint layer tests: 50
    nodes, 300 random edges, 6 features."""
    from pyg_fastattn import FastGATConv, FastGATv2Conv, FastTransformerConv
    torch.manual_seed(0)
    N = 50
    ei = torch.randint(N, (2, 300), device=device)
    x = torch.randn(N, 6, device=device)
    cls = {'gat': FastGATConv, 'gatv2': FastGATv2Conv,
           'transformer': FastTransformerConv}[conv]
    return N, ei, x, cls


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('hint', ['on', 'off'])
@pytest.mark.parametrize('conv', ['gat', 'gatv2', 'transformer'])
def test_length_hint_queued_with_the_transpose(monkeypatch, device, hint,
                                               conv):
    """Building a graph's transpose queues the length reduction on CUDA,
    once, so that a fresh graph's layers read it in the step that built it;
    once it has landed every call reads the exact lengths. Nothing is
    queued on the CPU or with PYG_FASTATTN_LENGTH_HINT=0, and the layers'
    results do not depend on it."""
    from pyg_fastattn import prepare
    if hint == 'off':
        monkeypatch.setenv('PYG_FASTATTN_LENGTH_HINT', '0')
    N, ei, x, cls = _hint_layer_case(device, conv)
    layers = [cls(6, 4, heads=2).to(device) for _ in range(2)]
    loops = conv != 'transformer'
    graph = prepare(ei, num_nodes=N, add_self_loops=loops, transpose=False)
    assert graph._lengths is None
    graph.csc  # noqa: B018
    queued = graph._lengths
    if device == 'cpu' or hint == 'off':
        assert queued is None
    else:
        assert queued is not None and not isinstance(queued[0], int)
    exact = _lengths(graph.rowptr, graph.csc.colptr)
    outs = []
    for layer in layers:
        out = layer(x, graph)
        out.sum().backward()
        outs.append(out.detach())
        assert graph._lengths is queued or graph._lengths == exact
    if device == 'cuda' and hint == 'on':
        torch.cuda.synchronize()
        assert graph.max_lengths == exact
        assert graph._lengths == exact
    # the same results on a graph whose hint is never known
    monkeypatch.setenv('PYG_FASTATTN_LENGTH_HINT', '0')
    other = prepare(ei, num_nodes=N, add_self_loops=loops)
    for layer, out in zip(layers, outs):
        torch.testing.assert_close(layer(x, other).detach(), out, rtol=0,
                                   atol=0)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('conv', ['gat', 'gatv2', 'transformer'])
def test_no_grad_forward_builds_no_transpose(device, conv):
    """A forward under torch.no_grad() leaves a graph's transpose unbuilt
    (only backward passes walk it) and gives the same output as with
    autograd on, which then builds it. On CUDA the length hint is reduced
    over the rows alone until the transpose exists, then over both."""
    from pyg_fastattn import prepare
    N, ei, x, cls = _hint_layer_case(device, conv)
    layer = cls(6, 4, heads=2).to(device).eval()
    loops = conv != 'transformer'
    graph = prepare(ei, num_nodes=N, add_self_loops=loops, transpose=False)
    with torch.no_grad():
        out = layer(x, graph)
    assert graph._csc is None
    if device == 'cuda':
        torch.cuda.synchronize()
        rows = _lengths(graph.rowptr, graph.rowptr)[0]
        assert graph.max_lengths == (rows, -1)
    out2 = layer(x, graph)
    assert graph._csc is not None
    torch.testing.assert_close(out2.detach(), out, rtol=0, atol=0)
    out2.sum().backward()  # walks the transpose built by the second call
    assert all(p.grad is not None for p in layer.parameters()
               if p.requires_grad)
    if device == 'cuda':
        torch.cuda.synchronize()
        assert graph.max_lengths == _lengths(graph.rowptr, graph.csc.colptr)
    # the same output from a fresh edge_index under no_grad (the layer's
    # own preparation and cache)
    with torch.no_grad():
        out3 = layer(x, ei.clone())
    torch.testing.assert_close(out3, out, rtol=0, atol=0)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('idx', IDX)
def test_graph_lengths_op(device, idx):
    """The native graph_lengths op (what max_lengths reads on CUDA): the
    longest step of each pointer as a [2] int64 CPU tensor, 0 for a pointer
    without rows, a decreasing step counted as 0; CUDA fills pinned memory
    asynchronously (read after a synchronization)."""
    if not _build.native_available(torch.device(device)):
        pytest.skip(f'native kernels unavailable: {_build.load().error}')
    op = torch.ops.pyg_fastattn.graph_lengths
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(0, 40, (3000, ), generator=g)
    rows[1234] = 700  # one hub row
    cols = torch.randint(0, 3, (5, ), generator=g)
    cases = [(rows, cols, (700, int(cols.max()))),
             (cols, rows, (int(cols.max()), 700)),
             (torch.zeros(0, dtype=torch.long), rows, (0, 700))]
    for r, c, want in cases:
        ptrs = [torch.cat([torch.zeros(1, dtype=torch.long), t.cumsum(0)])
                .to(device, idx) for t in (r, c)]
        got = op(*ptrs)
        if device == 'cuda':
            assert got.is_pinned()
            torch.cuda.synchronize()
        assert got.device.type == 'cpu' and got.dtype == torch.int64
        assert tuple(got.tolist()) == want
    down = torch.tensor([0, 5, 3, 9], dtype=idx, device=device)  # 5, -2, 6
    got = op(down, down[:2])
    if device == 'cuda':
        torch.cuda.synchronize()
    assert tuple(got.tolist()) == (6, 5)
    with pytest.raises(RuntimeError, match='colptr'):
        op(down, down.float())


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize('hint', ['on', 'off'])
@pytest.mark.parametrize('conv', ['gat', 'gatv2', 'transformer'])
def test_length_hint_reaches_the_kernels(monkeypatch, hint, conv):
    """A layer step on a cached graph of short rows with more edges than the
    split thresholds: with the hint known, no split window is marked; with
    PYG_FASTATTN_LENGTH_HINT=0 three launches mark their windows (GAT: the
    forward, the CSC backward and segment_sum; GATv2 and Transformer: the
    forward and the backward's row and column passes)."""
    if not _build.load().cuda:
        pytest.skip(f'native CUDA kernels unavailable: {_build.load().error}')
    from pyg_fastattn import FastGATConv, FastGATv2Conv, FastTransformerConv
    monkeypatch.delenv(SPLIT_ENV, raising=False)
    if hint == 'off':
        monkeypatch.setenv('PYG_FASTATTN_LENGTH_HINT', '0')
    torch.manual_seed(0)
    N, E = 2000, 20000
    ei = torch.randint(N, (2, E), device='cuda')
    x = torch.randn(N, 16, device='cuda')
    cls = {'gat': FastGATConv, 'gatv2': FastGATv2Conv,
           'transformer': FastTransformerConv}[conv]
    layer = cls(16, 8, heads=4).cuda()

    def step():
        layer(x, ei).sum().backward()

    step()  # prepares and caches the graph, queues the length reduction
    torch.cuda.synchronize()
    with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    marks = sum(e.count for e in prof.key_averages()
                if 'mark_windows' in e.key)
    if hint == 'on':
        assert marks == 0
    else:
        assert marks >= 3

"""Graph preparation for fresh graphs: input already grouped by destination
(``sorted=True``, ``torch_geometric.EdgeIndex``, detected on CPU) gives the
same prepared graph as the sort; validation modes; no host sync on CUDA."""
import pytest
import torch
from torch_geometric import EdgeIndex
from torch_geometric.nn import GATConv

import pyg_fastattn.nn.graph as graph_mod
from pyg_fastattn import FastGATConv, prepare, set_validation
from pyg_fastattn.nn.graph import get_validation

from conftest import DEVICES, requires_cuda

FIELDS = ('rowptr', 'col', 'csr_perm', 'removed', 'fill_index')


def make_edges(num_src, num_dst, E, loops, gen, device='cpu',
               dtype=torch.int64):
    """Random edges with a hub, some self-loops (when ``loops``) and
    destinations without edges; returned sorted by destination (stable)
    and in their random order."""
    src = torch.randint(0, num_src, (E, ), generator=gen)
    dst = torch.randint(0, max(num_dst // 2, 1), (E, ), generator=gen)
    dst[:E // 3] = 0  # a hub row; rows past num_dst // 2 stay empty
    if loops and E:
        k = torch.arange(min(E, 5))
        m = min(num_src, num_dst)
        src[k] = dst[k] = k % m
        src[-1] = dst[-1] = m - 1
    ei = torch.stack([src, dst]).to(device, dtype)
    perm = torch.argsort(ei[1], stable=True)
    return ei[:, perm], ei


def assert_same_graph(a, b):
    for k in FIELDS:
        x, y = getattr(a, k), getattr(b, k)
        assert (x is None) == (y is None), k
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), k
    for x, y in zip(a.csc, b.csc):
        assert x.dtype == y.dtype and torch.equal(x, y)
    assert (a.num_src, a.num_dst, a.num_edges, a.num_loops) == (
        b.num_src, b.num_dst, b.num_edges, b.num_loops)


CASES = [(12, 12, 80), (30, 9, 70), (9, 30, 70), (1, 1, 4), (6, 6, 0),
         (1, 40, 25)]


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('dtype', [torch.int32, torch.int64])
@pytest.mark.parametrize('add_self_loops', [True, False])
@pytest.mark.parametrize('loops', [True, False])
@pytest.mark.parametrize('case', CASES)
def test_sorted_inputs_same_graph(device, dtype, add_self_loops, loops, case):
    """The sort-free build (declared, detected, EdgeIndex with and without
    its cached pointer) equals the sorting build on the same edges."""
    ns, nd, E = case
    gen = torch.Generator().manual_seed(E + ns)
    ei, _ = make_edges(ns, nd, E, loops, gen, device, dtype)
    kw = dict(size=(ns, nd), add_self_loops=add_self_loops)
    ref = prepare(ei, sorted=False, **kw)
    assert ref.index_dtype == dtype
    assert_same_graph(ref, prepare(ei, sorted=True, **kw))
    assert_same_graph(ref, prepare(ei, **kw))  # detected on CPU
    e1 = EdgeIndex(ei, sparse_size=(ns, nd), sort_order='col')
    assert_same_graph(ref, prepare(e1, add_self_loops=add_self_loops))
    e2 = EdgeIndex(ei, sparse_size=(ns, nd), sort_order='col')
    e2.get_indptr()  # cached pointer over destinations
    assert e2._indptr is not None
    assert_same_graph(ref, prepare(e2, add_self_loops=add_self_loops))


def test_cpu_detection_skips_the_sort(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    ei, shuffled = make_edges(20, 20, 200, True, gen)

    def no_sort(*args):
        raise AssertionError('sorted input was sorted again')

    monkeypatch.setattr(graph_mod, '_csr_sort', no_sort)
    # The PyTorch path (the native build decides on its own).
    monkeypatch.setattr(graph_mod, '_use_native', lambda *a: False)
    prepare(ei, num_nodes=20)
    prepare(EdgeIndex(ei, sparse_size=(20, 20), sort_order='col'))
    with pytest.raises(AssertionError, match='sorted again'):
        prepare(shuffled, num_nodes=20)


def test_transpose_on_first_use():
    gen = torch.Generator().manual_seed(4)
    ei, _ = make_edges(12, 12, 60, True, gen)
    g = prepare(ei, num_nodes=12, transpose=False)
    assert g._csc is None
    x = torch.randn(12, 5, requires_grad=True)
    conv = FastGATConv(5, 3, heads=2)
    out = conv(x, g)
    assert g._csc is not None  # built by the layer, kept
    torch.testing.assert_close(out, conv(x, ei))
    out.sum().backward()
    ref = prepare(ei, num_nodes=12)
    for a, b in zip(g.csc, ref.csc):
        assert torch.equal(a, b)


def _kept_edge_set(g):
    ei = g.edge_index()
    return sorted(zip(ei[0].tolist(), ei[1].tolist()))


def test_edge_index_cached_transpose():
    """An EdgeIndex sorted by destination with its transpose cached: its
    CSC is used (add_self_loops=False) and is a valid transpose."""
    gen = torch.Generator().manual_seed(1)
    ei, _ = make_edges(15, 11, 90, True, gen)
    e = EdgeIndex(ei, sparse_size=(15, 11), sort_order='col')
    e.get_csr()  # fills _T_perm, _T_indptr
    g = prepare(e, add_self_loops=False)
    ref = prepare(ei, size=(15, 11), add_self_loops=False, sorted=False)
    assert torch.equal(g.csc.perm.long(), e._T_perm.long())  # reused
    assert torch.equal(g.csc.colptr, ref.csc.colptr)
    perm = g.csc.perm.long()
    assert torch.equal(g.col.long()[perm],
                       torch.repeat_interleave(torch.arange(15),
                                               g.csc.colptr.diff().long()))
    assert torch.equal(g.csc.row.long(), g.dst_of(perm))
    assert torch.equal(g.csc.inv.long()[perm], torch.arange(perm.numel()))
    assert _kept_edge_set(g) == _kept_edge_set(ref)


def _grads(conv, x, ei, ea, size):
    out = conv(x, ei, ea, size=size)
    g = torch.autograd.grad((out * torch.arange(out.numel()).view_as(out)
                             .to(out) / out.numel()).sum(),
                            [p for p in conv.parameters()] + list(
                                x if isinstance(x, tuple) else (x, )))
    return out, g


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('bipartite', [False, True])
@pytest.mark.parametrize('add_self_loops', [True, False])
def test_layer_on_sorted_inputs_matches_gatconv(device, bipartite,
                                                add_self_loops):
    """FastGATConv on sorted tensors, declared-sorted prepared graphs and
    EdgeIndex inputs equals GATConv (outputs and gradients, with edge
    features, so the edge order and the loop fill values count)."""
    gen = torch.Generator().manual_seed(2)
    ns, nd = (23, 14) if bipartite else (23, 23)
    ei, shuffled = make_edges(ns, nd, 120, True, gen, device)
    ea = torch.randn(ei.size(1), 3, generator=gen, dtype=torch.float64)
    ea = ea.to(device)
    torch.manual_seed(0)
    kw = dict(heads=4, edge_dim=3, add_self_loops=add_self_loops)
    in_ch = (6, 5) if bipartite else 6
    ref = GATConv(in_ch, 7, **kw).double().to(device)
    fast = FastGATConv(in_ch, 7, **kw).double().to(device)
    fast.load_state_dict(ref.state_dict())
    xs = torch.randn(ns, 6, generator=gen, dtype=torch.float64).to(device)
    xd = torch.randn(nd, 5, generator=gen, dtype=torch.float64).to(device)
    xs.requires_grad_()
    xd.requires_grad_()
    x = (xs, xd) if bipartite else xs
    size = (ns, nd) if bipartite else None
    want = _grads(ref, x, ei, ea, size)
    inputs = [ei, EdgeIndex(ei, sparse_size=(ns, nd), sort_order='col'),
              prepare(ei, size=(ns, nd), add_self_loops=add_self_loops,
                      sorted=True)]
    for inp in inputs:
        got = _grads(fast, x, inp, ea, size)
        torch.testing.assert_close(got[0], want[0])
        for a, b in zip(got[1], want[1]):
            torch.testing.assert_close(a, b)


def test_validation_modes():
    conv = FastGATConv(4, 2)
    x = torch.randn(5, 4)
    bad = torch.tensor([[0, 1], [2, 5]])
    assert get_validation() == 'auto'
    with pytest.raises(IndexError, match=r'\[0, 5\)'):
        prepare(bad, num_nodes=5, validate='async')  # on CPU: exact check
    prepare(bad, num_nodes=5, validate=False)  # unchecked: builds
    with pytest.raises(ValueError, match='declared sorted'):
        prepare(torch.tensor([[0, 1], [3, 2]]), num_nodes=5, sorted=True)
    try:
        set_validation('off')
        out = conv(x, bad)  # kernels clamp: finite, no crash
        assert torch.isfinite(out).all()
    finally:
        set_validation('auto')
    with pytest.raises(IndexError):
        conv(x, bad.clone())
    with pytest.raises(ValueError, match='validation mode'):
        set_validation('sometimes')
    with pytest.raises(ValueError, match='validate'):
        prepare(bad, num_nodes=5, validate='maybe')


def test_unsorted_input_declared_sorted_stays_in_range():
    """Wrongly declared order without validation: a wrong graph, but every
    index in range."""
    gen = torch.Generator().manual_seed(3)
    _, shuffled = make_edges(10, 10, 60, True, gen)
    g = prepare(shuffled, num_nodes=10, sorted=True, validate=False)
    E2 = g.num_aug
    assert 0 <= int(g.csr_perm.min()) and int(g.csr_perm.max()) < E2
    assert 0 <= int(g.col.min()) and int(g.col.max()) < 10
    assert int(g.rowptr[-1]) <= E2 and bool((g.rowptr.diff() >= 0).all())


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize('form', ['tensor', 'edge_index', 'prepared'])
def test_fresh_graph_step_no_host_sync(form):
    """A training step on a new graph every step (as a sampler gives)
    never waits for the GPU: preparation (sort or not), validation
    ('auto' = device-side), forward and backward."""
    N, E = 2000, 20000
    torch.manual_seed(0)
    convs = torch.nn.ModuleList([FastGATConv(16, 8, heads=4),
                                 FastGATConv(32, 5)]).cuda()
    x = torch.randn(N, 16, device='cuda')

    def fresh():
        ei = torch.randint(0, N, (2, E), device='cuda')
        if form == 'tensor':
            return ei
        ei = ei[:, torch.argsort(ei[1])]
        if form == 'edge_index':
            return EdgeIndex(ei, sparse_size=(N, N), sort_order='col')
        if form == 'prepared':
            return prepare(ei, num_nodes=N, sorted=True)

    def step(ei):
        h = convs[0](x, ei).relu()
        convs[1](h, ei).square().sum().backward()

    step(fresh())  # warm-up: allocator, lazy inits
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode('error')
    try:
        for _ in range(3):
            step(fresh())
    finally:
        torch.cuda.set_sync_debug_mode('default')
    torch.cuda.synchronize()


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('is_sorted', [False, True])
@pytest.mark.parametrize('add_self_loops', [False, True])
def test_opcheck_build_ops(device, is_sorted, add_self_loops):
    """torch.library.opcheck of the two preparation ops."""
    gen = torch.Generator().manual_seed(5)
    ei, shuffled = make_edges(9, 7, 40, True, gen, device)
    src, dst = (ei if is_sorted else shuffled).unbind(0)
    dst_ptr = torch.searchsorted(dst, torch.arange(8, device=device)) \
        if is_sorted else None
    args = (src, dst, 9, 7, add_self_loops, is_sorted, dst_ptr)
    torch.library.opcheck(torch.ops.pyg_fastattn.build_csr.default, args)
    rowptr, col = graph_mod._build_csr(*args)[:2]
    torch.library.opcheck(torch.ops.pyg_fastattn.build_csc.default,
                          (rowptr, col, 9))


def test_edge_index_reaches_the_build_as_plain_tensors(monkeypatch):
    """An ``EdgeIndex``'s data is used as plain tensors: PyG's subclass keeps
    itself through ``as_subclass`` and sends every op through its
    ``__torch_dispatch__`` (on CPU that made a small prepare 4x slower)."""
    seen = []
    csr_of = graph_mod._csr_of

    def spy(src, dst, *args):
        seen.append((type(src), type(dst)))
        return csr_of(src, dst, *args)

    monkeypatch.setattr(graph_mod, '_csr_of', spy)
    ei = EdgeIndex(torch.tensor([[0, 1, 2], [0, 0, 1]]), sparse_size=(3, 3),
                   sort_order='col')
    g = prepare(ei)
    assert seen == [(torch.Tensor, torch.Tensor)]
    assert_same_graph(g, prepare(ei.as_tensor(), num_nodes=3))


def test_eager_prepare_skips_the_custom_op_wrappers(monkeypatch):
    """Eager preparation calls the builds directly: the custom ops (what
    torch.compile sees) cost more host time than building a small graph."""
    def refuse(*args):
        raise AssertionError('eager prepare went through the custom op')

    monkeypatch.setattr(graph_mod, '_build_csr', refuse)
    monkeypatch.setattr(graph_mod, '_build_csc', refuse)
    ei = torch.tensor([[0, 1, 2, 2], [1, 2, 0, 2]])
    g = prepare(ei, num_nodes=3)
    monkeypatch.undo()
    want = graph_mod._build_csr(ei[0], ei[1], 3, 3, True, False, None)
    assert len(want) == 4
    for got, w in zip((g.rowptr, g.col, g.csr_perm, g.removed), want):
        assert torch.equal(got, w)
    for got, w in zip(g.csc, graph_mod._build_csc(g.rowptr, g.col, 3)):
        assert torch.equal(got, w)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('is_sorted', [True, False])
@pytest.mark.parametrize('num_src,num_dst', [(30, 20), (12, 20)])
def test_fill_index_from_the_csr(device, is_sorted, num_src, num_dst):
    """fill_index (computed from the CSR on first access) is each input
    edge's destination, L for a removed self-loop or a destination >= L; None
    without added loops."""
    gen = torch.Generator().manual_seed(4)
    ei, shuffled = make_edges(num_src, num_dst, 300, True, gen, device)
    e = ei if is_sorted else shuffled
    L = min(num_src, num_dst)
    g = prepare(e, size=(num_src, num_dst), sorted=is_sorted)
    src, dst = e[0], e[1]
    want = dst.masked_fill((src == dst) | (dst >= L), L)
    assert g.fill_index.dtype == torch.int64
    assert torch.equal(g.fill_index, want)
    assert g.fill_index is g.fill_index  # kept
    assert prepare(e, size=(num_src, num_dst), add_self_loops=False,
                   sorted=is_sorted).fill_index is None

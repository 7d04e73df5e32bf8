"""The compiled graph builds (``csr_build``, ``csc_build``) equal the PyTorch
path of :func:`pyg_fastattn.prepare` bit for bit (values and dtypes), and
are used wherever they are available."""
import os

import pytest
import torch

import pyg_fastattn.nn.graph as graph_mod
from pyg_fastattn import _build, prepare
from pyg_fastattn.ops import csr_to_csc

from conftest import DEVICES, requires_cuda
from test_prepare import make_edges


def native_or_skip(device):
    if not _build.native_available(torch.device(device)):
        pytest.skip(f'no native kernels for {device}')


def assert_same(got, want):
    assert len(got) == len(want)
    for k, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype, (k, a.dtype, b.dtype)
        assert a.device == b.device, k
        assert torch.equal(a, b), (k, a, b)


def hub_edges(gen):
    """A destination with > 20000 edges (split-size rows), some loops."""
    E, n = 25000, 300
    src = torch.randint(0, n, (E, ), generator=gen)
    dst = torch.full((E, ), 7)
    dst[::5] = torch.randint(0, n, (E // 5, ), generator=gen)
    src[::97] = dst[::97]
    return src, dst, n, n


def cases():
    """(name, src, dst, num_src, num_dst) in random order."""
    gen = torch.Generator().manual_seed(17)
    out = []
    for name, (ns, nd, E, loops) in {
            'square': (40, 40, 300, True),
            'square_no_loops': (40, 40, 300, False),
            'more_src': (70, 30, 250, True),
            'more_dst': (30, 70, 250, True),
            'one_node': (1, 1, 5, True),
            'sparse_rows': (5000, 5000, 300, True),  # mostly empty rows
            'big': (20000, 20000, 200000, True)}.items():
        _, shuffled = make_edges(ns, nd, E, loops, gen)
        out.append((name, shuffled[0], shuffled[1], ns, nd))
    for name, ns, nd in (('empty', 6, 6), ('no_nodes', 0, 0),
                         ('no_src', 0, 5), ('no_dst', 5, 0)):
        none = torch.zeros(0, dtype=torch.long)
        out.append((name, none, none.clone(), ns, nd))
    src, dst, ns, nd = hub_edges(gen)
    out.append(('hub', src, dst, ns, nd))
    # Every edge a self-loop; every row holding exactly its loop.
    a = torch.arange(50)
    out.append(('all_loops', a, a.clone(), 50, 50))
    return out


CASES = cases()


def edge_rows(src, dst, dtype, device, layout):
    """(src, dst) as rows of a [2, E] tensor, as strided views of a [E, 2]
    one ('strided'), or as separate contiguous tensors."""
    ei = torch.stack([src, dst]).to(device, dtype)
    if layout == 'strided':
        ei = ei.t().contiguous().t()
        assert ei.size(1) < 2 or ei[0].stride(0) == 2
    elif layout == 'separate':
        return ei[0].clone(), ei[1].clone()
    return ei[0], ei[1]


@pytest.mark.parametrize('device', DEVICES)
def test_native_ops_are_used(device, monkeypatch):
    """Where the extension serves the device, both ops exist and the
    preparation ops call them."""
    device = torch.device(device)
    expected = os.environ.get('PYG_FASTATTN_BACKEND', 'auto') != 'reference' \
        and (device.type == 'cpu' or _build._want_cuda())
    if expected:  # a failed build must not turn this test into a skip
        assert _build.native_available(device), _build.load().error
    native_or_skip(device)
    assert hasattr(torch.ops.pyg_fastattn, 'csr_build')
    assert hasattr(torch.ops.pyg_fastattn, 'csc_build')
    assert graph_mod._use_native(device, 100, 10, 10)
    calls = []
    for name in ('_csr_build_native', '_csc_build_native'):
        fn = getattr(graph_mod, name)
        monkeypatch.setattr(graph_mod, name, lambda *a, _f=fn, _n=name: (
            calls.append(_n), _f(*a))[1])
    gen = torch.Generator().manual_seed(0)
    ei, shuffled = make_edges(20, 20, 200, True, gen, device)
    for e, is_sorted in ((ei, True), (shuffled, False)):
        prepare(e, num_nodes=20, sorted=is_sorted)
    assert calls == ['_csr_build_native', '_csc_build_native'] * 2


def test_large_graphs_take_the_torch_path():
    assert not graph_mod._use_native(torch.device('cpu'), 2**31 - 1, 5, 5)
    assert not graph_mod._use_native(torch.device('cpu'), 5, 5, 2**31 - 1)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('dtype', [torch.int32, torch.int64])
@pytest.mark.parametrize('add_self_loops', [True, False])
@pytest.mark.parametrize('order', ['unsorted', 'sorted', 'sorted_as_unsorted'])
@pytest.mark.parametrize('case', CASES, ids=[c[0] for c in CASES])
def test_same_as_torch_path(device, dtype, add_self_loops, order, case):
    native_or_skip(device)
    _, src, dst, ns, nd = case
    if order != 'unsorted':
        p = torch.argsort(dst, stable=True)
        src, dst = src[p], dst[p]
    is_sorted = order == 'sorted'
    for layout in ('rows', 'strided', 'separate'):
        s, d = edge_rows(src, dst, dtype, device, layout)
        want = graph_mod._build_csr_torch(s, d, ns, nd, add_self_loops,
                                          is_sorted, None)
        *got, status = torch.ops.pyg_fastattn.csr_build(
            s, d, ns, nd, add_self_loops, is_sorted)
        assert_same(got, want)
        assert int(status.item()) & (7 if is_sorted else 3) == 0
        assert_same(graph_mod._build_csr(s, d, ns, nd, add_self_loops,
                                         is_sorted, None), want)
        rowptr, col = want[:2]
        want_csc = csr_to_csc(rowptr, col, ns, validate=False)
        assert_same(torch.ops.pyg_fastattn.csc_build(rowptr, col, ns),
                    want_csc)
        assert_same(graph_mod._build_csc(rowptr, col, ns), want_csc)


def any_csr(device, dtype, size):
    """(rowptr, col, num_cols): a CSR with empty rows, a tail outside every
    row and num_cols beyond the largest column; 'tiles': many CUDA tiles
    (2048 positions), a long run of empty rows and a row across several
    tiles."""
    gen = torch.Generator().manual_seed(3)
    N, E, num_cols = (60, 500, 45) if size == 'small' else (6000, 70000, 900)
    deg = torch.randint(0, 12, (N, ), generator=gen)
    deg[::4] = 0
    if size == 'tiles':
        deg[1000:3000] = 0
        deg[4000] = 9000
    rowptr = torch.cat([torch.zeros(1, dtype=torch.long), deg.cumsum(0)])
    rowptr = (rowptr * (E - 40) // int(rowptr[-1])).to(device, dtype)
    col = torch.randint(0, num_cols - 5, (E, ), generator=gen)
    col = col.to(device, dtype)
    return rowptr, col, num_cols


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('dtype', [torch.int32, torch.int64])
@pytest.mark.parametrize('size', ['small', 'tiles'])
def test_csc_of_any_csr(device, dtype, size):
    """csc_build on the CSRs of any_csr, with num_cols and num_cols - 5."""
    native_or_skip(device)
    rowptr, col, num_cols = any_csr(device, dtype, size)
    for n_cols in (num_cols, num_cols - 5):
        assert_same(torch.ops.pyg_fastattn.csc_build(rowptr, col, n_cols),
                    csr_to_csc(rowptr, col, n_cols, validate=False))


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize('dtype', [torch.int32, torch.int64])
@pytest.mark.parametrize('size,pass_bytes', [('small', 4), ('small', 1200),
                                             ('tiles', 12000)])
def test_csc_inv_in_passes(dtype, size, pass_bytes, monkeypatch):
    """PYG_FASTATTN_INV_PASS_BYTES (read at every launch) splits the CUDA
    inv scatter into passes of pass_bytes // index size entries (at least
    1; the last range partial): the same CSC as the torch path."""
    native_or_skip('cuda')
    monkeypatch.setenv('PYG_FASTATTN_INV_PASS_BYTES', str(pass_bytes))
    rowptr, col, num_cols = any_csr('cuda', dtype, size)
    assert_same(torch.ops.pyg_fastattn.csc_build(rowptr, col, num_cols),
                csr_to_csc(rowptr, col, num_cols, validate=False))


@pytest.mark.parametrize('device', DEVICES)
def test_small_dtypes_and_sparse_input(device):
    """int16 indices and sparse adjacencies go through the native build
    (as int64) and give the torch path's graph."""
    native_or_skip(device)
    gen = torch.Generator().manual_seed(8)
    ei, shuffled = make_edges(30, 30, 200, True, gen, device)
    for e in (ei, shuffled):
        s, d = e.to(torch.int16).unbind(0)
        want = graph_mod._build_csr_torch(s, d, 30, 30, True, e is ei, None)
        assert_same(graph_mod._build_csr(s, d, 30, 30, True, e is ei, None),
                    want)
    adj = torch.sparse_coo_tensor(shuffled.flip(0),
                                  torch.ones(200, device=device),
                                  (30, 30)).coalesce()
    g = prepare(adj)
    src, dst = adj.indices()[1], adj.indices()[0]
    want = graph_mod._build_csr_torch(src, dst, 30, 30, True, False, None)
    assert_same((g.rowptr, g.col, g.csr_perm, g.removed), want)


@pytest.mark.parametrize('device', DEVICES)
def test_declared_sorted_but_not_stays_in_range(device):
    """Wrongly declared order: a wrong graph, every index in range."""
    native_or_skip(device)
    gen = torch.Generator().manual_seed(3)
    _, shuffled = make_edges(10, 10, 60, True, gen, device)
    rowptr, col, perm, _, _ = torch.ops.pyg_fastattn.csr_build(
        shuffled[0], shuffled[1], 10, 10, True, True)
    assert 0 <= int(perm.min()) and int(perm.max()) < 70
    assert 0 <= int(col.min()) and int(col.max()) < 10
    assert int(rowptr[-1]) <= 70 and bool((rowptr.diff() >= 0).all())


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('dtype', [torch.int32, torch.int64])
@pytest.mark.parametrize('add_self_loops', [True, False])
@pytest.mark.parametrize('is_sorted', [True, False])
def test_status_bits(device, dtype, add_self_loops, is_sorted):
    """csr_build's status: 1 = a source out of range, 2 = a destination out
    of range, 4 = a decrease in dst (reported for input declared sorted;
    the CPU build reports it always). Bad input builds without a crash."""
    native_or_skip(device)
    ns, nd = 6, 5
    good = torch.tensor([[0, 5, 1, 2, 3], [0, 1, 1, 3, 4]])
    cases = [(good, 0), (torch.tensor([[0, 6, 1], [0, 1, 2]]), 1),
             (torch.tensor([[0, -1, 1], [0, 1, 2]]), 1),
             (torch.tensor([[0, 1, 1], [0, 1, 5]]), 2),
             (torch.tensor([[0, 1, 1], [-1, 1, 2]]), 2),
             (torch.tensor([[0, 1, 2], [2, 1, 3]]), 4),
             (torch.tensor([[9, 1, 2], [2, 1, 7]]), 7)]
    for ei, bits in cases:
        ei = ei.to(device, dtype)
        out = torch.ops.pyg_fastattn.csr_build(ei[0], ei[1], ns, nd,
                                               add_self_loops, is_sorted)
        got = int(out[4].item())
        want = bits if (is_sorted or device == 'cpu') else bits & 3
        assert got == want, (ei.tolist(), got, want)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize('is_sorted', [True, False])
def test_async_validation_from_status(is_sorted):
    """validate='async' on CUDA checks the build's status on the device:
    good input passes without a host sync, bad input fails at the next
    synchronization (a device-side assert; run in a subprocess, which it
    kills)."""
    import subprocess
    import sys
    ei = torch.tensor([[0, 1, 2], [0, 1, 2]], device='cuda')
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode('error')
    try:
        prepare(ei, num_nodes=3, sorted=is_sorted, validate='async')
    finally:
        torch.cuda.set_sync_debug_mode('default')
    torch.cuda.synchronize()
    code = ('import torch; from pyg_fastattn import prepare; '
            "ei = torch.tensor([[0, 1, 7], [0, 1, 2]], device='cuda'); "
            f'prepare(ei, num_nodes=3, sorted={is_sorted}, '
            "validate='async'); torch.cuda.synchronize()")
    r = subprocess.run([sys.executable, '-c', code], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0
    assert 'out of range' in r.stderr or 'assert' in r.stderr.lower(), \
        r.stderr[-2000:]

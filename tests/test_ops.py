"""Every op and its gradients against a float64 reference, per backend."""
import pytest
import torch
from torch_geometric.utils import softmax as pyg_softmax

from pyg_fastattn import _build, ops, reference as R
from pyg_fastattn.ops.csr import rows_of

from conftest import DEVICES, requires_cuda
from graphs import csr_from_degrees, hub_graph, make_graph, noncontig

GRAPHS = ['mixed', 'huge', 'empty', 'single', 'deg1']
HC = [(1, 1), (4, 7), (8, 33), (1, 64), (8, 64)]
IDX = [torch.int32, torch.int64]
NO_CSC = (None, ) * 4  # the attention op's transpose arguments (backward only)
NO_BIAS_CSC = (None, ) + NO_CSC
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


def _leaf(t, dtype, contiguous=True):
    t = t.to(dtype)
    if not contiguous:
        t = noncontig(t)
    return t.detach().requires_grad_(True)


def _close(a, b, dtype, what, norm=None):
    assert a.shape == b.shape, f'{what}: shape {a.shape} != {b.shape}'
    tol = TOL.get(dtype, 2e-2)
    # Long rows sum thousands of terms: scale the absolute tolerance (by the
    # largest L2 norm of a sum's terms, when given: a sum that cancels has
    # the rounding error of its terms, not of its result).
    scale = max(1.0, b.detach().abs().max().item()) if b.numel() else 1.0
    if norm is not None and norm.numel():
        scale = max(scale, norm.max().item())
    torch.testing.assert_close(a.double(), b.double(), atol=tol * scale, rtol=tol,
                               msg=lambda m: f'{what}: {m}')


def _check(fn, ref, inputs, dtype):
    """Compare fn(*inputs) against ref(float64 inputs): output and grads."""
    out = fn(*inputs)
    ref_inputs = [x.detach().double().requires_grad_(x.requires_grad)
                  if torch.is_tensor(x) and x.is_floating_point() else x
                  for x in inputs]
    exp = ref(*ref_inputs)
    _close(out, exp, dtype, 'output')
    grad = torch.randn_like(exp)
    diff = [(x, r) for x, r in zip(inputs, ref_inputs)
            if torch.is_tensor(x) and x.requires_grad]
    if not diff or out.numel() == 0:
        return
    got = torch.autograd.grad(out, [x for x, _ in diff], grad.to(out.dtype),
                              allow_unused=True)
    want = torch.autograd.grad(exp, [r for _, r in diff], grad,
                               allow_unused=True)
    for i, (g, w) in enumerate(zip(got, want)):
        g = torch.zeros_like(diff[i][0]) if g is None else g
        w = torch.zeros_like(diff[i][1]) if w is None else w
        _close(g, w, dtype, f'grad of input {i}')


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('graph', GRAPHS)
@pytest.mark.parametrize('heads', [1, 4, 8])
@pytest.mark.parametrize('idx', IDX)
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_edge_softmax(backend, device, graph, heads, idx, dtype):
    rowptr, col, _ = make_graph(graph, idx, device)
    E = col.numel()
    s = _leaf(torch.randn(E, heads, device=device) * 3, dtype,
              contiguous=heads == 4)
    _check(lambda s: ops.edge_softmax(s, rowptr),
           lambda s: R.edge_softmax(rowptr, s), [s], dtype)
    # Same result as PyG's softmax with ptr (what GATConv uses).
    ref = pyg_softmax(s.detach().double(), ptr=rowptr.long())
    _close(ops.edge_softmax(s.detach(), rowptr), ref, dtype, 'vs PyG')
    # 1-D scores.
    s1 = s.detach()[:, 0].contiguous()
    _close(ops.edge_softmax(s1, rowptr), R.edge_softmax(rowptr, s1[:, None])[:, 0],
           dtype, '1-D')


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16, torch.float32,
                                   torch.float64])
@pytest.mark.parametrize('heads', [1, 2, 3, 16, 64])
@pytest.mark.parametrize('offset', [0, 1])
def test_edge_softmax_heads_dtypes(device, dtype, heads, offset):
    """Native kernels: rows of every start alignment (degrees 0..40, one of
    300), heads 1..64, 16- and 64-bit floats, scores starting one element
    past a 16-byte boundary (offset = 1). On CUDA these take the one-pass
    vector path in groups of every size (rows that do not fit their group
    wait for a larger one) and the multi-pass path (odd heads, offset input,
    long rows)."""
    if not _build.load().native:
        pytest.skip(f'native kernels unavailable: {_build.load().error}')
    g = torch.Generator().manual_seed(heads)
    deg = torch.randint(0, 41, (200, ), generator=g)
    deg[::17] = 0
    deg[5], deg[6] = 300, 1
    rowptr, _ = csr_from_degrees(deg, 1, device=device)
    E = int(deg.sum())
    base = (torch.randn(E * heads + offset, generator=g) * 3).to(device, dtype)
    s = base[offset:].view(E, heads).detach().requires_grad_()
    _check(lambda s: ops.edge_softmax(s, rowptr),
           lambda s: R.edge_softmax(rowptr, s), [s], dtype)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('graph', GRAPHS)
@pytest.mark.parametrize('heads,C', HC)
@pytest.mark.parametrize('idx', IDX)
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_softmax_aggregate(backend, device, graph, heads, C, idx, dtype):
    rowptr, col, Ns = make_graph(graph, idx, device)
    E = col.numel()
    s = _leaf(torch.randn(E, heads, device=device), dtype)
    v = _leaf(torch.randn(Ns, heads, C, device=device), dtype,
              contiguous=C != 7)
    _check(lambda s, v: ops.softmax_aggregate(rowptr, col, s, v),
           lambda s, v: R.attention(rowptr, col, None, None, s, None, v, 1.0)[0],
           [s, v], dtype)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('graph', ['mixed', 'huge', 'empty'])
@pytest.mark.parametrize('heads,C', HC)
@pytest.mark.parametrize('idx', IDX)
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_spmm(backend, device, graph, heads, C, idx, dtype):
    rowptr, col, Ns = make_graph(graph, idx, device)
    E = col.numel()
    w = _leaf(torch.randn(E, heads, device=device), dtype, contiguous=heads > 1)
    v = _leaf(torch.randn(Ns, heads, C, device=device), dtype)
    _check(lambda w, v: ops.spmm(rowptr, col, w, v),
           lambda w, v: R.spmm(rowptr, col, w, None, v), [w, v], dtype)
    # No weights: a plain neighbour sum; [Ns, C] values with [E] weights.
    _check(lambda v: ops.spmm(rowptr, col, None, v),
           lambda v: R.spmm(rowptr, col, None, None, v), [v], dtype)
    w1 = _leaf(torch.randn(E, device=device), dtype)
    v1 = _leaf(torch.randn(Ns, C, device=device), dtype)
    _check(lambda w, v: ops.spmm(rowptr, col, w, v),
           lambda w, v: R.spmm(rowptr, col, w[:, None], None, v[:, None])[:, 0],
           [w1, v1], dtype)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('heads,C', HC)
@pytest.mark.parametrize('idx', IDX)
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
@pytest.mark.parametrize('E', [0, 1, 300])
def test_sddmm(backend, device, heads, C, idx, dtype, E):
    Na, Nb = 13, 7
    a = _leaf(torch.randn(Na, heads, C, device=device), dtype)
    b = _leaf(torch.randn(Nb, heads, C, device=device), dtype,
              contiguous=C != 33)
    ai = torch.randint(0, Na, (E, ), device=device, dtype=idx)
    bi = torch.randint(0, Nb, (E, ), device=device, dtype=idx)
    _check(lambda a, b: ops.sddmm(a, b, ai, bi),
           lambda a, b: (a[ai] * b[bi]).sum(-1), [a, b], dtype)
    a2 = _leaf(torch.randn(Na, C, device=device), dtype)
    b2 = _leaf(torch.randn(Nb, C, device=device), dtype)
    _check(lambda a, b: ops.sddmm(a, b, ai, bi),
           lambda a, b: (a[ai] * b[bi]).sum(-1), [a2, b2], dtype)
    # op='add': GAT's per-node terms.
    a3 = _leaf(torch.randn(Na, heads, device=device), dtype)
    b3 = _leaf(torch.randn(Nb, heads, device=device), dtype)
    _check(lambda a, b: ops.sddmm(a, b, ai, bi, op='add'),
           lambda a, b: a[ai] + b[bi], [a3, b3], dtype)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('graph', ['mixed', 'huge', 'single'])
@pytest.mark.parametrize('terms', ['src', 'dst', 'edge', 'src,dst',
                                   'src,dst,edge', 'src,dst,edge,mask'])
@pytest.mark.parametrize('idx', IDX)
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
@pytest.mark.parametrize('H,C', [(4, 6), (4, 8), (8, 64)])
def test_attention(backend, device, graph, terms, idx, dtype, H, C):
    """The fused GAT path: scores from node/edge terms, leaky relu, dropout.
    C = 8 takes the 16-byte-vector kernels in both dtypes (on CUDA, without
    a_edge and mask: the lean backward variant); C = 6 the scalar ones for
    float32; 8 x 64 more heads than a warp holds side by side (on CUDA,
    several head tiles of one head a lane)."""
    rowptr, col, Ns = make_graph(graph, idx, device)
    N, E = rowptr.numel() - 1, col.numel()
    terms = terms.split(',')
    mk = lambda *shape: _leaf(torch.randn(*shape, device=device), dtype)
    a_src = mk(Ns, H) if 'src' in terms else None
    a_dst = mk(N, H) if 'dst' in terms else None
    a_edge = mk(E, H) if 'edge' in terms else None
    mask = ((torch.rand(E, H, device=device) > 0.3).to(dtype) / 0.7
            if 'mask' in terms else None)
    v = mk(Ns, H, C)

    def fn(a_src, a_dst, a_edge, v):
        return ops.attention(rowptr, col, v, a_src, a_dst, a_edge, mask, 0.2)

    def ref(a_src, a_dst, a_edge, v):
        m = mask.double() if mask is not None else None
        return R.attention(rowptr, col, a_src, a_dst, a_edge, m, v, 0.2)[0]

    _check(fn, ref, [a_src, a_dst, a_edge, v], dtype)


@pytest.mark.parametrize('device', DEVICES)
def test_reference_backward_matches_autograd(device):
    """The fallback's hand-written backward equals autograd through its
    forward (so the reference is a sound oracle for the kernels)."""
    rowptr, col, Ns = make_graph('mixed', torch.int64, device)
    N, E, H, C = rowptr.numel() - 1, col.numel(), 3, 5
    d = dict(dtype=torch.float64, device=device)
    a_src = torch.randn(Ns, H, **d, requires_grad=True)
    a_dst = torch.randn(N, H, **d, requires_grad=True)
    a_edge = torch.randn(E, H, **d, requires_grad=True)
    v = torch.randn(Ns, H, C, **d, requires_grad=True)
    mask = (torch.rand(E, H, **d) > 0.5).double() * 2
    out, lse = R.attention(rowptr, col, a_src, a_dst, a_edge, mask, v, 0.2)
    go = torch.randn_like(out)
    ga_edge, gv, ga_src, ga_dst = torch.autograd.grad(
        out, [a_edge, v, a_src, a_dst], go)
    csc = ops.csr_to_csc(rowptr, col, Ns)
    gv_r, gz, gs = R.attention_backward(rowptr, col, *csc[:3], a_src, a_dst,
                                        a_edge, mask, v, 0.2, out, lse, go)
    torch.testing.assert_close(gz[csc.inv], ga_edge)  # gz in CSC order
    torch.testing.assert_close(gv_r, gv)
    torch.testing.assert_close(gs, ga_src)
    torch.testing.assert_close(R.segment_sum(rowptr, csc.inv, gz), ga_dst)
    gz_csr = R.attention_backward(rowptr, col, *csc[:3], a_src, a_dst, a_edge,
                                  mask, v, 0.2, out, lse, go, True)[1]
    torch.testing.assert_close(gz_csr, ga_edge)
    s = torch.randn(E, H, **d, requires_grad=True)
    y = R.edge_softmax(rowptr, s)
    gy = torch.randn_like(y)
    torch.testing.assert_close(R.edge_softmax_backward(rowptr, y, gy),
                               torch.autograd.grad(y, s, gy)[0])


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('grad_z_csr', [False, True])
@pytest.mark.parametrize('heads', [1, 4])
def test_attention_backward_kernel_orders(device, grad_z_csr, heads):
    """The compiled attention_backward against the reference in both grad_z
    orders, on a graph with a tail of unused edges past rowptr[N] (as in a
    prepared graph); grad_z is 0 on the tail."""
    if not _build.load().native:
        pytest.skip(f'native kernels unavailable: {_build.load().error}')
    K = torch.ops.pyg_fastattn
    rowptr, col, Ns = make_graph('mixed', torch.int32, device)
    E0 = col.numel()
    tail = torch.randint(Ns, (7, ), device=device, dtype=col.dtype)
    col = torch.cat([col, tail])
    N, E, H, C = rowptr.numel() - 1, col.numel(), heads, 6
    d = dict(dtype=torch.float64, device=device)
    a_src, a_dst = torch.randn(Ns, H, **d), torch.randn(N, H, **d)
    a_edge, v = torch.randn(E, H, **d), torch.randn(Ns, H, C, **d)
    mask = (torch.rand(E, H, **d) > 0.3).double() * 1.5
    out, lse = R.attention(rowptr, col, a_src, a_dst, a_edge, mask, v, 0.2)
    go = torch.randn_like(out)
    csc = ops.csr_to_csc(rowptr, col, Ns, validate=False)
    args = (rowptr, col, *csc[:3], a_src, a_dst, a_edge, mask, v, 0.2, out,
            lse, go, grad_z_csr)
    got, want = K.attention_backward(*args), R.attention_backward(*args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    end = E0 if grad_z_csr else int(csc.colptr[-1])
    assert end < E and (got[1][end:] == 0).all()


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
@pytest.mark.parametrize('heads,C', [(1, 8), (4, 8), (4, 6), (2, 40)])
@pytest.mark.parametrize('with_mask', [False, True])
def test_attention_bias_kernels(device, dtype, heads, C, with_mask):
    """The compiled attention with ``bias`` (added in the forward's store,
    empty rows too) against the reference, and its backward: the delta term
    must use out - bias, so it equals the backward of the bias-free output.
    float32 with C = 8 and no mask takes the vector kernels and, on CUDA,
    the lean backward; C = 40 more than one unit per lane."""
    if not _build.load().native:
        pytest.skip(f'native kernels unavailable: {_build.load().error}')
    K = torch.ops.pyg_fastattn
    rowptr, col, Ns = make_graph('mixed', torch.int64, device)
    N, E, H = rowptr.numel() - 1, col.numel(), heads
    assert bool((rowptr[1:] == rowptr[:-1]).any())  # has empty rows
    d = dict(dtype=dtype, device=device)
    a_src, a_dst = torch.randn(Ns, H, **d), torch.randn(N, H, **d)
    v, bias = torch.randn(Ns, H, C, **d), torch.randn(H * C, **d)
    mask = (torch.rand(E, H, **d) > 0.3).to(dtype) * 1.5 if with_mask else None
    csc = ops.csr_to_csc(rowptr, col, Ns, validate=False)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else {}
    out0, lse0 = K.attention(rowptr, col, a_src, a_dst, None, mask, v, 0.2, *NO_BIAS_CSC)
    out, lse = K.attention(rowptr, col, a_src, a_dst, None, mask, v, 0.2, bias, *NO_CSC)
    ref, ref_lse = R.attention(rowptr, col, a_src, a_dst, None, mask, v, 0.2,
                               bias)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(lse, ref_lse, **tol)
    torch.testing.assert_close(out, out0 + bias.view(H, C), **tol)
    empty = rowptr[1:] == rowptr[:-1]
    torch.testing.assert_close(out[empty], bias.view(H, C).expand_as(out[empty]))
    go = torch.randn_like(out)
    args = (rowptr, col, *csc[:3], a_src, a_dst, None, mask, v, 0.2)
    got = K.attention_backward(*args, out, lse, go, False, bias)
    want = R.attention_backward(*args, out, lse, go, False, bias)
    plain = K.attention_backward(*args, out0, lse0, go, False)
    for g, w, p in zip(got, want, plain):
        torch.testing.assert_close(g, w, **tol)
        torch.testing.assert_close(g, p, **tol)


@pytest.mark.parametrize('device', DEVICES)
def test_attention_bias_bad_size(device):
    """A bias of the wrong size is a clear error from the op's checks, with
    numbers in the message (PFA_CHECK formats them without iostreams: on the
    lent H200 image a streamed number crashed the process instead)."""
    if not _build.load().native:
        pytest.skip(f'native kernels unavailable: {_build.load().error}')
    K = torch.ops.pyg_fastattn
    rowptr, col, Ns = make_graph('mixed', torch.int64, device)
    N, H, C = rowptr.numel() - 1, 2, 8
    a_src, a_dst = torch.randn(Ns, H, device=device), torch.randn(N, H, device=device)
    v, bias = torch.randn(Ns, H, C, device=device), torch.randn(H * C - 1, device=device)
    with pytest.raises(RuntimeError, match='`bias` must have H \\* C = 16 '
                       'elements, got 15'):
        K.attention(rowptr, col, a_src, a_dst, None, None, v, 0.2, bias,
                    *NO_CSC)
    with pytest.raises(RuntimeError, match=r'`values` must be 3-D, got shape '
                       r'\[2, 8\]'):  # numbers and sizes in messages
        K.attention(rowptr, col, a_src, a_dst, None, None, v[:2, 0], 0.2,
                    *NO_BIAS_CSC)


@pytest.mark.parametrize('device', DEVICES)
def test_gradcheck(backend, device):
    """torch.autograd.gradcheck in float64 on a small graph, every op."""
    rowptr, col, Ns = make_graph('mixed', torch.int64, device)
    N, E, H, C = rowptr.numel() - 1, col.numel(), 2, 3
    d = dict(dtype=torch.float64, device=device, requires_grad=True)
    s = torch.randn(E, H, **d)
    v = torch.randn(Ns, H, C, **d)
    w = torch.randn(E, H, **d)
    a_src, a_dst = torch.randn(Ns, H, **d), torch.randn(N, H, **d)
    mask = (torch.rand(E, H, device=device) > 0.4).double() / 0.6
    # The reference's index_add is atomic on CUDA: allow its reordering.
    nondet = 1e-12 if backend == 'reference' and device == 'cuda' else 0.0
    gc = lambda f, *x: torch.autograd.gradcheck(f, x, atol=1e-7,
                                                nondet_tol=nondet)
    assert gc(lambda s: ops.edge_softmax(s, rowptr), s)
    assert gc(lambda s, v: ops.softmax_aggregate(rowptr, col, s, v), s, v)
    assert gc(lambda w, v: ops.spmm(rowptr, col, w, v), w, v)
    perm = torch.randperm(E, device=device)
    assert gc(lambda w: ops.segment_sum(rowptr, w, perm), w)
    assert gc(lambda w: ops.segment_sum(rowptr, w), w)
    ai = torch.randint(0, Ns, (E, ), device=device)
    assert gc(lambda a, b: ops.sddmm(a, b, ai, col), v, v.detach().clone()
              .requires_grad_())
    # z near 0 makes leaky_relu's kink meet finite differences; shift it away.
    a_edge = (torch.randn(E, H, dtype=torch.float64, device=device) + 0.05).sign() \
        .mul(3).requires_grad_()
    assert gc(lambda a, b, e, v: ops.attention(rowptr, col, v, a, b, e, mask, 0.2),
              a_src, a_dst, a_edge, v)


def _functional_cases(rowptr, col, Ns, device):
    """(name, fn, inputs) for every differentiable functional op, float64,
    H = 2, C = 3."""
    N, E, H, C = rowptr.numel() - 1, col.numel(), 2, 3
    r = lambda *shape: torch.randn(*shape, dtype=torch.float64,  # noqa: E731
                                   device=device, requires_grad=True)
    mask = (torch.rand(E, H, device=device) > 0.4).double() / 0.6
    csc, csc_n = ops.csr_to_csc(rowptr, col, Ns), ops.csr_to_csc(rowptr, col, N)
    row = rows_of(rowptr, E)
    return [
        ('edge_softmax', lambda s: ops.edge_softmax(s, rowptr), [r(E, H)]),
        ('softmax_aggregate', lambda s, v: ops.softmax_aggregate(
            rowptr, col, s, v, csc), [r(E, H), r(Ns, H, C)]),
        ('spmm', lambda w, v: ops.spmm(rowptr, col, w, v),
         [r(E, H), r(Ns, H, C)]),
        ('sddmm', lambda a, b: ops.sddmm(a, b, row, col),
         [r(N, H, C), r(Ns, H, C)]),
        ('sddmm_csr', lambda a, b: ops.sddmm_csr(rowptr, col, a, b),
         [r(N, H, C), r(Ns, H, C)]),
        ('attention', lambda v, a, b, e: ops.attention(
            rowptr, col, v, a, b, e, mask, 0.2),
         [r(Ns, H, C), r(Ns, H), r(N, H), r(E, H)]),
        ('gat_attention', lambda h, a, hd, b, e, bias: ops.gat_attention(
            rowptr, col, csc, h, a, hd, b, e, mask, bias=bias),
         [r(Ns, H, C), r(1, H, C), r(N, H, C), r(1, H, C), r(E, H),
          r(H * C)]),
        ('gat_attention x, weight', lambda x, w, a, b: ops.gat_attention(
            rowptr, col, csc_n, None, a, None, b, dst_is_src=True, x=x,
            weight=w), [r(N, 5), r(H * C, 5), r(1, H, C), r(1, H, C)]),
        ('gatv2_attention', lambda xl, xr, att, e, bias: ops.gatv2_attention(
            rowptr, col, xl, xr, att, e, mask, bias=bias),
         [r(Ns, H, C), r(N, H, C), r(H, C), r(E, H, C), r(H * C)]),
        ('transformer_attention', lambda q, k, v, e: ops.transformer_attention(
            rowptr, col, q, k, v, e, mask, 0.5, grads_in_place=True),
         [r(N, H, C), r(Ns, H, C), r(Ns, H, C), r(E, H, C)]),
        ('transformer_attention no edge', lambda q, k, v: ops.
         transformer_attention(rowptr, col, q, k, v, grads_in_place=True),
         [r(N, H, C), r(Ns, H, C), r(Ns, H, C)]),
        ('linear', ops.linear, [r(N, 5), r(4, 5), r(4)]),
        ('column_sum', ops.column_sum, [r(N, 5)]),
        ('segment_sum', lambda s: ops.segment_sum(rowptr, s, csc.inv),
         [r(E, H)]),
    ]


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('graph', ['mixed', 'empty'])
def test_grads_batched(backend, device, graph):
    """autograd.grad(is_grads_batched=True) through every functional op (the
    legacy vmap over its backward): a loop of autograd.grad. The batched
    call frees the graph, as where grads_in_place may write over buffers."""
    rowptr, col, Ns = make_graph(graph, torch.int64, device)
    for name, fn, inputs in _functional_cases(rowptr, col, Ns, device):
        out = fn(*inputs)
        V = torch.randn((3, ) + out.shape, dtype=out.dtype, device=device)
        grad = lambda v, **kw: torch.autograd.grad(  # noqa: E731
            out, inputs, v, allow_unused=True, **kw)
        loop = [None if g[0] is None else torch.stack(g)  # (None: E = 0)
                for g in zip(*(grad(v, retain_graph=True) for v in V))]
        got = grad(V, is_grads_batched=True)
        torch.testing.assert_close(list(got), loop,
                                   msg=lambda m: f'{name}: {m}')


def test_grads_batched_on_another_thread(backend):
    """The legacy vmap's batching rule on a thread other than the vmap's, as
    autograd runs a CUDA backward on its device thread (the vmap nesting
    there is 0): the tensors' own level; two levels raise."""
    import threading
    from torch._vmap_internals import _vmap
    rowptr = torch.tensor([0, 2, 5, 5, 6])
    out = ops.edge_softmax(torch.randn(6, 2, dtype=torch.float64), rowptr)
    backward = torch.ops.pyg_fastattn.edge_softmax_backward

    def on_thread(g):
        res = []
        t = threading.Thread(target=lambda: res.append(
            _catch(lambda: backward(rowptr, out, g))))
        t.start()
        t.join()
        if isinstance(res[0], Exception):
            raise res[0]
        return res[0]

    G = torch.randn(3, 6, 2, dtype=torch.float64)
    want = torch.stack([backward(rowptr, out, g) for g in G])
    assert torch.equal(_vmap(on_thread)(G), want)
    with pytest.raises(RuntimeError, match='nested vmap'):
        _vmap(_vmap(on_thread))(G.unsqueeze(0))


def _catch(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 (re-raised on the test's thread)
        return e


@pytest.mark.parametrize('device', DEVICES)
def test_neg_inf_rows_and_nan(backend, device):
    """-inf scores mask edges; a row of only -inf gives 0, not NaN; NaN
    propagates through its own row and nowhere else."""
    rowptr = torch.tensor([0, 2, 4, 5], device=device)
    col = torch.tensor([0, 1, 1, 2, 0], device=device)
    s = torch.tensor([[0.5], [float('-inf')], [float('-inf')], [float('-inf')],
                      [float('nan')]], device=device)
    v = torch.randn(3, 1, 4, device=device)
    out = ops.edge_softmax(s, rowptr)
    assert out[:2].tolist() == [[1.0], [0.0]]
    assert out[2:4].eq(0).all() and out[4].isnan().all()
    agg = ops.softmax_aggregate(rowptr, col, s, v)
    torch.testing.assert_close(agg[0], v[0])
    assert agg[1].eq(0).all() and agg[2].isnan().all()



@pytest.mark.parametrize('device', DEVICES)
def test_nan_row_reaches_the_gradients(backend, device):
    """A row whose weights are NaN gives NaN gradients to its scores and to
    its sources' values, as autograd through PyG's softmax does (a NaN loss
    with finite gradients would hide it from checks such as GradScaler's);
    the other rows' gradients are exact. An entry of -inf beside finite ones
    is masked out in both."""
    rowptr = torch.tensor([0, 2, 4, 6], device=device)
    col = torch.tensor([0, 1, 1, 2, 0, 1], device=device)
    row = rows_of(rowptr, 6)
    for bad in (float('nan'), float('inf')):
        s0 = torch.tensor([[0.5, 1.0], [float('-inf'), 0.2], [0.3, -1.0],
                           [1.5, 0.1], [bad, 0.4], [0.7, 2.0]],
                          dtype=torch.float64, device=device)
        v0 = torch.randn(3, 2, 3, dtype=torch.float64, device=device)
        g = torch.randn(3, 2, 3, dtype=torch.float64, device=device)
        got, want = [], []
        for res, fn in ((got, lambda s, v: ops.softmax_aggregate(
                            rowptr, col, s, v)),
                        (want, lambda s, v: torch.zeros_like(v).index_add(
                            0, row, pyg_softmax(s, row, num_nodes=3)
                            .unsqueeze(-1) * v[col]))):
            s, v = s0.clone().requires_grad_(), v0.clone().requires_grad_()
            out = fn(s, v)
            res += [out, *torch.autograd.grad(out, (s, v), g)]
        assert got[1][4:, 0].isnan().all() and got[1][:4].isfinite().all()
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, equal_nan=True)

def test_csr_to_csc_roundtrip():
    rowptr, col, Ns = make_graph('mixed')
    csc = ops.csr_to_csc(rowptr, col, Ns)
    row = rows_of(rowptr, col.numel())
    # Every CSR edge appears once, in its column, with its row, stably.
    assert sorted(csc.perm.tolist()) == list(range(col.numel()))
    assert torch.equal(col[csc.perm], torch.repeat_interleave(
        torch.arange(Ns), csc.colptr.diff()))
    assert torch.equal(csc.row, row[csc.perm])
    assert torch.equal(csc.perm[csc.inv], torch.arange(col.numel()))
    for j in range(Ns):
        seg = csc.perm[csc.colptr[j]:csc.colptr[j + 1]]
        assert torch.equal(seg, seg.sort().values)



# segment_sum: widths 1..8 take the narrow CUDA kernel in float32 (3: scalar
# loads; 4, 8: 16-byte vectors), 16 the warp-per-row one; in float64 1, 3, 4
# are narrow. Graphs with empty rows, one 5000-edge row (block-shared on
# CUDA), E = 0, N = 1.
SEG_H = [1, 3, 4, 8, 16]


def _seg_ref(rowptr, perm, src):
    """reference.segment_sum where perm entries outside [0, src rows)
    contribute nothing (what the CPU and CUDA kernels do): they are pointed
    at an extra zero row."""
    if perm is None:
        return R.segment_sum(rowptr, None, src)
    Es = src.size(0)
    ok = (perm >= 0) & (perm < Es)
    pad = torch.cat([src, src.new_zeros((1, src.size(1)))])
    return R.segment_sum(rowptr, torch.where(ok, perm, torch.full_like(perm, Es)),
                         pad)[:, :src.size(1)]


def _misaligned(t):
    """A contiguous copy of 2-D ``t`` whose data starts one element past a
    16-byte boundary (the CUDA kernels then take their scalar-load path)."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = flat[1:].view(t.shape)
    out.copy_(t)
    return out


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('graph', GRAPHS)
@pytest.mark.parametrize('heads', SEG_H)
@pytest.mark.parametrize('use_perm', [False, True])
@pytest.mark.parametrize('idx', IDX)
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_segment_sum(backend, device, graph, heads, use_perm, idx, dtype):
    rowptr, col, _ = make_graph(graph, idx, device)
    E = col.numel()
    perm = torch.randperm(E, device=device).to(idx) if use_perm else None
    src = _leaf(torch.randn(E, heads, device=device), dtype,
                contiguous=heads != 3)
    _check(lambda s: ops.segment_sum(rowptr, s, perm),
           lambda s: R.segment_sum(rowptr, perm, s), [src], dtype)
    x = src.detach()
    out = ops.segment_sum(rowptr, x, perm)
    # Rows not 16-byte aligned (scalar loads on CUDA).
    _close(ops.segment_sum(rowptr, _misaligned(x), perm), out, dtype,
           'misaligned src')
    if device == 'cuda' and backend == 'native':  # no atomics: same bits
        assert torch.equal(ops.segment_sum(rowptr, x, perm), out)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('graph', ['mixed', 'huge'])
@pytest.mark.parametrize('heads', [1, 4, 8])
@pytest.mark.parametrize('idx', IDX)
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_segment_sum_tail_and_invalid(backend, device, graph, heads, idx,
                                      dtype):
    """Entries past rowptr[N] (an unused tail) are ignored, with and without
    perm; on the compiled kernels, perm entries outside [0, src rows)
    contribute nothing, and CPU and CUDA agree."""
    rowptr, col, _ = make_graph(graph, idx, device)
    Es = col.numel() + 7  # src and perm longer than rowptr[N]
    src = torch.randn(Es, heads, device=device, dtype=dtype)
    perm = torch.randperm(Es, device=device).to(idx)
    for p in (None, perm):
        norm = R.segment_sum(rowptr, p, src.double().square()).sqrt()
        _close(ops.segment_sum(rowptr, src, p),
               R.segment_sum(rowptr, p, src.double()), dtype, 'tail', norm)
    if backend != 'native':  # the reference assumes valid indices
        return
    bad = perm.clone()
    k = torch.randperm(Es, device=device)[:Es // 3]
    bad[k[0::3]] = -1
    bad[k[1::3]] = Es
    bad[k[2::3]] = Es + 1000
    K = torch.ops.pyg_fastattn
    got = K.segment_sum(rowptr, bad, src)
    _close(got, _seg_ref(rowptr, bad, src.double()), dtype, 'invalid perm')
    if device == 'cuda':
        cpu = torch.ops.pyg_fastattn.segment_sum(
            rowptr.cpu(), bad.cpu(), src.cpu())
        _close(got.cpu(), cpu, dtype, 'CUDA vs CPU')
        assert torch.equal(K.segment_sum(rowptr, bad, src), got)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('avg_deg', [3, 21])
@pytest.mark.parametrize('heads', SEG_H)
@pytest.mark.parametrize('idx', IDX)
@pytest.mark.parametrize('dtype', [torch.float32, torch.float16,
                                   torch.bfloat16])
def test_segment_sum_large(device, avg_deg, heads, idx, dtype):
    """The compiled segment_sum on 40k rows (grids of many blocks on CUDA):
    empty rows, rows of 300 and 30000 edges among short ones (block-shared
    on CUDA), a random perm; deterministic on CUDA."""
    if not _build.load().native:
        pytest.skip(f'native kernels unavailable: {_build.load().error}')
    N = 40000
    deg = torch.randint(0, 2 * avg_deg + 1, (N, ))
    deg[::97] = 0
    deg[::1000] = 300
    deg[5] = deg[N - 3] = 30000
    rowptr, col = csr_from_degrees(deg, 0, idx, device)
    E = int(deg.sum())
    perm = torch.randperm(E, device=device).to(idx)
    src = torch.randn(E, heads, device=device).to(dtype)
    K = torch.ops.pyg_fastattn
    for p in (perm, None):
        got = K.segment_sum(rowptr, p, src) if dtype == torch.float32 or \
            device == 'cuda' else ops.segment_sum(rowptr, src, p)
        _close(got, R.segment_sum(rowptr, p, src.double()), dtype, 'output')
        if device == 'cuda':
            assert torch.equal(K.segment_sum(rowptr, p, src), got)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('heads,C', [(8, 32), (4, 64), (8, 64), (64, 4),
                                     (48, 2), (6, 20)])
@pytest.mark.parametrize('split', [None, '16'])
def test_many_heads(monkeypatch, dtype, heads, C, split):
    """CUDA, more heads than a warp holds side by side (one head a lane, the
    other heads in further tiles of the grid): attention with every term,
    attention with node terms only (the lean backward), softmax_aggregate,
    spmm and sddmm, on a graph with a hub row and a hub column (split=16:
    on the split path), against the same ops in float64 on the CPU."""
    if not _build.load().native:
        pytest.skip(f'native kernels unavailable: {_build.load().error}')
    rowptr, col, Ns, g = hub_graph(monkeypatch, split, torch.int64)
    N, E = rowptr.numel() - 1, col.numel()

    def rand(*shape):
        return torch.randn(*shape, device='cuda', generator=g).to(dtype)

    xs = [rand(Ns, heads, C), rand(Ns, heads), rand(N, heads),
          rand(E, heads), rand(E, heads), rand(N, heads, C)]
    mask = ((torch.rand(E, heads, device='cuda', generator=g) > 0.3)
            / 0.7).to(dtype)
    go = rand(N, heads, C)

    def run(device, dt):
        rp, c = rowptr.to(device), col.to(device)
        v, a_src, a_dst, a_edge, s, q = [
            x.to(device, dt).requires_grad_(True) for x in xs]
        m, g_out = mask.to(device, dt), go.to(device, dt)
        csc = ops.csr_to_csc(rp, c, Ns, validate=False)
        res = []
        out = ops.attention(rp, c, v, a_src, a_dst, a_edge, m, 0.2, csc=csc)
        res += [out, *torch.autograd.grad(out, [v, a_src, a_dst, a_edge],
                                          g_out)]
        out = ops.attention(rp, c, v, a_src=a_src, a_dst=a_dst, csc=csc)
        res += [out, *torch.autograd.grad(out, [v, a_src, a_dst], g_out)]
        out = ops.softmax_aggregate(rp, c, s, v, csc=csc, validate=False)
        res += [out, *torch.autograd.grad(out, [s, v], g_out)]
        out = ops.spmm(rp, c, s, v)
        res += [out, *torch.autograd.grad(out, [s, v], g_out)]
        z = ops.sddmm(q, v, rows_of(rp, E), c)
        res += [z, *torch.autograd.grad(z, [q, v], torch.ones_like(z))]
        return res

    got, exp = run('cuda', dtype), run('cpu', torch.float64)
    # Per-head results (scores and their gradients) are dots of C-channel
    # rows, and a score gradient is the difference of two of them (exactly
    # 0 on a degree-1 row): in bfloat16 (out is stored rounded) its error is
    # that of its terms, up to |grad_out row| * |values row|.
    terms = (go.float().norm(dim=-1).amax() *
             xs[0].float().norm(dim=-1).amax()).cpu().reshape(1)
    for k, (a, b) in enumerate(zip(got, exp)):
        assert torch.isfinite(a).all(), k
        per_head = dtype == torch.bfloat16 and a.dim() == 2
        _close(a.cpu(), b, dtype, f'result {k}', terms if per_head else None)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('heads,C', [(4, 32), (1, 32), (8, 16), (2, 8), (4, 12), (1, 4),
                                     (2, 64), (1, 128)])
@pytest.mark.parametrize('idx', IDX)
@pytest.mark.parametrize('split', [None, '16'])
@pytest.mark.parametrize('wide', ['0', '1'])
def test_owner_lanes(monkeypatch, dtype, heads, C, idx, split, wide):
    """CUDA, one head per lane: each weight of an edge batch computed by one
    lane of its head and shuffled (PYG_FASTATTN_OWNER_LANES=1) against every
    lane computing every weight (=0), forward and backward, with a hub row
    and a hub column (and with split=16 both on the split path), 1 to 32
    lanes a head; wide=1: the float32 backward's 8-entry batches where a
    head has at least 8 lanes. Outputs,
    grad_values and grad_z (so grad_a_dst) agree bit for bit; grad_a_src sums
    the same terms in another order."""
    if not _build.load().native:
        pytest.skip(f'native kernels unavailable: {_build.load().error}')
    monkeypatch.setenv('PYG_FASTATTN_BWD_WIDE', wide)
    rowptr, col, Ns, g = hub_graph(monkeypatch, split, idx)
    N, E = rowptr.numel() - 1, col.numel()

    def leaf(*shape):
        t = torch.randn(*shape, device='cuda', generator=g).to(dtype)
        return t.requires_grad_(True)

    v, a_src, a_dst, s = leaf(Ns, heads, C), leaf(Ns, heads), leaf(N, heads), leaf(E, heads)
    go = torch.randn(N, heads, C, device='cuda', generator=g).to(dtype)
    csc = ops.csr_to_csc(rowptr, col, Ns, validate=False)
    res = {}
    for own in ('0', '1'):
        monkeypatch.setenv('PYG_FASTATTN_OWNER_LANES', own)
        out = ops.attention(rowptr, col, v, a_src=a_src, a_dst=a_dst, csc=csc)
        gv, gsrc, gdst = torch.autograd.grad(out, [v, a_src, a_dst], go)
        out2 = ops.softmax_aggregate(rowptr, col, s, v, csc=csc, validate=False)
        gs2, gv2 = torch.autograd.grad(out2, [s, v], go)
        res[own] = dict(out=out, gv=gv, gdst=gdst, gsrc=gsrc, out2=out2,
                        gs2=gs2, gv2=gv2)
    for k, a in res['0'].items():
        b = res['1'][k]
        assert torch.isfinite(a).all(), k
        if k == 'gsrc':
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            scale = a.abs().max().item()
            torch.testing.assert_close(b.float(), a.float(), rtol=tol,
                                       atol=tol * scale, msg=lambda m: f'{k}: {m}')
        else:
            assert torch.equal(a, b), k


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize('heads,C', [(4, 32), (8, 16), (1, 64), (4, 12)])
@pytest.mark.parametrize('idx', IDX)
@pytest.mark.parametrize('split', [None, '16'])
def test_bwd_narrow_batch(monkeypatch, heads, C, idx, split):
    """CUDA: the float32 lean attention backward with kAttnBwdNarrowBatch
    entries a lane in flight (PYG_FASTATTN_BWD_NARROW=1, the default) gives
    the gradients of bwd_batch's 4 (=0) bit for bit, with a hub row and a
    hub column (split=16: also on the split path)."""
    if not _build.load().native:
        pytest.skip(f'native kernels unavailable: {_build.load().error}')
    monkeypatch.delenv('PYG_FASTATTN_OWNER_LANES', raising=False)
    rowptr, col, Ns, g = hub_graph(monkeypatch, split, idx)
    N = rowptr.numel() - 1
    v = torch.randn(Ns, heads, C, device='cuda', generator=g)
    a_src = torch.randn(Ns, heads, device='cuda', generator=g)
    a_dst = torch.randn(N, heads, device='cuda', generator=g)
    go = torch.randn(N, heads, C, device='cuda', generator=g)
    csc = ops.csr_to_csc(rowptr, col, Ns, validate=False)
    res = {}
    for on in ('0', '1'):
        monkeypatch.setenv('PYG_FASTATTN_BWD_NARROW', on)
        leaves = [t.clone().requires_grad_(True) for t in (v, a_src, a_dst)]
        out = ops.attention(rowptr, col, leaves[0], a_src=leaves[1],
                            a_dst=leaves[2], csc=csc)
        res[on] = torch.autograd.grad(out, leaves, go)
    for k, (a, b) in enumerate(zip(res['0'], res['1'])):
        assert torch.isfinite(a).all() and a.abs().sum() > 0, k
        assert torch.equal(a, b), f'gradient {k} differs'

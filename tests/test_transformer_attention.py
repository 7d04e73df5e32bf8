"""transformer_attention (op): TransformerConv's fused dot-product score,
row softmax and aggregation.

The op is checked against autograd through the float64 reference forward
(``reference.transformer_attention`` called as a plain function, so the
explicit backward formulas of both backends are under test), with
gradcheck, opcheck, for determinism, in half precision, under autocast and
torch.compile, and the native kernels against the reference kernels."""
import pytest
import torch

from pyg_fastattn import _build, ops, reference
from pyg_fastattn.ops._lib import use_reference

from conftest import DEVICES, requires_cuda
from graphs import (assert_bitwise, assert_deterministic, hub_rows,
                    make_graph, noncontig)
from test_gatv2 import _check as _check_gatv2
from test_gatv2 import _check_half, _grads, _misaligned, _tol32

KINDS = ['mixed', 'huge', 'empty', 'single', 'deg1']
SCALE = 0.37  # != 1: the scale enters the score and every gradient


def _inputs(kind, device, idx=torch.int64, dtype=torch.float64, H=4, C=5,
            edge=True, mask=True):
    rowptr, col, Ns = make_graph(kind, idx, device)
    N, E = rowptr.numel() - 1, col.numel()
    d = dict(dtype=dtype, device=device)
    q = torch.randn(N, H, C, **d)
    k = torch.randn(Ns, H, C, **d)
    v = torch.randn(Ns, H, C, **d)
    e_t = torch.randn(E, H, C, **d) if edge else None
    m = ((torch.rand(E, H, device=device) > 0.3).to(dtype) / 0.7
         if mask else None)
    return rowptr, col, q, k, v, e_t, m


def _dbl(t):
    return t.double() if t is not None else None


def _check(rowptr, col, q, k, v, e_t, mask, tol, scale=SCALE):
    """The op (current backend) against the float64 reference: output and
    the gradients of query, key, value and edge_term."""
    def op(a, b, c, e):
        return ops.transformer_attention(rowptr, col, a, b, c, e, mask, scale)

    def ref(a, b, c, e):
        return reference.transformer_attention(rowptr, col, a, b, c, e,
                                               _dbl(mask), scale)[0]

    go = torch.randn(rowptr.numel() - 1, k.size(1), k.size(2),
                     dtype=k.dtype, device=k.device)
    out, g = _grads(op, (q, k, v, e_t), go)
    out_ref, g_ref = _grads(ref, [_dbl(t) for t in (q, k, v, e_t)],
                            go.double())
    assert out.dtype == k.dtype
    torch.testing.assert_close(out.double(), out_ref, atol=tol, rtol=tol)
    names = [n for n, t in zip(['query', 'key', 'value', 'edge_term'],
                               (q, k, v, e_t)) if t is not None]
    assert len(g) == len(names)
    for name, a, b in zip(names, g, g_ref):
        assert a.dtype == k.dtype, name
        assert a.shape == b.shape, name
        # sums over hub rows / columns: the error grows with the largest term
        scale_ = max(1.0, b.abs().max().item()) if b.numel() else 1.0
        torch.testing.assert_close(a.double(), b, atol=tol * scale_, rtol=tol,
                                   msg=lambda m: f'{name}: {m}')


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('kind', KINDS)
@pytest.mark.parametrize('idx', [torch.int32, torch.int64])
def test_graph_shapes(backend, device, kind, idx):
    """Empty rows, degree-1 rows, a 5000-edge hub row, E = 0, N = 1."""
    _check(*_inputs(kind, device, idx), tol=1e-10)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('H', [1, 4, 8])
@pytest.mark.parametrize('C', [5, 7, 32])
@pytest.mark.parametrize('edge,mask', [(False, False), (True, False),
                                       (False, True), (True, True)])
def test_heads_channels_terms(backend, device, H, C, edge, mask):
    """Heads 1/4/8, odd and vector-sized channels, with and without the
    edge term and the dropout mask; float32 against float64."""
    t = _inputs('mixed', device, torch.int32, torch.float32, H, C, edge, mask)
    _check(*t, tol=2e-5)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('H,C', [(16, 64), (2, 256), (1, 129), (1, 301),
                                 (3, 7), (64, 2)])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_layouts(backend, device, H, C, dtype):
    t = _inputs('mixed', device, torch.int64, dtype, H, C)
    _check(*t, tol=1e-10 if dtype == torch.float64 else _tol32(C))


@pytest.mark.parametrize('device', DEVICES)
def test_noncontiguous_and_misaligned(backend, device):
    rowptr, col, q, k, v, e_t, m = _inputs('mixed', device)
    _check(rowptr, col, noncontig(q), noncontig(k), noncontig(v),
           noncontig(e_t), noncontig(m), tol=1e-10)
    t = _inputs('mixed', device, dtype=torch.float32, H=4, C=8)
    rowptr, col = t[:2]
    _check(rowptr, col, *[_misaligned(u) for u in t[2:6]], t[6], tol=5e-5)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('scale', [1.0, 0.05, 3.0])
def test_scales(backend, device, scale):
    _check(*_inputs('mixed', device), tol=1e-10, scale=scale)


@pytest.mark.parametrize('device', DEVICES)
def test_many_rows(backend, device):
    """More rows than fit one thread's share (the parallel row and column
    paths), a hub row."""
    rowptr, col = hub_rows(20000, 15000, 5, device)
    H, C = 4, 32
    d = dict(device=device)
    q = torch.randn(20000, H, C, **d)
    k, v = torch.randn(15000, H, C, **d), torch.randn(15000, H, C, **d)
    _check(rowptr, col, q, k, v, None, None, tol=1e-4, scale=C ** -0.5)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize('H,C', [(2, 256), (1, 512), (1, 1024)])
def test_wide_heads_hub(backend, H, C):
    """CUDA, gatv2_attention and transformer_attention: heads wider than 32
    vector units (two, four and eight float32 channel slots a lane) with a
    dropout mask, on a graph with a hub row on the split path and thousands
    of short rows."""
    rowptr, col = hub_rows(3000, 2000, 6, 'cuda')
    d = dict(device='cuda')
    src, dst = torch.randn(2000, H, C, **d), torch.randn(3000, H, C, **d)
    m = (torch.rand(col.numel(), H, **d) > 0.3).float() / 0.7
    att = torch.randn(H, C, **d) * C ** -0.5  # scores of order 1
    _check_gatv2(rowptr, col, src, dst, None, att, m, tol=1e-4)
    _check(rowptr, col, dst, src, torch.randn(2000, H, C, **d), None, m,
           tol=1e-4, scale=C ** -0.5)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('grad', ['query', 'key', 'value', 'edge_term',
                                  'key,value'])
def test_needs_input_grad(backend, device, grad):
    """Gradients only for the inputs that need them; an edge_term without
    requires_grad gets none (and costs no [E, H, C] gradient)."""
    rowptr, col, q, k, v, e_t, m = _inputs('mixed', device)
    names = ['query', 'key', 'value', 'edge_term']
    ts = [t.detach().requires_grad_(n in grad.split(','))
          for n, t in zip(names, (q, k, v, e_t))]
    out = ops.transformer_attention(rowptr, col, *ts[:3], ts[3], m, SCALE)
    go = torch.randn_like(out)
    out.backward(go)
    ref_ts = [t.detach().requires_grad_() for t in (q, k, v, e_t)]
    ref = reference.transformer_attention(rowptr, col, *ref_ts, m, SCALE)[0]
    want = torch.autograd.grad(ref, ref_ts, go)
    for n, t, w in zip(names, ts, want):
        if n in grad.split(','):
            torch.testing.assert_close(t.grad, w, atol=1e-10, rtol=1e-10)
        else:
            assert t.grad is None, n


@pytest.mark.parametrize('device', DEVICES)
def test_lse_and_empty_rows(backend, device):
    rowptr, col, q, k, v, e_t, m = _inputs('mixed', device)
    out, lse = ops.transformer_attention(rowptr, col, q, k, v, e_t, m, SCALE,
                                         return_lse=True)
    _, lse_ref = reference.transformer_attention(rowptr, col, q, k, v, e_t, m,
                                                 SCALE)
    assert lse.dtype == torch.float64
    torch.testing.assert_close(lse, lse_ref)
    empty = (rowptr[1:] == rowptr[:-1])
    assert empty.any()
    assert torch.isneginf(lse[empty]).all()
    assert (out[empty] == 0).all()
    # 16-bit inputs: lse in float32
    _, lse16 = ops.transformer_attention(rowptr, col, q.bfloat16(),
                                         k.bfloat16(), v.bfloat16(),
                                         return_lse=True)
    assert lse16.dtype == torch.float32


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('edge', [False, True])
@pytest.mark.parametrize('mask', [False, True])
def test_gradcheck(backend, device, edge, mask):
    """gradcheck in float64 on a graph with empty and degree-1 rows."""
    rowptr, col, q, k, v, e_t, m = _inputs('mixed', device, H=2, C=3,
                                           edge=edge, mask=mask)
    deg = rowptr[1:] - rowptr[:-1]
    assert (deg == 0).any() and (deg == 1).any()
    # The reference's index_add is atomic on CUDA: allow its reordering.
    nondet = 1e-12 if backend == 'reference' and device == 'cuda' else 0.0
    args = [q, k, v] + ([e_t] if edge else [])
    args = [a.requires_grad_() for a in args]

    def fn(a, b, c, e=None):
        return ops.transformer_attention(rowptr, col, a, b, c, e, m, SCALE)

    assert torch.autograd.gradcheck(fn, args, nondet_tol=nondet)


def _op_args(device, idx, edge=True, mask=True, dtype=torch.float64):
    rowptr, col, q, k, v, e_t, m = _inputs('mixed', device, idx, dtype,
                                           edge=edge, mask=mask)
    csc = ops.csr_to_csc(rowptr, col, k.size(0))
    return rowptr, col, csc, q, k, v, e_t, m


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('idx', [torch.int32, torch.int64])
@pytest.mark.parametrize('terms', [True, False])
def test_opcheck(backend, device, idx, terms):
    """Schema, autograd registration, fake tensors and AOT dispatch of both
    ops, with and without the optional inputs."""
    rowptr, col, csc, q, k, v, e_t, m = _op_args(device, idx, terms, terms,
                                                 torch.float32)
    leaves = [t.requires_grad_() if t is not None else None
              for t in (q, k, v, e_t)]
    csc_args = tuple(csc)[:3] if terms else (None, ) * 3
    lens = ((int(rowptr.diff().max()), int(csc.colptr.diff().max()))
            if terms else (-1, -1))
    fwd = (rowptr, col, *leaves, m, SCALE, *csc_args, *lens, False)
    torch.library.opcheck(torch.ops.pyg_fastattn.transformer_attention.default,
                          fwd)
    # grads_in_place=True lets the backward overwrite the op's own output,
    # which the AOT utility compares after a backward: the other three.
    torch.library.opcheck(
        torch.ops.pyg_fastattn.transformer_attention.default,
        fwd[:-1] + (True, ),
        test_utils=('test_schema', 'test_autograd_registration',
                    'test_faketensor'))
    nd = [t.detach() if t is not None else None for t in leaves]
    out, lse = torch.ops.pyg_fastattn.transformer_attention(
        rowptr, col, *nd, m, SCALE, *csc_args, *lens, False)
    bwd = (rowptr, col, *tuple(csc)[:3], *nd, m, SCALE, out, lse,
           torch.randn_like(out), terms, *lens)
    torch.library.opcheck(
        torch.ops.pyg_fastattn.transformer_attention_backward.default, bwd)


def _native_or_skip(device):
    if not _build.native_available(torch.device(device)):
        pytest.skip(f'native kernels unavailable on {device}')


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('kind', ['mixed', 'huge'])
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32,
                                   torch.bfloat16])
@pytest.mark.parametrize('terms', [True, False])
def test_native_kernels_match_reference(device, kind, dtype, terms):
    """Both native kernels called directly against the reference kernels
    (use_reference) on the same inputs, need_edge on and off."""
    _native_or_skip(device)
    K = torch.ops.pyg_fastattn
    rowptr, col, q, k, v, e_t, m = _inputs(kind, device, torch.int32, dtype,
                                           edge=terms, mask=terms)
    csc = ops.csr_to_csc(rowptr, col, k.size(0))
    lens = (int(rowptr.diff().max()), int(csc.colptr.diff().max()))
    go = torch.randn_like(q)

    def run():
        out, lse = K.transformer_attention(rowptr, col, q, k, v, e_t, m,
                                           SCALE, *tuple(csc)[:3], *lens,
                                           False)
        grads = [K.transformer_attention_backward(
            rowptr, col, *tuple(csc)[:3], q, k, v, e_t, m, SCALE, out, lse,
            go, need, *lens) for need in (False, True)]
        return out, lse, grads

    got = run()
    with use_reference():
        want = run()
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 1e-2)
    close = lambda a, b: torch.testing.assert_close(  # noqa: E731
        a.double(), b.double(), atol=tol * max(1.0, b.abs().max().item())
        if b.numel() else tol, rtol=tol)
    close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], atol=tol, rtol=tol)
    assert got[1].dtype == want[1].dtype
    for need, g_got, g_want in zip((False, True), got[2], want[2]):
        for a, b in zip(g_got, g_want):
            assert a.shape == b.shape and a.dtype == b.dtype
            close(a, b)
        assert g_got[3].numel() == (0 if not (need and terms) else
                                    e_t.numel())


@pytest.mark.parametrize('device', DEVICES)
def test_positions_outside_rows(device):
    """rowptr[0] > 0 and a tail past rowptr[N] (direct kernel calls):
    those positions contribute nothing and get a zero edge gradient."""
    _native_or_skip(device)
    K = torch.ops.pyg_fastattn
    rowptr, col, q, k, v, e_t, m = _inputs('mixed', device)
    E, H, C = col.numel(), k.size(1), k.size(2)
    lead, tail = 3, 4
    pad = lambda t, fill: torch.cat([  # noqa: E731
        fill(lead, t), t, fill(tail, t)])
    rnd = lambda n, t: torch.randn((n, ) + t.shape[1:], dtype=t.dtype,  # noqa
                                   device=device)
    col_p = pad(col, lambda n, t: torch.randint(0, k.size(0), (n, ),
                                                device=device))
    e_p, m_p = pad(e_t, rnd), pad(m, rnd)
    rp_p = rowptr + lead
    csc = ops.csr_to_csc(rowptr, col, k.size(0))
    csc_p = ops.csr_to_csc(rp_p, col_p, k.size(0), validate=False)
    go = torch.randn_like(q)
    out, lse = K.transformer_attention(rowptr, col, q, k, v, e_t, m, SCALE,
                                       None, None, None, -1, -1, False)
    out_p, lse_p = K.transformer_attention(rp_p, col_p, q, k, v, e_p, m_p,
                                           SCALE, None, None, None, -1, -1,
                                           False)
    torch.testing.assert_close(out_p, out)
    torch.testing.assert_close(lse_p, lse)
    g = K.transformer_attention_backward(rowptr, col, *tuple(csc)[:3], q, k,
                                         v, e_t, m, SCALE, out, lse, go, True,
                                         -1, -1)
    g_p = K.transformer_attention_backward(rp_p, col_p, *tuple(csc_p)[:3], q,
                                           k, v, e_p, m_p, SCALE, out_p,
                                           lse_p, go, True, -1, -1)
    for a, b in zip(g_p[:3], g[:3]):
        torch.testing.assert_close(a, b)
    assert g_p[3].shape == (E + lead + tail, H, C)
    torch.testing.assert_close(g_p[3][lead:lead + E], g[3])
    assert (g_p[3][:lead] == 0).all() and (g_p[3][lead + E:] == 0).all()


@pytest.mark.parametrize('device', DEVICES)
def test_native_kernels_never_touch_out_of_bounds(device):
    """Garbage indices straight into the kernels must not crash."""
    _native_or_skip(device)
    K = torch.ops.pyg_fastattn
    t = lambda *x: torch.tensor(*x, device=device)  # noqa: E731
    rowptr, col = t([0, 9, -3, 2, 100]), t([5, -7, 1000000, 1])
    d = dict(device=device)
    q, k, v = (torch.randn(4, 2, 5, **d), torch.randn(3, 2, 5, **d),
               torch.randn(3, 2, 5, **d))
    e_t, m = torch.randn(4, 2, 5, **d), torch.rand(4, 2, **d)
    out, lse = K.transformer_attention(rowptr, col, q, k, v, e_t, m, 1.0,
                                       None, None, None, -1, -1, False)
    K.transformer_attention_backward(rowptr, col, t([0, 3, -2, 99]),
                                     t([7, -1, 2, 0]), t([-5, 2, 100, 1]), q,
                                     k, v, e_t, m, 1.0, out, lse,
                                     torch.randn_like(out), True, -1, -1)
    if device == 'cuda':
        torch.cuda.synchronize()
    _check(*_inputs('mixed', device), tol=1e-10)  # still right afterwards


@pytest.mark.parametrize('device', DEVICES)
def test_backward_bitwise_reproducible(device):
    """Two forward and backward passes give the same bits (no atomics); on
    CPU also with 1 and 2 threads."""
    rowptr, col, q, k, v, e_t, m = _inputs('huge', device,
                                           dtype=torch.float32, H=4, C=16)
    go = torch.randn(rowptr.numel() - 1, 4, 16, device=device)
    csc = ops.csr_to_csc(rowptr, col, k.size(0))

    def run():
        out, g = _grads(lambda a, b, c, e: ops.transformer_attention(
            rowptr, col, a, b, c, e, m, SCALE, csc=csc), (q, k, v, e_t), go)
        return [out] + g

    assert_deterministic(run, device)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_half_precision(backend, device, dtype):
    """Half inputs, float32 accumulation: within half-precision error of
    float32 on the same (rounded) inputs."""
    rowptr, col, q, k, v, e_t, m = _inputs('mixed', device,
                                           dtype=torch.float32, H=4, C=8)
    ts = [t.to(dtype) for t in (q, k, v, e_t)]
    go = torch.randn(rowptr.numel() - 1, 4, 8, device=device).to(dtype)
    mh = m.to(dtype)

    def op(a, b, c, e):
        return ops.transformer_attention(rowptr, col, a, b, c, e, mh, SCALE)

    _check_half(op, ts, go, dtype)


@pytest.mark.parametrize('device', DEVICES)
def test_autocast(backend, device):
    """Under autocast the op runs in bfloat16 (float32 accumulation) and
    its input gradients come back in the inputs' dtype."""
    rowptr, col, q, k, v, e_t, m = _inputs('mixed', device,
                                           dtype=torch.float32, H=4, C=8)
    ts = [t.requires_grad_() for t in (q, k, v, e_t)]
    out32 = ops.transformer_attention(rowptr, col, *ts, m, SCALE)
    with torch.autocast(device, dtype=torch.bfloat16):
        out = ops.transformer_attention(rowptr, col, *ts, m, SCALE)
    assert out.dtype == torch.bfloat16
    rel = ((out.float() - out32).norm() / out32.norm()).item()
    assert rel < 1e-2
    g = torch.autograd.grad(out.float().sum(), ts)
    g32 = torch.autograd.grad(out32.sum(), ts)
    for a, b in zip(g, g32):
        assert a.dtype == torch.float32
        assert ((a - b).norm() / b.norm()).item() < 3e-2


@pytest.mark.parametrize('device', DEVICES)
def test_compile_fullgraph(backend, device):
    """torch.compile(fullgraph=True) (inductor) over the op and its
    backward equals eager."""
    torch._dynamo.reset()
    rowptr, col, q, k, v, e_t, m = _inputs('mixed', device,
                                           dtype=torch.float32, H=4, C=8)
    csc = ops.csr_to_csc(rowptr, col, k.size(0))
    lin = torch.nn.Linear(8, 8).to(device)

    def fn(q, k, v, e):
        out = ops.transformer_attention(rowptr, col, q, lin(k), v, e, m,
                                        SCALE, csc=csc, validate=False)
        return torch.nn.functional.elu(out).sum()

    compiled = torch.compile(fn, fullgraph=True)
    results = []
    for f in (fn, compiled):
        ts = [t.detach().requires_grad_() for t in (q, k, v, e_t)]
        loss = f(*ts)
        grads = torch.autograd.grad(loss, ts + [lin.weight])
        results.append((loss.detach(), grads))
    (le, ge), (lc, gc) = results
    torch.testing.assert_close(lc, le, atol=1e-5, rtol=1e-5)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_checks():
    rowptr, col, q, k, v, e_t, m = _inputs('mixed', 'cpu')
    f = ops.transformer_attention
    short = rowptr.clone()
    short[-1] -= 1  # rowptr[-1] != E
    bad = [
        (lambda: f(rowptr, col, q[:-1], k, v), ValueError, 'query'),
        (lambda: f(rowptr, col, q[..., :-1], k, v), ValueError, 'query'),
        (lambda: f(rowptr, col, q, k, v[:-1]), ValueError, 'value'),
        (lambda: f(rowptr, col, q, k, v[:, :-1]), ValueError, 'value'),
        (lambda: f(rowptr, col, q, k, v, e_t[:-1]), ValueError, 'edge_term'),
        (lambda: f(rowptr, col, q, k, v, None, m[:, :-1]), ValueError,
         'mask'),
        (lambda: f(rowptr, col, q[0], k, v), ValueError, 'query'),
        (lambda: f(rowptr, col, q, k, v.long()), TypeError, 'value'),
        (lambda: f(rowptr.float(), col, q, k, v), TypeError, 'rowptr'),
        (lambda: f(rowptr, col + 100, q, k, v), IndexError, 'col'),
        (lambda: f(short, col, q, k, v), ValueError, 'rowptr'),
    ]
    for call, exc, text in bad:
        with pytest.raises(exc, match=text):
            call()
    # The kernels' own checks (any backend with the native build).
    if not _build.native_available(torch.device('cpu')):
        return
    K = torch.ops.pyg_fastattn
    rest = (None, ) * 3 + (-1, -1, False)  # no transpose, no length hint
    kernel_bad = [
        ((rowptr, col, q.float(), k, v, e_t, m, 1.0, *rest), 'query'),
        ((rowptr, col, q, k, v.float(), e_t, m, 1.0, *rest), 'value'),
        ((rowptr, col, q, k, v, e_t.float(), m, 1.0, *rest), 'edge_term'),
        ((rowptr, col, q, k, v, e_t, m.float(), 1.0, *rest), 'mask'),
        ((rowptr, col, q[:-1], k, v, e_t, m, 1.0, *rest), 'query'),
        ((rowptr, col, q, k, v[:-1], e_t, m, 1.0, *rest), 'value'),
        ((rowptr, col, q, k, v, e_t[:, :-1], m, 1.0, *rest), 'edge_term'),
        ((rowptr, col.int(), q, k, v, e_t, m, 1.0, *rest), 'col'),
    ]
    for args, text in kernel_bad:
        with pytest.raises(RuntimeError, match=text):
            K.transformer_attention(*args)
    out, lse = K.transformer_attention(rowptr, col, q, k, v, e_t, m, 1.0,
                                       *rest)
    csc = tuple(ops.csr_to_csc(rowptr, col, k.size(0)))[:3]
    go = torch.randn_like(out)
    base = [rowptr, col, *csc, q, k, v, e_t, m, 1.0, out, lse, go, True, -1,
            -1]
    for pos, value, text in [(12, lse.float(), 'lse'), (12, lse[:-1], 'lse'),
                             (2, csc[0][:-1], 'colptr'),
                             (13, go[:-1], 'grad_out'),
                             (11, out.float(), 'out')]:
        args = list(base)
        args[pos] = value
        with pytest.raises(RuntimeError, match=text):
            K.transformer_attention_backward(*args)


def _hub_column_inputs(device, idx, dtype):
    """3000 rows of degree 2, each with an edge from source 0 (a column
    longer than the CUDA split threshold) and one random source."""
    N, Ns, H, C = 3000, 50, 2, 8
    rowptr = torch.arange(0, 2 * N + 1, 2)
    col = torch.stack([torch.zeros(N, dtype=torch.long),
                       torch.randint(1, Ns, (N, ))], 1).flatten()
    d = dict(dtype=dtype, device=device)
    return (rowptr.to(device, idx), col.to(device, idx),
            torch.randn(N, H, C, **d), torch.randn(Ns, H, C, **d),
            torch.randn(Ns, H, C, **d), None, None)


def _in_place_grads(inputs, in_place):
    """Output and the gradients of query, key, value (and edge_term) of the
    op called with grads_in_place; the inputs' producers are clones, so
    the op's key and value are its own."""
    rowptr, col, q, k, v, e_t, m = inputs
    leaves = [t.detach().clone().requires_grad_() if t is not None else None
              for t in (q, k, v, e_t)]
    q_, k_, v_ = (t * 1 for t in leaves[:3])  # fresh non-leaf buffers
    out = ops.transformer_attention(rowptr, col, q_, k_, v_, leaves[3], m,
                                    SCALE, grads_in_place=in_place)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(3),
                     dtype=torch.float64).to(out)
    kept = out.detach().clone()
    out.backward(go)
    grads = [t.grad for t in leaves if t is not None]
    return kept, grads, out


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('kind', ['mixed', 'huge', 'empty', 'hub_column'])
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32,
                                   torch.bfloat16])
@pytest.mark.parametrize('idx', [torch.int32, torch.int64])
def test_grads_in_place_equal(backend, device, kind, dtype, idx):
    """grads_in_place=True gives the gradients of the out-of-place backward
    bit for bit (hub rows and a hub column take the split path on CUDA),
    and it really overwrote the op's out with grad_query."""
    torch.manual_seed(0)
    if kind == 'hub_column':
        inputs = _hub_column_inputs(device, idx, dtype)
    else:
        inputs = _inputs(kind, device, idx, dtype, edge=kind == 'mixed',
                         mask=kind != 'empty')
    out_a, g_a, _ = _in_place_grads(inputs, False)
    out_b, g_b, spent = _in_place_grads(inputs, True)
    if backend == 'reference' and device == 'cuda':  # index_add: atomics
        tol = 1e-10 if dtype == torch.float64 else 1e-2
        for a, b in zip([out_a] + g_a, [out_b] + g_b):
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    else:
        assert_bitwise([out_a] + g_a, [out_b] + g_b, 'in place')
    if out_b.numel():
        assert torch.equal(spent.detach(), g_b[0])  # out now holds grad_query


@pytest.mark.parametrize('device', DEVICES)
def test_grads_in_place_retain_graph(backend, device):
    """With retain_graph the backward leaves out, key and value intact
    (even with grads_in_place), so a second backward gives the same
    gradients; without it the in-place backward overwrote out."""
    inputs = _inputs('mixed', device, dtype=torch.float32)
    rowptr, col, q, k, v, e_t, m = inputs
    for in_place in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ops.transformer_attention(rowptr, col, *(t * 1 for t in leaves),
                                        e_t, m, SCALE,
                                        grads_in_place=in_place)
        kept = out.detach().clone()
        loss = (out * torch.linspace(-1, 1, out.numel(), device=device)
                .view_as(out)).sum()
        loss.backward(retain_graph=True)
        assert torch.equal(out.detach(), kept)
        first = [t.grad.clone() for t in leaves]
        loss.backward()
        for a, t in zip(first, leaves):
            torch.testing.assert_close(t.grad, 2 * a)
        # the last backward frees the graph: in place where autograd says so
        # (the Python formula needs torch's keep_graph query)
        if in_place and (_build.load().native or hasattr(
                torch._C._autograd, '_get_current_graph_task_keep_graph')):
            assert not torch.equal(out.detach(), kept), 'not in place'
        else:
            assert torch.equal(out.detach(), kept)


@pytest.mark.parametrize('device', DEVICES)
def test_grads_in_place_skipped_when_unsafe(backend, device):
    """A non-contiguous key, value the same tensor as key, grad_out that is
    out itself: the backward falls back to the out-of-place op, leaves its
    inputs intact and gets the same gradients."""
    rowptr, col, q, k, _, _, _ = _inputs('mixed', device, dtype=torch.float64)

    def grads(qq, kk, vv, in_place, go=None):
        out = ops.transformer_attention(rowptr, col, qq, kk, vv, None, None,
                                        SCALE, grads_in_place=in_place)
        return torch.autograd.grad(out, (qq, kk, vv),
                                   out if go == 'out' else torch.ones_like(out))

    nc = noncontig(k).requires_grad_()
    shared = k.clone().requires_grad_()
    cases = [('non-contiguous key', lambda: (q.clone().requires_grad_(), nc,
                                             k.clone().requires_grad_()), None),
             ('value is key', lambda: (q.clone().requires_grad_(), shared,
                                       shared), None),
             ('grad_out is out', lambda: tuple(
                 t.clone().requires_grad_() for t in (q, k, k.flip(0))),
              'out')]
    for name, make, go in cases:
        args = make()
        before = [t.detach().clone() for t in args]
        want = grads(*args, False, go)
        got = grads(*args, True, go)
        for a, b in zip(args, before):
            assert torch.equal(a.detach(), b), name
        for a, b in zip(got, want):
            if backend == 'reference' and device == 'cuda':  # atomics
                torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
            else:
                assert torch.equal(a, b), name

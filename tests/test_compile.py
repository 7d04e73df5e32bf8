"""The ops as PyTorch custom ops: torch.library.opcheck on every op, gradcheck
of the fused GAT op, compiled (inductor) training against eager, and
autocast against float32."""
import pytest
import torch
import torch.nn.functional as F

from pyg_fastattn import (FastGATConv, FastGATv2Conv, FastTransformerConv,
                          ops, prepare)
from pyg_fastattn.ops import _lib
from pyg_fastattn.ops.csr import rows_of

from conftest import DEVICES, HALF, assert_float32_x_grad, requires_cuda
from graphs import make_graph

CUDA_ONLY = [pytest.param('cuda', marks=[pytest.mark.cuda, requires_cuda])]


def _inputs(device, idx, dtype=torch.float32, H=2, C=3, grad=True):
    rowptr, col, Ns = make_graph('mixed', idx, device)
    N, E = rowptr.numel() - 1, col.numel()
    d = dict(dtype=dtype, device=device, requires_grad=grad)
    csc = ops.csr_to_csc(rowptr, col, Ns)
    return dict(rowptr=rowptr, col=col, csc=csc, Ns=Ns, N=N, E=E, H=H, C=C,
                s=torch.randn(E, H, **d), v=torch.randn(Ns, H, C, **d),
                a_src=torch.randn(Ns, H, **d), a_dst=torch.randn(N, H, **d),
                mask=(torch.rand(E, H, device=device) > 0.3).to(dtype) / 0.7,
                bias=torch.randn(H * C, **d), d=d)


def _op_cases(device, idx):
    """(op name, args) for every op, with the graph's real index tensors."""
    t = _inputs(device, idx)
    rowptr, col, csc, d = t['rowptr'], t['col'], t['csc'], t['d']
    N, E, H, C = t['N'], t['E'], t['H'], t['C']
    s, v, bias = t['s'], t['v'], t['bias']
    x = torch.randn(N, 5, **d)  # dst_is_src: sources are the N targets
    csc_n = ops.csr_to_csc(rowptr, col, N)
    w = torch.randn(H * C, 5, **d)
    att = [torch.randn(1, H, C, **d) for _ in range(2)]
    out, lse = ops.attention(rowptr, col, v.detach(), t['a_src'].detach(),
                             None, None, None, 0.2, return_lse=True)
    row = rows_of(rowptr, E)
    nd = lambda a: a.detach()  # noqa: E731
    lens = (int(rowptr.diff().max()), int(csc.colptr.diff().max()))
    x_r, e_t = torch.randn(N, H, C, **d), torch.randn(E, H, C, **d)
    out2, lse2 = ops.gatv2_attention(rowptr, col, nd(v), nd(x_r), nd(att[0]),
                                     nd(e_t), t['mask'], return_lse=True,
                                     bias=nd(bias))
    q, val = torch.randn(N, H, C, **d), torch.randn(t['Ns'], H, C, **d)
    out3, lse3 = ops.transformer_attention(rowptr, col, nd(q), nd(v),
                                           nd(val), nd(e_t), t['mask'], 0.5,
                                           return_lse=True)
    return [
        ('edge_softmax', (rowptr, s)),
        ('edge_softmax_backward', (rowptr, nd(s).softmax(0), torch.randn_like(nd(s)))),
        ('sddmm_dot', (torch.randn(N, H, C, **d), v, row, col)),
        ('sddmm_csr', (torch.randn(N, H, C, **d), v, rowptr, col, row,
                       *tuple(csc)[:3])),
        ('spmm', (rowptr, col, s, None, v, None, None, None)),
        ('spmm', (rowptr, col, s, None, v, *tuple(csc)[:3])),
        ('segment_sum', (rowptr, csc.inv, s)),
        ('attention', (rowptr, col, t['a_src'], t['a_dst'], s, t['mask'], v,
                       0.2, bias, *csc)),
        ('attention', (rowptr, col, None, None, s, None, v, 1.0, None, None,
                       None, None, None)),
        ('attention_backward', (rowptr, col, csc.colptr, csc.row, csc.perm,
                                nd(t['a_src']), None, None, None, nd(v), 0.2,
                                out, lse, torch.randn_like(out), False, None)),
        ('gat_attention', (rowptr, col, *csc_n, x, w, None, att[0], None,
                           att[1], s, t['mask'], bias, 0.2, True, -1, -1)),
        ('gat_attention', (rowptr, col, *csc, None, None, v, att[0],
                           torch.randn(N, H, C, **d), att[1], None, None,
                           None, 0.2, False, int(rowptr.diff().max()),
                           int(csc.colptr.diff().max()))),
        ('gatv2_attention', (rowptr, col, v, x_r, e_t, att[0][0], t['mask'],
                             0.2, bias, *tuple(csc)[:3], *lens)),
        ('gatv2_attention', (rowptr, col, v, x_r, None, att[0][0], None, 0.2,
                             None, None, None, None, -1, -1)),
        ('gatv2_attention_backward', (rowptr, col, *tuple(csc)[:3], nd(v),
                                      nd(x_r), nd(e_t), nd(att[0][0]),
                                      t['mask'], 0.2, nd(bias), out2, lse2,
                                      torch.randn_like(out2), True, *lens)),
        ('gatv2_attention_backward', (rowptr, col, *tuple(csc)[:3], nd(v),
                                      nd(x_r), None, nd(att[0][0]), None,
                                      0.2, None, out2, lse2,
                                      torch.randn_like(out2), False, -1, -1)),
        ('transformer_attention', (rowptr, col, q, v, val, e_t, t['mask'],
                                   0.5, *tuple(csc)[:3], *lens, False)),
        ('transformer_attention', (rowptr, col, q, v, val, None, None, 1.0,
                                   None, None, None, -1, -1, False)),
        ('transformer_attention_backward', (
            rowptr, col, *tuple(csc)[:3], nd(q), nd(v), nd(val), nd(e_t),
            t['mask'], 0.5, out3, lse3, torch.randn_like(out3), True, *lens)),
        ('transformer_attention_backward', (
            rowptr, col, *tuple(csc)[:3], nd(q), nd(v), nd(val), None, None,
            0.5, out3, lse3, torch.randn_like(out3), False, -1, -1)),
        ('transformer_attention_backward_', (
            rowptr, col, *tuple(csc)[:3], nd(q), nd(v).clone(),
            nd(val).clone(), nd(e_t), t['mask'], 0.5, out3.clone(), lse3,
            torch.randn_like(out3), True, *lens)),
        ('linear', (x, w, bias)),
        ('linear', (x, w, None)),
        ('linear_backward', (torch.randn(N, H * C, device=x.device), nd(x),
                             nd(w), [True, True, True])),
        ('linear_backward', (torch.randn(N, H * C, device=x.device), nd(x),
                             nd(w), [False, True, False])),
        ('column_sum', (nd(s), )),
    ]


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('idx', [torch.int32, torch.int64])
def test_opcheck(backend, device, idx):
    """Schema, autograd registration, fake tensors and AOT dispatch of every
    op (``gat_attention_backward`` through ``gat_attention``'s backward)."""
    seen = set()
    for name, args in _op_cases(device, idx):
        torch.library.opcheck(_lib.op(name), args)
        seen.add(name)
    assert seen | {'gat_attention_backward'} == set(_lib._names)


def _as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else out


@pytest.mark.parametrize('device', DEVICES)
def test_vmap_every_op(backend, device):
    """Every op under torch.func.vmap and under the legacy vmap of
    is_grads_batched (torch._vmap_internals), over a batch of two for each
    floating-point argument: a loop over the batch's results, the
    arguments an op writes included."""
    from torch._vmap_internals import _vmap
    seen = set()
    for name, args in _op_cases(device, torch.int64):
        o = _lib.op(name)
        args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
        dims = tuple(0 if isinstance(a, torch.Tensor) and a.is_floating_point()
                     else None for a in args)
        batch = [torch.stack([a, 0.5 * a + 0.25]) if d == 0 else a
                 for a, d in zip(args, dims)]
        written = [i for i, a in enumerate(o._schema.arguments)
                   if a.alias_info is not None and a.alias_info.is_write]
        samples = [[b[k].clone() if d == 0 else b for b, d in zip(batch, dims)]
                   for k in range(2)]
        want = [_as_tuple(o(*a)) for a in samples]
        want = (torch.stack(want) if isinstance(want[0], torch.Tensor) else
                tuple(torch.stack(t) for t in zip(*want)))
        for vmap in (torch.func.vmap, _vmap):
            args_k = [b.clone() if d == 0 else b for b, d in zip(batch, dims)]
            got = vmap(lambda *a: _as_tuple(o(*a)), in_dims=dims)(*args_k)
            torch.testing.assert_close(got, want, msg=lambda m: f'{name}: {m}')
            for i in written:
                torch.testing.assert_close(
                    args_k[i], torch.stack([a[i] for a in samples]),
                    msg=lambda m: f'{name} argument {i}: {m}')
        if written:  # an argument it writes must be batched with the others
            part = tuple(None if i in written else d for i, d in
                         enumerate(dims))
            with pytest.raises(RuntimeError, match='which is not batched'):
                torch.func.vmap(o, in_dims=part)(*[
                    b if d == 0 else a for a, b, d in zip(args, batch, part)])
        seen.add(name)
    assert seen | {'gat_attention_backward'} == set(_lib._names)


@pytest.mark.parametrize('device', DEVICES)
def test_no_second_derivative(backend, device):
    """Every differentiable op under create_graph: the same first-order
    gradients, and differentiating them raises a clear error (torch.autograd
    .grad too: it must not prune the error away and return a wrong number)."""
    for name, args in _op_cases(device, torch.int64):
        inputs = [a for a in args
                  if isinstance(a, torch.Tensor) and a.requires_grad]
        if not inputs:
            continue
        out = _lib.op(name)(*args)
        out = out[0] if isinstance(out, (tuple, list)) else out
        w = torch.randn_like(out)
        loss = lambda: (out * w).pow(2).sum()  # noqa: E731
        plain = torch.autograd.grad(loss(), inputs, retain_graph=True,
                                    allow_unused=True)
        grads = torch.autograd.grad(loss(), inputs, create_graph=True,
                                    allow_unused=True)
        for a, b in zip(plain, grads):
            assert (a is None) == (b is None), name
            if a is None:
                continue
            _assert_same(b.detach(), a, backend, device, msg=name)
        second = sum(g.pow(2).sum() for g in grads if g is not None)
        with pytest.raises(RuntimeError, match=f'{name} has no second deriv'):
            torch.autograd.grad(second, inputs, allow_unused=True,
                                retain_graph=True)
        with pytest.raises(RuntimeError, match='no second derivative'):
            second.backward()


GAT_MODES = ['lin', 'shared', 'bipartite', 'no_dst']


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('mode', GAT_MODES)
def test_gat_attention_gradcheck(backend, device, mode):
    """gradcheck of the fused GAT op in float64, in each of its forms."""
    t = _inputs(device, torch.int64, torch.float64)
    rowptr, col, csc, d = t['rowptr'], t['col'], t['csc'], t['d']
    Ns, N, H, C = t['Ns'], t['N'], t['H'], t['C']
    att_src, att_dst = torch.randn(1, H, C, **d), torch.randn(1, H, C, **d)
    v = t['v']
    if mode in ('lin', 'shared'):  # the sources are the N targets
        Ns, csc = N, ops.csr_to_csc(rowptr, col, N)
        v = torch.randn(N, H, C, **d)
    # keep z away from leaky_relu's kink
    a_edge = (torch.randn(t['E'], H, dtype=torch.float64, device=device)
              + 0.05).sign().mul(3).requires_grad_()
    mask, bias = t['mask'], t['bias']

    def gat(h_src, att_src, h_dst, att_dst, a_edge, bias, x=None, w=None):
        return ops.gat_attention(rowptr, col, csc, h_src, att_src, h_dst,
                                 att_dst, a_edge, mask, 0.2,
                                 dst_is_src=mode in ('lin', 'shared'),
                                 bias=bias, x=x, weight=w)

    # The reference's index_add is atomic on CUDA: allow its reordering.
    nondet = 1e-12 if backend == 'reference' and device == 'cuda' else 0.0
    gc = lambda f, *a: torch.autograd.gradcheck(  # noqa: E731
        f, a, atol=1e-7, nondet_tol=nondet)
    if mode == 'lin':
        x, w = torch.randn(Ns, 4, **d), torch.randn(H * C, 4, **d)
        assert gc(lambda x, w, a, b, e, c: gat(None, a, None, b, e, c, x, w),
                  x, w, att_src, att_dst, a_edge, bias)
        # x needing no gradient takes the through-x path for the weight
        assert gc(lambda w, a, b: gat(None, a, None, b, a_edge, bias,
                                      x.detach(), w), w, att_src, att_dst)
    elif mode == 'shared':
        assert gc(lambda h, a, b, e, c: gat(h, a, None, b, e, c),
                  v, att_src, att_dst, a_edge, bias)
    elif mode == 'bipartite':
        h_dst = torch.randn(N, H, C, **d)
        assert gc(lambda h, a, hd, b, e: gat(h, a, hd, b, e, None),
                  v, att_src, h_dst, att_dst, a_edge)
    else:
        assert gc(lambda h, a, c: gat(h, a, None, att_dst, None, c), v,
                  att_src, bias)




def _gat_lin_case(device, dtype, x_grad=True):
    """gat_attention computing h from x: the graph and 16-bit leaves (weight,
    att_src, att_dst, bias) of dtype, a float32 x, an upstream gradient."""
    torch.manual_seed(0)
    t = _inputs(device, torch.int32, grad=False)
    rowptr, col, N, H, C = t['rowptr'], t['col'], t['N'], t['H'], t['C']
    csc = ops.csr_to_csc(rowptr, col, N)
    d = dict(dtype=dtype, device=device, requires_grad=True)
    leaves = [torch.randn(H * C, 5, **d), torch.randn(1, H, C, **d),
              torch.randn(1, H, C, **d), torch.randn(H * C, **d)]
    x = torch.randn(N, 5, device=device, requires_grad=x_grad)
    g = torch.randn(N, H, C, device=device, dtype=dtype)

    def run(x, w, a, b, bias, mask=t['mask'].to(dtype)):
        return ops.gat_attention(rowptr, col, csc, None, a, None, b, None,
                                 mask, 0.2, dst_is_src=True, bias=bias, x=x,
                                 weight=w)
    return run, x, leaves, g


@pytest.mark.parametrize('device,dtype', HALF)
@pytest.mark.parametrize('x_grad', [True, False])
def test_gat_attention_float32_x_beside_half_weight(backend, device, dtype,
                                                    x_grad):
    """gat_attention takes x in float32 beside a 16-bit weight (autocast
    leaves x so: the op casts it, and no cast of x or of its gradient
    outlives the op): the output and the weights' gradients are those of x
    cast first, x's gradient comes back in float32 (on CUDA written so by
    the GEMM: within rounding of the cast one)."""
    run, x, leaves, g = _gat_lin_case(device, dtype, x_grad)
    out = run(x, *leaves)
    out.backward(g)
    got = [t.grad for t in leaves]
    x16 = x.detach().to(dtype).requires_grad_(x_grad)
    for t in leaves:
        t.grad = None
    ref = run(x16, *leaves)
    ref.backward(g)
    assert out.dtype == dtype and torch.equal(out, ref)
    for a, t in zip(got, leaves):
        _assert_same(a, t.grad, backend, device)
    if x_grad:
        assert_float32_x_grad(x, x16, device)
    with _GrabOutputs() as grab:  # the op's arguments of this call
        run(x.detach(), *[t.detach() for t in leaves])
    torch.library.opcheck(_lib.op('gat_attention'), grab.args)
    with pytest.raises(RuntimeError, match='dtype'):
        run(x.detach().double(), *leaves)


@pytest.mark.parametrize('device,dtype', HALF)
def test_gat_attention_float32_x_frozen_weight(backend, device, dtype):
    """x in float32 beside a 16-bit weight that needs no gradient (the
    backward then casts no x): x's gradient is the one it gets when the
    weight needs its gradient too."""
    run, x, leaves, g = _gat_lin_case(device, dtype)
    run(x, *leaves).backward(g)
    want = x.grad
    x.grad = None
    leaves[0].requires_grad_(False)
    run(x, *leaves).backward(g)
    assert x.grad.dtype == torch.float32
    _assert_same(x.grad, want, backend, device)


@pytest.mark.parametrize('device', DEVICES)
def test_gat_attention_without_autograd_builds_no_transpose(
        backend, device, monkeypatch):
    """ops.gat_attention with csc=None under torch.no_grad() builds no
    transpose (only its backward reads one) and gives the output it gives
    with the transpose built."""
    from pyg_fastattn.ops import gat as gat_mod
    t = _inputs(device, torch.int64, grad=False)
    rowptr, col, v = t['rowptr'], t['col'], t['v']
    att = [torch.randn(1, t['H'], t['C'], device=device) for _ in range(2)]
    ref = ops.gat_attention(rowptr, col, None, v, att[0], None, att[1])

    def no_transpose(*args, **kwargs):
        raise AssertionError('transpose built without autograd')
    monkeypatch.setattr(gat_mod, 'maybe_csc', no_transpose)
    with torch.no_grad():
        out = ops.gat_attention(rowptr, col, None, v, att[0], None, att[1])
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize('device', DEVICES)
def test_gat_attention_h_changed_in_place(backend, device):
    """The op's h output (kept for its backward out of autograd's version
    check, and freed between the backward's parts) changed in place before
    the backward: the backward recomputes h, gradients as without."""
    run, x, leaves, g = _gat_lin_case(device, torch.float32)
    grads = []
    for touch in (False, True):
        for t in [x] + leaves:
            t.grad = None
        with _GrabOutputs() as grab:
            out = run(x, *leaves)
        if touch:
            grab.outputs[2].add_(1.0)
        out.backward(g)
        grads.append([t.grad.clone() for t in [x] + leaves])
    for a, b in zip(*grads):
        _assert_same(a, b, backend, device)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('retain', [False, True])
def test_gat_backward_frees_h_before_its_gemms(backend, device, retain):
    """h (x @ W.t(), made and kept by the op) is gone when the backward's
    last GEMM (x's gradient) runs, unless the graph is kept; the backward
    of a kept graph runs again with the same gradients."""
    from torch.multiprocessing.reductions import StorageWeakRef
    run, x, leaves, g = _gat_lin_case(device, torch.float32)
    with _GrabOutputs() as grab:
        out = run(x, *leaves)
    h = StorageWeakRef(grab.outputs[2].untyped_storage())
    grab.outputs = None

    class AtEachMm(torch.utils._python_dispatch.TorchDispatchMode):
        expired = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.name() == 'aten::mm':
                self.expired.append(h.expired())
            return func(*args, **(kwargs or {}))
    with AtEachMm() as seen:
        out.backward(g, retain_graph=retain)
    assert seen.expired and seen.expired[-1] is not retain
    first = x.grad.clone()
    if retain:
        x.grad = None
        out.backward(g)
        _assert_same(x.grad, first, backend, device)


def _assert_same(a, b, backend, device, msg=None):
    """The same bits, or within rounding where the reference's index_add
    (atomics on CUDA) sums in any order."""
    if backend == 'reference' and device == 'cuda':
        torch.testing.assert_close(a, b, msg=msg)
    else:
        assert torch.equal(a, b), msg


class _GrabOutputs(torch.utils._python_dispatch.TorchDispatchMode):
    """The arguments and outputs of the first pyg_fastattn::gat_attention
    call below it."""
    args = outputs = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.name() == 'pyg_fastattn::gat_attention' and not self.outputs:
            self.args, self.outputs = args, out
        return out


@pytest.mark.parametrize('device', CUDA_ONLY)
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_gat_layer_memory_peak(device, dtype):
    """Forward+backward of a layer whose x needs its gradient, in float32
    and under autocast (x float32): the backward frees h before the GEMMs of
    x and weight, and autocast keeps no cast of x for the backward, so at
    most three [N, H * C] tensors (h, out, g_h) or out, g_h and x's float32
    gradient are live at once, besides the small per-node and per-edge ones
    (there were four and five: 2,060 and 1,282 MiB at 1M / 20M in
    RESULTS.md). Measured on a second call, after the first has made the
    backward thread's cuBLAS workspace."""
    torch.manual_seed(0)
    N, F_in, H, C = 200_000, 128, 2, 64
    ei = torch.stack([torch.arange(N, device=device),
                      torch.randint(0, N, (N, ), device=device)])
    g = prepare(ei, num_nodes=N)
    conv = FastGATConv(F_in, C, heads=H).to(device)
    x = torch.randn(N, F_in, device=device, requires_grad=True)
    grad = torch.randn(N, H * C, device=device, dtype=dtype)

    def step():
        x.grad = None
        conv.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=dtype,
                            enabled=dtype != torch.float32):
            out = conv(x, g)
        out.backward(grad)

    step()
    torch.cuda.synchronize()
    x.grad = None
    conv.zero_grad(set_to_none=True)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    unit = N * H * C * grad.element_size()
    bound = max(3 * unit, 2 * unit + N * F_in * 4) + unit // 2
    assert peak <= bound, (peak / unit, bound / unit)
    assert x.grad.dtype == torch.float32


# torch.compile (inductor) against eager #####################################


class Net(torch.nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.conv1 = FastGATConv(12, 8, heads=4, edge_dim=3, dropout=dropout)
        self.conv2 = FastGATConv(32, 5, heads=1, concat=False,
                                 dropout=dropout)

    def forward(self, x, edge_index, edge_attr):
        x = F.elu(self.conv1(x, edge_index, edge_attr))
        return self.conv2(x, edge_index)


def _graph(device, N=60, E=400):
    g = torch.Generator().manual_seed(1)
    ei = torch.randint(0, N - 2, (2, E), generator=g)
    ei[:, :4] = torch.tensor([[0, 1, 2, 2], [0, 1, 3, 3]])  # loops, dups
    return (torch.randn(N, 12, generator=g).to(device), ei.to(device),
            torch.randn(E, 3, generator=g).to(device))


def _step_grads(model, x, ei, ea, y):
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x, ei, ea), y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('prepared', [False, True])
def test_inductor_training_matches_eager(backend, device, prepared):
    """One step's loss and gradients under inductor equal eager's to 1e-4 of
    their largest magnitude, then 5 SGD steps track eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    x, ei, ea = _graph(device)
    y = torch.randint(0, 5, (x.size(0), ), device=device)
    graph = prepare(ei, num_nodes=x.size(0)) if prepared else ei
    eager = Net().to(device)
    compiled_model = Net().to(device)
    compiled_model.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_model, fullgraph=True)
    loss_e, g_e = _step_grads(eager, x, graph, ea, y)
    loss_c, g_c = _step_grads(compiled, x, graph, ea, y)
    torch.testing.assert_close(loss_c, loss_e, atol=1e-5, rtol=1e-5)
    for (name, _), a, b in zip(eager.named_parameters(), g_c, g_e):
        tol = 1e-4 * max(b.abs().max().item(), 1e-12)
        assert (a - b).abs().max().item() <= tol, name
    opts = [torch.optim.SGD(m.parameters(), lr=0.5)
            for m in (eager, compiled_model)]
    for _ in range(5):
        losses = []
        for m, opt in zip((eager, compiled), opts):
            loss, _ = _step_grads(m, x, graph, ea, y)
            opt.step()
            losses.append(loss)
        torch.testing.assert_close(losses[1], losses[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('prepared', [False, True])
def test_compiled_no_grad_forward_matches_eager(device, prepared):
    """Compiled inference (``torch.no_grad()``, where no transpose is built)
    equals eager, before and after a compiled training call on the same
    graph, for each drop-in."""
    g = torch.Generator().manual_seed(5)
    N = 60
    x = torch.randn(N, 12, generator=g).to(device)
    ei = torch.randint(0, N, (2, 400), generator=g).to(device)
    for conv in (FastGATConv, FastGATv2Conv, FastTransformerConv):
        torch._dynamo.reset()
        torch.manual_seed(0)
        layer = conv(12, 8, heads=4).to(device).eval()
        graph = prepare(ei, num_nodes=N, transpose=False,
                        add_self_loops=conv is not FastTransformerConv) \
            if prepared else ei
        with torch.no_grad():
            ref = layer(x, graph)
        layer(x, graph).square().sum().backward()
        ref_grads = [p.grad for p in layer.parameters()]
        layer.zero_grad(set_to_none=True)
        compiled = torch.compile(layer, fullgraph=True)
        with torch.no_grad():
            outs = [compiled(x, graph)]
        train = compiled(x, graph)  # grad mode on: a second graph
        train.square().sum().backward()
        with torch.no_grad():
            outs.append(compiled(x, graph))
        for out in outs + [train.detach()]:
            tol = 1e-5 * max(ref.abs().max().item(), 1.0)
            assert (out - ref).abs().max().item() <= tol, conv.__name__
        tol = 1e-4 * max(b.abs().max().item() for b in ref_grads)
        for (name, p), b in zip(layer.named_parameters(), ref_grads):
            assert (p.grad - b).abs().max().item() <= tol, (conv, name)


@pytest.mark.parametrize('device', DEVICES)
def test_compiled_layers_on_changing_graphs(device):
    """A compiled model fed a graph of another size every step (as
    NeighborLoader gives): each layer's outputs and gradients equal eager's,
    and after one recompile with dynamic sizes no further graph is made."""
    from torch._dynamo.utils import counters

    from pyg_fastattn import FastGATv2Conv, FastTransformerConv

    class Two(torch.nn.Module):
        def __init__(self, conv):
            super().__init__()
            self.c1, self.c2 = conv(12, 8, heads=4), conv(32, 4)

        def forward(self, x, edge_index):
            return self.c2(self.c1(x, edge_index).relu(), edge_index)

    sizes = [(50, 300), (70, 500), (90, 610), (33, 100), (64, 64)]
    for conv in (FastGATConv, FastGATv2Conv, FastTransformerConv):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = Two(conv).to(device)
        compiled = torch.compile(model)
        made = []
        for N, E in sizes:
            g = torch.Generator().manual_seed(N)
            x = torch.randn(N, 12, generator=g).to(device)
            ei = torch.randint(0, N, (2, E), generator=g).to(device)
            res = []
            for m in (model, compiled):
                model.zero_grad(set_to_none=True)
                out = m(x, ei)
                out.square().sum().backward()
                res.append([out] + [p.grad for p in model.parameters()])
            for a, b in zip(*res):
                tol = 1e-4 * max(b.abs().max().item(), 1.0)
                assert (a - b).abs().max().item() <= tol, (conv, N, E)
            made.append(counters['stats']['unique_graphs'])
        assert made[-1] == made[1] <= 2, (conv.__name__, made)


@pytest.mark.parametrize('device', DEVICES)
def test_compiled_graph_checks_indices(device):
    """A graph prepared inside a compiled graph is checked there (a
    device-side assertion; on CPU it raises at once), unless validation is
    'off'; in range, the compiled layer equals eager."""
    from pyg_fastattn.nn.graph import get_validation, set_validation
    torch._dynamo.reset()
    conv = FastGATConv(12, 4, heads=2).to(device).eval()
    x, ei, _ = _graph(device)
    compiled = torch.compile(conv, fullgraph=True)
    torch.testing.assert_close(compiled(x, ei), conv(x, ei))
    if device == 'cuda':  # a failed device assertion ends the CUDA context
        return
    bad = ei.clone()
    bad[0, 5] = x.size(0)
    with pytest.raises(RuntimeError, match='out of range'):
        compiled(x, bad)
    mode = get_validation()
    try:
        set_validation('off')
        torch._dynamo.reset()
        torch.compile(conv, fullgraph=True)(x, bad)  # no check, no crash
    finally:
        set_validation(mode)


def test_export_dynamic_sizes():
    """torch.export with unbounded Dim node and edge counts (int64 indices
    in the exported graph build) runs on graphs of other sizes, more nodes
    than edges included, with the eager layer's outputs."""
    from torch.export import Dim, export

    class Two(torch.nn.Module):
        def __init__(self, conv, **kw):
            super().__init__()
            self.c1, self.c2 = conv(12, 4, heads=2, **kw), conv(8, 3, **kw)

        def forward(self, x, edge_index):
            return self.c2(self.c1(x, edge_index).relu(), edge_index)

    from pyg_fastattn import FastTransformerConv
    x, ei, _ = _graph('cpu')
    dims = ({0: Dim('N')}, {1: Dim('E')})
    for model in (Two(FastGATConv).eval(),
                  Two(FastTransformerConv, root_weight=False).eval()):
        ep = export(model, (x, ei), dynamic_shapes=dims)
        for N, E in ((60, 400), (50, 17), (9, 3)):
            g = torch.Generator().manual_seed(N)
            x2 = torch.randn(N, 12, generator=g)
            ei2 = torch.randint(0, N, (2, E), generator=g)
            torch.testing.assert_close(ep.module()(x2, ei2), model(x2, ei2))


@pytest.mark.parametrize('in_place', [False, True])
def test_compiled_autograd_after_eager_forward(in_place):
    """A backward compiled with compiled autograd, after an eager forward
    (the C++ autograd nodes mark no output non-differentiable: compiled
    autograd rejects those); also after an in-place op on an attention
    output."""
    import torch._dynamo.config as dynamo_config
    torch._dynamo.reset()
    torch.manual_seed(0)
    x, ei, ea = _graph('cpu')
    model = Net().eval()
    out = model(x, ei, ea)
    if in_place:  # on the output of the fused op itself
        out = model.conv1(x, ei, ea).relu_()
    loss = out.pow(2).sum()
    want = torch.autograd.grad(loss, list(model.parameters()),
                               retain_graph=True, allow_unused=True)
    dynamo_config.compiled_autograd = True
    try:
        torch.compile(lambda l: l.backward())(loss)
    finally:
        dynamo_config.compiled_autograd = False
        torch._dynamo.reset()
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, w)


class _InPlace(torch.nn.Module):
    """Two layers with in-place ops on their outputs: a ReLU and a
    residual."""

    def __init__(self, conv, **kw):
        super().__init__()
        self.c1, self.c2 = conv(12, 4, heads=2, **kw), conv(8, 4, heads=2, **kw)

    def forward(self, x, edge_index):
        h = self.c1(x, edge_index)
        h.relu_()
        out = self.c2(h, edge_index)
        out += h
        return out


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('name,compiler', [('gat', 'inductor'),
                                           ('gatv2', 'aot_eager'),
                                           ('transformer', 'aot_eager')])
def test_compiled_in_place_ops_on_outputs(device, name, compiler):
    """In-place ops on outputs that the fused ops keep for their backward
    (PyG's layers allow them): compiled training equals eager and PyG's."""
    from torch_geometric.nn import GATConv, GATv2Conv, TransformerConv
    pairs = {'gat': (GATConv, FastGATConv, {}),
             'gatv2': (GATv2Conv, FastGATv2Conv, {}),
             'transformer': (TransformerConv, FastTransformerConv,
                             dict(root_weight=False))}
    P, Fc, kw = pairs[name]
    torch._dynamo.reset()
    torch.manual_seed(0)
    x, ei, _ = _graph(device)
    pyg = _InPlace(P, **kw).to(device)
    ours = _InPlace(Fc, **kw).to(device)
    ours.load_state_dict(pyg.state_dict())
    compiled = torch.compile(ours, backend=compiler, fullgraph=True)
    res = []
    for m in (pyg, ours, compiled):
        pyg.zero_grad(set_to_none=True)
        ours.zero_grad(set_to_none=True)
        out = m(x, ei)
        out.pow(2).sum().backward()
        params = pyg if m is pyg else ours
        res.append((out.detach(), [p.grad for p in params.parameters()]))
    torch.testing.assert_close(res[1], res[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(res[2], res[1], atol=1e-5, rtol=1e-4)
    torch._dynamo.reset()


# autocast ###################################################################


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


AMP = [('cpu', torch.bfloat16)] + [
    pytest.param('cuda', dt, marks=[pytest.mark.cuda, requires_cuda])
    for dt in (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize('device,dtype', AMP)
def test_autocast_matches_float32(backend, device, dtype):
    """Under autocast the layers run in half precision (float32
    accumulation) and stay within half-precision error of float32, forward
    and backward; the weights' gradients come back in float32."""
    torch.manual_seed(0)
    x, ei, ea = _graph(device)
    y = torch.randint(0, 5, (x.size(0), ), device=device)
    model = Net().to(device)
    loss32, g32 = _step_grads(model, x, ei, ea, y)
    with torch.autocast(device, dtype=dtype):
        out = model.conv1(x, ei, ea)
        assert out.dtype == dtype
    model.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=dtype):
        loss = F.cross_entropy(model(x, ei, ea), y)
    loss.backward()
    assert abs(loss.item() - loss32.item()) < 2e-2 * abs(loss32.item())
    for (name, p), g in zip(model.named_parameters(), g32):
        assert p.grad.dtype == torch.float32, name
        assert _rel(p.grad, g) < 8e-2, (name, _rel(p.grad, g))


LAYER_CONFIGS = [
    (cls, kw) for cls in (FastGATConv, FastGATv2Conv, FastTransformerConv)
    for kw in (dict(heads=4), dict(heads=4, concat=False),
               dict(heads=4, bias=False), dict(heads=1),
               dict(heads=4, concat=False, bias=False))
] + [(FastGATConv, dict(heads=4, residual=True)),
     (FastGATv2Conv, dict(heads=4, residual=True)),
     (FastTransformerConv, dict(heads=4, root_weight=False))]


@pytest.mark.parametrize('device,dtype', AMP)
@pytest.mark.parametrize('cls,kw', LAYER_CONFIGS,
                         ids=lambda v: v.__name__ if isinstance(v, type)
                         else '-'.join(f'{k}={w}' for k, w in v.items()))
def test_autocast_output_dtype(device, dtype, cls, kw):
    """Every fused layer returns the autocast dtype in every configuration
    (bias fused or added, concat or mean, residual), close to its float32
    output, and its parameters' gradients come back in float32."""
    torch.manual_seed(0)
    x, ei, _ = _graph(device)
    conv = cls(12, 8, **kw).to(device)
    out32 = conv(x, ei)
    with torch.autocast(device, dtype=dtype):
        out = conv(x, ei)
    assert out.dtype == dtype
    assert _rel(out, out32) < 2e-2
    out.float().square().sum().backward()
    for name, p in conv.named_parameters():
        if p.grad is not None:
            assert p.grad.dtype == torch.float32, name
    bias = getattr(conv, 'bias', None)  # (TransformerConv's: in its Linears)
    assert bias is None or bias.grad is not None


@pytest.mark.parametrize('device', CUDA_ONLY)
def test_autocast_kernels_read_half(device):
    """On CUDA the fused op really runs in half precision (its output is
    half) and matches a float64 reference of the cast inputs."""
    t = _inputs(device, torch.int32, grad=False)
    v = t['v']
    with torch.autocast('cuda', dtype=torch.float16):
        out = ops.softmax_aggregate(t['rowptr'], t['col'], t['s'], v)
    assert out.dtype == torch.float16
    ref = ops.softmax_aggregate(t['rowptr'], t['col'], t['s'].half().double(),
                                v.half().double())
    assert _rel(out, ref) < 2e-3

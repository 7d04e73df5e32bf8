"""``ops.linear`` and ``ops.column_sum``: against ``F.linear`` / ``sum(0)``
in float64 and per dtype, gradcheck, autocast, determinism, and the layers'
use of them (PyG's plain ``Linear`` only; subclasses and hooks call the
module)."""
import pytest
import torch
import torch.nn.functional as F
from torch_geometric.nn import GATConv
from torch_geometric.nn.dense.linear import Linear

import pyg_fastattn
from pyg_fastattn import FastGATConv, FastGATv2Conv, FastTransformerConv, ops
from pyg_fastattn.nn.base import plain_linear
from pyg_fastattn.ops import _lib

from conftest import DEVICES, HALF, assert_float32_x_grad, requires_cuda


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('with_bias', [True, False])
def test_linear_matches_f_linear(backend, device, with_bias):
    d = dict(dtype=torch.float64, device=device, requires_grad=True)
    x, w = torch.randn(37, 11, **d), torch.randn(6, 11, **d)
    b = torch.randn(6, **d) if with_bias else None
    g = torch.randn(37, 6, dtype=torch.float64, device=device)
    inputs = [t for t in (x, w, b) if t is not None]
    y = ops.linear(x, w, b)
    want = F.linear(x, w, b)
    torch.testing.assert_close(y, want)
    got = torch.autograd.grad(y, inputs, g)
    exp = torch.autograd.grad(want, inputs, g)
    for a, e in zip(got, exp):
        torch.testing.assert_close(a, e)
    assert torch.autograd.gradcheck(
        lambda *t: ops.linear(*t) if with_bias else ops.linear(*t, None),
        [t.detach()[:5].clone().requires_grad_() if t is x else
         t.detach().clone().requires_grad_() for t in inputs])


@pytest.mark.parametrize('device', DEVICES)
def test_linear_partial_grads(backend, device):
    """Only the inputs that need a gradient get one (x a plain input)."""
    x = torch.randn(9, 4, device=device)
    w = torch.randn(3, 4, device=device, requires_grad=True)
    b = torch.randn(3, device=device)
    gw, = torch.autograd.grad(ops.linear(x, w, b).sum(), [w])
    torch.testing.assert_close(gw, torch.ones(9, 3, device=device).t() @ x)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('rows', [5, 40000])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64,
                                   torch.bfloat16])
def test_column_sum(device, rows, dtype):
    """Both sides of the GEMV threshold (CUDA): sum(0) within the dtype's
    rounding, and the same bits twice."""
    src = torch.randn(rows, 24, device=device).to(dtype)
    want = src.double().sum(0)
    got = ops.column_sum(src)
    assert got.dtype == dtype and got.shape == (24, )
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 1e-2}
    scale = src.double().abs().sum(0).clamp(min=1)
    assert ((got.double() - want).abs() / scale).max() < tol[dtype]
    assert torch.equal(ops.column_sum(src), got)


@pytest.mark.parametrize('device', DEVICES)
def test_column_sum_grad(device):
    """column_sum is differentiable: each row gets the output's gradient
    (it had no autograd formula, and a backward through it gave none)."""
    src = torch.randn(7, 5, dtype=torch.float64, device=device,
                      requires_grad=True)
    assert torch.autograd.gradcheck(ops.column_sum, (src, ))
    g = torch.randn(5, dtype=torch.float64, device=device)
    got, = torch.autograd.grad(ops.column_sum(src), src, g)
    assert torch.equal(got, g.expand(7, 5))
    torch.library.opcheck(_lib.op('column_sum'), (src, ))


def test_column_sum_rejects_bad_input():
    with pytest.raises(RuntimeError, match='2-D'):
        ops.column_sum(torch.randn(3))
    with pytest.raises(RuntimeError, match='floating'):
        ops.column_sum(torch.ones(3, 2, dtype=torch.long))


@pytest.mark.parametrize('device', DEVICES)
def test_linear_rejects_bad_input(device):
    x, w = torch.randn(4, 3, device=device), torch.randn(2, 3, device=device)
    with pytest.raises(RuntimeError, match='in_features'):
        ops.linear(torch.randn(4, 5, device=device), w, None)
    with pytest.raises(RuntimeError, match='out_features'):
        ops.linear(x, w, torch.randn(3, device=device))
    with pytest.raises(RuntimeError, match='dtype'):
        ops.linear(x.double(), w, None)


@pytest.mark.parametrize('device', [
    'cpu', pytest.param('cuda', marks=[pytest.mark.cuda, requires_cuda])])
def test_linear_autocast(device):
    """Under autocast all three inputs take its dtype, as F.linear's rule."""
    dtype = torch.bfloat16
    x = torch.randn(16, 8, device=device)
    w = torch.randn(4, 8, device=device, requires_grad=True)
    b = torch.randn(4, device=device, requires_grad=True)
    with torch.autocast(device, dtype=dtype):
        y = ops.linear(x, w, b)
        want = F.linear(x, w, b)
    assert y.dtype == want.dtype == dtype
    torch.testing.assert_close(y, want)
    gw, gb = torch.autograd.grad(y.float().sum(), [w, b])
    assert gw.dtype == gb.dtype == torch.float32
    torch.testing.assert_close(gb, torch.full_like(gb, 16.0))


@pytest.mark.parametrize('device', [
    'cpu', pytest.param('cuda', marks=[pytest.mark.cuda, requires_cuda])])
def test_autocast_casts_a_parameter_once(device):
    """The native autocast rule casts through autocast's cache, as aten ops
    do: a parameter used twice in one autocast region is cast once, an
    input that is not a leaf parameter every time."""
    from torch.utils._python_dispatch import TorchDispatchMode
    if not pyg_fastattn._build.load().native:
        pytest.skip('the autocast cache is the native rule\'s')

    class Casts(TorchDispatchMode):
        shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default:
                self.shapes.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    # (a float16 x is cast; a float32 x would stay float32, see
    # test_linear_float32_x_beside_half_weight)
    x = torch.randn(16, 8, device=device, dtype=torch.float16)
    w = torch.randn(4, 8, device=device, requires_grad=True)
    with torch.autocast(device, dtype=torch.bfloat16), Casts() as m:
        y = ops.linear(x, w, None) + ops.linear(x, w, None)
    assert y.dtype == torch.bfloat16
    assert m.shapes.count((4, 8)) == 1 and m.shapes.count((16, 8)) == 2


@pytest.mark.parametrize('device,dtype', HALF)
@pytest.mark.parametrize('x_grad', [True, False])
def test_linear_float32_x_beside_half_weight(backend, device, dtype, x_grad):
    """linear takes x in float32 beside a 16-bit weight (the native autocast
    rule leaves x so, and the op casts it where it reads it: no 16-bit copy
    of x is saved for the backward, and x's gradient needs no cast back).
    The output and the weight's and bias's gradients are those of x cast
    first; x's gradient comes back in float32 (on CUDA written so by the
    GEMM: within rounding of the cast one)."""
    torch.manual_seed(0)
    x = torch.randn(37, 11, device=device, requires_grad=x_grad)
    w = torch.randn(6, 11, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(6, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(37, 6, device=device, dtype=dtype)
    y = ops.linear(x, w, b)
    y.backward(g)
    got = [w.grad, b.grad]
    w.grad = b.grad = None
    x16 = x.detach().to(dtype).requires_grad_(x_grad)
    want = ops.linear(x16, w, b)
    want.backward(g)
    assert y.dtype == dtype and torch.equal(y, want)
    assert torch.equal(got[0], w.grad) and torch.equal(got[1], b.grad)
    if x_grad:
        assert_float32_x_grad(x, x16, device)
    torch.library.opcheck(_lib.op('linear'), (x.detach(), w, b))
    with pytest.raises(RuntimeError, match='dtype'):
        ops.linear(x.detach().double(), w, b)
    with pytest.raises(RuntimeError, match='dtype'):
        ops.linear(x.detach(), w, b.detach().float())


@pytest.mark.parametrize('device', [
    'cpu', pytest.param('cuda', marks=[pytest.mark.cuda, requires_cuda])])
def test_linear_autocast_keeps_float32_x(device):
    """Under autocast the native rule hands a float32 x to the op as it is
    (so the op, not the rule, casts it, and autograd saves no 16-bit copy
    of x); the output and x's gradient are those of F.linear under the same
    autocast, x's gradient in float32."""
    from torch.utils._python_dispatch import TorchDispatchMode
    if not pyg_fastattn._build.load().native:
        pytest.skip('the native rule keeps x; the Python rule casts it')

    class Seen(TorchDispatchMode):
        dtypes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is _lib.op('linear'):
                self.dtypes.append(args[0].dtype)
            return func(*args, **(kwargs or {}))

    x = torch.randn(16, 8, device=device, requires_grad=True)
    w = torch.randn(4, 8, device=device, requires_grad=True)
    b = torch.randn(4, device=device, requires_grad=True)
    with torch.autocast(device, dtype=torch.bfloat16):
        with Seen() as m:
            y = ops.linear(x, w, b)
        want = F.linear(x, w, b)
    assert m.dtypes == [torch.float32]
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)
    gx, = torch.autograd.grad(y.float().sum(), [x])
    ex, = torch.autograd.grad(want.float().sum(), [x])
    assert gx.dtype == torch.float32
    torch.testing.assert_close(gx, ex, rtol=1e-2, atol=1e-2)


def test_plain_linear():
    lin = Linear(8, 4)
    x = torch.randn(3, 8)
    assert plain_linear(lin, x)
    assert not plain_linear(lin, torch.randn(3, 5))  # another width
    assert not plain_linear(lin, x.double())  # another dtype
    assert not plain_linear(lin, torch.randn(2, 3, 8))  # not 2-D
    assert not plain_linear(torch.nn.Linear(8, 4), x)  # not PyG's

    class Sub(Linear):
        pass

    assert not plain_linear(Sub(8, 4), x)
    h = lin.register_forward_hook(lambda *a: None)
    assert not plain_linear(lin, x)
    h.remove()
    assert plain_linear(lin, x)
    assert not plain_linear(Linear(-1, 4), x)  # lazy, not initialized
    glob = torch.nn.modules.module
    for register in (lin.register_full_backward_hook,
                     lin.register_full_backward_pre_hook,
                     glob.register_module_forward_hook,
                     glob.register_module_forward_pre_hook,
                     glob.register_module_full_backward_hook,
                     glob.register_module_full_backward_pre_hook):
        h = register(lambda *a: None)
        try:
            assert not plain_linear(lin, x), register.__name__
        finally:
            h.remove()
        assert plain_linear(lin, x)


def test_pruned_linear_is_called():
    """torch.nn.utils.prune moves the weight out of the parameters (a hook
    computes it): not plain, so the layer calls it and matches GATConv."""
    import torch.nn.utils.prune as prune
    torch.manual_seed(0)
    x, ei = torch.randn(10, 8), torch.randint(0, 10, (2, 30))
    ref = GATConv(8, 4, heads=2)
    conv = FastGATConv(8, 4, heads=2)
    conv.load_state_dict(ref.state_dict())
    for m in (ref, conv):
        prune.l1_unstructured(m.lin, 'weight', amount=0.5)
        m.lin.weight_mask.copy_(ref.lin.weight_mask)
    assert 'weight' not in conv.lin._parameters
    assert not plain_linear(conv.lin, x)
    torch.testing.assert_close(conv(x, ei), ref(x, ei))


def _count_linear(monkeypatch):
    calls = []
    real = pyg_fastattn.ops.linear

    def counted(*args):
        calls.append(args[1].shape)
        return real(*args)

    monkeypatch.setattr(pyg_fastattn.ops, 'linear', counted)
    return calls


LAYERS = [(FastGATv2Conv, ['lin_l', 'lin_r']),
          (FastTransformerConv,
           ['lin_query', 'lin_key', 'lin_value', 'lin_skip'])]


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('cls,lins', LAYERS)
def test_layers_route_plain_linear(monkeypatch, device, cls, lins):
    """Every biased plain Linear of the layer goes through ops.linear (the
    projections of one node set as one call); with a hook on one of them,
    that one is called as a module (the hook runs), the others through
    ops.linear each, and the output does not change."""
    torch.manual_seed(0)
    conv = cls(8, 5, heads=2).to(device)
    x = torch.randn(12, 8, device=device)
    ei = torch.randint(12, (2, 40), device=device)
    calls = _count_linear(monkeypatch)
    out = conv(x, ei)
    assert len(calls) == 1
    seen = []
    h = getattr(conv, lins[0]).register_forward_hook(
        lambda m, i, o: seen.append(o.shape))
    calls.clear()
    out2 = conv(x, ei)
    h.remove()
    assert len(calls) == len(lins) - 1 and len(seen) == 1
    torch.testing.assert_close(out2, out)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('root_weight', [True, False])
@pytest.mark.parametrize('in_place', [True, False])
def test_transformer_fused_projections(monkeypatch, device, root_weight,
                                       in_place):
    """On one node set the query, key, value (and skip) Linears run as one
    ops.linear; output and every gradient match four separate ones
    (fuse_projections_max_elems = 0), with and without the in-place
    backward. Bipartite input and larger inputs keep one call each."""
    torch.manual_seed(0)
    conv = FastTransformerConv(8, 5, heads=2, root_weight=root_weight,
                               dropout=0.0).to(device)
    conv.grads_in_place = in_place
    x = torch.randn(12, 8, device=device, requires_grad=True)
    ei = torch.randint(12, (2, 40), device=device)
    g = torch.randn(12, 10, device=device)
    k = 4 if root_weight else 3
    leaves = [x] + list(conv.parameters())

    def run():
        out = conv(x, ei)
        return out, torch.autograd.grad(out, leaves, g, allow_unused=True)

    calls = _count_linear(monkeypatch)
    out, grads = run()
    assert len(calls) == 1
    conv.fuse_projections_max_elems = 0
    calls.clear()
    out0, grads0 = run()
    assert len(calls) == k
    torch.testing.assert_close(out, out0)
    assert sum(a is not None for a in grads) == 1 + 2 * k
    for a, b in zip(grads, grads0):
        torch.testing.assert_close(a, b)
    conv.fuse_projections_max_elems = 12 * 10 * k - 1  # one element over
    calls.clear()
    run()
    assert len(calls) == k
    conv.fuse_projections_max_elems = 1 << 23
    calls.clear()
    conv((x, x.detach().clone()), ei)  # bipartite: two node sets
    assert len(calls) == k


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('bias', [True, False])
@pytest.mark.parametrize('share_weights', [False, True])
def test_gatv2_fused_projections(monkeypatch, device, bias, share_weights):
    """On one node set lin_l and lin_r run as one ops.linear (with or
    without their biases); output and every gradient match two separate
    Linears (fuse_projections_max_elems = 0). Shared weights, bipartite
    input and larger inputs are not fused."""
    torch.manual_seed(0)
    conv = FastGATv2Conv(8, 5, heads=2, bias=bias, dropout=0.0,
                         share_weights=share_weights).to(device)
    x = torch.randn(12, 8, device=device, requires_grad=True)
    ei = torch.randint(12, (2, 40), device=device)
    g = torch.randn(12, 10, device=device)
    leaves = [x] + list(conv.parameters())
    unfused = (1 if share_weights else 2) if bias else 0

    def run():
        out = conv(x, ei)
        return out, torch.autograd.grad(out, leaves, g, allow_unused=True)

    calls = _count_linear(monkeypatch)
    out, grads = run()
    assert len(calls) == (unfused if share_weights else 1)
    conv.fuse_projections_max_elems = 0
    calls.clear()
    out0, grads0 = run()
    assert len(calls) == unfused
    torch.testing.assert_close(out, out0)
    assert all(a is not None for a in grads)
    for a, b in zip(grads, grads0):
        torch.testing.assert_close(a, b)
    conv.fuse_projections_max_elems = 12 * 10 * 2 - 1  # one element over
    calls.clear()
    run()
    assert len(calls) == unfused
    conv.fuse_projections_max_elems = 1 << 23
    calls.clear()
    conv((x, x.detach().clone()), ei)  # bipartite: a Linear per side
    assert len(calls) == (2 if bias else 0)


@pytest.mark.parametrize('cls,lins', LAYERS)
def test_layers_lazy_linear(cls, lins):
    """in_channels=-1: the first call initializes the lazy Linears, later
    calls take ops.linear; the output is the same."""
    torch.manual_seed(0)
    conv = cls(-1, 5, heads=2)
    x = torch.randn(12, 8)
    ei = torch.randint(12, (2, 40))
    out = conv(x, ei)
    torch.testing.assert_close(conv(x, ei), out)

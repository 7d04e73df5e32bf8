"""gatv2_attention (op) and FastGATv2Conv (layer).

The op is checked against autograd through the float64 reference forward
(``reference.gatv2_attention`` called as a plain function, so the explicit
backward formulas of both backends are under test), with gradcheck, for
determinism and in half precision. The layer is checked against PyG's
GATv2Conv under the same state_dict."""
import pytest
import torch
import torch.nn.functional as F
from torch_geometric.nn import GATv2Conv

from pyg_fastattn import FastGATv2Conv, ops, reference, swap

from conftest import DEVICES, requires_cuda
from graphs import assert_deterministic, hub_rows, make_graph, noncontig

KINDS = ['mixed', 'huge', 'empty', 'single', 'deg1']


def _inputs(kind, device, idx=torch.int64, dtype=torch.float64, H=4, C=5,
            edge=True, mask=True):
    rowptr, col, Ns = make_graph(kind, idx, device)
    N, E = rowptr.numel() - 1, col.numel()
    d = dict(dtype=dtype, device=device)
    x_l = torch.randn(Ns, H, C, **d)
    x_r = torch.randn(N, H, C, **d)
    att = torch.randn(H, C, **d)
    e_t = torch.randn(E, H, C, **d) if edge else None
    m = ((torch.rand(E, H, device=device) > 0.3).to(dtype) / 0.7
         if mask else None)
    return rowptr, col, x_l, x_r, e_t, att, m


def _grads(fn, tensors, grad_out):
    ts = [t.detach().requires_grad_() if t is not None else None
          for t in tensors]
    out = fn(*ts)
    gs = torch.autograd.grad(out, [t for t in ts if t is not None], grad_out)
    return out.detach(), list(gs)


def _check_half(op, ts, go, dtype):
    """Output and gradients of ``op`` in half precision ``dtype`` against
    the same op in float32: relative errors below 1e-2 and 3e-2."""
    out, g = _grads(op, ts, go)
    out32, g32 = _grads(op, [t.float() if t is not None else None
                             for t in ts], go.float())
    assert out.dtype == dtype
    rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item()  # noqa
    assert rel(out, out32) < 1e-2
    for a, b in zip(g, g32):
        assert a.dtype == dtype
        assert rel(a, b) < 3e-2


def _check(rowptr, col, x_l, x_r, e_t, att, mask, tol, slope=0.2,
           bias=None):
    """The op (current backend) against the float64 reference."""
    def op(a, b, c, e, bi):
        return ops.gatv2_attention(rowptr, col, a, b, c, e, mask, slope,
                                   bias=bi)

    def ref(a, b, c, e, bi):
        m = mask.double() if mask is not None else None
        e = e.double() if e is not None else None
        bi = bi.double() if bi is not None else None
        return reference.gatv2_attention(rowptr, col, a.double(), b.double(),
                                         e, c.double(), m, slope, bi)[0]

    go = torch.randn(rowptr.numel() - 1, x_l.size(1), x_l.size(2),
                     dtype=x_l.dtype, device=x_l.device)
    out, g = _grads(op, (x_l, x_r, att, e_t, bias), go)
    out_ref, g_ref = _grads(ref, [t.double() if t is not None else None
                                  for t in (x_l, x_r, att, e_t, bias)],
                            go.double())
    assert out.dtype == x_l.dtype
    torch.testing.assert_close(out.double(), out_ref, atol=tol, rtol=tol)
    names = [n for n, t in zip(['x_l', 'x_r', 'att', 'edge_term', 'bias'],
                               (x_l, x_r, att, e_t, bias)) if t is not None]
    for name, a, b in zip(names, g, g_ref):
        assert a.dtype == x_l.dtype, name
        # grad_att sums over every edge: its error grows with the largest
        # term, not with the (possibly cancelled) result
        scale = max(1.0, b.abs().max().item()) if b.numel() else 1.0
        torch.testing.assert_close(a.double(), b, atol=tol * scale, rtol=tol,
                                   msg=lambda m: f'{name}: {m}')


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('kind', KINDS)
@pytest.mark.parametrize('idx', [torch.int32, torch.int64])
def test_graph_shapes(backend, device, kind, idx):
    """Empty rows, degree-1 rows, a 5000-edge hub row, E = 0, N = 1."""
    t = _inputs(kind, device, idx)
    _check(*t, tol=1e-10)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('H', [1, 4, 8])
@pytest.mark.parametrize('C', [3, 8, 33, 64])
@pytest.mark.parametrize('edge,mask', [(False, False), (True, False),
                                       (False, True), (True, True)])
def test_heads_channels_terms(backend, device, H, C, edge, mask):
    """Heads 1/4/8, odd and vector-sized channels, with and without the
    edge term and the dropout mask; float32 against float64."""
    t = _inputs('mixed', device, torch.int32, torch.float32, H, C, edge,
                mask)
    _check(*t, tol=2e-5)


# (H, C) covering the CUDA kernels' lane layouts (float32 / float64): heads
# in several tiles, two / four channel slots (C > 32 vector units), eight
# slots of odd C (scalar units), 32 slots, one unit per head, many heads of
# 2 channels.
LAYOUTS = [(16, 64), (2, 256), (1, 129), (1, 301), (3, 7), (8, 4), (64, 2)]


def _tol32(C):
    """float32 tolerance against float64 at C channels a head (unscaled
    scores of sums of C terms)."""
    return 5e-5 if C <= 256 else 2e-4


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('H,C', LAYOUTS)
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_layouts(backend, device, H, C, dtype):
    t = _inputs('mixed', device, torch.int64, dtype, H, C)
    _check(*t, tol=1e-10 if dtype == torch.float64 else _tol32(C))


def _misaligned(t):
    """A contiguous copy of ``t`` starting one element into its storage."""
    big = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = big[1:].view(t.shape)
    out.copy_(t)
    assert out.is_contiguous()
    return out


@pytest.mark.parametrize('device', DEVICES)
def test_misaligned_inputs(backend, device):
    """Inputs whose data does not start on 16 bytes (scalar loads)."""
    rowptr, col, x_l, x_r, e_t, att, m = _inputs('mixed', device,
                                                 dtype=torch.float32, H=4,
                                                 C=8)
    _check(rowptr, col, _misaligned(x_l), _misaligned(x_r), _misaligned(e_t),
           _misaligned(att), m, tol=5e-5)


def _bias(t, shape=None):
    """A bias of H * C elements for the inputs ``t`` (x_l's dtype)."""
    x_l = t[2]
    H, C = x_l.shape[1], x_l.shape[2]
    b = torch.randn(H * C, dtype=torch.float64, device=x_l.device)
    return b.to(x_l.dtype).view(shape or (H * C, ))


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('kind', KINDS)
def test_bias_graph_shapes(backend, device, kind):
    """The bias added in the store (empty rows get it) and its gradient,
    with delta = <grad_out, out - bias> in the backward."""
    t = _inputs(kind, device)
    _check(*t, tol=1e-10, bias=_bias(t))


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('H,C', LAYOUTS + [(4, 32), (4, 5)])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_bias_layouts(backend, device, H, C, dtype):
    """Every CUDA lane layout (heads per lane, channel slots, vector and
    scalar units) stores and subtracts the bias at the right offsets."""
    t = _inputs('mixed', device, torch.int32, dtype, H, C)
    _check(*t, tol=1e-10 if dtype == torch.float64 else _tol32(C),
           bias=_bias(t, (H, C)))


@pytest.mark.parametrize('device', DEVICES)
def test_bias_misaligned_and_noncontiguous(backend, device):
    t = _inputs('mixed', device, dtype=torch.float32, H=4, C=8)
    _check(*t, tol=5e-5, bias=_misaligned(_bias(t)))
    _check(*t, tol=5e-5, bias=noncontig(_bias(t)))


@pytest.mark.parametrize('device', DEVICES)
def test_bias_empty_rows_and_lse(backend, device):
    """Empty rows hold the bias, their lse stays -inf; the lse does not
    depend on the bias."""
    t = _inputs('mixed', device)
    rowptr, col, x_l, x_r, e_t, att, m = t
    bias = _bias(t)
    out, lse = ops.gatv2_attention(rowptr, col, x_l, x_r, att, e_t, m,
                                   return_lse=True, bias=bias)
    out0, lse0 = ops.gatv2_attention(rowptr, col, x_l, x_r, att, e_t, m,
                                     return_lse=True)
    empty = (rowptr[1:] == rowptr[:-1])
    assert empty.any()
    assert torch.isneginf(lse[empty]).all()
    # bitwise for the native kernels; the reference's CUDA index_add uses
    # atomics, so two of its runs differ in the last bits
    if backend == 'native' or device == 'cpu':
        assert torch.equal(lse, lse0)
    else:
        torch.testing.assert_close(lse, lse0)
    assert torch.equal(out[empty], bias.view(1, 4, 5).expand_as(out[empty]))
    torch.testing.assert_close(out, out0 + bias.view(4, 5), atol=1e-12,
                               rtol=0)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('edge', [False, True])
def test_bias_gradcheck(backend, device, edge):
    """gradcheck with the bias, on a graph with empty and degree-1 rows."""
    rowptr, col, x_l, x_r, e_t, att, m = _inputs('mixed', device, H=2, C=3,
                                                 edge=edge)
    deg = rowptr[1:] - rowptr[:-1]
    assert (deg == 0).any() and (deg == 1).any()
    nondet = 1e-12 if backend == 'reference' and device == 'cuda' else 0.0
    bias = torch.randn(6, dtype=torch.float64, device=device)
    args = [x_l, x_r, att, bias] + ([e_t] if edge else [])
    args = [a.requires_grad_() for a in args]

    def fn(a, b, c, bi, e=None):
        return ops.gatv2_attention(rowptr, col, a, b, c, e, m, bias=bi)

    assert torch.autograd.gradcheck(fn, args, nondet_tol=nondet)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_bias_half_precision(backend, device, dtype):
    """Half inputs and bias, float32 accumulation (delta too): within
    half-precision error of float32 on the same rounded inputs."""
    t = _inputs('mixed', device, dtype=torch.float32, H=4, C=8)
    rowptr, col, x_l, x_r, e_t, att, m = t
    ts = [u.to(dtype) for u in (x_l, x_r, att, e_t, 3 * _bias(t))]
    go = torch.randn(rowptr.numel() - 1, 4, 8, device=device).to(dtype)
    mh = m.to(dtype)

    def op(a, b, c, e, bi):
        return ops.gatv2_attention(rowptr, col, a, b, c, e, mh, bias=bi)

    _check_half(op, ts, go, dtype)


@pytest.mark.parametrize('device', DEVICES)
def test_many_rows(backend, device):
    """More rows than the backward's fixed grid has warps (rows strided over
    warps, grad_att from many partials), the benchmark's head layout."""
    rowptr, col = hub_rows(20000, 15000, 5, device)
    H, C = 4, 32
    d = dict(device=device)
    x_l, x_r = torch.randn(15000, H, C, **d), torch.randn(20000, H, C, **d)
    att = torch.randn(H, C, **d)
    _check(rowptr, col, x_l, x_r, None, att, None, tol=1e-4)


@pytest.mark.parametrize('device', DEVICES)
def test_noncontiguous_and_slope(backend, device):
    rowptr, col, x_l, x_r, e_t, att, m = _inputs('mixed', device)
    _check(rowptr, col, noncontig(x_l), noncontig(x_r), noncontig(e_t),
           noncontig(att), noncontig(m), tol=1e-10, slope=0.01)


@pytest.mark.parametrize('device', DEVICES)
def test_lse_and_empty_rows(backend, device):
    rowptr, col, x_l, x_r, e_t, att, m = _inputs('mixed', device)
    out, lse = ops.gatv2_attention(rowptr, col, x_l, x_r, att, e_t, m,
                                   return_lse=True)
    _, lse_ref = reference.gatv2_attention(rowptr, col, x_l, x_r, e_t, att, m,
                                           0.2)
    torch.testing.assert_close(lse, lse_ref)
    empty = (rowptr[1:] == rowptr[:-1])
    assert empty.any()
    assert torch.isneginf(lse[empty]).all()
    assert (out[empty] == 0).all()


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('edge', [False, True])
def test_gradcheck(backend, device, edge):
    rowptr, col, x_l, x_r, e_t, att, m = _inputs('mixed', device, H=2, C=3,
                                                 edge=edge)
    # The reference's index_add is atomic on CUDA: allow its reordering.
    nondet = 1e-12 if backend == 'reference' and device == 'cuda' else 0.0
    args = [x_l, x_r, att] + ([e_t] if edge else [])
    args = [a.requires_grad_() for a in args]

    def fn(a, b, c, e=None):
        return ops.gatv2_attention(rowptr, col, a, b, c, e, m)

    assert torch.autograd.gradcheck(fn, args, nondet_tol=nondet)


@pytest.mark.parametrize('device', DEVICES)
def test_backward_bitwise_reproducible(device):
    """Two backward passes give the same bits (no atomics); on CPU also with
    1 and 2 threads."""
    rowptr, col, x_l, x_r, e_t, att, m = _inputs('huge', device,
                                                 dtype=torch.float32, H=4,
                                                 C=16)
    go = torch.randn(rowptr.numel() - 1, 4, 16, device=device)

    def run():
        _, g = _grads(lambda a, b, c, e: ops.gatv2_attention(
            rowptr, col, a, b, c, e, m), (x_l, x_r, att, e_t), go)
        return g

    assert_deterministic(run, device)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_half_precision(backend, device, dtype):
    """Half inputs, float32 accumulation: within half-precision error of
    float32 on the same (rounded) inputs."""
    rowptr, col, x_l, x_r, e_t, att, m = _inputs('mixed', device,
                                                 dtype=torch.float32, H=4,
                                                 C=8)
    ts = [t.to(dtype) for t in (x_l, x_r, att, e_t)]
    go = torch.randn(rowptr.numel() - 1, 4, 8, device=device).to(dtype)
    mh = m.to(dtype)

    def op(a, b, c, e):
        return ops.gatv2_attention(rowptr, col, a, b, c, e, mh)

    _check_half(op, ts, go, dtype)


def test_checks():
    rowptr, col, x_l, x_r, e_t, att, m = _inputs('mixed', 'cpu')
    with pytest.raises((RuntimeError, ValueError), match='x_r'):
        ops.gatv2_attention(rowptr, col, x_l, x_r[:-1], att, e_t, m)
    with pytest.raises((RuntimeError, ValueError), match='att'):
        ops.gatv2_attention(rowptr, col, x_l, x_r, att[:, :-1], e_t, m)
    with pytest.raises((RuntimeError, ValueError), match='edge_term'):
        ops.gatv2_attention(rowptr, col, x_l, x_r, att, e_t[:-1], m)
    with pytest.raises(IndexError):
        ops.gatv2_attention(rowptr, col + 100, x_l, x_r, att, e_t, m)
    bias = torch.randn(4 * 5, dtype=x_l.dtype)
    with pytest.raises((RuntimeError, ValueError), match='bias'):
        ops.gatv2_attention(rowptr, col, x_l, x_r, att, e_t, m,
                            bias=bias[:-1])
    op = torch.ops.pyg_fastattn.gatv2_attention
    with pytest.raises(RuntimeError, match='bias'):  # the kernels' checks
        op(rowptr, col, x_l, x_r, e_t, att, m, 0.2, bias[:-1], None, None,
           None, -1, -1)
    with pytest.raises(RuntimeError, match='bias'):
        op(rowptr, col, x_l, x_r, e_t, att, m, 0.2, bias.float(), None,
           None, None, -1, -1)


# FastGATv2Conv against GATv2Conv ############################################

CONFIGS = [
    dict(heads=2),
    dict(heads=1, concat=False),
    dict(heads=4, share_weights=True),
    dict(heads=4, concat=False, residual=True, negative_slope=0.1),
    dict(heads=2, edge_dim=3),
    dict(heads=2, edge_dim=3, fill_value='add', residual=True),
    dict(heads=2, edge_dim=3, fill_value=0.5, share_weights=True),
    dict(heads=8, add_self_loops=False, bias=False),
    dict(heads=2, edge_dim=3, add_self_loops=False),
]


def _graph(device, N=30, E=150, bipartite=False):
    g = torch.Generator().manual_seed(3)
    Ns = N
    Nd = N // 2 if bipartite else N
    src = torch.randint(0, Ns, (E, ), generator=g)
    dst = torch.randint(0, Nd, (E, ), generator=g)
    ei = torch.stack([src, dst])
    ei[:, :3] = torch.tensor([[0, 1, 2], [0, 1, 1]])  # self-loops, dups
    x = torch.randn(Ns, 7, generator=g, dtype=torch.float64)
    xd = torch.randn(Nd, 6, generator=g, dtype=torch.float64)
    ea = torch.randn(E, 3, generator=g, dtype=torch.float64)
    return x.to(device), xd.to(device), ei.to(device), ea.to(device)


def _pair(cfg, device, in_channels=7):
    torch.manual_seed(0)
    ref = GATv2Conv(in_channels, 5, **cfg).double().to(device)
    fast = FastGATv2Conv(in_channels, 5, **cfg).double().to(device)
    fast.load_state_dict(ref.state_dict())
    return ref, fast


def _compare(ref, fast, args, kwargs=None):
    kwargs = kwargs or {}
    out_r = ref(*args, **kwargs)
    out_f = fast(*args, **kwargs)
    if isinstance(out_r, tuple):
        (out_r, (ei_r, a_r)), (out_f, (ei_f, a_f)) = out_r, out_f
        assert torch.equal(ei_r, ei_f)
        torch.testing.assert_close(a_f, a_r)
    torch.testing.assert_close(out_f, out_r)
    go = torch.randn_like(out_r)
    params_r, params_f = list(ref.parameters()), list(fast.parameters())
    inputs = [a for a in args if isinstance(a, torch.Tensor)
              and a.requires_grad]
    g_r = torch.autograd.grad(out_r, params_r + inputs, go)
    g_f = torch.autograd.grad(out_f, params_f + inputs, go)
    names = [n for n, _ in ref.named_parameters()] + ['input'] * len(inputs)
    for name, a, b in zip(names, g_f, g_r):
        torch.testing.assert_close(a, b, msg=lambda m: f'{name}: {m}')


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('cfg', CONFIGS, ids=str)
def test_layer_matches_pyg(backend, device, cfg):
    x, _, ei, ea = _graph(device)
    ref, fast = _pair(cfg, device)
    x.requires_grad_()
    args = (x, ei, ea) if 'edge_dim' in cfg else (x, ei)
    _compare(ref, fast, args)
    _compare(ref, fast, args, dict(return_attention_weights=True))


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('share', [False, True])
def test_layer_bipartite(backend, device, share):
    x, xd, ei, ea = _graph(device, bipartite=True)
    torch.manual_seed(0)
    ref = GATv2Conv((7, 6) if not share else 7, 5, heads=3, edge_dim=3,
                    residual=True, share_weights=share).double().to(device)
    fast = FastGATv2Conv((7, 6) if not share else 7, 5, heads=3, edge_dim=3,
                         residual=True, share_weights=share
                         ).double().to(device)
    fast.load_state_dict(ref.state_dict())
    xd = xd if not share else torch.randn(xd.size(0), 7, dtype=xd.dtype,
                                          device=device)
    x.requires_grad_()
    xd.requires_grad_()
    _compare(ref, fast, ((x, xd), ei, ea))
    _compare(ref, fast, ((x, xd), ei, ea),
             dict(return_attention_weights=True))


BIAS_CONFIGS = [
    dict(heads=3),
    dict(heads=3, residual=True),
    dict(heads=2, edge_dim=3, share_weights=True),
    dict(heads=2, edge_dim=3, residual=True),
    dict(heads=1, concat=False),
    dict(heads=3, concat=False),
]


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('cfg', BIAS_CONFIGS, ids=str)
def test_layer_fused_bias(backend, device, cfg, monkeypatch):
    """The op adds the bias exactly when nothing comes between (concat or
    one head, no residual); either way the layer equals GATv2Conv (nonzero
    bias), forward and gradients, with and without attention weights."""
    biases = []
    op = ops.gatv2_attention

    def spy(*args, **kwargs):
        biases.append(kwargs.get('bias'))
        return op(*args, **kwargs)

    monkeypatch.setattr(ops, 'gatv2_attention', spy)
    x, _, ei, ea = _graph(device)
    ref, fast = _pair(cfg, device)
    with torch.no_grad():  # PyG initializes the bias to zeros
        ref.bias.normal_()
        fast.bias.copy_(ref.bias)
    x.requires_grad_()
    args = (x, ei, ea) if 'edge_dim' in cfg else (x, ei)
    _compare(ref, fast, args)
    _compare(ref, fast, args, dict(return_attention_weights=True))
    fused = ((cfg.get('concat', True) or cfg['heads'] == 1)
             and not cfg.get('residual', False))
    assert len(biases) == 2
    assert all((b is fast.bias) if fused else b is None for b in biases)


@pytest.mark.parametrize('device', DEVICES)
def test_layer_sparse_and_dropout(backend, device):
    x, _, ei, _ = _graph(device)
    N = x.size(0)
    ref, fast = _pair(dict(heads=2), device)
    adj = torch.sparse_coo_tensor(ei.flip(0), torch.ones(ei.size(1)),
                                  (N, N), device=device).coalesce()
    _compare(ref, fast, (x, adj.to_sparse_csr()))
    # dropout 1.0 drops every weight (deterministic), in training only
    ref.dropout = fast.dropout = 1.0
    ref.train()
    fast.train()
    _compare(ref, fast, (x, ei))
    ref.eval()
    fast.eval()
    _compare(ref, fast, (x, ei))


@pytest.mark.parametrize('device', DEVICES)
def test_layer_dropout_mask_in_weights(device):
    """In training the returned weights carry the dropout mask: each kept
    weight is alpha / (1 - p) for the eval-mode alpha, the others 0."""
    x, _, ei, _ = _graph(device)
    _, fast = _pair(dict(heads=2, dropout=0.5), device)
    fast.eval()
    _, (_, alpha) = fast(x, ei, return_attention_weights=True)
    fast.train()
    _, (_, alpha_d) = fast(x, ei, return_attention_weights=True)
    kept = alpha_d != 0
    assert 0 < kept.float().mean().item() < 1
    torch.testing.assert_close(alpha_d[kept], 2 * alpha[kept])


def test_swap_converts_gatv2():
    model = torch.nn.ModuleList([GATv2Conv(7, 5, heads=2, edge_dim=3)])
    model = model.double()
    x, _, ei, ea = _graph('cpu')
    before = model[0](x, ei, ea)
    swap(model)
    assert type(model[0]) is FastGATv2Conv
    torch.testing.assert_close(model[0](x, ei, ea), before)


# torch.compile (inductor) against eager #####################################


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = FastGATv2Conv(7, 8, heads=4, edge_dim=3)
        self.conv2 = FastGATv2Conv(32, 5, heads=1, concat=False,
                                   share_weights=True)

    def forward(self, x, edge_index, edge_attr):
        x = F.elu(self.conv1(x, edge_index, edge_attr))
        return self.conv2(x, edge_index)


@pytest.mark.parametrize('device', DEVICES)
def test_inductor_matches_eager(backend, device):
    """One step's loss and gradients under inductor equal eager's."""
    torch._dynamo.reset()
    x, _, ei, ea = _graph(device)
    x, ea = x.float(), ea.float()
    y = torch.randint(0, 5, (x.size(0), ), device=device)
    torch.manual_seed(0)
    eager = Net().to(device)
    model = Net().to(device)
    model.load_state_dict(eager.state_dict())
    compiled = torch.compile(model, fullgraph=True)
    grads = []
    for m in (eager, compiled):
        loss = F.cross_entropy(m(x, ei, ea), y)
        loss.backward()
        grads.append((loss.detach(), [p.grad for p in m.parameters()]))
    (le, ge), (lc, gc) = grads
    torch.testing.assert_close(lc, le, atol=1e-5, rtol=1e-5)
    for (name, _), a, b in zip(eager.named_parameters(), gc, ge):
        tol = 1e-4 * max(b.abs().max().item(), 1e-12)
        assert (a - b).abs().max().item() <= tol, name


@pytest.mark.parametrize('device,dtype', [('cpu', torch.bfloat16)] + [
    pytest.param('cuda', dt, marks=[pytest.mark.cuda, requires_cuda])
    for dt in (torch.bfloat16, torch.float16)])
def test_layer_autocast(backend, device, dtype):
    x, _, ei, ea = _graph(device)
    x, ea = x.float(), ea.float()
    torch.manual_seed(0)
    ref = GATv2Conv(7, 8, heads=4, edge_dim=3).to(device)
    conv = FastGATv2Conv(7, 8, heads=4, edge_dim=3).to(device)
    conv.load_state_dict(ref.state_dict())
    out32 = conv(x, ei, ea)
    with torch.autocast(device, dtype=dtype):
        out = conv(x, ei, ea)
        out_ref = ref(x, ei, ea)
    # The autocast dtype (GATv2Conv's float32 bias promotes its output to
    # float32; ours is cast, as the fused op casts it)
    assert out.dtype == dtype and out_ref.dtype == torch.float32
    rel = ((out.float() - out32).norm() / out32.norm()).item()
    assert rel < 3e-2


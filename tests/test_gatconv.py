"""FastGATConv against PyG's GATConv: outputs, gradients, attention weights,
state dicts, swap_gat, the prepared-graph cache and torch.compile."""

import pytest
import torch
import torch.nn.functional as F
from torch_geometric.nn import GATConv

from pyg_fastattn import FastGATConv, PreparedGraph, prepare, swap_gat
from pyg_fastattn.nn import cache_info, clear_cache
from torch_geometric.nn.conv import MessagePassing

from conftest import requires_cuda

TOL = {torch.float64: dict(atol=1e-10, rtol=1e-9),
       torch.float32: dict(atol=2e-5, rtol=1e-4)}


def random_graph(num_src, num_dst, E, seed=0, loops=True):
    """Edges with duplicates, existing self-loops and isolated nodes."""
    g = torch.Generator().manual_seed(seed)
    # Leave the last nodes isolated on both sides.
    src = torch.randint(0, max(num_src - 2, 1), (E, ), generator=g)
    dst = torch.randint(0, max(num_dst - 2, 1), (E, ), generator=g)
    if E >= 8:
        src[:3], dst[:3] = src[3:6], dst[3:6]  # duplicates
        if loops:
            k = min(num_src, num_dst) - 2
            src[6:8] = dst[6:8] = torch.tensor([0, k - 1]).clamp(min=0)
    return torch.stack([src, dst])


def make_pair(dtype, *args, **kwargs):
    torch.manual_seed(0)
    ref = GATConv(*args, **kwargs).to(dtype)
    if getattr(ref, 'bias', None) is not None:  # GATConv starts it at zero
        with torch.no_grad():
            ref.bias.normal_()
    fast = FastGATConv(*args, **kwargs).to(dtype)
    fast.load_state_dict(ref.state_dict(), strict=True)
    ref.eval()
    fast.eval()
    return ref, fast


def leaf(t):
    return None if t is None else t.detach().clone().requires_grad_(
        t.is_floating_point())


def run(conv, x, edge_index, edge_attr=None, size=None, attention=False,
        x_grad=True):
    """Forward + backward of a weighted sum; returns outputs and grads.
    x_grad=False: x needs no gradient (a first layer)."""
    xs = tuple(leaf(t) for t in x) if isinstance(x, tuple) else leaf(x)
    if not x_grad:
        xs = tuple(t.detach() for t in xs) if isinstance(xs, tuple) else \
            xs.detach()
    ea = leaf(edge_attr)
    res = conv(xs, edge_index, ea, size=size,
               return_attention_weights=True if attention else None)
    out, att = (res if attention else (res, None))
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype,
                       device=out.device).view_as(out)
    loss = (out * w).sum()
    if att is not None and isinstance(att[1], torch.Tensor):
        alpha = att[1]
        loss = loss + (alpha * torch.linspace(
            0, 1, alpha.numel(), dtype=alpha.dtype,
            device=alpha.device).view_as(alpha)).sum()
    conv.zero_grad(set_to_none=True)
    loss.backward()
    inputs = list(xs) if isinstance(xs, tuple) else [xs]
    inputs.append(ea)
    grads = [None if t is None else t.grad for t in inputs]
    pgrads = {n: p.grad for n, p in conv.named_parameters()}
    return [out, att, grads, pgrads]


def assert_same(ref_res, fast_res, dtype):
    tol = TOL[dtype]
    (o1, a1, g1, p1), (o2, a2, g2, p2) = ref_res, fast_res
    torch.testing.assert_close(o2, o1, **tol)
    for i, (x, y) in enumerate(zip(g1, g2)):
        if x is None:
            assert y is None or not y.abs().any(), f'input {i}'
        else:
            torch.testing.assert_close(y, x, **tol, msg=f'grad of input {i}')
    assert p1.keys() == p2.keys()
    for n in p1:
        if p1[n] is None:
            assert p2[n] is None or not p2[n].abs().any(), n
        else:
            torch.testing.assert_close(p2[n], p1[n], **tol, msg=f'grad {n}')
    if a1 is not None:
        e1, w1 = a1
        e2, w2 = a2
        if isinstance(e1, torch.Tensor) and e1.layout == torch.strided:
            assert torch.equal(e1, e2)
            assert e1.dtype == e2.dtype
        torch.testing.assert_close(w2, w1, **tol)


CONFIGS = {
    'heads1': dict(heads=1),
    'heads8': dict(heads=8),
    'mean_heads': dict(heads=3, concat=False),
    'residual': dict(heads=2, residual=True),
    'residual_mean': dict(heads=2, residual=True, concat=False),
    'no_loops': dict(heads=2, add_self_loops=False),
    'no_bias_slope': dict(heads=2, bias=False, negative_slope=0.05),
}


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
@pytest.mark.parametrize('name', list(CONFIGS))
@pytest.mark.parametrize('attention', [True, False])
@pytest.mark.parametrize('x_grad', [True, False])
def test_parity(backend, dtype, name, attention, x_grad):
    """attention=False takes the fused path (lin, score terms and, without a
    residual, the bias inside one autograd node); True the one that also
    returns the weights. x_grad=False (a first layer) takes the score
    gradient through x in the fused path."""
    ref, fast = make_pair(dtype, 12, 5, **CONFIGS[name])
    ei = random_graph(30, 30, 160)
    x = torch.randn(30, 12, dtype=dtype)
    assert_same(run(ref, x, ei, attention=attention, x_grad=x_grad),
                run(fast, x, ei, attention=attention, x_grad=x_grad), dtype)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
@pytest.mark.parametrize('name', list(CONFIGS) + ['edge_dim', 'bipartite'])
@pytest.mark.parametrize('attention', [True, False])
@pytest.mark.parametrize('x_grad', [True, False])
def test_parity_cuda(dtype, name, attention, x_grad):
    """The same parity on the GPU (native CUDA kernels)."""
    kw = dict(CONFIGS.get(name, dict(heads=4)))
    cin, size, ea = 12, None, None
    x = torch.randn(30, 12, dtype=dtype)
    ei = random_graph(30, 30, 160)
    if name == 'edge_dim':
        kw['edge_dim'] = 3
        ea = torch.randn(ei.size(1), 3, dtype=dtype)
    if name == 'bipartite':  # more destination than source nodes
        cin, size = (12, 7), (20, 30)
        x = (torch.randn(20, 12, dtype=dtype), torch.randn(30, 7, dtype=dtype))
        ei = random_graph(20, 30, 160)
    ref, fast = make_pair(dtype, cin, 5, **kw)
    ref, fast = ref.cuda(), fast.cuda()
    cuda = lambda t: tuple(v.cuda() for v in t) if isinstance(t, tuple) else (
        None if t is None else t.cuda())
    x, ei, ea = cuda(x), ei.cuda(), cuda(ea)
    assert_same(run(ref, x, ei, ea, size=size, attention=attention,
                    x_grad=x_grad),
                run(fast, x, ei, ea, size=size, attention=attention,
                    x_grad=x_grad), dtype)


FILLS = ['mean', 'add', 'max', 'min', 'mul', 0.5, 'tensor']


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
@pytest.mark.parametrize('fill', FILLS)
def test_edge_features(backend, dtype, fill):
    if fill == 'tensor':
        fill = torch.tensor([0.3, -1.0, 2.0], dtype=dtype)
    ref, fast = make_pair(dtype, 12, 4, heads=3, edge_dim=3, fill_value=fill)
    ei = random_graph(25, 25, 120, seed=1)
    x = torch.randn(25, 12, dtype=dtype)
    ea = torch.randn(120, 3, dtype=dtype)
    assert_same(run(ref, x, ei, ea, attention=True),
                run(fast, x, ei, ea, attention=True), dtype)


@pytest.mark.parametrize('fill', ['mean', 2.0])
def test_edge_features_1d_and_no_loops(backend, fill):
    dtype = torch.float64
    ei = random_graph(20, 20, 90, seed=2)
    x = torch.randn(20, 6, dtype=dtype)
    ea = torch.randn(90, dtype=dtype)
    ref, fast = make_pair(dtype, 6, 4, heads=2, edge_dim=1, fill_value=fill)
    assert_same(run(ref, x, ei, ea), run(fast, x, ei, ea), dtype)
    ref, fast = make_pair(dtype, 6, 4, heads=2, edge_dim=1,
                          add_self_loops=False)
    assert_same(run(ref, x, ei, ea), run(fast, x, ei, ea), dtype)
    # edge_dim set but no edge_attr: no edge term, as in GATConv.
    assert_same(run(ref, x, ei), run(fast, x, ei), dtype)


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
@pytest.mark.parametrize('case', ['more_src', 'more_dst', 'dst_none',
                                  'shared_lin', 'no_size'])
def test_bipartite(backend, dtype, case):
    Ns, Nd = {'more_src': (30, 12), 'more_dst': (10, 25)}.get(case, (20, 20))
    ei = random_graph(Ns, Nd, 140, seed=3)
    xs = torch.randn(Ns, 7, dtype=dtype)
    xd = torch.randn(Nd, 5, dtype=dtype)
    size = (Ns, Nd)
    if case == 'dst_none':
        x = (xs, None)
        ref, fast = make_pair(dtype, (7, 5), 4, heads=2, residual=True)
    elif case == 'shared_lin':
        x = (xs, torch.randn(Nd, 7, dtype=dtype))
        ref, fast = make_pair(dtype, 7, 4, heads=2, residual=True)
    else:
        x = (xs, xd)
        ref, fast = make_pair(dtype, (7, 5), 4, heads=3, residual=True)
    if case == 'no_size':
        size = None
    assert_same(run(ref, x, ei, size=size, attention=True),
                run(fast, x, ei, size=size, attention=True), dtype)


def test_bipartite_edge_features(backend):
    dtype = torch.float64
    Ns, Nd = 30, 12  # more src than dst: PyG's fill reduction works
    ei = random_graph(Ns, Nd, 100, seed=4)
    ea = torch.randn(100, 2, dtype=dtype)
    x = (torch.randn(Ns, 7, dtype=dtype), torch.randn(Nd, 5, dtype=dtype))
    for fill in ['mean', 'max', 1.5]:
        ref, fast = make_pair(dtype, (7, 5), 4, heads=2, edge_dim=2,
                              fill_value=fill)
        assert_same(run(ref, x, ei, ea, size=(Ns, Nd), attention=True),
                    run(fast, x, ei, ea, size=(Ns, Nd), attention=True), dtype)


def test_single_tensor_with_bipartite_weights(backend):
    dtype = torch.float64
    ref, fast = make_pair(dtype, (6, 6), 4, heads=2)
    ei = random_graph(15, 15, 60)
    x = torch.randn(15, 6, dtype=dtype)
    assert_same(run(ref, x, ei), run(fast, x, ei), dtype)


@pytest.mark.parametrize('loops', [True, False])
def test_int32_edge_index(backend, loops):
    dtype = torch.float64
    ref, fast = make_pair(dtype, 8, 4, heads=2, add_self_loops=loops)
    ei = random_graph(20, 20, 80).to(torch.int32)
    x = torch.randn(20, 8, dtype=dtype)
    # GATConv's own gradients are wrong for int32 without self-loops (torch
    # 2.13 CPU: torch.gather with a broadcast int32 index, which PyG's
    # scatter backward is, returns wrong rows), so compare against its int64
    # results ...
    r1, r2 = run(ref, x, ei.long(), attention=True), run(fast, x, ei,
                                                         attention=True)
    e_ref = ref(x, ei, return_attention_weights=True)[1][0]
    assert r2[1][0].dtype == e_ref.dtype  # ... and its int32 edge dtype
    r1[1] = (r1[1][0].to(e_ref.dtype), r1[1][1])
    assert_same(r1, r2, dtype)


@pytest.mark.parametrize('loops', [True, False])
def test_no_edges(backend, loops):
    dtype = torch.float64
    ref, fast = make_pair(dtype, 8, 4, heads=2, add_self_loops=loops,
                          residual=True)
    ei = torch.empty(2, 0, dtype=torch.long)
    x = torch.randn(6, 8, dtype=dtype)
    assert_same(run(ref, x, ei, attention=True),
                run(fast, x, ei, attention=True), dtype)


def test_lazy_in_channels(backend):
    dtype = torch.float64
    torch.manual_seed(0)
    ref = GATConv(-1, 4, heads=2, residual=True).to(dtype)
    fast = FastGATConv(-1, 4, heads=2, residual=True).to(dtype)
    x = torch.randn(15, 9, dtype=dtype)
    ei = random_graph(15, 15, 50)
    ref(x, ei)
    fast(x, ei)  # both initialize; then copy weights
    fast.load_state_dict(ref.state_dict(), strict=True)
    assert_same(run(ref, x, ei), run(fast, x, ei), dtype)


def test_wrong_input_width_raises_as_gatconv(backend):
    """x narrower than in_channels: the same error as GATConv's (its
    Linear's matmul), not one about the fused op's weight."""
    torch.manual_seed(0)
    x, ei = torch.randn(6, 5), random_graph(6, 6, 12)
    errors = []
    for conv in (GATConv, FastGATConv):
        with pytest.raises(RuntimeError) as e:
            conv(8, 4, heads=2)(x, ei)
        errors.append(str(e.value))
    assert errors[0] == errors[1]


@pytest.mark.parametrize('layout', ['coo', 'csr'])
@pytest.mark.parametrize('loops', [True, False])
def test_torch_sparse_adjacency(backend, layout, loops):
    dtype = torch.float64
    N = 20
    ei = torch.unique(random_graph(N, N, 90, seed=5), dim=1)  # coalesced
    adj = torch.sparse_coo_tensor(ei.flip(0), torch.ones(ei.size(1)),
                                  (N, N)).coalesce()
    if layout == 'csr':
        adj = adj.to_sparse_csr()
    ref, fast = make_pair(dtype, 6, 4, heads=2, add_self_loops=loops)
    x = torch.randn(N, 6, dtype=dtype)
    r1, r2 = run(ref, x, adj, attention=True), run(fast, x, adj,
                                                    attention=True)
    assert_same(r1, r2, dtype)
    adj1, adj2 = r1[1][0], r2[1][0]
    assert adj1.layout == adj2.layout
    torch.testing.assert_close(adj2.to_dense(), adj1.to_dense(),
                               **TOL[dtype])
    # Same numbers as with the equivalent edge_index.
    out_ei = fast(x, ei)
    torch.testing.assert_close(fast(x, adj), out_ei, **TOL[dtype])


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_low_precision(backend, dtype):
    ref, fast = make_pair(torch.float32, 8, 4, heads=2, edge_dim=3)
    ei = random_graph(30, 30, 120)
    x, ea = torch.randn(30, 8), torch.randn(120, 3)
    expected = ref(x, ei, ea)
    out, (_, alpha) = fast.to(dtype)(x.to(dtype), ei, ea.to(dtype),
                                     return_attention_weights=True)
    assert out.dtype == dtype and alpha.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=0.05, rtol=0.05)
    out.float().sum().backward()
    assert fast.att_src.grad.dtype == dtype


@pytest.mark.parametrize('loops', [True, False])
def test_torch_sparse_bipartite(backend, loops):
    dtype = torch.float64
    Ns, Nd = 15, 9
    ei = torch.unique(random_graph(Ns, Nd, 60, seed=5), dim=1)
    adj = torch.sparse_coo_tensor(ei.flip(0), torch.ones(ei.size(1)),
                                  (Nd, Ns)).coalesce()
    x = (torch.randn(Ns, 6, dtype=dtype), torch.randn(Nd, 5, dtype=dtype))
    ref, fast = make_pair(dtype, (6, 5), 4, heads=2, add_self_loops=loops)
    for a in (adj, adj.to_sparse_csr()):
        assert_same(run(ref, x, a, attention=True),
                    run(fast, x, a, attention=True), dtype)


def test_unsupported_edge_index_type():
    conv = FastGATConv(4, 2)
    with pytest.raises(ValueError, match='torch.sparse'):  # as GATConv
        conv(torch.randn(3, 4), [[0, 1], [1, 2]])


# Training mode: dropout ######################################################


def test_dropout(backend):
    torch.manual_seed(0)
    conv = FastGATConv(8, 4, heads=2, dropout=0.5).double()
    x = torch.randn(30, 8, dtype=torch.float64)
    ei = random_graph(30, 30, 200)
    conv.eval()
    out_eval, (e_eval, a_eval) = conv(x, ei, return_attention_weights=True)
    conv.train()
    out1, (e1, a1) = conv(x, ei, return_attention_weights=True)
    out2 = conv(x, ei)
    assert torch.equal(e1, e_eval)
    assert not torch.allclose(out1, out_eval)
    assert not torch.allclose(out1, out2)  # fresh mask every call
    dropped = a1 == 0
    assert 0.35 < dropped.double().mean() < 0.65
    torch.testing.assert_close(a1[~dropped], 2 * a_eval[~dropped])
    # Without dropout, training mode equals eval mode.
    conv.dropout = 0.0
    torch.testing.assert_close(conv(x, ei), out_eval)
    conv.dropout = 1.0  # everything dropped: only the bias remains
    torch.testing.assert_close(conv(x, ei), conv.bias.expand(30, -1))


# State dicts and swap_gat ####################################################


@pytest.mark.parametrize('kw', [dict(heads=3, edge_dim=2, residual=True),
                                dict(heads=2, bias=False)])
def test_state_dict_round_trip(kw):
    for in_ch in (6, (6, 5)):
        ref, fast = GATConv(in_ch, 4, **kw), FastGATConv(in_ch, 4, **kw)
        assert isinstance(fast, MessagePassing)
        assert list(ref.state_dict()) == list(fast.state_dict())
        for a, b in [(ref, fast), (fast, ref)]:
            b.load_state_dict(a.state_dict(), strict=True)
            for (n1, t1), (n2, t2) in zip(a.state_dict().items(),
                                          b.state_dict().items()):
                assert n1 == n2 and torch.equal(t1, t2)
    fast.reset_parameters()
    assert repr(fast) == repr(ref)  # prints as the PyG layer


class Net(torch.nn.Module):
    def __init__(self, conv_cls=GATConv):
        super().__init__()
        self.conv1 = conv_cls(10, 8, heads=4, dropout=0.6)
        self.conv2 = conv_cls(32, 3, heads=1, concat=False, dropout=0.6)
        self.convs = torch.nn.ModuleList([conv_cls(3, 3)])

    def forward(self, x, edge_index):
        x = F.elu(self.conv1(x, edge_index))
        x = self.conv2(x, edge_index)
        return self.convs[0](x, edge_index)


def test_swap_gat(backend):
    torch.manual_seed(0)
    model = Net().double().eval()
    x = torch.randn(40, 10, dtype=torch.float64)
    ei = random_graph(40, 40, 200)
    expected = model(x, ei)
    params = list(model.parameters())
    assert swap_gat(model) is model
    assert type(model.conv1) is FastGATConv
    assert type(model.convs[0]) is FastGATConv
    assert not model.training and not model.conv1.training
    assert all(a is b for a, b in zip(params, model.parameters()))
    torch.testing.assert_close(model(x, ei), expected, atol=1e-10, rtol=0)
    # A GATConv itself gives back its fast twin.
    conv = GATConv(4, 2).train()
    fast = swap_gat(conv)
    assert type(fast) is FastGATConv and fast.training


def test_swap_gat_skips_what_it_cannot_convert():
    class MyGAT(GATConv):
        pass

    model = torch.nn.Sequential(MyGAT(4, 4), GATConv(4, 4, aggr='mean'),
                                GATConv(4, 4))
    with pytest.warns(UserWarning, match='MyGAT') as rec:
        swap_gat(model)
    assert any('aggr' in str(w.message) for w in rec)
    assert type(model[0]) is MyGAT
    assert type(model[1]) is GATConv
    assert type(model[2]) is FastGATConv


def test_swap_gat_lazy():
    torch.manual_seed(0)
    model = torch.nn.Sequential(GATConv(-1, 4, heads=2))
    swap_gat(model)
    assert type(model[0]) is FastGATConv
    x = torch.randn(10, 5)
    out = model[0](x, random_graph(10, 10, 30))
    assert out.shape == (10, 8)


def test_fallback_paths_match_pyg():
    """aggr != 'add' uses GATConv's own code."""
    ref, fast = make_pair(torch.float64, 6, 3, heads=2, aggr='mean')
    x = torch.randn(12, 6, dtype=torch.float64)
    ei = random_graph(12, 12, 40)
    torch.testing.assert_close(fast(x, ei), ref(x, ei))


# Prepared graphs and the cache ###############################################


def test_cache_hits_and_invalidation(backend):
    clear_cache()
    dtype = torch.float64
    torch.manual_seed(0)
    model = Net(FastGATConv).double().eval()
    ref = Net(GATConv).double().eval()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(40, 10, dtype=dtype)
    ei = random_graph(40, 40, 200)
    out = model(x, ei)
    assert cache_info()['misses'] == 1  # three layers, one preparation
    assert cache_info()['hits'] == 2
    torch.testing.assert_close(model(x, ei), out)
    assert cache_info()['misses'] == 1
    # In-place mutation invalidates.
    ei[1, :50] = (ei[1, :50] + 7) % 38
    out2 = model(x, ei)
    assert cache_info()['misses'] == 2
    assert not torch.allclose(out2, out)
    torch.testing.assert_close(out2, ref(x, ei), atol=1e-10, rtol=0)
    # An equal tensor that is another object is prepared again.
    model(x, ei.clone())
    assert cache_info()['misses'] == 3
    # Entries die with their tensor.
    size = cache_info()['size']
    tmp = ei.clone()
    model(x, tmp)
    assert cache_info()['size'] == size + 1
    del tmp
    assert cache_info()['size'] == size


def test_cache_inference_mode_tensors(backend):
    """An edge_index made under inference_mode (no version counter) is
    prepared once, not on every call, and gives GATConv's result."""
    clear_cache()
    torch.manual_seed(0)
    model = Net(FastGATConv).eval()
    ref = Net(GATConv).eval()
    ref.load_state_dict(model.state_dict())
    with torch.inference_mode():
        x = torch.randn(40, 10)
        ei = random_graph(40, 40, 200).clone()
        assert ei.is_inference()
        out = model(x, ei)
        model(x, ei)
        expected = ref(x, ei)
    assert cache_info()['misses'] == 1 and cache_info()['hits'] == 5
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


def test_prepared_graph(backend):
    dtype = torch.float64
    ref, fast = make_pair(dtype, 8, 4, heads=2, edge_dim=2)
    ei = random_graph(25, 25, 100)
    ea = torch.randn(100, 2, dtype=dtype)
    x = torch.randn(25, 8, dtype=dtype)
    g = prepare(ei, num_nodes=25)
    assert isinstance(g, PreparedGraph)
    assert g.num_aug == 125 and g.num_kept() == 100 + 25 - int(
        (ei[0] == ei[1]).sum())
    assert torch.equal(g.edge_index(), ref(x, ei, return_attention_weights=True)[1][0])
    assert_same(run(ref, x, ei, ea, attention=True),
                run(fast, x, g, ea, attention=True), dtype)
    # Bipartite prepared graphs.
    ref2, fast2 = make_pair(dtype, (8, 3), 4, heads=2)
    eb = random_graph(25, 10, 60)
    xb = (x, torch.randn(10, 3, dtype=dtype))
    gb = prepare(eb, size=(25, 10))
    assert_same(run(ref2, xb, eb, size=(25, 10)), run(fast2, xb, gb), dtype)
    with pytest.raises(ValueError, match='PreparedGraph'):
        fast(x[:20], g)
    with pytest.raises(ValueError, match='add_self_loops'):
        fast(x, prepare(ei, num_nodes=25, add_self_loops=False))
    assert 'num_src=25' in repr(g)


def test_bad_edge_index():
    conv = FastGATConv(4, 2)
    x = torch.randn(5, 4)
    with pytest.raises(IndexError, match=r'edge_index.*\[0, 5\)'):
        conv(x, torch.tensor([[0, 1], [2, 5]]))
    with pytest.raises(IndexError, match='edge_index'):
        conv(x, torch.tensor([[0, -1], [2, 3]]))
    with pytest.raises(ValueError, match='edge_index'):
        conv(x, torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match='edge_index'):
        conv(x, torch.zeros(2, 4))
    with pytest.raises(IndexError, match='edge_index'):
        prepare(torch.tensor([[0, 1], [2, 9]]), num_nodes=5)
    with pytest.raises(IndexError, match='edge_attr'):  # as GATConv
        FastGATConv(4, 2, edge_dim=2)(x, torch.tensor([[0], [1]]),
                                      torch.randn(3, 2))


# torch.compile ###############################################################


class CompiledNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = FastGATConv(10, 4, heads=4, edge_dim=3, dropout=0.0)
        self.conv2 = FastGATConv(16, 3, heads=1, concat=False)

    def forward(self, x, edge_index, edge_attr):
        x = F.elu(self.conv1(x, edge_index, edge_attr))
        return self.conv2(x, edge_index)


@pytest.mark.parametrize('prepared', [False, True])
def test_torch_compile_fullgraph(backend, prepared):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = CompiledNet()
    x = torch.randn(40, 10, requires_grad=True)
    ei = random_graph(40, 40, 160)
    ea = torch.randn(160, 3)
    graph = prepare(ei, num_nodes=40) if prepared else ei
    expected = model(x, graph, ea)
    g_expected = torch.autograd.grad(expected.sum(), [x] + list(
        model.parameters()))
    explain = torch._dynamo.explain(model)(x, graph, ea)
    assert explain.graph_break_count == 0, explain.break_reasons
    compiled = torch.compile(model, fullgraph=True, backend='aot_eager')
    out = compiled(x, graph, ea)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    g = torch.autograd.grad(out.sum(), [x] + list(model.parameters()))
    for a, b in zip(g, g_expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)

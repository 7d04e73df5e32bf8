"""FastTransformerConv against PyG's TransformerConv: outputs, attention
weights and every gradient in float64 under one state_dict; dropout,
gradcheck, determinism, torch.compile, autocast and swap()."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch_geometric.nn import GATConv, GATv2Conv, TransformerConv

from pyg_fastattn import FastGATConv, FastTransformerConv, prepare, swap, ops
from pyg_fastattn.ops.csr import rows_of

from conftest import DEVICES, requires_cuda
from graphs import assert_bitwise

TOL = {torch.float64: dict(atol=1e-10, rtol=1e-9),
       torch.float32: dict(atol=2e-5, rtol=1e-4)}


def graph(num_src, num_dst, E, seed=0, device='cpu'):
    """Duplicates, self-loops, isolated (empty) rows, degree-1 rows and a hub
    row that receives an edge from every source."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, max(num_src - 1, 1), (E, ), generator=g)
    dst = torch.randint(3, max(num_dst - 2, 4), (E, ), generator=g)
    src[:2], dst[:2] = src[2:4], dst[2:4]  # duplicates
    hub = torch.arange(num_src)  # row 0: the hub
    one = torch.tensor([[1], [1]])  # row 1: degree 1 (a self-loop)
    ei = torch.cat([torch.stack([src, dst]), torch.stack(
        [hub, torch.zeros_like(hub)]), one], dim=1)
    # rows 2 and num_dst - 2, num_dst - 1: empty
    return ei.to(device)


def make_pair(dtype, *args, device='cpu', **kwargs):
    torch.manual_seed(0)
    ref = TransformerConv(*args, **kwargs).to(device, dtype)
    fast = FastTransformerConv(*args, **kwargs).to(device, dtype)
    fast.load_state_dict(ref.state_dict(), strict=True)
    with torch.no_grad():  # non-trivial biases
        for n, p in ref.named_parameters():
            if n.endswith('bias'):
                p.normal_()
                dict(fast.named_parameters())[n].copy_(p)
    ref.eval()
    fast.eval()
    return ref, fast


def leaf(t):
    return None if t is None else t.detach().clone().requires_grad_()


def run(conv, x, edge_index, edge_attr=None, attention=True):
    """Forward + backward of a weighted sum of the output and the attention
    weights; returns (out, weights, input grads, parameter grads)."""
    xs = tuple(leaf(t) for t in x) if isinstance(x, tuple) else leaf(x)
    ea = leaf(edge_attr)
    res = conv(xs, edge_index, ea,
               return_attention_weights=True if attention else None)
    out, att = res if attention else (res, None)
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype,
                       device=out.device).view_as(out)
    loss = (out * w).sum()
    if att is not None and isinstance(att, tuple):
        alpha = att[1]
        loss = loss + (alpha * torch.linspace(
            0, 1, alpha.numel(), dtype=alpha.dtype,
            device=alpha.device).view_as(alpha)).sum()
    conv.zero_grad(set_to_none=True)
    loss.backward()
    inputs = (list(xs) if isinstance(xs, tuple) else [xs]) + [ea]
    grads = [None if t is None else t.grad for t in inputs]
    return out, att, grads, {n: p.grad for n, p in conv.named_parameters()}


def assert_same(ref_res, fast_res, dtype, same_edge_index=True):
    tol = TOL[dtype]
    (o1, a1, g1, p1), (o2, a2, g2, p2) = ref_res, fast_res
    torch.testing.assert_close(o2, o1, **tol)
    for i, (x, y) in enumerate(zip(g1, g2)):
        if x is None or x.numel() == 0:  # unused or empty
            assert y is None or not y.abs().any(), f'input {i}'
        else:
            torch.testing.assert_close(y, x, **tol, msg=f'grad of input {i}')
    assert p1.keys() == p2.keys()
    for n in p1:
        if p1[n] is None or p2[n] is None:  # unused: no or zero grads
            assert all(t is None or not t.abs().any() for t in (p1[n], p2[n]))
        else:
            torch.testing.assert_close(p2[n], p1[n], **tol, msg=f'grad {n}')
    if a1 is not None:
        if same_edge_index:
            assert a2[0] is a1[0] or torch.equal(a2[0], a1[0])
        torch.testing.assert_close(a2[1], a1[1], **tol)


CONFIGS = {
    'plain': dict(heads=2),
    'heads1': dict(heads=1),
    'heads4_beta': dict(heads=4, beta=True),
    'heads8': dict(heads=8),
    'mean': dict(heads=3, concat=False),
    'mean_beta': dict(heads=3, concat=False, beta=True),
    'no_root': dict(heads=2, root_weight=False),
    'no_bias': dict(heads=2, bias=False, beta=True),
    'edge_small': dict(heads=2, edge_dim=3),  # D < C: projected after
    'edge_large': dict(heads=4, edge_dim=9, beta=True),  # D >= C
    'edge_mean': dict(heads=3, edge_dim=2, concat=False, root_weight=False),
}


@pytest.mark.parametrize('name', list(CONFIGS))
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_parity(backend, name, dtype):
    kw = CONFIGS[name]
    ref, fast = make_pair(dtype, 11, 5, **kw)
    ei = graph(30, 30, 150)
    x = torch.randn(30, 11, dtype=dtype)
    ea = (torch.randn(ei.size(1), kw['edge_dim'], dtype=dtype)
          if 'edge_dim' in kw else None)
    assert_same(run(ref, x, ei, ea), run(fast, x, ei, ea), dtype)
    assert_same(run(ref, x, ei, ea, False), run(fast, x, ei, ea, False),
                dtype)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('name', ['plain', 'heads8', 'edge_small',
                                  'edge_large', 'mean_beta'])
def test_parity_devices(backend, device, name):
    kw = CONFIGS[name]
    dtype = torch.float64
    ref, fast = make_pair(dtype, 7, 3, device=device, **kw)
    ei = graph(40, 40, 300, seed=1, device=device)
    x = torch.randn(40, 7, dtype=dtype, device=device)
    ea = (torch.randn(ei.size(1), kw['edge_dim'], dtype=dtype, device=device)
          if 'edge_dim' in kw else None)
    assert_same(run(ref, x, ei, ea), run(fast, x, ei, ea), dtype)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('idx', [torch.int32, torch.int64])
@pytest.mark.parametrize('edge_dim', [None, 4])
def test_bipartite_and_index_dtypes(backend, device, idx, edge_dim):
    dtype = torch.float64
    ref, fast = make_pair(dtype, (6, 9), 5, heads=3, beta=True,
                          edge_dim=edge_dim, device=device)
    ei = graph(20, 12, 80, seed=2, device=device)
    xs = torch.randn(20, 6, dtype=dtype, device=device)
    xd = torch.randn(12, 9, dtype=dtype, device=device)
    ea = (None if edge_dim is None else
          torch.randn(ei.size(1), edge_dim, dtype=dtype, device=device))
    r1 = run(ref, (xs, xd), ei, ea)
    r2 = run(fast, (xs, xd), ei.to(idx), ea)
    assert r2[1][0].dtype == idx  # the input edge_index comes back
    assert_same(r1, r2, dtype, same_edge_index=False)
    assert torch.equal(r2[1][0].long(), ei)


def test_non_contiguous_inputs(backend):
    dtype = torch.float64
    ref, fast = make_pair(dtype, 8, 5, heads=2, edge_dim=3)
    ei = graph(25, 25, 100, seed=3)
    x = torch.randn(8, 25, dtype=dtype).t()
    ea = torch.randn(3, ei.size(1), dtype=dtype).t()
    ei_nc = torch.stack([ei[1], ei[0]], dim=1).t().flip(0)
    assert not x.is_contiguous() and not ei_nc.is_contiguous()
    assert_same(run(ref, x, ei, ea), run(fast, x, ei_nc, ea), dtype,
                same_edge_index=False)


def test_no_edges(backend):
    ref, fast = make_pair(torch.float64, 8, 4, heads=2, edge_dim=2)
    x = torch.randn(5, 8, dtype=torch.float64)
    ei = torch.empty(2, 0, dtype=torch.long)
    ea = torch.empty(0, 2, dtype=torch.float64)
    assert_same(run(ref, x, ei, ea), run(fast, x, ei, ea), torch.float64)


# edge_attr shapes that broadcast to [E, H, C] (E, H, C as given)
RAW_EDGE_ATTR = {'EHC': lambda E, H, C: (E, H, C), 'E1C': lambda E, H, C:
                 (E, 1, C), 'EH1': lambda E, H, C: (E, H, 1),
                 '1HC': lambda E, H, C: (1, H, C), 'HC': lambda E, H, C:
                 (H, C), 'scalar': lambda E, H, C: ()}


@pytest.mark.parametrize('name', ['plain', 'mean_beta', 'no_root'])
@pytest.mark.parametrize('shape', list(RAW_EDGE_ATTR))
def test_edge_attr_without_edge_dim(backend, name, shape):
    """Without edge_dim, TransformerConv adds edge_attr as it is to the
    values (not to the keys): outputs and every gradient, edge_attr's
    included, on edge_index and on a PreparedGraph."""
    kw = CONFIGS[name]
    dtype = torch.float64
    ref, fast = make_pair(dtype, 11, 5, **kw)
    ei = graph(30, 30, 150)
    x = torch.randn(30, 11, dtype=dtype)
    ea = torch.randn(RAW_EDGE_ATTR[shape](ei.size(1), kw['heads'], 5),
                     dtype=dtype)
    r1 = run(ref, x, ei, ea)
    assert_same(r1, run(fast, x, ei, ea), dtype)
    g = prepare(ei, num_nodes=30, add_self_loops=False)
    assert_same(r1, run(fast, x, g, ea), dtype, same_edge_index=False)


def test_edge_attr_without_edge_dim_as_pyg():
    """Raw edge_attr: dropout applies to its term; dtypes promote as in
    TransformerConv; shapes only PyG's message passing takes (or rejects)
    run it; a PreparedGraph rejects them."""
    dtype = torch.float64
    ei = graph(20, 20, 80, seed=4)
    E = ei.size(1)
    x = torch.randn(20, 8, dtype=dtype)
    ref, fast = make_pair(dtype, 8, 4, heads=2, dropout=1.0)
    ea = torch.randn(E, 2, 4, dtype=dtype)
    ref.train()
    fast.train()  # every weight dropped: only the skip term is left
    torch.testing.assert_close(fast(x, ei, ea), ref(x, ei, ea))
    torch.testing.assert_close(fast(x, ei, ea), ref.lin_skip(x))

    ref, fast = make_pair(torch.float32, 8, 4, heads=2)
    out = fast(x.float(), ei, ea)
    assert out.dtype == torch.float64  # float32 values + float64 edge_attr
    torch.testing.assert_close(out, ref(x.float(), ei, ea),
                               **TOL[torch.float32])

    g = prepare(ei, num_nodes=20, add_self_loops=False)
    for shape in [(E, 8), (E, ), (E, 4), (2, E, 2, 4)]:
        ea = torch.randn(shape, dtype=dtype)
        ref, fast = make_pair(dtype, 8, 4, heads=2)
        with pytest.raises(RuntimeError):
            ref(x, ei, ea)
        with pytest.raises(RuntimeError):
            fast(x, ei, ea)
        with pytest.raises(ValueError, match='broadcast'):
            fast(x, g, ea)
    # one head, mean: PyG broadcasts [E, C] to [E, E, C]
    ref, fast = make_pair(dtype, 8, 4, heads=1, concat=False)
    ea = torch.randn(E, 4, dtype=dtype)
    torch.testing.assert_close(fast(x, ei, ea), ref(x, ei, ea))


@pytest.mark.parametrize('layout', ['coo', 'csr'])
def test_torch_sparse_adjacency(backend, layout):
    dtype = torch.float64
    ref, fast = make_pair(dtype, 8, 5, heads=2, beta=True)
    ei = torch.unique(graph(15, 15, 60, seed=5), dim=1)  # coalesced
    x = torch.randn(15, 8, dtype=dtype)
    adj = torch.sparse_coo_tensor(ei.flip(0), torch.ones(ei.size(1)),
                                  (15, 15)).coalesce()
    adj = {'coo': adj, 'csr': adj.to_sparse_csr(),
           'csc': adj.to_sparse_csc()}[layout]
    r1, r2 = run(ref, x, adj), run(fast, x, adj)
    assert r2[1][0] is adj
    assert_same(r1, r2, dtype)
    out_ei = fast(x, ei)
    torch.testing.assert_close(r2[0], out_ei, **TOL[dtype])
    # PyG's TransformerConv rejects CSC; ours takes it
    torch.testing.assert_close(fast(x, adj.to_sparse_csc()), out_ei,
                               **TOL[dtype])


def test_prepared_graph(backend):
    dtype = torch.float64
    ref, fast = make_pair(dtype, 8, 5, heads=2, edge_dim=3)
    ei = graph(25, 25, 100, seed=6)
    x = torch.randn(25, 8, dtype=dtype)
    ea = torch.randn(ei.size(1), 3, dtype=dtype)
    g = prepare(ei, num_nodes=25, add_self_loops=False)
    r1, r2 = run(ref, x, ei, ea), run(fast, x, g, ea)
    assert torch.equal(r2[1][0], ei)
    assert_same(r1, r2, dtype, same_edge_index=False)
    with pytest.raises(ValueError, match='add_self_loops'):
        fast(x, prepare(ei, num_nodes=25), ea)


def test_dropout(backend):
    """Training: the returned weights are before dropout (as PyG), the
    output uses alpha * mask on the values and on the edge term."""
    dtype = torch.float64
    ref, fast = make_pair(dtype, 8, 4, heads=2, edge_dim=3, dropout=0.4)
    ei = graph(20, 20, 90, seed=7)
    x = torch.randn(20, 8, dtype=dtype)
    ea = torch.randn(ei.size(1), 3, dtype=dtype)
    fast.train()
    out1, (_, a1) = fast(x, ei, ea, return_attention_weights=True)
    out2 = fast(x, ei, ea)
    assert not torch.allclose(out1, out2)  # fresh masks
    _, (_, a_eval) = ref(x, ei, ea, return_attention_weights=True)
    torch.testing.assert_close(a1, a_eval, **TOL[dtype])

    # A fixed mask: the output equals PyG's message passing with alpha*mask.
    E, H, C = ei.size(1), 2, 4
    mask = (torch.rand(E, H, generator=torch.Generator().manual_seed(0))
            > 0.4).to(dtype) / 0.6
    g = prepare(ei, num_nodes=20, add_self_loops=False)
    fast.dropout_mask = lambda E_, H_, like: mask[g.csr_perm].clone()
    out = fast(x, g, ea)
    q = ref.lin_query(x).view(-1, H, C)
    k = ref.lin_key(x).view(-1, H, C)
    v = ref.lin_value(x).view(-1, H, C)
    e = ref.lin_edge(ea).view(-1, H, C)
    src, dst = ei
    s = (q[dst] * (k[src] + e)).sum(-1) / math.sqrt(C)
    alpha = torch.exp(s - s.max())
    den = torch.zeros(20, H, dtype=dtype).index_add(0, dst, alpha)
    alpha = alpha / den[dst] * mask
    agg = torch.zeros(20, H, C, dtype=dtype).index_add(
        0, dst, alpha.unsqueeze(-1) * (v[src] + e))
    want = agg.view(20, -1) + ref.lin_skip(x)
    torch.testing.assert_close(out, want, **TOL[dtype])


@pytest.mark.parametrize('edge_dim', [None, 2, 6])
def test_gradcheck(backend, edge_dim):
    torch.manual_seed(0)
    conv = FastTransformerConv(4, 3, heads=2, beta=True,
                               edge_dim=edge_dim).double()
    ei = graph(7, 7, 14, seed=8)
    x = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    ea = (None if edge_dim is None else torch.randn(
        ei.size(1), edge_dim, dtype=torch.float64, requires_grad=True))
    inputs = (x, ) if ea is None else (x, ea)
    params = [p for n, p in conv.named_parameters()
              if n.startswith(('lin_key.weight', 'lin_query.weight',
                               'lin_edge'))]

    def f(*args):
        return conv(args[0], ei, args[1] if ea is not None else None)

    assert torch.autograd.gradcheck(f, inputs)
    # parameters through functional_call
    names = [n for n, p in conv.named_parameters()
             if n.startswith(('lin_key.weight', 'lin_query.weight',
                              'lin_edge'))]

    def g(*ps):
        return torch.func.functional_call(conv, dict(zip(names, ps)),
                                          (x.detach(), ei, ea))

    assert torch.autograd.gradcheck(g, tuple(p.detach().requires_grad_()
                                             for p in params))


@pytest.mark.parametrize('device', DEVICES)
def test_gradients_bitwise_deterministic(backend, device):
    if backend == 'reference' and device == 'cuda':
        pytest.skip('the reference uses index_add (atomics) on CUDA')
    g = torch.Generator().manual_seed(0)
    N, E = 2000, 40000
    dst = (torch.rand(E, generator=g) ** 4 * N).long()  # power law
    ei = torch.stack([torch.randint(0, N, (E, ), generator=g), dst]).to(device)
    x = torch.randn(N, 32, device=device)
    ea = torch.randn(E, 3, device=device)
    conv = FastTransformerConv(32, 16, heads=4, edge_dim=3,
                               beta=True).to(device)

    def grads():
        conv.zero_grad(set_to_none=True)
        xr, er = x.clone().requires_grad_(), ea.clone().requires_grad_()
        out = conv(xr, ei, er)
        (out * torch.linspace(-1, 1, out.numel(), device=device).view_as(
            out)).sum().backward()
        return [out.detach(), xr.grad, er.grad] + [
            p.grad.clone() for p in conv.parameters()]

    for a, b in zip(grads(), grads()):
        assert torch.equal(a, b), 'results differ between identical runs'


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = FastTransformerConv(12, 8, heads=2, edge_dim=3,
                                         beta=True, dropout=0.0)
        self.conv2 = FastTransformerConv(16, 5, heads=1, concat=False)

    def forward(self, x, ei, ea):
        return self.conv2(F.elu(self.conv1(x, ei, ea)), ei)


def _graph(device, N=60, E=400):
    g = torch.Generator().manual_seed(1)
    ei = torch.randint(0, N - 2, (2, E), generator=g)
    return (torch.randn(N, 12, generator=g).to(device), ei.to(device),
            torch.randn(E, 3, generator=g).to(device))


def _step_grads(model, x, ei, ea, y):
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x, ei, ea), y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('prepared', [False, True])
def test_inductor_matches_eager(backend, device, prepared):
    """torch.compile(fullgraph=True, inductor): one step's loss and
    gradients equal eager's to 1e-4 of their largest magnitude."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    x, ei, ea = _graph(device)
    y = torch.randint(0, 5, (x.size(0), ), device=device)
    g = prepare(ei, num_nodes=x.size(0), add_self_loops=False) \
        if prepared else ei
    eager = Net().to(device)
    model = Net().to(device)
    model.load_state_dict(eager.state_dict())
    compiled = torch.compile(model, fullgraph=True)
    loss_e, g_e = _step_grads(eager, x, g, ea, y)
    loss_c, g_c = _step_grads(compiled, x, g, ea, y)
    torch.testing.assert_close(loss_c, loss_e, atol=1e-5, rtol=1e-5)
    for (name, _), a, b in zip(eager.named_parameters(), g_c, g_e):
        # (lin_key.bias's gradient is 0 up to rounding: a per-row shift)
        tol = 1e-4 * max(b.abs().max().item(), 1e-4)
        assert (a - b).abs().max().item() <= tol, name


AMP = [('cpu', torch.bfloat16)] + [
    pytest.param('cuda', dt, marks=[pytest.mark.cuda, requires_cuda])
    for dt in (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize('device,dtype', AMP)
def test_autocast_matches_float32(backend, device, dtype):
    torch.manual_seed(0)
    x, ei, ea = _graph(device)
    y = torch.randint(0, 5, (x.size(0), ), device=device)
    model = Net().to(device)
    loss32, g32 = _step_grads(model, x, ei, ea, y)
    model.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=dtype):
        loss = F.cross_entropy(model(x, ei, ea), y)
    loss.backward()
    assert abs(loss.item() - loss32.item()) < 3e-2 * abs(loss32.item())
    scale = max(g.abs().max().item() for g in g32)
    for (name, p), g in zip(model.named_parameters(), g32):
        assert p.grad.dtype == torch.float32, name
        if name.endswith('lin_key.bias'):  # 0 up to rounding (a row shift)
            assert p.grad.abs().max().item() < 1e-2 * scale, name
            continue
        rel = ((p.grad - g).norm() / g.norm().clamp_min(1e-12)).item()
        assert rel < 8e-2, (name, rel)


def test_fallback_paths_match_pyg():
    """aggr other than 'add' runs TransformerConv's own code."""
    torch.manual_seed(0)
    ref = TransformerConv(6, 4, heads=2, aggr='mean').double()
    fast = FastTransformerConv(6, 4, heads=2, aggr='mean').double()
    fast.load_state_dict(ref.state_dict())
    ei = graph(10, 10, 30)
    x = torch.randn(10, 6, dtype=torch.float64)
    torch.testing.assert_close(fast(x, ei), ref(x, ei))


def test_lazy_in_channels(backend):
    torch.manual_seed(0)
    ref = TransformerConv(-1, 4, heads=2, beta=True).double()
    fast = FastTransformerConv(-1, 4, heads=2, beta=True).double()
    x = torch.randn(10, 6, dtype=torch.float64)
    ei = graph(10, 10, 30)
    ref(x, ei)
    fast(x, ei)
    fast.load_state_dict(ref.state_dict())
    torch.testing.assert_close(fast(x, ei), ref(x, ei))


# sddmm_csr ##################################################################


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('idx', [torch.int32, torch.int64])
def test_sddmm_csr_matches_sddmm(backend, device, idx):
    g = graph(9, 14, 40, device=device)
    gp = prepare(g.to(idx), num_nodes=14, add_self_loops=False)
    a = torch.randn(14, 3, 5, dtype=torch.float64, device=device,
                    requires_grad=True)
    b = torch.randn(14, 3, 5, dtype=torch.float64, device=device,
                    requires_grad=True)
    out = ops.sddmm_csr(gp.rowptr, gp.col, a, b, csc=gp.csc)
    row = rows_of(gp.rowptr, gp.col.numel())
    want = ops.sddmm(a, b, row, gp.col)
    torch.testing.assert_close(out, want)
    w = torch.randn_like(out)
    ga, gb = torch.autograd.grad((out * w).sum(), (a, b))
    wa, wb = torch.autograd.grad((want * w).sum(), (a, b))
    torch.testing.assert_close(ga, wa)
    torch.testing.assert_close(gb, wb)
    assert torch.autograd.gradcheck(
        lambda a_, b_: ops.sddmm_csr(gp.rowptr, gp.col, a_, b_, csc=gp.csc),
        (a, b))


# swap #######################################################################


def test_swap_replaces_all_and_keeps_weights(backend):
    torch.manual_seed(0)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gat = GATConv(8, 4, heads=2)
            self.tf = TransformerConv(8, 4, heads=2, edge_dim=3)
            self.v2 = GATv2Conv(8, 4, heads=2)
            self.seq = torch.nn.ModuleList([TransformerConv(8, 8)])
            self.shared = self.gat

    m = Model().double()
    ei = graph(12, 12, 40)
    x = torch.randn(12, 8, dtype=torch.float64)
    ea = torch.randn(ei.size(1), 3, dtype=torch.float64)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    params = {n: p for n, p in m.named_parameters()}
    outs = [m.gat(x, ei), m.tf(x, ei, ea), m.v2(x, ei), m.seq[0](x, ei)]
    assert swap(m) is m
    after = m.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p is params[n] for n, p in m.named_parameters())
    assert type(m.gat) is FastGATConv and m.shared is m.gat
    assert type(m.tf) is FastTransformerConv
    assert type(m.seq[0]) is FastTransformerConv
    try:
        from pyg_fastattn.nn.gatv2_conv import FastGATv2Conv
    except ImportError:
        assert type(m.v2) is GATv2Conv
    else:
        assert type(m.v2) is FastGATv2Conv
    new = [m.gat(x, ei), m.tf(x, ei, ea), m.v2(x, ei), m.seq[0](x, ei)]
    for a, b in zip(outs, new):
        torch.testing.assert_close(b, a, **TOL[torch.float64])
    # the single-layer form returns the new layer
    tf = TransformerConv(8, 4)
    assert type(swap(tf)) is FastTransformerConv


def test_swap_leaves_what_it_cannot_convert():
    class MyTF(TransformerConv):
        pass

    m = torch.nn.ModuleList([MyTF(4, 4), TransformerConv(4, 4, aggr='max')])
    with pytest.warns(UserWarning) as rec:
        swap(m)
    assert type(m[0]) is MyTF and type(m[1]) is TransformerConv
    assert any('MyTF' in str(r.message) for r in rec)
    assert any("aggr='max'" in str(r.message) for r in rec)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('name', ['plain', 'heads4_beta', 'mean', 'no_root',
                                  'edge_small'])
def test_grads_in_place_layer(backend, device, name):
    """The layer's in-place backward (the default) against grads_in_place =
    False: the same output and gradients bit for bit, the returned output
    unchanged by the backward, and retain_graph: a second backward gives
    the same gradients (the backward with retain_graph is out of place)."""
    kw = CONFIGS[name]
    edge_dim = kw.get('edge_dim')
    torch.manual_seed(0)
    conv = FastTransformerConv(6, 5, **kw).to(device)
    x = torch.randn(30, 6, device=device)
    ei = graph(30, 30, 120, device=device)
    ea = (torch.randn(ei.size(1), edge_dim, device=device)
          if edge_dim else None)
    # in place wherever the attention output is not the returned tensor,
    # nor saved by beta's Mul
    in_place = ((kw.get('root_weight', True) or not kw.get('concat', True))
                and not kw.get('beta', False))

    def step(flag, twice=False):
        conv.grads_in_place = flag
        conv.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_()
        saved = []  # (saved tensor, its value when saved)

        def pack(t):
            saved.append((t, t.detach().clone()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = conv(xr, ei, ea)
        kept = out.detach().clone()
        loss = (out * torch.linspace(-1, 1, out.numel(), device=device)
                .view_as(out)).sum()
        loss.backward(retain_graph=twice)
        assert torch.equal(out.detach(), kept), 'output changed by backward'
        if twice:  # the first backward kept the graph: out of place
            assert all(torch.equal(t, v) for t, v in saved)
            loss.backward()
        # the (last) backward overwrote saved tensors iff it ran in place
        changed = not all(torch.equal(t, v) for t, v in saved)
        assert changed == (flag and in_place), (flag, changed)
        return [kept, xr.grad] + [p.grad.clone() for p in conv.parameters()
                                  if p.grad is not None]

    try:
        if backend == 'reference' and device == 'cuda':  # index_add: atomics
            for a, b in zip(step(True), step(False)):
                torch.testing.assert_close(a, b)
        else:
            assert_bitwise(step(True), step(False), 'grads_in_place')
        once = step(False)
        for flag in (True, False):
            twice = step(flag, twice=True)
            for a, b in zip(once[1:], twice[1:]):
                torch.testing.assert_close(b, 2 * a)
    finally:
        del conv.grads_in_place  # back to the class default
    assert FastTransformerConv.grads_in_place

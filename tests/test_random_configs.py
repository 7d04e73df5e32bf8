"""Random layer configurations against PyG and under torch.compile.

Each case draws one layer (GAT, GATv2 or Transformer) with random options
(heads, concat, edge features, self-loops and ``fill_value``, residual,
bias, ``share_weights``, ``beta``, ``root_weight``, bipartite inputs) and a
random graph (empty graphs, a hub, int32 or int64 indices), so that option
combinations the hand-written tests do not name are still checked:

* eager, float64: output, attention weights and every gradient equal
  PyG's layer under the same ``state_dict``. PyG runs on int64 indices: on
  torch 2.13's CPU its gradients are wrong for int32 ones (``torch.gather``
  with a broadcast int32 index), ours are not.
* ``torch.compile(fullgraph=True)`` with inductor: output and gradients
  equal eager.
"""
import random

import pytest
import torch
from torch_geometric.nn import GATConv, GATv2Conv, TransformerConv

from pyg_fastattn import FastGATConv, FastGATv2Conv, FastTransformerConv

from conftest import DEVICES

PAIRS = {'gat': (GATConv, FastGATConv), 'gatv2': (GATv2Conv, FastGATv2Conv),
         'transformer': (TransformerConv, FastTransformerConv)}


def draw(seed: int, small: bool = False):
    """A random case: (family, in_channels, out_channels, kwargs, edge_index,
    edge_attr, Ns, Nd, F, Fd)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    family = rng.choice(sorted(PAIRS))
    bip = rng.random() < 0.3
    Ns = rng.randint(1, 25)
    Nd = rng.randint(1, 25) if bip else Ns
    E = rng.randint(1, 90)
    if not small and rng.random() < 0.15:
        E = 0
    F = rng.choice([1, 3, 8, 13])
    Fd = rng.choice([F, 5]) if bip else F
    heads = rng.choice([1, 2, 3, 4, 8])
    C = rng.choice([1, 2, 5, 8])
    edge_dim = rng.choice([None, None, 1, 3])
    src = torch.randint(0, Ns, (E, ), generator=g)
    dst = torch.randint(0, Nd, (E, ), generator=g)
    if E and rng.random() < 0.3:  # a hub
        dst[:E // 2] = 0
    ei = torch.stack([src, dst])
    if rng.random() < 0.3:
        ei = ei.int()
    ea = None if edge_dim is None else torch.randn(E, edge_dim, generator=g)
    if ea is not None and edge_dim == 1 and family != 'transformer' and \
            rng.random() < 0.5:  # (TransformerConv takes no 1-D edge_attr)
        ea = ea.view(-1)
    kw = dict(heads=heads, concat=rng.random() < 0.7, bias=rng.random() < 0.8)
    if edge_dim is not None:
        kw['edge_dim'] = edge_dim
    if family in ('gat', 'gatv2'):
        kw['add_self_loops'] = not bip and rng.random() < 0.8
        if kw['add_self_loops'] and edge_dim is not None:
            fills = ['mean', 'add', 'max', 'min', 0.5]
            kw['fill_value'] = rng.choice(fills + (['mul'] if family == 'gat'
                                                   else []))
        kw['residual'] = rng.random() < 0.3
        kw['negative_slope'] = rng.choice([0.2, 0.01, 0.5])
        if family == 'gatv2':
            kw['share_weights'] = (F == Fd) and rng.random() < 0.3
    else:
        kw['beta'] = rng.random() < 0.3
        kw['root_weight'] = rng.random() < 0.8
    in_channels = (F, Fd) if bip else F
    return family, in_channels, C, kw, ei, ea, Ns, Nd, F, Fd, bip


def call(layer, x, ei, ea, size, weights):
    kw = {'size': size} if isinstance(layer, GATConv) else {}  # (only it)
    if weights:
        kw['return_attention_weights'] = True
    return layer(x, ei, **kw) if ea is None else layer(x, ei, ea, **kw)


def grads(out, inputs, grad):
    return torch.autograd.grad(out, inputs, grad, allow_unused=True)


@pytest.mark.parametrize('seed', range(60))
def test_random_config_matches_pyg(seed):
    dtype = torch.float64
    family, inc, C, kw, ei, ea, Ns, Nd, F, Fd, bip = draw(seed)
    Pyg, Fast = PAIRS[family]
    torch.manual_seed(seed)
    ref = Pyg(inc, C, **kw).to(dtype)
    fast = Fast(inc, C, **kw).to(dtype)
    fast.load_state_dict(ref.state_dict())
    ref.eval(), fast.eval()
    x = torch.randn(Ns, F, dtype=dtype, requires_grad=True)
    xd = torch.randn(Nd, Fd, dtype=dtype, requires_grad=True) if bip else None
    inp = (x, xd) if bip else x
    ea = None if ea is None else ea.to(dtype)
    size = (Ns, Nd) if bip else None
    weights = seed % 4 == 0
    r = call(ref, inp, ei.long(), ea, size, weights)
    f = call(fast, inp, ei, ea, size, weights)
    if weights:
        (r, (ei_r, a_r)), (f, (ei_f, a_f)) = r, f
        assert torch.equal(ei_r, ei_f.long()), (family, kw)
        torch.testing.assert_close(a_f, a_r, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(f, r, rtol=1e-9, atol=1e-12)
    if r.numel() == 0:
        return
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(r.shape, dtype=dtype, generator=gen)
    inputs = [x] + ([xd] if bip else [])
    g_r = grads(r, inputs + list(ref.parameters()), g)
    g_f = grads(f, inputs + list(fast.parameters()), g)
    names = (['x', 'x_dst'][:len(inputs)]
             + [n for n, _ in ref.named_parameters()])
    for name, a, b in zip(names, g_r, g_f):
        a = torch.zeros_like(b) if a is None and b is not None else a
        b = torch.zeros_like(a) if b is None and a is not None else b
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-8, atol=1e-10,
                                       msg=lambda m: f'{name}: {m}')


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('seed', range(100, 106))
def test_random_config_compiled_matches_eager(seed, device):
    family, inc, C, kw, ei, ea, Ns, Nd, F, Fd, bip = draw(seed, small=True)
    torch.manual_seed(seed)
    layer = PAIRS[family][1](inc, C, **kw).to(device)
    ei = ei.to(device)
    ea = None if ea is None else ea.to(device)
    x = torch.randn(Ns, F, device=device)
    xd = torch.randn(Nd, Fd, device=device) if bip else None
    size = (Ns, Nd) if bip else None

    def step(x, xd):
        return call(layer, (x, xd) if bip else x, ei, ea, size, False)

    # One code object (step) across all cases: a fresh Dynamo cache each time,
    # or the recompile limit (8) fails a fullgraph compile after 8 cases.
    torch._dynamo.reset()
    runs = []
    for fn in (step, torch.compile(step, backend='inductor', fullgraph=True)):
        xs = [x.clone().requires_grad_()] + (
            [xd.clone().requires_grad_()] if bip else [None])
        out = fn(*xs)
        gen = torch.Generator().manual_seed(seed)
        g = torch.randn(out.shape, generator=gen).to(device)
        ins = [t for t in xs if t is not None] + list(layer.parameters())
        runs.append((out.detach(), grads(out, ins, g)))
    (o_e, g_e), (o_c, g_c) = runs
    torch.testing.assert_close(o_c, o_e, rtol=1e-4, atol=1e-5)
    names = (['x', 'x_dst'][:1 + bip]
             + [n for n, _ in layer.named_parameters()])
    for name, a, b in zip(names, g_e, g_c):
        assert (a is None) == (b is None), name
        if a is not None:  # 1e-4 of the gradient's largest magnitude
            tol = 1e-5 + 1e-4 * a.abs().max().item()
            assert (a - b).abs().max().item() <= tol, (name, family, kw)

"""The fused GAT path: determinism, no host syncs, CUDA graphs, memory."""
import pytest
import torch
import torch.nn.functional as F

from pyg_fastattn import ops
from pyg_fastattn.nn import FastGATConv

from conftest import DEVICES, load_example, requires_cuda


def _power_law_graph(N, E, device, seed=0):
    """Edges whose destinations follow a power law: a few nodes receive most
    edges, so atomics (if any) would show run-to-run differences."""
    g = torch.Generator().manual_seed(seed)
    dst = (torch.rand(E, generator=g) ** 4 * N).long()
    src = torch.randint(0, N, (E, ), generator=g)
    return torch.stack([src, dst]).to(device)


def GAT(cin, hidden, cout, heads=8, dropout=0.6):
    """PyG's example GAT (examples/train_cora.py) on FastGATConv."""
    return load_example().GAT(FastGATConv, cin, hidden, cout, heads, dropout)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_gradients_bitwise_deterministic(backend, device, dtype):
    if backend == 'reference' and device == 'cuda':
        pytest.skip('the reference uses index_add (atomics) on CUDA')
    N, E = 2000, 40000
    ei = _power_law_graph(N, E, device)
    x = torch.randn(N, 32, device=device, dtype=dtype)
    conv = FastGATConv(32, 16, heads=4, edge_dim=3).to(device, dtype)
    ea = torch.randn(E, 3, device=device, dtype=dtype)

    def grads():
        conv.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_()
        out = conv(xr, ei, ea)
        (out * torch.linspace(-1, 1, out.numel(), device=device,
                              dtype=dtype).view_as(out)).sum().backward()
        return [out.detach().clone(), xr.grad.clone()] + [
            p.grad.clone() for p in conv.parameters()]

    first, second = grads(), grads()
    for a, b in zip(first, second):
        assert torch.equal(a, b), 'results differ between identical runs'


def test_cpu_kernels_independent_of_thread_count():
    """The CPU kernels hand out row chunks dynamically, but every output row
    has one writer in a fixed order: 1 and 2 threads give identical bits
    (the attention op and its gradients; BLAS GEMMs are not checked)."""
    from pyg_fastattn import _build
    if not _build.load().native:
        pytest.skip(f'native kernels unavailable: {_build.load().error}')
    N, E, H, C = 3000, 60000, 4, 8
    src, dst = _power_law_graph(N, E, 'cpu', seed=3)
    perm = torch.argsort(dst, stable=True)
    col = src[perm]
    rowptr = torch.searchsorted(dst[perm], torch.arange(N + 1))
    csc = ops.csr_to_csc(rowptr, col, N)
    leaves = [torch.randn(N, H), torch.randn(N, H), torch.randn(E, H),
              torch.randn(N, H, C)]
    mask = (torch.rand(E, H) > 0.5).float() * 2

    def run():
        xs = [t.clone().requires_grad_() for t in leaves]
        out = ops.attention(rowptr, col, xs[3], xs[0], xs[1], xs[2], mask,
                            csc=csc)
        out.pow(2).sum().backward()
        return [out.detach()] + [t.grad for t in xs]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two):
        assert torch.equal(a, b), 'results depend on the thread count'


@requires_cuda
@pytest.mark.cuda
def test_no_host_sync_once_prepared():
    """With the graph prepared and cached, forward and backward never
    synchronize with the host (checked by torch's sync debug mode)."""
    N, E = 1000, 20000
    ei = _power_law_graph(N, E, 'cuda')
    model = GAT(64, 8, 7).cuda().train()
    x = torch.randn(N, 64, device='cuda')
    model(x, ei).sum().backward()  # prepares, validates, caches the graph
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode('error')
    try:
        out = model(x, ei)
        out.logsumexp(-1).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode('default')
    torch.cuda.synchronize()


@requires_cuda
@pytest.mark.cuda
def test_cuda_graph_training_step():
    """A full training step captured in a CUDA graph replays correctly, with
    fresh dropout randomness every replay."""
    torch.manual_seed(0)
    N, E, classes = 500, 5000, 5
    ei = _power_law_graph(N, E, 'cuda')
    x = torch.randn(N, 32, device='cuda')
    y = torch.randint(0, classes, (N, ), device='cuda')
    model = GAT(32, 8, classes).cuda().train()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, capturable=True)

    def step():
        opt.zero_grad(set_to_none=False)
        out = model(x, ei)
        loss = F.cross_entropy(out, y)
        loss.backward()
        opt.step()
        return out, loss

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_loss = step()
    outs, losses = [], []
    for _ in range(60):
        graph.replay()
        outs.append(static_out.clone())
        losses.append(static_loss.item())
    assert not torch.equal(outs[-1], outs[-2]), 'dropout did not change'
    assert sum(losses[-10:]) < sum(losses[:10]), losses
    # Eager evaluation after graph training agrees with the captured weights.
    model.eval()
    assert model(x, ei).isfinite().all()


@requires_cuda
@pytest.mark.cuda
def test_never_materializes_messages():
    """Peak memory of a forward+backward stays far below one [E, H, C]
    message tensor (what GATConv allocates several of)."""
    N, E, H, C = 20000, 2_000_000, 8, 16
    ei = _power_law_graph(N, E, 'cuda')
    conv = FastGATConv(64, C, heads=H).cuda()
    x = torch.randn(N, 64, device='cuda', requires_grad=True)
    conv(x, ei).sum().backward()  # warm the cache
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    conv(x, ei).sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    message = (E + N) * H * C * 4
    assert peak < message / 2, f'peak {peak / 2**20:.0f} MiB vs one message ' \
        f'tensor {message / 2**20:.0f} MiB'


@pytest.mark.parametrize('device', DEVICES)
def test_softmax_aggregate_reuses_csc(backend, device):
    """Passing the cached CSC gives the same gradients as building it."""
    N, E = 300, 3000
    ei = _power_law_graph(N, E, device)
    perm = torch.argsort(ei[1], stable=True)
    col = ei[0][perm]
    rowptr = torch.searchsorted(ei[1][perm], torch.arange(N + 1, device=device))
    csc = ops.csr_to_csc(rowptr, col, N)
    s = torch.randn(E, 4, device=device, requires_grad=True)
    v = torch.randn(N, 4, 5, device=device, requires_grad=True)
    g1 = torch.autograd.grad(ops.softmax_aggregate(rowptr, col, s, v).sum(), [s, v])
    g2 = torch.autograd.grad(
        ops.softmax_aggregate(rowptr, col, s, v, csc=csc).sum(), [s, v])
    for a, b in zip(g1, g2):
        if backend == 'reference' and device == 'cuda':  # atomic index_add
            torch.testing.assert_close(a, b)
        else:
            assert torch.equal(a, b)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize('N,H,C', [(1, 1, 1), (257, 3, 7), (40000, 8, 16),
                                   (5000, 5, 8), (3000, 1, 32),
                                   (3000, 2, 300), (20000, 4, 64)])
def test_score_terms_kernel_matches_pyg(N, H, C):
    """The score-term kernels (gat_score.cu: graphs of at most 2^24 elements
    of h, x requiring its gradient) against GATConv in float64: from one row
    to a full grid of row blocks, heads wider than a block's columns, odd
    sizes; the gradients of att_src / att_dst are the kernels'
    column sums, and two runs give the same bits."""
    from torch_geometric.nn import GATConv
    torch.manual_seed(0)
    ei = _power_law_graph(N, 4 * N, 'cuda')
    ref = GATConv(16, C, heads=H).cuda().double()
    fast = FastGATConv(16, C, heads=H).cuda().double()
    fast.load_state_dict(ref.state_dict())
    x = torch.randn(N, 16, device='cuda', dtype=torch.float64)
    g = torch.randn(N, H * C, device='cuda', dtype=torch.float64)
    res = []
    for layer in (ref, fast, fast):
        xr = x.clone().requires_grad_()
        layer.zero_grad(set_to_none=True)
        out = layer(xr, ei)
        out.backward(g)
        res.append([out.detach(), xr.grad] +
                   [p.grad.clone() for p in layer.parameters()])
    for a, b in zip(res[0], res[1]):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-9)
    for a, b in zip(res[1], res[2]):
        assert torch.equal(a, b)

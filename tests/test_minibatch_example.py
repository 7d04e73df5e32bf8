"""examples/train_minibatch.py runs a few steps on a small graph, and its
fallback sampler gives NeighborLoader's batch structure."""
import importlib.util

import pytest
import torch

from conftest import REPO


def load():
    spec = importlib.util.spec_from_file_location(
        'train_minibatch', REPO / 'examples' / 'train_minibatch.py')
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fallback_sampler_batches():
    """Seeds first, then each hop's new nodes; local edges grouped by hop and
    by destination; every edge is an edge of the graph; fanout respected;
    no node twice."""
    mod = load()
    N = 500
    x, y, ei = mod.power_law_graph(N, 8, 4, 3, seed=1)
    fanouts = [5, 3]
    s = mod.TorchNeighborSampler(x, y, ei, N, fanouts, torch.arange(40), 16)
    edges = set(zip(ei[0].tolist(), ei[1].tolist()))
    indeg = torch.bincount(ei[1], minlength=N)
    batches = list(s)
    assert len(batches) == len(s) == 3
    for b in batches:
        n_id, loc = b.n_id, b.edge_index
        assert n_id.unique().numel() == n_id.numel()
        assert b.num_sampled_nodes[0] == b.batch_size
        assert sum(b.num_sampled_nodes) == n_id.numel()
        assert sum(b.num_sampled_edges) == loc.size(1)
        assert torch.equal(b.x, x[n_id]) and torch.equal(b.y, y[n_id])
        assert bool((loc[1][1:] >= loc[1][:-1]).all())  # grouped by dst
        g = n_id[loc]
        assert all(e in edges for e in zip(g[0].tolist(), g[1].tolist()))
        start_n = start_e = 0
        for h, k in enumerate(fanouts):
            hop = loc[:, start_e:start_e + b.num_sampled_edges[h]]
            dst_lo, dst_hi = start_n, start_n + b.num_sampled_nodes[h]
            assert bool(((hop[1] >= dst_lo) & (hop[1] < dst_hi)).all())
            cnt = torch.bincount(hop[1] - dst_lo,
                                 minlength=dst_hi - dst_lo)
            want = indeg[n_id[dst_lo:dst_hi]].clamp(max=k)
            # without replacement: min(fanout, in-degree) draws per node
            assert torch.equal(cnt, want)
            start_n, start_e = dst_hi, start_e + b.num_sampled_edges[h]
    assert s.local.eq(-1).all()


@pytest.mark.parametrize('mfg', ['bipartite', 'trim'])
def test_example_runs_both_layers(capsys, mfg):
    mod = load()
    hist = mod.run(['--nodes', '3000', '--avg-degree', '6', '--features',
                    '16', '--classes', '4', '--hidden', '8', '--heads', '2',
                    '--batch-size', '64', '--max-steps', '4', '--epochs',
                    '2', '--dropout', '0', '--layer', 'both', '--layers', '3',
                    '--mfg', mfg, '--device', 'cpu', '--sampler', 'torch',
                    '--log-every', '2'])
    out = capsys.readouterr().out
    assert 'sampler: pure-PyTorch' in out and 'loader' in out
    assert len(hist) == 2 and all(h['steps'] == 4 for h in hist)
    for h in hist:
        assert h['fast_s'] > 0 and h['pyg_s'] > 0 and h['loader_s'] > 0
        # same initial weights, same batches, no dropout: the same run
        assert abs(h['fast_loss'] - h['pyg_loss']) < 1e-4 * max(
            1.0, h['pyg_loss'])

"""examples/train_ddp.py: two gloo processes on the CPU, launched by
torchrun, give the gradients of single-process training on the same data."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, load_example


@pytest.mark.parametrize('layer', ['fast', 'pyg'])
def test_ddp_gradients_equal_single_process(tmp_path, layer):
    out = tmp_path / 'grads.pt'
    env = dict(os.environ, OMP_NUM_THREADS='1')
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone',
           '--nproc_per_node', '2', str(REPO / 'examples' / 'train_ddp.py'),
           '--synthetic', '--dropout', '0', '--layer', layer,
           '--save-grads', str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                          timeout=300, cwd=str(REPO))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ddp_grads = torch.load(out)

    # One process, same weights, the mean loss over all training nodes.
    mod = load_example()
    data, _ = mod.load_data('Cora', None, synthetic=True)
    torch.manual_seed(0)
    model = mod.GAT(mod.LAYERS[layer], data.num_features, 8,
                    int(data.y.max()) + 1, dropout=0.0)
    model.train()
    loss = F.cross_entropy(model(data.x, data.edge_index)[data.train_mask],
                           data.y[data.train_mask])
    loss.backward()
    assert set(ddp_grads) == {n for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():
        torch.testing.assert_close(ddp_grads[n], p.grad, atol=1e-6,
                                   rtol=1e-4, msg=n)

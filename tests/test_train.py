"""The Cora example: accuracy of a full training run, and the no-data path."""
import os
import subprocess
import sys


from conftest import EXAMPLE, load_example as _example


def test_fast_gat_reaches_cora_accuracy(shared_data_root):
    from pyg_fastattn.datasets import load_planetoid
    data = load_planetoid('Cora', root=shared_data_root)[0]
    result = _example().train(data, 'fast', epochs=200, device='cpu', seed=0,
                              measure_memory=False)
    assert result['test_acc'] >= 0.78, result['test_acc']
    assert len(result['epoch_times']) == 200


def test_no_data_exits_with_clear_message(tmp_path):
    env = dict(os.environ, PYG_FASTATTN_BACKEND='reference')
    env.pop('PYG_FASTATTN_DATA', None)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), '--root', str(tmp_path), '--epochs',
         '1'], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert 'Traceback' not in proc.stderr
    assert 'not found' in proc.stderr and str(tmp_path) in proc.stderr
    assert 'PYG_FASTATTN_DATA' in proc.stderr
    assert 'ind.cora' in proc.stderr

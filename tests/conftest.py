import os
from pathlib import Path

import pytest
import torch

import pyg_fastattn
from pyg_fastattn import _build
from pyg_fastattn.ops._lib import use_reference

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / 'examples' / 'train_cora.py'
SHARED_PLANETOID = REPO.parent / 'shared' / 'data' / 'Planetoid'

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason='needs a CUDA GPU')

# Devices every op test runs on; CUDA ones are marked so `-m cuda` selects them.
DEVICES = ['cpu', pytest.param('cuda', marks=[pytest.mark.cuda, requires_cuda])]
# (device, 16-bit dtype) pairs: bfloat16 on the CPU, both on CUDA.
HALF = [('cpu', torch.bfloat16)] + [
    pytest.param('cuda', dt, marks=[pytest.mark.cuda, requires_cuda])
    for dt in (torch.bfloat16, torch.float16)]


def assert_float32_x_grad(x, x16, device):
    """x's gradient from an op that took x in float32 beside a 16-bit weight
    against x16's (x cast first): float32, within rounding of the cast one
    (on CUDA the GEMM writes float32 itself), the same bits on the CPU."""
    assert x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, x16.grad.float(), rtol=1e-2, atol=1e-2)
    if device == 'cpu':
        assert torch.equal(x.grad, x16.grad.float())


def load_example():
    """examples/train_cora.py as a module (its GAT model and train())."""
    import importlib.util
    spec = importlib.util.spec_from_file_location('train_cora', EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(params=['native', 'reference'])
def backend(request):
    """Run a test against the compiled kernels and against the fallback."""
    if request.param == 'reference':
        with use_reference():
            yield request.param
        return
    if not _build.load().native:
        pytest.skip(f'native kernels unavailable: {_build.load().error}')
    yield request.param


@pytest.fixture
def shared_data_root():
    """The Planetoid root beside the checkout (skips when absent)."""
    root = os.environ.get('PYG_FASTATTN_DATA') or str(SHARED_PLANETOID)
    if not (Path(root) / 'Cora' / 'raw').is_dir():
        pytest.skip(f'no Planetoid data at {root} (set PYG_FASTATTN_DATA)')
    return root


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(12345)


def pytest_report_header(config):
    info = pyg_fastattn.backend_info()
    return (f"pyg_fastattn: native_cpu={info['native_cpu']} "
            f"native_cuda={info['native_cuda']} torch={info['torch']}")

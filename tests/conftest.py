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

import os
from pathlib import Path

import pytest
import torch

import pyg_fastattn
from pyg_fastattn import _build, reference

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
def backend(request, monkeypatch):
    """Run a test against the compiled kernels and against the fallback."""
    if request.param == 'reference':
        monkeypatch.setattr(_build, 'backend_for', lambda device: reference)
    elif not _build.load().native:
        pytest.skip(f'native kernels unavailable: {_build.load().error}')
    return request.param


_CPP_ERRORS = None


@pytest.fixture
def cpp_errors():
    """Skips unless an error raised by an op's C++ checks reaches Python.

    On the lent H200 image (torch 2.11.0+cu130, g++ 13.3) a JIT-built
    extension whose failed check streams a number into its message crashes
    (SIGSEGV; a five-line TORCH_LIBRARY op does too). PFA_CHECK therefore
    formats numbers with std::to_string (csrc/common.h); this probe runs
    such a failing check (shape and rank in the message) in a subprocess
    once, and skips the tests of direct op calls with bad input where it
    still crashes. The public API validates in Python first."""
    global _CPP_ERRORS
    if not _build.load().native:
        pytest.skip(f'native kernels unavailable: {_build.load().error}')
    if _CPP_ERRORS is None:
        import subprocess
        import sys
        code = ('import torch\nfrom pyg_fastattn import _build\n_build.load()\n'
                'try:\n    torch.ops.pyg_fastattn.segment_sum(torch.zeros('
                '3, dtype=torch.long), None, torch.zeros(2, 1, 1))\n'
                'except RuntimeError:\n    print("raised")\n')
        r = subprocess.run([sys.executable, '-c', code], capture_output=True,
                           text=True, timeout=600)
        _CPP_ERRORS = (r.returncode, r.stdout.strip())
    if _CPP_ERRORS != (0, 'raised'):
        pytest.skip('this torch build does not propagate C++ exceptions '
                    f'from extensions (probe exit code {_CPP_ERRORS[0]})')


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

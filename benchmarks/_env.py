"""Environment record of a benchmark run (hardware, versions, backend,
git commit), device selection and the measured copy bandwidth.

Importing this module puts the repository root on ``sys.path`` (the
benchmarks run from a checkout without installing the package).
"""
import datetime as _dt
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from _timing import time_fn  # noqa: E402

# Vendor datasheet HBM/GDDR bandwidth (GB/s), matched on the device name.
_NOMINAL_GBS = [
    ('H200', 4800.0), ('H100 NVL', 3900.0), ('H100 PCIe', 2000.0),
    ('H100', 3350.0), ('GH200', 4000.0), ('A100-SXM4-80GB', 2039.0),
    ('A100 80GB PCIe', 1935.0), ('A100', 1555.0), ('L40S', 864.0),
    ('L40', 864.0), ('L4', 300.0), ('A10G', 600.0), ('A10', 600.0),
    ('V100', 900.0), ('T4', 320.0), ('RTX 4090', 1008.0),
    ('RTX 3090', 936.0), ('B200', 8000.0),
]


def cpu_name() -> str:
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.lower().startswith('model name'):
                    return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def loadavg() -> Optional[str]:
    try:
        return ' '.join(f'{v:.2f}' for v in os.getloadavg())
    except OSError:
        return None


def _git(*args) -> Optional[str]:
    try:
        r = subprocess.run(['git', '-C', str(REPO)] + list(args),
                           capture_output=True, text=True, timeout=10)
        return r.stdout.strip() if r.returncode == 0 else None
    except Exception:  # noqa: BLE001
        return None


def env_info(device: torch.device) -> dict:
    """Everything that identifies a run: hardware, versions, date, backend."""
    import torch_geometric
    info = {
        'date': _dt.datetime.now(_dt.timezone.utc).strftime(
            '%Y-%m-%d %H:%M:%S UTC'),
        'device': device.type,
        'device_name': None,
        'cpu': cpu_name(),
        'cpu_threads': torch.get_num_threads(),
        'cpu_count': os.cpu_count(),
        'python': platform.python_version(),
        'torch': torch.__version__,
        'torch_cuda': torch.version.cuda,
        'pyg': torch_geometric.__version__,
        'host': platform.node(),
        'loadavg': loadavg(),
        'git': None,
    }
    commit = _git('rev-parse', '--short', 'HEAD')
    if commit:
        dirty = _git('status', '--porcelain', '--untracked-files=no')
        info['git'] = commit + ('+dirty' if dirty else '')
    if device.type == 'cuda':
        p = torch.cuda.get_device_properties(device)
        info['device_name'] = p.name
        info['gpu_mem_gib'] = round(p.total_memory / 2**30, 1)
        info['gpu_sms'] = p.multi_processor_count
        try:
            out = subprocess.run(
                ['nvidia-smi', '--query-gpu=driver_version',
                 '--format=csv,noheader'], capture_output=True, text=True,
                timeout=20).stdout.strip().splitlines()
            info['driver'] = out[0] if out else None
        except Exception:  # noqa: BLE001
            info['driver'] = None
    else:
        info['device_name'] = info['cpu']
    try:
        import pyg_fastattn
        from pyg_fastattn import _build
        b = _build.info()
        info['pyg_fastattn'] = getattr(pyg_fastattn, '__version__', None)
        info['backend_native_cpu'] = b.get('native_cpu')
        info['backend_native_cuda'] = b.get('native_cuda')
        info['backend_reason'] = (b.get('reason') or '').splitlines()[0][:300] \
            if b.get('reason') else None
        native = b.get('native_cuda') if device.type == 'cuda' else \
            b.get('native_cpu')
        info['backend'] = 'native' if native else 'reference'
    except Exception as e:  # noqa: BLE001
        info['backend'] = f'unavailable ({type(e).__name__}: {e})'
    return info


def env_lines(info: dict) -> List[str]:
    """A few human lines for markdown headers and console."""
    lines = [
        f"date: {info['date']}",
        f"device: {info['device']} ({info['device_name']})",
    ]
    if info['device'] == 'cuda':
        lines.append(f"GPU memory {info.get('gpu_mem_gib')} GiB, "
                     f"{info.get('gpu_sms')} SMs, driver {info.get('driver')}")
        if info.get('bw_nominal_gbs') or info.get('bw_copy_gbs'):
            lines.append(f"bandwidth: nominal {info.get('bw_nominal_gbs')} GB/s"
                         f", measured D2D copy {info.get('bw_copy_gbs')} GB/s")
    lines.append(f"CPU: {info['cpu']} ({info['cpu_threads']} torch threads, "
                 f"{info['cpu_count']} cpus)")
    load = info.get('loadavg')
    if info['device'] == 'cpu' and load:
        busy = float(load.split()[0]) > 0.75 * (info['cpu_count'] or 1)
        end = info.get('loadavg_end')
        lines.append(f"load average at start: {load}"
                     + (f', at end: {end}' if end else '')
                     + (' (machine busy: CPU timings are noisy)' if busy else ''))
    lines.append(f"torch {info['torch']} (CUDA {info['torch_cuda']}), "
                 f"PyG {info['pyg']}, python {info['python']}")
    lines.append(f"pyg_fastattn {info.get('pyg_fastattn')} backend: "
                 f"{info.get('backend')}, git {info.get('git')}")
    if info.get('backend') == 'reference' and info.get('backend_reason'):
        lines.append(f"native kernels unavailable: {info['backend_reason']}")
    return lines


def bandwidth(device: torch.device) -> dict:
    """Nominal (datasheet) and measured device-to-device copy bandwidth."""
    res = {'bw_nominal_gbs': None, 'bw_copy_gbs': None}
    if device.type != 'cuda':
        return res
    name = torch.cuda.get_device_name(device)
    for key, gbs in _NOMINAL_GBS:
        if key in name:
            res['bw_nominal_gbs'] = gbs
            break
    try:
        n = 256 * 2**20  # 1 GiB of fp32
        src = torch.empty(n, device=device).uniform_()
        dst = torch.empty_like(src)
        t = time_fn(lambda: dst.copy_(src), device, warmup=3, min_reps=10,
                    max_reps=20, budget_s=0.5)
        res['bw_copy_gbs'] = round(2 * n * 4 / (t['median_ms'] * 1e-3) / 1e9, 1)
        del src, dst
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass
    return res


def setup_threads(device: torch.device):
    if device.type == 'cpu':
        torch.set_num_threads(os.cpu_count() or 1)


def pick_device(name: Optional[str]) -> torch.device:
    if name in (None, 'auto'):
        name = 'cuda' if torch.cuda.is_available() else 'cpu'
    if name == 'cuda' and not torch.cuda.is_available():
        raise SystemExit('--device cuda: no CUDA device is visible')
    return torch.device(name)

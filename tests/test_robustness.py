"""Bad input, odd graphs, 64-bit sizes, huge rows, leaks, build faults."""
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Optional

import pytest
import torch

from pyg_fastattn import _build, ops, reference as R

from conftest import DEVICES, REPO, requires_cuda
from graphs import csr_from_degrees


def _graph(device, idx=torch.int64):
    rowptr = torch.tensor([0, 2, 3, 5], device=device, dtype=idx)
    col = torch.tensor([0, 1, 2, 0, 3], device=device, dtype=idx)
    return rowptr, col


# ---------------------------------------------------------------- bad input
def _bad_calls(device):
    """(description, call, exception type, text the message must contain)."""
    rowptr, col = _graph(device)
    s = torch.randn(5, 2, device=device)
    v = torch.randn(4, 2, 3, device=device)
    t = lambda *x, **k: torch.tensor(*x, device=device, **k)
    agg = ops.softmax_aggregate
    return [
        ('col out of range', lambda: agg(rowptr, t([0, 1, 2, 0, 4]), s, v),
         IndexError, 'col'),
        ('negative col', lambda: agg(rowptr, t([0, -1, 2, 0, 3]), s, v),
         IndexError, 'col'),
        ('rowptr not starting at 0', lambda: agg(t([1, 2, 3, 5]), col, s, v),
         ValueError, 'rowptr'),
        ('rowptr decreasing', lambda: agg(t([0, 3, 2, 5]), col, s, v),
         ValueError, 'non-decreasing'),
        ('rowptr[-1] != E', lambda: agg(t([0, 2, 3, 4]), col, s, v),
         ValueError, 'rowptr[-1]'),
        ('scores length', lambda: agg(rowptr, col, s[:4], v), ValueError,
         'scores'),
        ('heads mismatch', lambda: agg(rowptr, col, s, v[:, :1]), ValueError,
         'heads'),
        ('integer scores', lambda: agg(rowptr, col, s.long(), v), TypeError,
         'scores'),
        ('bool values', lambda: agg(rowptr, col, s, v > 0), TypeError,
         'values'),
        ('wrong rank', lambda: agg(rowptr, col, s, v[:, 0, 0]), ValueError,
         'values'),
        ('float rowptr', lambda: agg(rowptr.float(), col, s, v), TypeError,
         'rowptr'),
        ('edge_softmax rowptr[-1]', lambda: ops.edge_softmax(s[:3], rowptr),
         ValueError, 'rowptr[-1]'),
        ('edge_softmax 3-D', lambda: ops.edge_softmax(v, rowptr), ValueError,
         'scores'),
        ('sddmm index', lambda: ops.sddmm(v, v, t([0, 4]), t([0, 1])),
         IndexError, 'a_idx'),
        ('sddmm lengths', lambda: ops.sddmm(v, v, t([0, 1]), t([0])),
         ValueError, 'same length'),
        ('sddmm op', lambda: ops.sddmm(v, v, t([0]), t([0]), op='max'),
         ValueError, 'op'),
        ('spmm weights', lambda: ops.spmm(rowptr, col, s[:2], v), ValueError,
         'weights'),
        ('spmm col', lambda: ops.spmm(rowptr, t([9, 0, 0, 0, 0]), s, v),
         IndexError, 'col'),
        ('segment_sum rowptr[-1]', lambda: ops.segment_sum(t([0, 2, 9]), s),
         ValueError, 'rowptr[-1]'),
        ('segment_sum perm range', lambda: ops.segment_sum(
            rowptr, s, t([0, 9, 1, 2, 3])), IndexError, 'perm'),
        ('segment_sum perm repeats', lambda: ops.segment_sum(
            rowptr, s, t([0, 1, 1, 2, 3])), ValueError, 'repeat'),
        ('segment_sum float perm', lambda: ops.segment_sum(
            rowptr, s, t([0., 1., 2., 3., 4.])), TypeError, 'perm'),
        ('sddmm_csr float col', lambda: ops.sddmm_csr(rowptr, col.float(),
                                                      v[:3], v), TypeError,
         'col'),
        ('sddmm_csr 2-D rowptr', lambda: ops.sddmm_csr(rowptr.view(1, -1),
                                                       col, v[:3], v),
         ValueError, 'rowptr'),
        ('csc of another graph', lambda: agg(
            rowptr, col, s, v,
            csc=ops.csr_to_csc(rowptr, t([1, 0, 2, 0, 3]), 4)),
         ValueError, 'transpose'),
        ('csc perm not a permutation', lambda: agg(
            rowptr, col, s, v, csc=ops.CSC(*ops.csr_to_csc(rowptr, col, 4)[:2],
                                           t([0, 0, 1, 2, 3]), None)),
         ValueError, 'permutation'),
        ('csc colptr', lambda: ops.spmm(rowptr, col, s, v, csc=ops.CSC(
            t([0, 9, 3, 4, 5]), *ops.csr_to_csc(rowptr, col, 4)[1:])),
         ValueError, 'csc.colptr'),
        ('gatv2 att [C, H]', lambda: ops.gatv2_attention(
            rowptr, col, v, v[:3], v[0].t()), ValueError, '`att`'),
        ('csr_to_csc num_cols', lambda: ops.csr_to_csc(rowptr, col, -3),
         ValueError, 'num_cols'),
        ('validate under vmap', lambda: torch.vmap(
            lambda r: agg(r, col, s, v))(rowptr.expand(2, -1)), ValueError,
         'validate=False'),
    ]


@pytest.mark.parametrize('device', DEVICES)
def test_bad_input_raises_clear_errors(backend, device):
    rowptr, col = _graph(device)
    s = torch.randn(5, 2, device=device)
    v = torch.randn(4, 2, 3, device=device)
    for what, call, exc, text in _bad_calls(device):
        with pytest.raises(exc, match=re.escape(text)):
            call()
        # The process (and the CUDA context) stays usable after the error.
        out = ops.softmax_aggregate(rowptr, col, s, v)
        ref = R.attention(rowptr, col, None, None, s, None, v, 1.0)[0]
        torch.testing.assert_close(out, ref, msg=f'after {what}')
    if device == 'cuda':
        torch.cuda.synchronize()


@requires_cuda
@pytest.mark.cuda
def test_mixed_devices_raise():
    rowptr, col = _graph('cpu')
    s, v = torch.randn(5, 2), torch.randn(4, 2, 3)
    with pytest.raises(ValueError, match='device'):
        ops.softmax_aggregate(rowptr, col, s.cuda(), v)
    with pytest.raises(ValueError, match='device'):
        ops.edge_softmax(s.cuda(), rowptr)
    with pytest.raises(ValueError, match='device'):
        ops.sddmm(v.cuda(), v, col, col)
    out = ops.softmax_aggregate(rowptr.cuda(), col.cuda(), s.cuda(), v.cuda())
    torch.cuda.synchronize()
    assert out.isfinite().all()


@pytest.mark.parametrize('device', DEVICES)
def test_native_ops_never_touch_out_of_bounds(device, monkeypatch):
    """Unvalidated calls straight into the kernels with garbage indices must
    not crash (kernels clamp rows and skip bad columns)."""
    from pyg_fastattn import _build
    if not _build.native_available(torch.device(device)):
        pytest.skip('native kernels unavailable')
    K = torch.ops.pyg_fastattn
    t = lambda *x: torch.tensor(*x, device=device)
    rowptr, col = t([0, 9, -3, 2, 100]), t([5, -7, 1000000, 1])
    s = torch.randn(4, 2, device=device)
    v = torch.randn(3, 2, 5, device=device)
    K.edge_softmax(rowptr, s)
    K.spmm(rowptr, col, s, col, v, None, None, None)
    K.segment_sum(rowptr, col, s)
    K.sddmm_dot(v, v, col, col)
    out, lse = K.attention(rowptr, col, None, None, s, None, v, 1.0,
                           *(None, ) * 5)
    K.attention_backward(rowptr, col, t([0, 3, -2, 99]), t([7, -1, 2, 0]),
                         t([-5, 2, 100, 1]), None, None, s, None, v, 1.0, out,
                         lse, torch.randn_like(out))
    # One head per lane (CUDA: the lean kernels, 1 to 8 lanes a head, owner
    # lanes where a head has several), GAT terms and softmax_aggregate's.
    csc_bad = (t([0, 3, -2, 99]), t([7, -1, 2, 0]), t([-5, 2, 100, 1]))
    for C in (4, 8, 16, 32):
        vl = torch.randn(3, 2, C, device=device)
        a_s, a_d = torch.randn(3, 2, device=device), torch.randn(4, 2, device=device)
        o, lo = K.attention(rowptr, col, a_s, a_d, None, None, vl, 0.2,
                            *(None, ) * 5)
        go = torch.randn_like(o)
        K.attention_backward(rowptr, col, *csc_bad, a_s, a_d, None, None, vl,
                             0.2, o, lo, go)
        o, lo = K.attention(rowptr, col, None, None, s, None, vl, 1.0,
                            *(None, ) * 5)
        K.attention_backward(rowptr, col, *csc_bad, None, None, s, None, vl,
                             1.0, o, lo, go, True)
        # gatv2 and transformer, on CUDA gathering one edge at a time and
        # through their shared-memory rings
        xr, att = torch.randn(4, 2, C, device=device), torch.randn(2, C, device=device)
        et, mk = torch.randn(4, 2, C, device=device), torch.ones(4, 2, device=device)
        for ring in (('0', '1') if device == 'cuda' else ('1', )):
            monkeypatch.setenv('PYG_FASTATTN_GATV2_ASYNC', ring)
            o, lo = K.gatv2_attention(rowptr, col, vl, xr, et, att, mk, 0.2,
                                      None, None, None, None, -1, -1)
            K.gatv2_attention_backward(rowptr, col, *csc_bad, vl, xr, et, att,
                                       mk, 0.2, None, o, lo, go, True, -1, -1)
            o, lo = K.transformer_attention(rowptr, col, xr, vl, vl, et, mk,
                                            0.5, None, None, None, -1, -1,
                                            False)
            K.transformer_attention_backward(rowptr, col, *csc_bad, xr, vl, vl,
                                             et, mk, 0.5, o, lo, go, True, -1,
                                             -1)
    if device == 'cuda':
        torch.cuda.synchronize()
    # And a valid call still gives the right answer.
    rp, c = _graph(device)
    sv, vv = torch.randn(5, 2, device=device), torch.randn(4, 2, 3, device=device)
    torch.testing.assert_close(ops.softmax_aggregate(rp, c, sv, vv),
                               R.attention(rp, c, None, None, sv, None, vv, 1.0)[0])


# --------------------------------------------------------------- odd graphs
@pytest.mark.parametrize('device', DEVICES)
def test_huge_row(backend, device):
    """One row with 10^6 edges: correct, and not pathologically slow."""
    E = 1_000_000
    rowptr, col = csr_from_degrees([3, E, 0, 1], 1000, device=device)
    s = torch.randn(E + 4, 2, device=device, dtype=torch.float64)
    v = torch.randn(1000, 2, 4, device=device, dtype=torch.float64)
    t0 = time.perf_counter()
    out = ops.softmax_aggregate(rowptr, col, s, v, validate=False)
    y = ops.edge_softmax(s, rowptr, validate=False)
    if device == 'cuda':
        torch.cuda.synchronize()
    took = time.perf_counter() - t0
    ref = R.attention(rowptr, col, None, None, s, None, v, 1.0)[0]
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(y, R.edge_softmax(rowptr, s))
    assert took < 30, f'10^6-edge row took {took:.1f} s'


@pytest.mark.parametrize('device', DEVICES)
def test_edge_cases_match_pyg_softmax(backend, device):
    """E = 0, N = 1, duplicate edges, nodes without in-edges."""
    from torch_geometric.utils import softmax as pyg_softmax
    for deg in ([0, 0, 0], [4], [0, 2, 0, 3, 0], [1, 1, 1]):
        rowptr, col = csr_from_degrees(deg, 2, device=device)  # duplicates
        s = torch.randn(col.numel(), 3, device=device, dtype=torch.float64)
        v = torch.randn(2, 3, 4, device=device, dtype=torch.float64)
        torch.testing.assert_close(ops.edge_softmax(s, rowptr),
                                   pyg_softmax(s, ptr=rowptr))
        out = ops.softmax_aggregate(rowptr, col, s, v)
        assert out.shape == (len(deg), 3, 4)
        empty = torch.tensor(deg, device=device) == 0
        assert out[empty].eq(0).all()


# ----------------------------------------------------------- 64-bit safety
@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize('idx', [torch.int32, torch.int64])
def test_64bit_sizes(idx):
    """E * H * C and Ns * H * C past 2^31 elements (E = 70M, H * C = 32)."""
    torch.cuda.empty_cache()
    dev = 'cuda'
    E, N, Ns, H, C = 70_000_000, 1 << 21, 70_000_000, 1, 32
    assert E * H * C > 2**31 and Ns * H * C > 2**31
    deg = torch.full((N, ), E // N, dtype=torch.long)
    deg[: E - int(deg.sum())] += 1
    rowptr = torch.zeros(N + 1, dtype=torch.long, device=dev)
    rowptr[1:] = deg.to(dev).cumsum(0)
    # Columns reach the end of `values`, where offsets exceed 2^31.
    col = torch.randint(Ns - 2_000_000, Ns, (E, ), device=dev)
    rowptr, col = rowptr.to(idx), col.to(idx)
    s = torch.randn(E, H, device=dev, dtype=torch.float16)
    v = torch.randn(Ns, H, C, device=dev, dtype=torch.float16)
    out = ops.softmax_aggregate(rowptr, col, s, v, validate=False)
    dots = ops.sddmm(v, v, col, col, validate=False)
    # Check sampled rows / edges against float64 on just those rows.
    rows = torch.tensor([0, 1, N // 2, N - 1], device=dev)
    for i in rows.tolist():
        a, b = int(rowptr[i]), int(rowptr[i + 1])
        alpha = torch.softmax(s[a:b].double(), dim=0)
        ref = (alpha.unsqueeze(-1) * v[col[a:b].long()].double()).sum(0)
        torch.testing.assert_close(out[i].double(), ref, atol=2e-2, rtol=2e-2)
    for e in [0, E // 2, E - 1]:
        j = int(col[e])
        ref = (v[j].double() ** 2).sum(-1)
        torch.testing.assert_close(dots[e].double(), ref, atol=0.1, rtol=1e-2)
    del out, dots, s, v
    torch.cuda.empty_cache()


# -------------------------------------------------------------------- leaks
@pytest.mark.parametrize('device', DEVICES)
def test_no_leaks(device):
    """1000 forward+backward iterations leave allocated memory flat."""
    from pyg_fastattn.nn import FastGATConv
    torch.manual_seed(0)
    x = torch.randn(200, 16, device=device)
    ei = torch.randint(0, 200, (2, 1500), device=device)
    conv = FastGATConv(16, 8, heads=4, dropout=0.3).to(device)
    conv.train()

    def step():
        out = conv(x, ei)
        out.square().mean().backward()
        conv.zero_grad(set_to_none=True)

    def mem():
        if device == 'cuda':
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated()
        with open('/proc/self/statm') as f:
            return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')

    for _ in range(50):
        step()
    before = mem()
    for _ in range(1000):
        step()
    grown = mem() - before
    limit = 0 if device == 'cuda' else 16 << 20  # RSS also moves with malloc
    assert grown <= limit, f'memory grew by {grown / 2**20:.1f} MiB'


# ------------------------------------------------------- build faults / race
def _python(code, env, timeout=900):
    return subprocess.run([sys.executable, '-c', textwrap.dedent(code)],
                          env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=str(REPO))


_PROBE = """
    import warnings, torch
    warnings.simplefilter('always')
    with warnings.catch_warnings(record=True) as w:
        import pyg_fastattn
        from pyg_fastattn import ops
        rowptr = torch.tensor([0, 2, 3]); col = torch.tensor([0, 1, 1])
        s = torch.randn(3, 2); v = torch.randn(2, 2, 4)
        out = ops.softmax_aggregate(rowptr, col, s, v)
        out2 = ops.edge_softmax(s, rowptr)
    ours = [x for x in w if 'pyg_fastattn' in str(x.message)]
    info = pyg_fastattn.backend_info()
    print('NATIVE', info['native_cpu'], 'WARNINGS', len(ours))
    assert torch.allclose(out[1], v[1]), out
"""


def test_no_compiler_falls_back_to_reference(tmp_path):
    # CPU only: a CUDA build would run nvcc for minutes before the C++
    # compiler fails (and once more on the retry)
    env = dict(os.environ, PYG_FASTATTN_CACHE=str(tmp_path), PYG_FASTATTN_CUDA='0',
               CXX=str(tmp_path / 'no-such-compiler'), PYG_FASTATTN_BACKEND='auto')
    r = _python(_PROBE, env)
    assert r.returncode == 0, r.stderr
    assert 'NATIVE False WARNINGS 1' in r.stdout, r.stdout + r.stderr


def test_broken_cache_falls_back_to_reference(tmp_path):
    """A corrupt cached library (and no compiler to rebuild it) still lets
    the package import and work, with one warning."""
    code = """
        import torch, sys
        from pathlib import Path
        from pyg_fastattn import _build
        d = _build._build_dir_for(_build._csrc(), False)
        d.mkdir(parents=True)
        (d / (_build.NAME + '.so')).write_bytes(b'not a shared library')
        print(d)
    """
    env = dict(os.environ, PYG_FASTATTN_CACHE=str(tmp_path), PYG_FASTATTN_CUDA='0',
               CUDA_VISIBLE_DEVICES='', PYG_FASTATTN_BACKEND='reference')
    r = _python(code, env)  # (reference: the import builds nothing)
    assert r.returncode == 0, r.stderr
    env['PYG_FASTATTN_BACKEND'] = 'auto'
    env['CXX'] = str(tmp_path / 'no-such-compiler')
    r = _python(_PROBE, env)
    assert r.returncode == 0, r.stderr
    assert 'NATIVE False WARNINGS 1' in r.stdout, r.stdout + r.stderr


def test_reference_backend_env(tmp_path):
    env = dict(os.environ, PYG_FASTATTN_BACKEND='reference',
               PYG_FASTATTN_CACHE=str(tmp_path))
    r = _python(_PROBE, env)
    assert r.returncode == 0, r.stderr
    assert 'NATIVE False WARNINGS 0' in r.stdout, r.stdout
    assert not any(tmp_path.iterdir()), 'reference backend must not build'


def _cpu_objects() -> Optional[Path]:
    """The CPU-only build folder of these sources in this process's cache
    when it holds compiled objects (this process's own build when it is
    CPU-only; on a CUDA machine the one ``gpu_check.sh`` builds), else
    None."""
    _build.load()  # (a CPU-only process builds its library here)
    root = _build._csrc()
    if root is None:
        return None
    d = _build._build_dir_for(root, False)
    return d if any(d.glob('*.o')) else None


def _native_cpu_cache(tmp_path):
    """The environment of a CPU-only native build into the fresh cache
    ``tmp_path``. Compiled CPU-only objects (:func:`_cpu_objects`) are
    copied in when there are any (not the library, not the lock): a build
    there is then ninja's link step, not minutes of compiling."""
    src = _cpu_objects()
    if src is not None:
        shutil.copytree(src, tmp_path / src.name, ignore=shutil.ignore_patterns(
            '*.so', 'lock'))
    return dict(os.environ, PYG_FASTATTN_CACHE=str(tmp_path),
                PYG_FASTATTN_BACKEND='native', PYG_FASTATTN_CUDA='0')


def test_build_key_has_whole_compiler_version(tmp_path, monkeypatch):
    """Two compilers whose ``--version`` differ only after the first line
    (as nvcc's: its first line names no version) get different build
    folders; CUDA sources come first in the build order."""
    root = _build._csrc()
    dirs = []
    for release in ('12.8', '13.0'):
        cc = tmp_path / f'cc{release}'
        cc.write_text('#!/bin/sh\necho "nvcc: NVIDIA (R) Cuda compiler driver"\n'
                      f'echo "Cuda compilation tools, release {release}"\n')
        cc.chmod(0o755)
        monkeypatch.setenv('CXX', str(cc))
        monkeypatch.setenv('PYG_FASTATTN_CACHE', str(tmp_path))
        dirs.append(_build._build_dir_for(root, False))
    assert dirs[0] != dirs[1]
    assert 'release 13.0' in _build._version([str(cc)])
    order = [Path(f).suffix for f in _build._sources(root, True)]
    assert order == sorted(order, key=lambda s: s != '.cu') and '.cu' in order


def test_cpu_arch_flags(tmp_path, monkeypatch):
    """x86-64-v3 code only where /proc/cpuinfo shows every feature of it,
    never with FMA contraction, nothing with PYG_FASTATTN_CPU_ARCH=0; the
    flags are part of the build key."""
    monkeypatch.setenv('PYG_FASTATTN_CACHE', str(tmp_path))
    root = _build._csrc()
    keys = {}
    for env in ('1', '0'):
        monkeypatch.setenv('PYG_FASTATTN_CPU_ARCH', env)
        monkeypatch.setattr(_build, '_cpu_arch', None)
        flags = _build._cpu_arch_flags()
        assert set(flags) <= set(_build._flags(False)[0])
        keys[env] = (flags, _build._build_dir_for(root, False))
    flags, _ = keys['1']
    assert keys['0'][0] == []
    assert flags in ([], ['-march=x86-64-v3', '-ffp-contract=off'])
    if flags:
        have = set(Path('/proc/cpuinfo').read_text().split())
        assert _build._X86_64_V3 <= have
        assert keys['1'][1] != keys['0'][1]


def test_build_progress_lines(tmp_path, capsys):
    """While a build runs, a stderr line at each interval counts the object
    files ninja has written out of the sources; none after it stops."""
    for name in ('attention.o', 'attention.cuda.o', 'build.ninja'):
        (tmp_path / name).touch()
    progress = _build._Progress(tmp_path, 5, interval=0.05)
    progress.start()
    time.sleep(0.3)
    (tmp_path / 'spmm.o').touch()
    time.sleep(0.3)
    progress.stop.set()
    progress.join(5)
    assert not progress.is_alive()
    err = capsys.readouterr().err
    assert re.search(r'pyg_fastattn: 2 of 5 files compiled \(\d+ s\)', err)
    assert 'pyg_fastattn: 3 of 5 files compiled' in err
    time.sleep(0.2)
    assert capsys.readouterr().err == ''


@pytest.mark.skipif(os.environ.get('PYG_FASTATTN_BACKEND') == 'reference',
                    reason='native backend disabled')
def test_concurrent_builds(tmp_path):
    """Two processes importing and building into one fresh cache at once
    both succeed and both get the native kernels (the race is over ninja's
    link step where _native_cpu_cache seeds the objects)."""
    env = _native_cpu_cache(tmp_path)
    code = textwrap.dedent(_PROBE)
    procs = [subprocess.Popen([sys.executable, '-c', code], env=env,
                              cwd=str(REPO), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=1200) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert 'NATIVE True WARNINGS 0' in out, out + err


@pytest.mark.skipif(os.environ.get('PYG_FASTATTN_BACKEND') == 'reference',
                    reason='native backend disabled')
def test_stale_build_lock_does_not_hang(tmp_path):
    """A build killed midway leaves torch's ``lock`` file in the build
    folder; the next import must not wait for it forever (torch's
    cpp_extension would)."""
    env = _native_cpu_cache(tmp_path)
    code = """
        from pyg_fastattn import _build
        d = _build._build_dir_for(_build._csrc(), False)
        d.mkdir(parents=True, exist_ok=True)
        (d / 'lock').touch()
    """
    r = _python(code, dict(env, PYG_FASTATTN_BACKEND='reference'))
    assert r.returncode == 0, r.stderr  # (reference: the import builds nothing)
    r = _python(_PROBE, env, timeout=600)  # a hang fails here
    assert r.returncode == 0, r.stderr
    assert 'NATIVE True WARNINGS 0' in r.stdout, r.stdout + r.stderr

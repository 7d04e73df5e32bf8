#!/usr/bin/env python3
"""Benchmark the fused CSR ops of ``pyg_fastattn.ops`` against the PyG/torch
compositions they replace, in one run, on one device.

    python benchmarks/bench_ops.py                   # CUDA if visible, else CPU
    python benchmarks/bench_ops.py --device cpu --quick
    python benchmarks/bench_ops.py --only edge_softmax,softmax_aggregate

Ops and baselines (``ours`` is always called with ``validate=False`` and,
where it takes one, a precomputed CSC):

* edge_softmax      vs ``torch_geometric.utils.softmax(s, ptr=rowptr)``
                       and ``softmax(s, index=row)``
* sddmm (dot)       vs ``(x[i] * x[j]).sum(-1)``
* softmax_aggregate vs PyG's composition ``softmax(s, index)`` ->
                       ``alpha[..., None] * v[col]`` -> ``scatter(sum)``
                       (and softmax(ptr) + ``index_add_``)
* spmm              vs ``scatter(w[..., None] * v[col], row, sum)``,
                       ``index_add_`` and, single head, ``torch.sparse`` CSR

Modes: ``fwd`` runs under ``torch.no_grad()``; ``fwd+bwd`` runs forward and
``torch.autograd.grad`` of every differentiable input with a random
upstream gradient. Timing and launch counting: see
``benchmarks/_timing.py``; peak memory: ``benchmarks/_memory.py``.
Bandwidth: ``floor`` bytes = every input and output tensor of the op (both
passes for fwd+bwd) read or written exactly once;
``gather`` bytes add one [H*C] feature-row read per edge and per gather pass
(the traffic with no cache reuse of neighbour rows). GB/s = bytes / median
time; %BW = floor GB/s over the measured device-to-device copy bandwidth.

Outputs in ``--out`` (default ``bench_out/``): ``ops_<device>.json``,
``.csv`` (long form, one row per implementation) and ``.md`` (one row per
workload), rewritten after every workload so a killed run keeps its results.
"""
import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _env import (  # noqa: E402
    bandwidth, env_info, env_lines, loadavg, pick_device, setup_threads)
from _graphs import (  # noqa: E402
    SKEWED_DOC, generator, nbytes, randn, random_csr, skewed_csr)
from _memory import cuda_error, free_memory, guarded, peak_memory_mib  # noqa: E402
from _report import fmt, md_table, write_outputs  # noqa: E402
from _timing import (  # noqa: E402
    Budget, add_timing_args, count_launches, sync, time_fn)

import torch  # noqa: E402
from torch_geometric.utils import scatter as pyg_scatter  # noqa: E402
from torch_geometric.utils import softmax as pyg_softmax  # noqa: E402

try:
    from pyg_fastattn import ops
    _OPS_ERR = None
except Exception as e:  # noqa: BLE001
    ops = None
    _OPS_ERR = f'{type(e).__name__}: {e}'


class Case:
    """One workload in one mode: several implementations of one result."""

    def __init__(self, op, size, mode, impls: Dict[str, Callable], baseline,
                 floor, gather, seed=False, target=None, params=None):
        self.op, self.size, self.mode = op, size, mode
        self.impls, self.baseline = impls, baseline
        self.floor, self.gather = floor, gather
        self.seed, self.target, self.params = seed, target, params or {}


def _nograd(f):
    def run():
        with torch.no_grad():
            return f()
    return run


def _fwd_bwd(f, inputs, grad):
    def run():
        out = f()
        return torch.autograd.grad(out, inputs, grad)
    return run


def _both(op, size, impls, baseline, inputs, gout, floor, gather, seed,
          targets=None, params=None, modes=('fwd', 'fwd+bwd'), fwd_only=()):
    targets = targets or {}
    cases = []
    bwd_impls = {k: f for k, f in impls.items() if k not in fwd_only}
    if 'fwd' in modes:
        cases.append(Case(op, size, 'fwd', {k: _nograd(f) for k, f in impls.items()},
                          baseline, floor[0], gather[0], seed, targets.get('fwd'),
                          params))
    if 'fwd+bwd' in modes:
        cases.append(Case(op, size, 'fwd+bwd',
                          {k: _fwd_bwd(f, inputs, gout) for k, f in bwd_impls.items()},
                          baseline, floor[1], gather[1], seed,
                          targets.get('fwd+bwd'), params))
    return cases


def _ours(fn):
    if ops is None:
        def missing():
            raise RuntimeError(f'pyg_fastattn.ops unavailable: {_OPS_ERR}')
        return missing
    return fn


# ----------------------------------------------------------------------------
# workloads
# ----------------------------------------------------------------------------
def edge_softmax_cases(dev, N, H, deg=None, deg_range=None, seed=False,
                       target=None, idx=torch.long, graph=None):
    if graph is not None:  # (kind, num_edges, s): see _graphs.skewed_csr
        rowptr, col, row = skewed_csr(graph[0], N, graph[1], dev, s=graph[2],
                                      seed=1, index_dtype=idx)
    else:
        rowptr, col, row = random_csr(N, dev, deg=deg, deg_range=deg_range,
                                      seed=1, index_dtype=idx)
    row64, ptr64 = row.long(), rowptr.long()
    E = col.numel()
    s = randn((E, H), dev, 2, requires_grad=True)
    g = randn((E, H), dev, 3)
    impls = {
        'ours': _ours(lambda: ops.edge_softmax(s, rowptr, validate=False)),
        'pyg-ptr': lambda: pyg_softmax(s, ptr=ptr64),
        'pyg-index': lambda: pyg_softmax(s, index=row64, num_nodes=N),
    }
    d = _graph_label(graph, deg, deg_range)
    size = f'{N:,} rows x {d} x {H}h (E={E:,})'
    fl = (2 * nbytes(s) + nbytes(rowptr), 4 * nbytes(s) + nbytes(rowptr))
    return _both('edge_softmax', size, impls, 'pyg-ptr', [s], g, fl, fl, seed,
                 {'fwd': target}, dict(N=N, E=E, H=H))


def sddmm_cases(dev, N, E, C, seed=False, target=None, idx=torch.long):
    gen = generator(dev, 4)
    i = torch.randint(N, (E, ), device=dev, generator=gen).to(idx)
    j = torch.randint(N, (E, ), device=dev, generator=gen).to(idx)
    i64, j64 = i.long(), j.long()
    x = randn((N, C), dev, 5, requires_grad=True)
    g = randn((E, ), dev, 6)
    impls = {
        'ours': _ours(lambda: ops.sddmm(x, x, i, j, op='dot', validate=False)),
        'torch-gather': lambda: (x[i64] * x[j64]).sum(-1),
    }
    size = f'{N:,} nodes, {E:,} edges x {C}'
    out_b, row_b = E * 4, C * 4
    fwd_floor = nbytes(x, i, j) + out_b
    fb_floor = fwd_floor + out_b + nbytes(x)  # + grad_out, grad_x
    fwd_gather = nbytes(i, j) + out_b + 2 * E * row_b
    fb_gather = fwd_gather + out_b + 2 * E * row_b + nbytes(x)
    return _both('sddmm', size, impls, 'torch-gather', [x], g,
                 (fwd_floor, fb_floor), (fwd_gather, fb_gather), seed,
                 {'fwd': target}, dict(N=N, E=E, C=C))


def _aggregate_data(dev, N, deg, H, C, deg_range=None, idx=torch.long,
                    graph=None):
    if graph is not None:  # (kind, num_edges, s): see _graphs.skewed_csr
        kind, E, s_exp = graph
        rowptr, col, row = skewed_csr(kind, N, E, dev, s=s_exp, seed=7,
                                      index_dtype=idx)
    else:
        rowptr, col, row = random_csr(N, dev, deg=deg, deg_range=deg_range,
                                      seed=7, index_dtype=idx)
    E = col.numel()
    s = randn((E, H), dev, 8, requires_grad=True)
    v = randn((N, H, C), dev, 9, requires_grad=True)
    g = randn((N, H, C), dev, 10)
    csc = ops.csr_to_csc(rowptr, col, N) if ops is not None else None
    sync(dev)
    return rowptr, col, row, E, s, v, g, csc


def _aggregate_bytes(rowptr, col, s, v, g):
    E, HC = col.numel(), v.shape[1] * v.shape[2]
    out = nbytes(g)
    fwd_floor = nbytes(rowptr, col, s, v) + out
    fb_floor = fwd_floor + nbytes(g) + nbytes(s) + nbytes(v)
    gathered = E * HC * v.element_size()
    fwd_gather = nbytes(rowptr, col, s) + out + gathered
    fb_gather = fwd_gather + nbytes(g) + nbytes(s) + nbytes(v) + 2 * gathered
    return (fwd_floor, fb_floor), (fwd_gather, fb_gather)


def _graph_label(graph, deg, deg_range):
    if graph is not None:
        kind, _, s_exp = graph
        return f'power law s={s_exp}' if kind == 'power' else kind
    return f'deg {deg}' if deg else f'deg {deg_range[0]}-{deg_range[1]}'


def softmax_aggregate_cases(dev, N, deg, H, C, seed=False, targets=None,
                            deg_range=None, idx=torch.long, graph=None):
    rowptr, col, row, E, s, v, g, csc = _aggregate_data(dev, N, deg, H, C,
                                                        deg_range, idx, graph)
    row64, col64, ptr64 = row.long(), col.long(), rowptr.long()

    def pyg():
        alpha = pyg_softmax(s, index=row64, num_nodes=N)
        msg = alpha.unsqueeze(-1) * v[col64]
        return pyg_scatter(msg, row64, dim=0, dim_size=N, reduce='sum')

    def ptr_index_add():
        alpha = pyg_softmax(s, ptr=ptr64)
        msg = alpha.unsqueeze(-1) * v.index_select(0, col64)
        return v.new_zeros((N, H, C)).index_add_(0, row64, msg)

    impls = {
        'ours': _ours(lambda: ops.softmax_aggregate(rowptr, col, s, v, csc=csc,
                                                    validate=False)),
        'pyg': pyg,
        'pyg-ptr+index_add': ptr_index_add,
    }
    d = _graph_label(graph, deg, deg_range)
    size = f'{N:,} rows x {d} x {H}h x {C}c (E={E:,})'
    if idx != torch.long:
        size += f', {str(idx).split(".")[-1]} indices'
    fl, ga = _aggregate_bytes(rowptr, col, s, v, g)
    return _both('softmax_aggregate', size, impls, 'pyg', [s, v], g, fl, ga,
                 seed, targets, dict(N=N, E=E, H=H, C=C))


def spmm_cases(dev, N, deg, H, C, seed=False, sparse=False, idx=torch.long,
               graph=None):
    rowptr, col, row, E, w, v, g, csc = _aggregate_data(dev, N, deg, H, C,
                                                        None, idx, graph)
    row64, col64, ptr64 = row.long(), col.long(), rowptr.long()

    def pyg():
        return pyg_scatter(w.unsqueeze(-1) * v[col64], row64, dim=0,
                           dim_size=N, reduce='sum')

    def index_add():
        msg = w.unsqueeze(-1) * v.index_select(0, col64)
        return v.new_zeros((N, H, C)).index_add_(0, row64, msg)

    impls = {
        'ours': _ours(lambda: ops.spmm(rowptr, col, w, v, csc=csc,
                                       validate=False)),
        'pyg': pyg,
        'torch-index_add': index_add,
    }
    if sparse and H == 1:
        # forward only: autograd through a CSR tensor's values rejects
        # graphs with duplicate edges (torch limitation)
        def sp():
            A = torch.sparse_csr_tensor(ptr64, col64, w.view(-1), (N, N))
            return (A @ v.view(N, C)).view(N, 1, C)
        impls['torch.sparse-csr'] = sp
    size = f'{N:,} rows x {_graph_label(graph, deg, None)} x {H}h x {C}c (E={E:,})'
    fl, ga = _aggregate_bytes(rowptr, col, w, v, g)
    return _both('spmm', size, impls, 'pyg', [w, v], g, fl, ga, seed, None,
                 dict(N=N, E=E, H=H, C=C), fwd_only=('torch.sparse-csr', ))


def plan(dev, quick: bool):
    """(op name, builder) in run order; builders create data on call."""
    cuda = dev.type == 'cuda'
    P = []
    seedsz = [
        ('edge_softmax', lambda: edge_softmax_cases(dev, 384, 8, deg_range=(16, 20), seed=True)),
        ('sddmm', lambda: sddmm_cases(dev, 2048, 16384, 128, seed=True)),
        ('softmax_aggregate', lambda: softmax_aggregate_cases(dev, 384, 18, 1, 64, seed=True)),
        ('softmax_aggregate', lambda: softmax_aggregate_cases(dev, 384, 18, 8, 8, seed=True)),
        ('spmm', lambda: spmm_cases(dev, 384, 18, 1, 64, seed=True)),
    ]
    if cuda and not quick:
        P += [
            ('edge_softmax', lambda: edge_softmax_cases(
                dev, 1_000_000, 8, deg=20, target=('ms<=', 0.5))),
            ('sddmm', lambda: sddmm_cases(dev, 1_000_000, 20_000_000, 128,
                                          target=('ms<=', 6.0))),
            ('softmax_aggregate', lambda: softmax_aggregate_cases(
                dev, 1_000_000, 20, 8, 16,
                targets={'fwd+bwd': ('speedup>=', 12.0)})),
            # the same with int32 indices, as prepare() gives the layers
            ('softmax_aggregate', lambda: softmax_aggregate_cases(
                dev, 1_000_000, 20, 8, 16, idx=torch.int32,
                targets={'fwd+bwd': ('speedup>=', 12.0)})),
            ('spmm', lambda: spmm_cases(dev, 1_000_000, 20, 8, 16)),
            ('spmm', lambda: spmm_cases(dev, 1_000_000, 20, 1, 128, sparse=True)),
        ]
        # Hubs (SKEWED): one row of 10^6 edges against the same edges in rows
        # of 20, and the power-law graphs of 1M rows / 20M edges.
        for kind in ('hub', 'rows20'):
            P += [
                ('softmax_aggregate', lambda kind=kind: softmax_aggregate_cases(
                    dev, 50_000, None, 8, 16, graph=(kind, 1_000_000, 1.0))),
                ('edge_softmax', lambda kind=kind: edge_softmax_cases(
                    dev, 50_000, 8, graph=(kind, 1_000_000, 1.0))),
                ('spmm', lambda kind=kind: spmm_cases(
                    dev, 50_000, None, 8, 16, graph=(kind, 1_000_000, 1.0))),
            ]
        for s_exp in (0.8, 1.0):
            P += [
                ('softmax_aggregate', lambda s_exp=s_exp: softmax_aggregate_cases(
                    dev, 1_000_000, None, 8, 16,
                    graph=('power', 20_000_000, s_exp))),
                ('edge_softmax', lambda s_exp=s_exp: edge_softmax_cases(
                    dev, 1_000_000, 8, graph=('power', 20_000_000, s_exp))),
            ]
    elif cuda:  # quick
        P += [
            ('edge_softmax', lambda: edge_softmax_cases(dev, 100_000, 8, deg=20)),
            ('sddmm', lambda: sddmm_cases(dev, 100_000, 2_000_000, 128)),
            ('softmax_aggregate', lambda: softmax_aggregate_cases(dev, 100_000, 20, 8, 16)),
            ('spmm', lambda: spmm_cases(dev, 100_000, 20, 1, 128, sparse=True)),
        ]
    elif not quick:
        P += [
            # CPU hub row vs balanced rows (SKEWED), target: within 4x.
            ('softmax_aggregate', lambda: softmax_aggregate_cases(
                dev, 10_000, None, 4, 16, graph=('hub', 200_000, 1.0))),
            ('softmax_aggregate', lambda: softmax_aggregate_cases(
                dev, 10_000, None, 4, 16, graph=('rows20', 200_000, 1.0))),
            ('edge_softmax', lambda: edge_softmax_cases(dev, 100_000, 4, deg=10)),
            ('sddmm', lambda: sddmm_cases(dev, 100_000, 1_000_000, 64)),
            ('softmax_aggregate', lambda: softmax_aggregate_cases(dev, 100_000, 10, 4, 16)),
            ('spmm', lambda: spmm_cases(dev, 100_000, 10, 4, 16)),
            ('spmm', lambda: spmm_cases(dev, 100_000, 10, 1, 64, sparse=True)),
        ]
    else:
        P += [
            ('edge_softmax', lambda: edge_softmax_cases(dev, 10_000, 4, deg=10)),
            ('sddmm', lambda: sddmm_cases(dev, 10_000, 100_000, 64)),
            ('softmax_aggregate', lambda: softmax_aggregate_cases(dev, 10_000, 10, 4, 16)),
            ('spmm', lambda: spmm_cases(dev, 10_000, 10, 1, 64, sparse=True)),
        ]
    return seedsz + P


# ----------------------------------------------------------------------------
# measurement
# ----------------------------------------------------------------------------
def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in out if t is not None]


def rel_err(a, b) -> Optional[float]:
    errs = []
    for x, y in zip(_flat(a), _flat(b)):
        x, y = x.detach().double(), y.detach().double()
        if x.shape != y.shape:
            return float('nan')
        scale = y.abs().max().item() if y.numel() else 0.0
        d = (x - y).abs().max().item() if y.numel() else 0.0
        errs.append(d / scale if scale > 0 else d)
    return max(errs) if errs else None


def run_case(case: Case, dev, args, bw_ref: Optional[float]) -> List[dict]:
    recs = []
    budget = args.rep_budget
    for name, fn in case.impls.items():
        rec = dict(op=case.op, size=case.size, mode=case.mode, impl=name,
                   seed_size=case.seed, **case.params)
        st, t, msg = guarded(lambda: time_fn(
            fn, dev, warmup=args.warmup, min_reps=args.min_reps,
            max_reps=args.max_reps * (4 if case.seed else 1), budget_s=budget), dev)
        rec['status'] = st
        if msg:
            rec['message'] = msg
        if st == 'ok':
            rec.update({k: t[k] for k in ('median_ms', 'p10_ms', 'p90_ms',
                                          'min_ms', 'wall_ms', 'reps')})
            s = t['median_ms'] * 1e-3
            rec['bytes_floor'], rec['bytes_gather'] = case.floor, case.gather
            rec['gbs_floor'] = case.floor / s / 1e9
            rec['gbs_gather'] = case.gather / s / 1e9
            if bw_ref:
                rec['pct_bw_floor'] = 100.0 * rec['gbs_floor'] / bw_ref
            st2, mem, _ = guarded(lambda: peak_memory_mib(fn, dev), dev)
            rec['peak_mib'] = mem if st2 == 'ok' else st2
            if case.seed and not args.no_profile:
                st3, cnt, m3 = guarded(lambda: count_launches(fn, dev), dev)
                if st3 == 'ok':
                    rec.update({f'launch_{k}': v for k, v in cnt.items()})
        recs.append(rec)
        free_memory(dev)
    # correctness of every implementation against the baseline
    if case.baseline in case.impls:
        st, ref, _ = guarded(case.impls[case.baseline], dev)
        if st == 'ok':
            for rec in recs:
                if rec['impl'] == case.baseline or rec['status'] != 'ok':
                    continue
                st2, err, _ = guarded(
                    lambda: rel_err(case.impls[rec['impl']](), ref), dev)
                rec['rel_err'] = err if st2 == 'ok' else st2
        ref = None
        free_memory(dev)
    # speedups
    by = {r['impl']: r for r in recs}
    ours = by.get('ours')
    for r in recs:
        if ours and ours.get('status') == 'ok' and r.get('status') == 'ok':
            r['ours_speedup_vs_this'] = r['median_ms'] / ours['median_ms']
    if case.target and ours:
        kind, val = case.target
        ours['target'] = f'{kind}{val}'
        if ours.get('status') == 'ok':
            if kind == 'ms<=':
                ours['target_met'] = ours['median_ms'] <= val
            else:
                b = by.get(case.baseline, {})
                ours['target_met'] = (b.get('status') == 'ok' and
                                      b['median_ms'] / ours['median_ms'] >= val) \
                    or b.get('status') == 'OOM'
        else:
            ours['target_met'] = False
    return recs


# ----------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------
def _ms(r):
    if r is None:
        return None
    return r['median_ms'] if r.get('status') == 'ok' else r.get('status')


def summary_rows(records: List[dict], baselines: Dict[tuple, str]) -> List[dict]:
    groups: Dict[tuple, List[dict]] = {}
    for r in records:
        groups.setdefault((r['op'], r['size'], r['mode']), []).append(r)
    rows = []
    for key, rs in groups.items():
        by = {r['impl']: r for r in rs}
        ours = by.get('ours', {})
        base_name = baselines.get(key)
        base = by.get(base_name)
        others = [r for r in rs if r['impl'] not in ('ours', base_name)
                  and r.get('status') == 'ok']
        cands = [r for r in rs if r['impl'] != 'ours' and r.get('status') == 'ok']
        best = min(cands, key=lambda r: r['median_ms']) if cands else None
        ok = ours.get('status') == 'ok'
        row = dict(op=key[0], size=key[1], mode=key[2], ours_ms=_ms(ours),
                   baseline=f"{base_name}: {fmt(_ms(base))}" if base else '-',
                   others='; '.join(f"{o['impl']}: {fmt(o['median_ms'])}"
                                    for o in others) or '-')
        row['speedup'] = (base['median_ms'] / ours['median_ms']
                          if ok and base and base.get('status') == 'ok' else
                          ('base OOM' if base and base.get('status') == 'OOM'
                           else None))
        row['speedup_best'] = (best['median_ms'] / ours['median_ms']
                               if ok and best else None)
        row['gbs'] = ours.get('gbs_floor') if ok else None
        row['gbs_gather'] = ours.get('gbs_gather') if ok else None
        row['pct_bw'] = ours.get('pct_bw_floor') if ok else None
        row['mem'] = f"{fmt(ours.get('peak_mib'))} / {fmt(base.get('peak_mib') if base else None)}"
        if 'launch_kernels' in ours or (base and 'launch_kernels' in base):
            row['launches'] = (f"{fmt(ours.get('launch_kernels'))} / "
                               f"{fmt(base.get('launch_kernels') if base else None)}")
        elif 'launch_ops' in ours:
            row['launches'] = (f"{fmt(ours.get('launch_ops'))} / "
                               f"{fmt(base.get('launch_ops') if base else None)} ops")
        else:
            row['launches'] = None
        errs = [r.get('rel_err') for r in rs if isinstance(r.get('rel_err'), float)]
        row['err'] = ours.get('rel_err')
        if 'target' in ours:
            row['target'] = f"{ours['target']}: {'MET' if ours.get('target_met') else 'MISSED'}"
        else:
            row['target'] = None
        if not ok:
            row['ours_ms'] = f"{ours.get('status')}: {ours.get('message', '')}"[:80]
        rows.append(row)
    return rows


def markdown(meta, records, baselines, args) -> str:
    rows = summary_rows(records, baselines)
    launch_hdr = 'kernels/call ours / base' if meta['device'] == 'cuda' else \
        'top-level ops/call ours / base'
    cols = [('op', 'op'), ('size', 'size'), ('mode', 'mode'),
            ('ours ms', 'ours_ms'), ('baseline ms', 'baseline'),
            ('other baselines ms', 'others'), ('speedup', 'speedup'),
            ('vs best', 'speedup_best'), ('GB/s floor', 'gbs'),
            ('GB/s gather', 'gbs_gather'), ('% copy BW', 'pct_bw'),
            ('peak MiB ours / base', 'mem'), (launch_hdr, 'launches'),
            ('rel err', 'err'), ('target', 'target')]
    head = [f'# pyg_fastattn op benchmark ({meta["device"]})', '']
    head += [f'- {line}' for line in env_lines(meta)]
    head += [f'- command: `{meta["command"]}`',
             f'- graphs: uniform random degrees (deg), or {SKEWED_DOC}', '',
             'Median of per-call times ('
             + ('CUDA events' if meta['device'] == 'cuda' else 'perf_counter')
             + ') after warm-up; speedup = baseline / ours; "vs best" = fastest '
             'baseline / ours. GB/s floor counts every input/output tensor once; '
             'GB/s gather adds one feature-row read per edge and gather pass. '
             'Peak MiB = memory one call adds '
             + ('(max_memory_allocated delta)' if meta['device'] == 'cuda' else
                '(peak RSS growth)') + '. rel err = max|ours - baseline| / '
             'max|baseline| over all outputs (grads for fwd+bwd).', '']
    return '\n'.join(head) + '\n' + md_table(rows, cols) + '\n'


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--device', default='auto', choices=['auto', 'cpu', 'cuda'])
    ap.add_argument('--quick', action='store_true', help='small sizes, few reps')
    ap.add_argument('--out', default='bench_out')
    ap.add_argument('--only', default=None,
                    help='comma list of ops (edge_softmax,sddmm,softmax_aggregate,spmm)')
    ap.add_argument('--no-seed', action='store_true', help='skip the seed sizes')
    ap.add_argument('--no-profile', action='store_true',
                    help='skip launch counting (torch.profiler)')
    add_timing_args(ap)
    args = ap.parse_args(argv)

    dev = pick_device(args.device)
    setup_threads(dev)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rep_budget is None:
        args.rep_budget = (0.6 if dev.type == 'cuda' else 2.0) * (0.3 if args.quick else 1)
    if args.quick:
        args.min_reps = min(args.min_reps, 3)
        args.warmup = min(args.warmup, 2)
    meta = env_info(dev)
    meta.update(bandwidth(dev))
    meta['command'] = ' '.join([os.path.basename(sys.executable)] + sys.argv)
    meta['quick'] = args.quick
    bw_ref = meta.get('bw_copy_gbs') or meta.get('bw_nominal_gbs')
    meta['bw_ref_gbs'] = bw_ref
    for line in env_lines(meta):
        print(line, flush=True)
    print(f'graphs: uniform random degrees (deg), or {SKEWED_DOC}', flush=True)
    if ops is None:
        print(f'WARNING: pyg_fastattn.ops unavailable: {_OPS_ERR}', flush=True)
    elif meta.get('backend') != 'native':
        print('WARNING: the native kernels are not in use; "ours" runs the '
              'pure-PyTorch reference', flush=True)

    only = set(args.only.split(',')) if args.only else None
    out_dir = Path(args.out)
    stem = f'ops_{dev.type}'
    budget = Budget(args.budget_s)
    records: List[dict] = []
    baselines: Dict[tuple, str] = {}
    skipped = []
    lost = None  # set when a failure leaves the CUDA context unusable
    not_run = []
    for op, build in plan(dev, args.quick):
        if only and op not in only:
            continue
        if lost:
            not_run.append(op)
            continue
        if budget.spent():
            skipped.append(op)
            continue
        t0 = time.perf_counter()
        st, cases, msg = guarded(build, dev)
        if st != 'ok':
            print(f'[{op}] setup failed: {st} {msg}', flush=True)
            records.append(dict(op=op, size='?', mode='-', impl='setup',
                                status=st, message=msg))
            continue
        if args.no_seed and cases and cases[0].seed:
            continue
        for case in cases:
            if lost:
                not_run.append(f'{case.op} {case.size} {case.mode}')
                continue
            if budget.spent():
                skipped.append(f'{case.op} {case.size} {case.mode}')
                continue
            recs = run_case(case, dev, args, bw_ref)
            err = cuda_error(dev)
            if err:
                lost = f'{case.op} {case.size} {case.mode}: {err}'
                print(f'[{case.op}] the CUDA context is lost after {lost}; '
                      f'no later case can run in this process', flush=True)
            records += recs
            baselines[(case.op, case.size, case.mode)] = case.baseline
            by = {r['impl']: r for r in recs}
            o, b = by.get('ours', {}), by.get(case.baseline, {})
            sp = (f"{b['median_ms'] / o['median_ms']:.2f}x"
                  if o.get('status') == 'ok' and b.get('status') == 'ok' else '-')
            print(f"[{case.op}] {case.size} {case.mode}: ours "
                  f"{fmt(_ms(o))} ms, {case.baseline} {fmt(_ms(b))} ms, "
                  f"speedup {sp}, err {fmt(o.get('rel_err'))}", flush=True)
            meta['skipped'] = skipped
            write_outputs(out_dir, stem, meta, records,
                          markdown(meta, records, baselines, args))
        cases = None
        free_memory(dev)
        print(f'  ({op} took {time.perf_counter() - t0:.1f} s)', flush=True)
    meta['skipped'] = skipped
    meta['elapsed_s'] = round(budget.elapsed(), 1)
    meta['loadavg_end'] = loadavg()
    md = markdown(meta, records, baselines, args)
    if skipped:
        md += f'\nSkipped (time budget): {", ".join(skipped)}\n'
    if lost:
        meta['cuda_context_lost'] = lost
        md += (f'\nThe CUDA context was lost after {lost}. Not run: '
               f'{", ".join(not_run) or "-"}\n')
    paths = write_outputs(out_dir, stem, meta, records, md)
    print()
    print(md)
    print(f"wrote {paths['md']}, {paths['json']}, {paths['csv']}")
    bad = [r for r in records if r['impl'] == 'ours' and r.get('status') != 'ok']
    return 1 if bad or not_run else 0


if __name__ == '__main__':
    sys.exit(main())

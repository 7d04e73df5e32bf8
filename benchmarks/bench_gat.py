#!/usr/bin/env python3
"""Benchmark ``FastGATConv`` against ``torch_geometric.nn.GATConv``.

    python benchmarks/bench_gat.py                       # CUDA if visible
    python benchmarks/bench_gat.py --device cuda --cuda-graph
    python benchmarks/bench_gat.py --device cpu --quick
    python benchmarks/bench_gat.py --providers pyg,fast,floor   # no compile

Providers (``--providers``, default all; table order)
  ``pyg``          torch_geometric.nn.GATConv, eager
  ``pyg_compile``  ``torch.compile`` (default inductor mode) of the same PyG
                   model (the GAT model for epochs, the layer for layers),
                   compiled afresh per workload (``torch._dynamo.reset()``);
                   compile time is in ``first_ms`` only. Runs after every
                   other provider of every workload (second pass), so that a
                   time budget spent on compiling never costs the eager rows.
                   A compile failure is recorded in its row.
  ``fast``         pyg_fastattn.FastGATConv, loaded with the same state_dict
                   and called the drop-in way (``conv(x, edge_index)``)
  ``fast_compile`` ``torch.compile`` (default inductor mode) of the fast
                   model or layer, compiled afresh per workload, in the
                   second pass as ``pyg_compile``
  ``fast_compile_prepared``  ``fast_compile`` called with a
                   ``pyg_fastattn.PreparedGraph`` made once outside the
                   model (the README's advice for compiled models): no graph
                   preparation inside the compiled graph
  ``fast_bf16``    ``fast`` under ``torch.autocast(device, torch.bfloat16)``
                   (forward and loss; backward outside, as AMP does)
  ``fast+graph``   (``--cuda-graph``, epochs only) the fast training step
                   captured once in a CUDA graph and replayed (with the fused
                   Adam, as examples/train_cora.py --cuda-graph does)
  ``floor``        the same model with every attention layer replaced by its
                   own ``lin`` and bias (``x @ lin.weight.t() + bias``, mean
                   over heads when ``concat=False``): what no attention layer
                   can go below

Workloads
  ``epoch``  one full training epoch of PyG's example 2-layer GAT (8 heads x
             8 hidden, ELU, dropout 0.6, Adam lr 0.005 wd 5e-4): zero_grad,
             forward, cross-entropy on the training nodes, backward, step.
             Cora and CiteSeer (real Planetoid data; skipped with a note when
             absent) and a PubMed-sized synthetic graph
             (``pyg_fastattn.datasets.synthetic_pubmed``).
  ``fwd``    one layer, eval mode, under ``torch.no_grad()``
  ``fwd+bwd`` one layer, train mode, forward then ``torch.autograd.grad`` of
             all parameters with a random upstream gradient.
             Random graphs (uniform random edges, built on the device),
             and graphs with hubs (``benchmarks/_graphs.py`` skewed_csr):
             power law (each edge's destination drawn with weight
             1/(i+1)^s, s = 0.8 and 1.0, sources uniform), one hub row
             of 10^6 edges and the same edges in rows of 20.

Measurements: median per-call time after warm-up (CUDA events on GPU);
``host_ms`` = median time until the Python call returns (device synchronised
between calls, never inside the timed region; on CPU the same samples as the
median), peak memory one call adds (``max_memory_allocated`` delta on GPU;
peak-RSS growth on CPU, see ``benchmarks/_memory.py``), ``resident_mib`` =
memory that stays allocated after warm-up (caches, optimizer state) and
``first_ms`` = the first call (includes one-off graph preparation, and the
compilation for ``pyg_compile``). ``rel_err`` compares a provider with
eager PyG on identical weights: eval-mode outputs (epochs, fwd) or parameter
gradients (fwd+bwd). Ratios: ``speedup`` / ``mem_ratio`` against ``pyg``,
``speedup_compile`` / ``mem_ratio_compile`` against ``pyg_compile``,
``floor_x`` = provider time / ``floor`` time. An out-of-memory is recorded
as ``OOM`` and the run goes on.

Outputs in ``--out`` (default ``bench_out/``): ``gat_<device>.json``,
``.csv``, ``.md`` and ``.png`` (speedup and memory ratio per workload);
rewritten after every workload.
"""
import argparse
import contextlib
import copy
import importlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _env import (  # noqa: E402
    REPO, env_info, env_lines, loadavg, pick_device, setup_threads)
from _graphs import SKEWED_DOC, generator, randn, skewed_csr  # noqa: E402
from _memory import (  # noqa: E402
    cuda_error, free_memory, guarded, peak_memory_mib, resident_mib)
from _report import fmt, fmt_count, md_table, write_outputs  # noqa: E402
from _timing import Budget, add_timing_args, sync, time_fn  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch_geometric.nn import GATConv  # noqa: E402

PROVIDERS = ('pyg', 'pyg_compile', 'fast', 'fast_compile',
             'fast_compile_prepared', 'fast_bf16', 'fast+graph', 'floor')
# run in a second pass over the workloads
COMPILED = ('pyg_compile', 'fast_compile', 'fast_compile_prepared')

_FAST_ERR = None
try:
    from pyg_fastattn import FastGATConv
except Exception as e:  # noqa: BLE001
    FastGATConv = None
    _FAST_ERR = f'{type(e).__name__}: {e}'


# ----------------------------------------------------------------------------
# model and data
# ----------------------------------------------------------------------------
class GAT(torch.nn.Module):
    """PyG's examples/gat.py model, with the conv class as a parameter."""

    def __init__(self, conv, in_channels, hidden_channels, out_channels,
                 heads=8, dropout=0.6):
        super().__init__()
        self.dropout = dropout
        self.conv1 = conv(in_channels, hidden_channels, heads, dropout=dropout)
        self.conv2 = conv(hidden_channels * heads, out_channels, heads=1,
                          concat=False, dropout=dropout)

    def forward(self, x, edge_index):
        x = F.dropout(x, p=self.dropout, training=self.training)
        x = F.elu(self.conv1(x, edge_index))
        x = F.dropout(x, p=self.dropout, training=self.training)
        return self.conv2(x, edge_index)


def _data_dirs() -> List[Path]:
    dirs = []
    if os.environ.get('PYG_FASTATTN_DATA'):
        dirs.append(Path(os.environ['PYG_FASTATTN_DATA']))
    dirs += [REPO / '.data' / 'Planetoid', REPO / 'data' / 'Planetoid',
             REPO.parent / 'shared' / 'data' / 'Planetoid']
    return dirs


def _planetoid_fallback(name: str):
    """Copy the raw Planetoid files (read-only elsewhere) and let PyG parse
    them; used when ``pyg_fastattn.datasets`` is unavailable."""
    from torch_geometric.datasets import Planetoid
    for d in _data_dirs():
        for sub in (d / name, d):
            raw = sub / 'raw'
            if raw.is_dir() and any(raw.glob(f'ind.{name.lower()}.*')):
                tmp = Path(tempfile.mkdtemp(prefix='pfa_planetoid_'))
                shutil.copytree(raw, tmp / name / 'raw')
                return Planetoid(str(tmp), name)[0], f'Planetoid({raw})'
    raise FileNotFoundError(f'no raw {name} files under '
                            + ', '.join(str(d) for d in _data_dirs()))


def load_dataset(name: str):
    """(data, source note); raises when the data cannot be had."""
    if name == 'PubMed-synth':
        from pyg_fastattn.datasets import synthetic_pubmed
        return synthetic_pubmed(), 'pyg_fastattn.datasets.synthetic_pubmed'
    notes = []
    try:
        from pyg_fastattn.datasets import load_planetoid
        d = load_planetoid(name)
        src = 'pyg_fastattn.datasets'
    except Exception as e:  # noqa: BLE001
        notes.append(f'pyg_fastattn.datasets: {type(e).__name__}: {e}')
        d, src = _planetoid_fallback(name)
    from torch_geometric.data.data import BaseData
    if not isinstance(d, BaseData):  # a dataset
        d = d[0]
    if notes:
        src += ' (' + '; '.join(n.splitlines()[0][:160] for n in notes) + ')'
    return d, src


class FloorConv(torch.nn.Module):
    """An attention layer without the attention: its own ``lin`` and bias,
    ``x @ lin.weight.t() + bias`` ([N, H * C]; the mean over heads when
    ``concat=False``). Parameter names match GATConv's, so
    :func:`load_matching` fills it from a GATConv state_dict."""

    def __init__(self, in_channels, out_channels, heads=1, concat=True,
                 bias=True, **_):
        super().__init__()
        self.heads, self.out_channels, self.concat = heads, out_channels, concat
        self.lin = torch.nn.Linear(in_channels, heads * out_channels,
                                   bias=False)
        width = heads * out_channels if concat else out_channels
        self.bias = torch.nn.Parameter(torch.zeros(width)) if bias else None

    def forward(self, x, edge_index=None):
        if self.concat or self.heads == 1:  # the mean of one head is that head
            return F.linear(x, self.lin.weight, self.bias)
        h = F.linear(x, self.lin.weight)
        h = h.view(-1, self.heads, self.out_channels).mean(dim=1)
        return h if self.bias is None else h + self.bias


def load_matching(module, state, strict=True):
    """Load the entries of ``state`` that ``module`` has (all of its own, or
    with ``strict=False`` those ``state`` has: the floor of a layer whose
    names differ from GATConv's keeps its own initialization)."""
    own = module.state_dict()
    module.load_state_dict({k: v for k, v in state.items() if k in own},
                           strict=strict)
    return module


def autocast(device_type: Optional[str]):
    """bfloat16 autocast on ``device_type``; a no-op context for None."""
    if device_type is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.bfloat16)


def train_step(model, opt, x, ei, y, train_idx, zero_grad=True, amp=None):
    """One full-batch training step (zero_grad, forward, cross-entropy on the
    training nodes, backward, optimizer step) as a closure. zero_grad=False
    leaves the gradients to the caller (CUDA-graph capture); ``amp`` = a
    device type runs forward and loss under bfloat16 autocast."""
    def run():
        if zero_grad:
            opt.zero_grad(set_to_none=True)
        with autocast(amp):
            out = model(x, ei)
            loss = F.cross_entropy(out.index_select(0, train_idx),
                                   y.index_select(0, train_idx))
        loss.backward()
        opt.step()
        return loss
    return run


# ----------------------------------------------------------------------------
# measurement of one provider
# ----------------------------------------------------------------------------
def measure(fn, dev, args, record: dict, first: bool = True):
    """Time ``fn`` and measure its memory into ``record``; OOM-safe."""
    res0 = resident_mib(dev)

    def go():
        if first:
            t = time.perf_counter()
            out = fn()
            sync(dev)
            record['first_ms'] = (time.perf_counter() - t) * 1e3
            del out
        t = time_fn(fn, dev, warmup=args.warmup, min_reps=args.min_reps,
                    max_reps=args.max_reps, budget_s=args.rep_budget,
                    host=True)
        record.update({k: t[k] for k in ('median_ms', 'p10_ms', 'p90_ms',
                                         'min_ms', 'wall_ms', 'reps')})
        record.update(host_ms=t['host_median_ms'], host_p10_ms=t['host_p10_ms'],
                      host_p90_ms=t['host_p90_ms'], host_reps=t['host_reps'])
        record['peak_mib'] = peak_memory_mib(fn, dev)
        res1 = resident_mib(dev)
        if res0 is not None and res1 is not None:
            record['resident_mib'] = max(0.0, res1 - res0)

    st, _, msg = guarded(go, dev)
    record['status'] = st
    if msg:
        record['message'] = msg
    if st != 'ok':
        for k in ('median_ms', 'host_ms', 'peak_mib'):
            record.pop(k, None)
    return st


def compile_fresh(module):
    """``torch.compile(module)`` (default mode) with Dynamo's caches and
    counters reset, so every workload compiles from scratch."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(module)


def compiled_runs(args, ei, num_nodes):
    """(provider, model class, edges) of the compiled providers; ``edges()``
    gives what the compiled model is called with: the raw ``edge_index``, or
    for ``fast_compile_prepared`` a ``PreparedGraph`` made once outside."""
    def prepared():
        from pyg_fastattn import prepare
        return prepare(ei, num_nodes=num_nodes)
    return (('pyg_compile', pyg_cls, lambda: ei),
            ('fast_compile', fast_cls, lambda: ei),
            ('fast_compile_prepared', fast_cls, prepared))


def compile_stats(record: dict):
    """Graphs and graph breaks Dynamo reported since :func:`compile_fresh`."""
    try:
        from torch._dynamo.utils import counters
        record['compile_graphs'] = counters['stats'].get('unique_graphs')
        record['graph_breaks'] = sum(counters['graph_break'].values())
    except Exception:  # noqa: BLE001
        pass


def rel_err(a, b) -> float:
    """max |a - b| / max |b|, the worst over tensors when given tuples, each
    scaled by at least 1e-3 of the largest |b| of all: a gradient that is
    zero in exact arithmetic (TransformerConv's key bias: a constant shift
    of every score of a row) is rounding noise in both, not an error."""
    if isinstance(a, torch.Tensor):
        a, b = (a, ), (b, )
    floor = 1e-3 * max((y.detach().abs().max().item() for y in b
                        if y.numel()), default=0.0)
    worst = 0.0
    for x, y in zip(a, b):
        if not y.numel():
            continue
        x, y = x.detach().double(), y.detach().double()
        scale = max(y.abs().max().item(), floor)
        d = (x - y).abs().max().item()
        worst = max(worst, d / scale if scale > 0 else d)
    return worst


# One side stream per device for every warm-up and capture: cuBLAS keeps a
# workspace per stream it has seen, which a new stream per workload would
# add to the next workloads' resident memory.
_SIDE_STREAMS: Dict[torch.device, 'torch.cuda.Stream'] = {}


def cuda_graph_epoch(model, x, ei, y, train_idx, lr, wd):
    """Capture zero_grad-free fwd + loss + bwd + Adam(fused, capturable:
    one kernel instead of ~10 foreach kernels) step into a
    CUDA graph (warm-up on a side stream first); returns replay()."""
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=wd,
                           capturable=True, fused=True)
    model.train()
    step = train_step(model, opt, x, ei, y, train_idx, zero_grad=False)

    s = _SIDE_STREAMS.get(x.device)
    if s is None:
        s = _SIDE_STREAMS[x.device] = torch.cuda.Stream(x.device)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            step()
            # the graph's length hint (queued with its transpose in the
            # first step) must have landed before capture, which cannot
            # read it
            torch.cuda.synchronize(x.device)
    torch.cuda.current_stream().wait_stream(s)
    opt.zero_grad(set_to_none=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        static_loss = step()
    torch.cuda.synchronize()
    g.replay()
    torch.cuda.synchronize()
    if not torch.isfinite(static_loss).item():
        raise RuntimeError('CUDA-graph replay gave a non-finite loss')
    return g.replay, (g, opt, static_loss)


# ----------------------------------------------------------------------------
# workloads
# ----------------------------------------------------------------------------
# --conv: (PyG layer, drop-in) of each layer family
CONVS = {'gat': ('GATConv', 'FastGATConv'),
         'gatv2': ('GATv2Conv', 'FastGATv2Conv'),
         'transformer': ('TransformerConv', 'FastTransformerConv')}


def pyg_cls(args):
    return getattr(importlib.import_module('torch_geometric.nn'),
                   CONVS[args.conv][0])


def fast_cls(args):
    if args.fast_impl:
        mod, name = args.fast_impl.split(':')
        return getattr(importlib.import_module(mod), name)
    if FastGATConv is None:
        raise RuntimeError(f'FastGATConv unavailable: {_FAST_ERR}')
    return getattr(importlib.import_module('pyg_fastattn'),
                   CONVS[args.conv][1])


def epoch_workload(name, dev, args, provs) -> List[dict]:
    base = dict(workload=f'{name} epoch', kind='epoch', dataset=name)
    try:
        data, src = load_dataset(name)
    except Exception as e:  # noqa: BLE001
        note = f'skipped: data unavailable ({type(e).__name__}: {str(e)[:200]})'
        print(f'[gat] {name}: {note}', flush=True)
        return [dict(base, provider=provs[0], status='skipped', message=note)]
    x = data.x.to(dev)
    ei = data.edge_index.to(dev)
    y = data.y.to(dev)
    train_idx = data.train_mask.nonzero().view(-1).to(dev)
    N, E = x.size(0), ei.size(1)
    C = int(data.y.max()) + 1
    base.update(nodes=N, edges=E, in_channels=x.size(1), data_source=src)
    lr, wd = 0.005, 5e-4
    torch.manual_seed(0)
    pyg_model = GAT(pyg_cls(args), x.size(1), 8, C).to(dev)
    recs = []

    # eval-mode outputs with identical weights (correctness)
    with torch.no_grad():
        pyg_model.eval()
        ref = pyg_model(x, ei)
    state = copy.deepcopy(pyg_model.state_dict())

    def build(conv, strict=True):
        return load_matching(GAT(conv, x.size(1), 8, C).to(dev), state,
                             strict)

    def run(provider, make, amp=None, check=True, edges=ei):
        """Build the model, compare its eval outputs with PyG's, time one
        training step (the model called with ``edges``)."""
        r = dict(base, provider=provider)
        recs.append(r)
        st, model, msg = guarded(make, dev)
        if st != 'ok':
            r.update(status=st, message=msg)
            return r
        if check:
            def chk():
                model.eval()
                with torch.no_grad(), autocast(amp):
                    return rel_err(model(x, ei), ref)
            st, err, msg = guarded(chk, dev)
            r['rel_err'] = err if st == 'ok' else f'{st}: {msg}'
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=wd)
        measure(train_step(model, opt, x, edges, y, train_idx, amp=amp), dev,
                args, r)
        return r

    if 'pyg' in provs:
        run('pyg', lambda: pyg_model, check=False)
    pyg_model = None
    free_memory(dev)
    if 'fast' in provs:
        run('fast', lambda: build(fast_cls(args)))
        free_memory(dev)
    if 'fast_bf16' in provs:
        run('fast_bf16', lambda: build(fast_cls(args)), amp=dev.type)
        free_memory(dev)
    if 'floor' in provs:
        run('floor', lambda: build(FloorConv, strict=False), check=False)
        free_memory(dev)

    # fast + CUDA graph
    if 'fast+graph' in provs and args.cuda_graph and dev.type == 'cuda':
        r = dict(base, provider='fast+graph')
        holder = {}

        def build_graph():
            m = build(fast_cls(args))
            replay, keep = cuda_graph_epoch(m, x, ei, y, train_idx, lr, wd)
            holder['keep'] = (m, keep)
            return replay
        before = resident_mib(dev)
        t = time.perf_counter()
        st, replay, msg = guarded(build_graph, dev)
        if st != 'ok':
            r.update(status=f'capture {st}', message=msg)
            print(f'[gat] {name}: CUDA-graph capture failed: {msg}', flush=True)
        else:
            r['first_ms'] = (time.perf_counter() - t) * 1e3  # warm-up + capture
            measure(replay, dev, args, r, first=False)
            # The graph's activations live in its private pool for good:
            # count them (and params + optimizer state) as resident.
            after = resident_mib(dev)
            if before is not None and after is not None:
                r['resident_mib'] = after - before
        recs.append(r)
        holder.clear()
        replay = None
        free_memory(dev)

    # Compiled models: the eval-mode check would compile a second graph, so
    # no rel_err here.
    for p, cls, edges in compiled_runs(args, ei, N):
        if p not in provs:
            continue
        st, g, msg = guarded(edges, dev)
        if st != 'ok':
            recs.append(dict(base, provider=p, status=st, message=msg))
            continue
        r = run(p, lambda: compile_fresh(build(cls(args))), check=False,
                edges=g)
        compile_stats(r)
        g = None
        torch._dynamo.reset()
    ref = None
    free_memory(dev)
    return recs


def _graph_tag(graph):
    if graph is None:
        return ''
    kind, s_exp = graph
    return f' power s={s_exp}' if kind == 'power' else f' {kind}'


def layer_workload(N, E, fin, H, C, mode, dev, args, provs,
                   graph=None) -> List[dict]:
    """graph: None (uniform random edges) or (kind, s) of
    _graphs.skewed_csr (power law, one hub row, rows of 20)."""
    x_grad = mode == 'fwd+bwd' and getattr(args, 'x_grad', False)
    wl = (f'layer {fmt_count(N)}/{fmt_count(E)}{_graph_tag(graph)} '
          f'{fin}->{H}x{C} {mode}{" x-grad" if x_grad else ""}')
    base = dict(workload=wl, kind=f'layer {mode}', nodes=N, edges=E,
                in_channels=fin, heads=H, channels=C,
                graph=graph[0] if graph else 'uniform')
    recs = []
    gen = generator(dev, 11)
    if graph is None:
        ei = torch.randint(N, (2, E), device=dev, generator=gen)
    else:
        _, col, row = skewed_csr(graph[0], N, E, dev, s=graph[1], seed=11)
        ei = torch.stack([col, row])  # source -> destination
        del col, row
    x = randn((N, fin), dev, 12, requires_grad=x_grad)
    gout = randn((N, H * C), dev, 13) if mode == 'fwd+bwd' else None
    torch.manual_seed(0)
    pyg_conv = pyg_cls(args)(fin, C, heads=H).to(dev)
    state = copy.deepcopy(pyg_conv.state_dict())

    def fn_for(conv, amp=None, ei=ei):
        params = [p for p in conv.parameters() if p.requires_grad]
        if x_grad:  # a hidden layer: the gradient of its input too
            params.append(x)
        if mode == 'fwd':
            conv.eval()

            def run():
                with torch.no_grad(), autocast(amp):
                    return conv(x, ei)
        else:
            conv.train()
            g = gout if amp is None else gout.to(torch.bfloat16)

            def run():
                with autocast(amp):
                    out = conv(x, ei)
                return torch.autograd.grad(out, params, g)
        return run

    def check(r, fn):
        if ref is not None and r['status'] == 'ok':
            st, err, msg = guarded(lambda: rel_err(fn(), ref), dev)
            r['rel_err'] = err if st == 'ok' else f'{st}: {msg}'

    # outputs (fwd) or parameter gradients (fwd+bwd) of eager PyG
    ref = None
    if 'pyg' in provs:
        r = dict(base, provider='pyg')
        measure(fn_for(pyg_conv), dev, args, r)
        recs.append(r)
        if r['status'] == 'ok':
            st, ref, _ = guarded(lambda: fn_for(pyg_conv)(), dev)
    elif any(p in provs for p in ('fast', 'fast_bf16') + COMPILED):
        st, ref, _ = guarded(lambda: fn_for(pyg_conv)(), dev)
    pyg_conv = None
    free_memory(dev)

    fast_provs = [p for p in ('fast', 'fast_bf16') if p in provs]
    if fast_provs:
        st, fast_conv, msg = guarded(
            lambda: load_matching(fast_cls(args)(fin, C, heads=H).to(dev),
                                  state), dev)
        prep_ms = None
        if st == 'ok':
            prep = getattr(importlib.import_module('pyg_fastattn'), 'prepare',
                           None) if args.fast_impl is None else None
            if prep is not None:  # one-off cost of preparing the graph
                def prep_time():
                    sync(dev)
                    t = time.perf_counter()
                    prep(ei, num_nodes=N)
                    sync(dev)
                    return (time.perf_counter() - t) * 1e3
                guarded(prep_time, dev)  # first call pays lazy init
                pst, ms, _ = guarded(prep_time, dev)
                prep_ms = ms if pst == 'ok' else None
        for p in fast_provs:
            r = dict(base, provider=p)
            recs.append(r)
            if st != 'ok':
                r.update(status=st, message=msg)
                continue
            if p == 'fast' and prep_ms is not None:
                r['prepare_ms'] = prep_ms
            amp = dev.type if p == 'fast_bf16' else None
            measure(fn_for(fast_conv, amp), dev, args, r)
            check(r, fn_for(fast_conv, amp))
            free_memory(dev)
        fast_conv = None
        free_memory(dev)

    if 'floor' in provs:
        r = dict(base, provider='floor')
        recs.append(r)
        st, floor, msg = guarded(
            lambda: load_matching(FloorConv(fin, C, heads=H).to(dev), state,
                                  strict=False),
            dev)
        if st != 'ok':
            r.update(status=st, message=msg)
        else:
            measure(fn_for(floor), dev, args, r)
        floor = None
        free_memory(dev)

    for p, cls, edges in compiled_runs(args, ei, N):
        if p not in provs:
            continue
        r = dict(base, provider=p)
        recs.append(r)
        st, comp, msg = guarded(lambda: compile_fresh(load_matching(
            cls(args)(fin, C, heads=H).to(dev), state)), dev)
        if st == 'ok':
            st, g, msg = guarded(edges, dev)
        if st != 'ok':
            r.update(status=st, message=msg)
        else:
            measure(fn_for(comp, ei=g), dev, args, r)
            compile_stats(r)
            check(r, fn_for(comp, ei=g))
            g = None
        comp = None
        torch._dynamo.reset()
        free_memory(dev)
    ref = x = ei = gout = None
    free_memory(dev)
    return recs


def plan(dev, quick: bool):
    """[(name, legacy name for --only, build(providers) -> records)]."""
    cuda = dev.type == 'cuda'
    epochs = ['Cora'] if quick else ['Cora', 'CiteSeer', 'PubMed-synth']
    if cuda and not quick:
        layers = [(100_000, 2_000_000, 128, 8, 16),
                  (1_000_000, 20_000_000, 128, 4, 32),
                  (2_000_000, 100_000_000, 64, 8, 16)]
    elif cuda:
        layers = [(100_000, 2_000_000, 128, 8, 16)]
    elif not quick:
        layers = [(10_000, 100_000, 64, 4, 16), (50_000, 1_000_000, 64, 4, 16)]
    else:
        layers = [(5_000, 50_000, 64, 4, 16)]
    P = [(f'{n} epoch', f'{n} epoch',
          (lambda provs, n=n: epoch_workload(n, dev, ARGS, provs)))
         for n in epochs]
    for (N, E, fin, H, C) in layers:
        for mode in ('fwd', 'fwd+bwd'):
            P.append((f'layer {fmt_count(N)}/{fmt_count(E)} {fin}->{H}x{C} {mode}',
                      f'layer {N}/{E} {mode}',
                      (lambda provs, a=(N, E, fin, H, C, mode):
                       layer_workload(*a, dev, ARGS, provs))))
    # Hubs (x requiring grad is the fwd+bwd mode): power-law destinations
    # at 1M / 20M, and one row of 10^6 edges against the same edges in rows
    # of 20 (50k nodes).
    if cuda and not quick:
        skewed = [(1_000_000, 20_000_000, 128, 4, 32, ('power', 0.8)),
                  (1_000_000, 20_000_000, 128, 4, 32, ('power', 1.0)),
                  (50_000, 1_000_000, 128, 4, 32, ('hub', 1.0)),
                  (50_000, 1_000_000, 128, 4, 32, ('rows20', 1.0))]
    elif not quick:
        skewed = [(10_000, 200_000, 64, 4, 16, ('hub', 1.0)),
                  (10_000, 200_000, 64, 4, 16, ('rows20', 1.0))]
    else:
        skewed = []
    for (N, E, fin, H, C, graph) in skewed:
        name = (f'layer {fmt_count(N)}/{fmt_count(E)}{_graph_tag(graph)} '
                f'{fin}->{H}x{C} fwd+bwd')
        P.append((name, f'layer {N}/{E}{_graph_tag(graph)} fwd+bwd',
                  (lambda provs, a=(N, E, fin, H, C, 'fwd+bwd', dev, ARGS),
                   g=graph: layer_workload(*a, provs, graph=g))))
    return P


# ----------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------
# (provider, time key, memory key, label when it ran out of memory)
_BASES = (('pyg', 'speedup', 'mem_ratio', 'PyG OOM'),
          ('pyg_compile', 'speedup_compile', 'mem_ratio_compile',
           'compile OOM'))


def add_ratios(records: List[dict]):
    """Time and memory ratios against ``pyg`` and ``pyg_compile`` (base /
    provider: > 1 = the provider is faster / smaller) and ``floor_x`` =
    provider time / floor time."""
    by_wl: Dict[str, Dict[str, dict]] = {}
    for r in records:
        by_wl.setdefault(r['workload'], {})[r['provider']] = r
    for provs in by_wl.values():
        fl = provs.get('floor')
        for name, r in provs.items():
            if r.get('status') != 'ok':
                continue
            for base, tkey, mkey, oom in _BASES:
                b = provs.get(base)
                if name == base or b is None:
                    continue
                if b.get('status') == 'ok':
                    r[tkey] = b['median_ms'] / r['median_ms']
                    if b.get('peak_mib') and r.get('peak_mib'):
                        r[mkey] = b['peak_mib'] / r['peak_mib']
                elif b.get('status') == 'OOM':
                    r[tkey] = r[mkey] = oom
            if name != 'floor' and fl and fl.get('status') == 'ok':
                r['floor_x'] = r['median_ms'] / fl['median_ms']


def order_records(records: List[dict]) -> List[dict]:
    """Workloads in the order they first ran, providers in PROVIDERS order."""
    first: Dict[str, int] = {}
    for r in records:
        first.setdefault(r['workload'], len(first))
    rank = {p: i for i, p in enumerate(PROVIDERS)}
    return sorted(records, key=lambda r: (first[r['workload']],
                                          rank.get(r['provider'], len(rank))))


def _status_cell(r):
    if r.get('status') == 'ok':
        return r.get('median_ms')
    msg = r.get('message')
    return r.get('status') + (f' ({msg[:60]})' if msg and r.get('status') != 'OOM'
                              else '')


def markdown(meta, records) -> str:
    records = order_records(records)
    ok = lambda k: lambda r: r.get(k) if r.get('status') == 'ok' else None  # noqa: E731
    cols = [('workload', 'workload'), ('provider', 'provider'),
            ('median ms', _status_cell),
            ('p10-p90 ms', lambda r: f"{fmt(r.get('p10_ms'))}-{fmt(r.get('p90_ms'))}"
             if r.get('status') == 'ok' else None),
            ('host ms', ok('host_ms')), ('peak MiB', ok('peak_mib')),
            ('vs pyg', 'speedup'), ('vs compile', 'speedup_compile'),
            ('x floor', 'floor_x'), ('mem vs pyg', 'mem_ratio'),
            ('mem vs compile', 'mem_ratio_compile'),
            ('resident MiB', 'resident_mib'),
            ('first call ms', 'first_ms'), ('prepare ms', 'prepare_ms'),
            ('rel err', 'rel_err')]
    cuda = meta['device'] == 'cuda'
    mem = ('max_memory_allocated delta of one call' if cuda
           else 'peak-RSS growth of one call (VmHWM reset via /proc/self/clear_refs)')
    host = ('median time until the Python call returns, the GPU '
            'synchronised between calls and never inside the timed region '
            '(launch cost plus any wait the call forces)' if cuda else
            'median of the same perf_counter samples (on CPU host time = wall '
            'time)')
    pyg_name, fast_name = CONVS[meta.get('conv', 'gat')]
    head = [f'# {fast_name} vs {pyg_name} ({meta["device"]})', '']
    head += [f'- {line}' for line in env_lines(meta)]
    head += [f'- graphs with hubs: {SKEWED_DOC}']
    head += [f'- command: `{meta["command"]}`',
             f'- providers: {", ".join(meta.get("providers") or [])}', '',
             'Median of per-call times after warm-up '
             + ('(CUDA events)' if cuda else '(perf_counter)')
             + f'. host ms = {host}. Peak MiB = {mem}. '
             'vs pyg / vs compile = median of eager PyG / of PyG under '
             'torch.compile (default mode, compiled afresh per workload, '
             'compile time only in its first call ms) over the provider\'s '
             'median; x floor = provider median / floor median, where floor '
             '= the same model with every attention layer replaced by its own '
             'lin + bias (x @ W.t() + b), the cost no attention layer goes '
             'below; mem vs pyg / vs compile = base peak / provider peak. '
             'fast_bf16 = fast under torch.autocast(bfloat16). '
             'resident MiB = memory '
             'still held after warm-up (caches, optimizer state); first call '
             'includes one-off graph preparation (prepare ms: '
             '`pyg_fastattn.prepare` alone). rel err = max|provider - PyG| / '
             'max|PyG| with identical weights: eval-mode outputs (epochs, fwd) '
             'or parameter gradients (fwd+bwd; with --x-grad also x\'s). '
             'fast+graph: the epoch captured once in a CUDA graph and '
             'replayed (fused Adam: one kernel); its memory '
             'lives in the graph\'s private pool, so it shows as resident MiB '
             '(incl. parameters and optimizer state), first call = warm-up + '
             'capture. Epoch = '
             'zero_grad + forward + loss + backward + Adam step of the 2-layer '
             'PyG example GAT.', '']
    notes, seen = [], set()
    for r in records:
        if r.get('status') == 'skipped' and r['workload'] not in seen:
            seen.add(r['workload'])
            notes.append(f"- {r['workload']}: {r['message']}")
        elif r.get('status') not in ('ok', 'skipped', 'OOM', None) \
                and r.get('message'):
            notes.append(f"- {r['workload']} [{r['provider']}]: "
                         f"{r['status']}: {r['message']}")
        if r['provider'] in COMPILED and r.get('status') == 'ok':
            notes.append(f"- {r['workload']} [{r['provider']}]: "
                         f"{r.get('compile_graphs')} graph(s), "
                         f"{r.get('graph_breaks')} graph break(s); first call "
                         f"incl. compile {fmt(r.get('first_ms', 0) / 1e3)} s")
    body = md_table(records, cols)
    if notes:
        body += '\n\nNotes:\n' + '\n'.join(notes)
    srcs = sorted({f"{r['dataset']}: {r['data_source']}" for r in records
                   if r.get('data_source')})
    if srcs:
        body += '\n\nData: ' + '; '.join(srcs)
    return '\n'.join(head) + '\n' + body + '\n'


def plot(meta, records, path: Path):
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    except Exception as e:  # noqa: BLE001
        print(f'no plot: {e}', flush=True)
        return None
    wls = []
    for r in records:
        if r['workload'] not in wls:
            wls.append(r['workload'])
    provs = [p for p in PROVIDERS if p != 'pyg'
             and any(r['provider'] == p for r in records)]
    if not provs:
        return None
    get = {(r['workload'], r['provider']): r for r in records}
    wl_status = {r['workload']: r.get('status') for r in records
                 if r.get('status') not in (None, 'ok')}
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.1 * len(wls) + 3), 8.5),
                             sharex=True)
    width = 0.8 / len(provs)
    for k, (ax, key, label) in enumerate([
            (axes[0], 'speedup', 'speedup vs PyG GATConv (x)'),
            (axes[1], 'mem_ratio', 'peak memory: PyG / provider (x)')]):
        for j, p in enumerate(provs):
            xs, ys, notes = [], [], []
            for i, wl in enumerate(wls):
                r = get.get((wl, p))
                x = i + (j - (len(provs) - 1) / 2) * width
                v = r.get(key) if r else None
                if isinstance(v, (int, float)):
                    xs.append(x)
                    ys.append(v)
                else:
                    if isinstance(v, str):
                        txt = v
                    elif r is None:  # provider not run for this workload
                        if wl_status.get(wl) != 'skipped':
                            continue
                        txt = 'skipped'
                    elif r.get('status') == 'ok':
                        txt = 'n/a'
                    else:
                        txt = r.get('status')
                    notes.append((x, txt))
            style = {'color': '0.75', 'hatch': '//'} if p == 'floor' else {}
            bars = ax.bar(xs, ys, width, label=p, **style)
            for b, v in zip(bars, ys):
                ax.annotate(f'{v:.1f}', (b.get_x() + b.get_width() / 2,
                                         b.get_height()),
                            ha='center', va='bottom', fontsize=7)
            for x, txt in notes:
                ax.annotate(str(txt)[:14], (x, 1.0), ha='center', va='bottom',
                            rotation=90, fontsize=7, color='gray')
        ax.axhline(1.0, color='k', lw=0.8, ls='--')
        ax.set_ylabel(label)
        ax.set_yscale('log')
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f'{v:g}'))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.grid(axis='y', alpha=0.3, which='both')
        if k == 0:
            ax.legend()
    axes[1].set_xlim(-0.6, len(wls) - 0.4)
    axes[1].set_xticks(range(len(wls)))
    axes[1].set_xticklabels(wls, rotation=30, ha='right', fontsize=8)
    fig.suptitle(f"pyg_fastattn FastGATConv vs GATConv on {meta['device_name']}\n"
                 f"torch {meta['torch']} (CUDA {meta['torch_cuda']}), PyG "
                 f"{meta['pyg']}, backend {meta.get('backend')}, {meta['date']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def summary(r: dict) -> str:
    """One provider's console summary."""
    p = r.get('provider')
    if r.get('status') != 'ok':
        return f"{p} {r.get('status')}"
    s = (f"{p} {fmt(r['median_ms'])} ms (host {fmt(r.get('host_ms'))}) / "
         f"{fmt(r.get('peak_mib'))} MiB")
    if isinstance(r.get('speedup'), float):
        s += f" ({r['speedup']:.2f}x)"
    return s


ARGS = None


def main(argv=None):
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--device', default='auto', choices=['auto', 'cpu', 'cuda'])
    ap.add_argument('--quick', action='store_true', help='small smoke run')
    ap.add_argument('--cuda-graph', action='store_true',
                    help='also time the fast epoch captured in a CUDA graph')
    ap.add_argument('--out', default='bench_out')
    ap.add_argument('--only', default=None,
                    help='comma list of substrings of workload names')
    ap.add_argument('--providers', default=','.join(PROVIDERS),
                    help='comma list of providers to run (default all: '
                         + ','.join(PROVIDERS) + '; fast+graph also needs '
                         '--cuda-graph and CUDA)')
    add_timing_args(ap)
    ap.add_argument('--conv', default='gat', choices=sorted(CONVS),
                    help='layer family: GATConv, GATv2Conv or '
                         'TransformerConv against its drop-in')
    ap.add_argument('--x-grad', action='store_true',
                    help='layer fwd+bwd also differentiates x (a hidden '
                         'layer; workload names end in "x-grad")')
    ap.add_argument('--fast-impl', default=None,
                    help='module:Class used as the fast conv (testing the '
                         'harness, e.g. torch_geometric.nn:GATConv)')
    args = ap.parse_args(argv)
    ARGS = args
    provs = [p.strip() for p in args.providers.split(',') if p.strip()]
    unknown = [p for p in provs if p not in PROVIDERS]
    if unknown or not provs:
        ap.error(f'--providers: unknown {unknown}; choose from {PROVIDERS}')
    dev = pick_device(args.device)
    setup_threads(dev)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rep_budget is None:
        args.rep_budget = (1.0 if dev.type == 'cuda' else 2.0) * (0.3 if args.quick else 1)
    if args.quick:
        args.min_reps, args.warmup = min(args.min_reps, 3), min(args.warmup, 2)
    if dev.type == 'cuda':  # context, cuBLAS handles: out of every timing
        torch.ones(64, 64, device=dev) @ torch.ones(64, 64, device=dev)
        torch.cuda.synchronize()
    meta = env_info(dev)
    meta['command'] = ' '.join([os.path.basename(sys.executable)] + sys.argv)
    meta['quick'] = args.quick
    meta['fast_impl'] = args.fast_impl or f'pyg_fastattn.{CONVS[args.conv][1]}'
    meta['conv'] = args.conv
    meta['providers'] = [p for p in PROVIDERS if p in provs and (
        p != 'fast+graph' or (args.cuda_graph and dev.type == 'cuda'))]
    for line in env_lines(meta):
        print(line, flush=True)
    if FastGATConv is None and not args.fast_impl:
        print(f'WARNING: FastGATConv unavailable ({_FAST_ERR}); only PyG runs',
              flush=True)
    out_dir = Path(args.out)
    stem = f'{args.conv}_{dev.type}'
    budget = Budget(args.budget_s)
    records: List[dict] = []
    skipped = []
    only = args.only.split(',') if args.only else None
    # Pass 1: eager providers of every workload; pass 2: compiled ones, so
    # that compile time never crowds out eager rows under --budget-s.
    passes = [[p for p in provs if p not in COMPILED],
              [p for p in provs if p in COMPILED]]
    workloads = [w for w in plan(dev, args.quick)
                 if not only or any(o in w[0] or o in w[1] for o in only)]
    lost = None  # set when a failure leaves the CUDA context unusable
    not_run = []
    for pas in passes:
        if not pas:
            continue
        for name, _, build in workloads:
            label = name if pas is passes[0] else f'{name} [{",".join(pas)}]'
            if lost:
                not_run.append((label, pas))
                continue
            if budget.spent():
                skipped.append(label)
                continue
            t0 = time.perf_counter()
            st, recs, msg = guarded(lambda: build(pas), dev)
            if st != 'ok':
                recs = [dict(workload=name, provider=','.join(pas), status=st,
                             message=msg)]
            err = cuda_error(dev)
            if err:
                lost = f'{label}: {err}'
                print(f'[gat] the CUDA context is lost after {lost}; no '
                      f'later workload can run in this process', flush=True)
            records += recs
            add_ratios(records)
            print(f'[gat] {name}: ' + ', '.join(summary(r) for r in recs)
                  + f'  [{time.perf_counter() - t0:.1f} s]', flush=True)
            meta['skipped'] = skipped
            write_outputs(out_dir, stem, meta, order_records(records),
                          markdown(meta, records))
            plot(meta, records, out_dir / f'{stem}.png')
    meta['skipped'] = skipped
    meta['elapsed_s'] = round(budget.elapsed(), 1)
    meta['loadavg_end'] = loadavg()
    md = markdown(meta, records)
    if skipped:
        md += f'\nSkipped (time budget): {", ".join(skipped)}\n'
    if lost:
        meta['cuda_context_lost'] = lost
        md += (f'\nThe CUDA context was lost after {lost}. Not run: '
               f'{", ".join(n for n, _ in not_run) or "-"}\n')
    paths = write_outputs(out_dir, stem, meta, order_records(records), md)
    png = plot(meta, records, out_dir / f'{stem}.png')
    print()
    print(md)
    print(f"wrote {paths['md']}, {paths['json']}, {paths['csv']}"
          + (f', {png}' if png else ''))
    bad = [r for r in records if r.get('provider', '').startswith('fast')
           and r.get('status') not in ('ok', 'skipped')]
    bad += [n for n, pas in not_run if any(p.startswith('fast') for p in pas)]
    return 1 if bad or (FastGATConv is None and not args.fast_impl) else 0


if __name__ == '__main__':
    sys.exit(main())

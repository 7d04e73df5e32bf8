#!/usr/bin/env python3
"""The gather ceiling: how fast can a kernel gather random 512-byte rows on
this GPU, and how far is the package's attention forward from it?

    python benchmarks/gather_ceiling.py        # Hopper (sm_90) GPU and nvcc

Builds ``gather_ceiling.cu`` (beside this file) with nvcc into a shared
library called through ctypes, then times each probe kernel on a uniform
random graph of 1M nodes and 20M edges (sources and destinations drawn
uniformly with ``torch.randint``, grouped by destination, int32 CSR), rows of
128 fp32 (4 heads x 32), CUDA events, median of 20 after 3 warm-up calls.
GB/s counts the 512 bytes gathered per edge. The probes:

- ``reg_EB_IDX_MINB``: one warp per row, EB rows in flight per lane,
  IDX=1 indices by shuffles, MINB resident blocks (launch bounds);
- ``bulk_SLOTS_WARPS``: Hopper bulk copies (cp.async.bulk + mbarrier) of up
  to SLOTS rows per warp into shared memory;
- ``two_EB_MINB`` / ``real_EB_MINB_SYNC_WLATE``: the forward's shape, a first
  pass for the softmax statistics (a_src gathered per edge) and a weighted
  second pass; ``real`` splits the first pass over (edge, head) pairs as the
  package does.

Then the package's softmax_aggregate (4 x 32) and a FastGATConv forward on
the same graph, a device copy of h for scale, and torch.profiler tables of
the package's kernels.
"""
import ctypes, os, statistics, subprocess, sys, time
import torch

here = os.path.dirname(os.path.abspath(__file__))
so = '/tmp/gather_ceiling.so'
t0 = time.time()
subprocess.run(['nvcc', '-O3', '-arch=sm_90', '-shared', '-Xcompiler', '-fPIC',
                os.path.join(here, 'gather_ceiling.cu'), '-o', so], check=True)
print(f'nvcc {time.time() - t0:.1f} s', flush=True)
lib = ctypes.CDLL(so)
dev = torch.device('cuda')
print(torch.cuda.get_device_name(), torch.__version__, flush=True)
print('graph: 1M nodes, 20M edges, endpoints uniform (torch.randint, seed 0), rows of 128 fp32', flush=True)

N, E, D = 1_000_000, 20_000_000, 128
g = torch.Generator(device=dev).manual_seed(0)
ei = torch.randint(N, (2, E), device=dev, generator=g)
dst, order = ei[1].sort()
col = ei[0][order].to(torch.int32).contiguous()
rowptr = torch.zeros(N + 1, dtype=torch.int64, device=dev)
rowptr[1:] = torch.bincount(dst, minlength=N).cumsum(0)
rowptr = rowptr.to(torch.int32)
h = torch.randn(N, D, device=dev, generator=g)
a_src = torch.randn(N, 4, device=dev, generator=g)
out = torch.empty(N, D, device=dev)
ref = torch.zeros(N, D, device=dev).index_add_(0, dst, h[col.long()])
P = ctypes.c_void_p


def t_ms(fn, n=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); fn(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def stream():
    return P(torch.cuda.current_stream().cuda_stream)


rows = []
def report(name, ms, nbytes, err=None):
    gbs = nbytes / ms / 1e6
    rows.append((name, ms, gbs))
    e = '' if err is None else f'  max err {err:.2e}'
    print(f'{name:34s} {ms:8.3f} ms  {gbs:7.0f} GB/s{e}', flush=True)


gather_bytes = E * 512
report('copy h (read+write 1 GB)', t_ms(lambda: out.copy_(h)), 2 * h.numel() * 4)
for name in ['reg_4_0_1', 'reg_4_1_1', 'reg_8_0_1', 'reg_8_1_1', 'reg_16_1_1', 'reg_8_1_4',
             'reg_16_1_4', 'reg_4_1_8', 'bulk_32_4', 'bulk_24_4', 'bulk_16_8', 'bulk_8_8',
             'bulk_32_2']:
    f = getattr(lib, name)
    call = lambda: f(P(rowptr.data_ptr()), P(col.data_ptr()), P(h.data_ptr()),
                     P(out.data_ptr()), ctypes.c_int(N), stream())
    out.zero_(); call(); torch.cuda.synchronize()
    err = (out - ref).abs().max().item()
    report(name, t_ms(call), gather_bytes, err)
for name in ['two_4_1', 'two_8_1', 'two_8_4', 'real_4_1_0_0', 'real_4_1_0_1', 'real_4_1_1_1',
             'real_4_4_1_1', 'real_8_4_1_1', 'real_4_6_0_0', 'real_4_6_1_1']:
    f = getattr(lib, name)
    call = lambda: f(P(rowptr.data_ptr()), P(col.data_ptr()), P(a_src.data_ptr()),
                     P(h.data_ptr()), P(out.data_ptr()), ctypes.c_int(N), stream())
    report(name, t_ms(call), gather_bytes)

try:
    sys.path.insert(0, os.path.dirname(here))
    from pyg_fastattn import ops, FastGATConv, prepare
    s = torch.randn(E, 4, device=dev, generator=g)
    v = h.view(N, 4, 32)
    rp64, col64 = rowptr.long(), col.long()
    report('package softmax_aggregate 4x32 fwd',
           t_ms(lambda: ops.softmax_aggregate(rp64, col64, s, v, validate=False)), gather_bytes)
    report('package softmax_aggregate int32',
           t_ms(lambda: ops.softmax_aggregate(rowptr, col, s, v, validate=False)), gather_bytes)
    graph = prepare(torch.stack([col64, dst]), num_nodes=N, add_self_loops=False)
    m = FastGATConv(D, 32, heads=4, add_self_loops=False).to(dev)
    with torch.no_grad():
        report('package GAT layer fwd (no grad)', t_ms(lambda: m(h, graph)), gather_bytes)
except Exception as exc:  # the probe's own numbers stand without the package
    print('package part failed:', repr(exc)[:400], flush=True)


def profile(name, fn, n=5):
    from torch.profiler import profile as prof, ProfilerActivity
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    print(f'--- profile: {name} ({n} calls)')
    print(p.key_averages().table(sort_by='cuda_time_total', row_limit=14, max_name_column_width=70))


try:
    profile('softmax_aggregate 4x32 int32 fwd', lambda: ops.softmax_aggregate(rowptr, col, s, v, validate=False))
    with torch.no_grad():
        profile('GAT layer fwd no grad', lambda: m(h, graph))
    xg = h.clone().requires_grad_()
    gout = torch.randn(N, D, device=dev)
    ps = [xg] + list(m.parameters())
    profile('GAT layer fwd+bwd x grad', lambda: torch.autograd.grad(m(xg, graph), ps, gout))
except Exception as exc:
    print('profile failed:', repr(exc)[:400], flush=True)

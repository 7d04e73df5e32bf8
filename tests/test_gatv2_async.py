"""The gatv2 / transformer CUDA kernels' asynchronous gathers (a ring in
shared memory, PYG_FASTATTN_GATV2_ASYNC) against one edge at a time."""
import pytest
import torch

from pyg_fastattn import ops

from conftest import requires_cuda
from graphs import hub_graph


def _async_kernels(fn):
    """Names of the gatv2 / transformer CUDA kernels that ``fn`` launches
    with asynchronous gathers (their last template argument is true)."""
    with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key.split('<')[0].split('::')[-1] for e in prof.key_averages()
            if 'gatv2_' in e.key and '_kernel<' in e.key
            and e.key.split('>(')[0].endswith('true')}


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16,
                                   torch.float16])
@pytest.mark.parametrize('H,C', [(4, 32), (8, 16), (1, 64), (2, 8), (3, 4),
                                 (4, 12), (8, 64), (5, 64), (2, 256),
                                 (1, 512)])
@pytest.mark.parametrize('idx,split,terms', [
    (torch.int32, None, True), (torch.int64, '16', True),
    (torch.int32, '16', False), (torch.int64, None, False)])
def test_async_gathers(monkeypatch, dtype, H, C, idx, split, terms):
    """CUDA, one, two or four slots a lane (8 x 64: four tiles of heads,
    5 x 64: three, the last half used; 2 x 256: two units of a head a lane,
    1 x 512: four): the
    gatv2 and transformer kernels gathering
    through their shared-memory rings (PYG_FASTATTN_GATV2_ASYNC=1, rings of
    2, 4 and 7 stages, or as many as fit the shared memory) against one
    edge at a time (=0). Forward and both
    backward passes (all three kernels must take the ring), on a graph with
    empty rows, a hub row, a hub column and 20,000 short rows (split=16:
    every row and column of more than 16 edges on the split path). With
    terms: edge terms, a dropout mask (with int32 indices at an odd
    address, so 16-bit masks take the source pass's plain copies), bias, and
    out-of-range indices in the CSR and in the transpose (those edges are
    skipped, their edge-term gradients zero). Every output and gradient is
    equal bit for bit."""
    from pyg_fastattn import _build
    if not _build.load().cuda:
        pytest.skip(f'native CUDA kernels unavailable: {_build.load().error}')
    optin = getattr(torch.cuda.get_device_properties(0),
                    'shared_memory_per_block_optin', 0)
    if C > 256 and terms and optin < 200 * 1024:  # four slots a lane
        pytest.skip('the four-slot rings with terms need about 200 KiB of '
                    'shared memory a block')
    rowptr, col, Ns, g = hub_graph(monkeypatch, split, idx, many_rows=True)
    N, E = rowptr.numel() - 1, col.numel()
    csc = ops.csr_to_csc(rowptr, col, Ns, validate=False)
    if terms:  # garbage indices, which the kernels must skip
        t = lambda v: torch.tensor(v, dtype=idx, device=col.device)  # noqa
        col[[3, 7, E - 1]] = t([Ns + 3, -1, Ns])
        csc[1][[4, E - 2]] = t([N + 5, -1])
        csc[2][[9, E - 3]] = t([E + 2, -4])

    def rnd(*shape, grad=True):
        t = torch.randn(*shape, device='cuda', generator=g).to(dtype)
        return t.requires_grad_(grad)

    x_l, x_r, k, v = rnd(Ns, H, C), rnd(N, H, C), rnd(Ns, H, C), rnd(Ns, H, C)
    att, e_t = rnd(H, C), rnd(E, H, C) if terms else None
    bias = rnd(H * C) if terms else None
    mask = None
    if terms:  # with int32 indices one element into its storage
        odd = int(idx == torch.int32)
        m = (torch.rand(E * H + 1, device='cuda', generator=g) > 0.3) / 0.7
        mask = m.to(dtype)[odd:odd + E * H].view(E, H)
    go = rnd(N, H, C, grad=False)

    def gatv2():
        out = ops.gatv2_attention(rowptr, col, x_l, x_r, att, e_t, mask,
                                  csc=csc, validate=False, bias=bias)
        ins = [t for t in (x_l, x_r, att, e_t, bias) if t is not None]
        return [out] + list(torch.autograd.grad(out, ins, go))

    def transformer():
        out = ops.transformer_attention(rowptr, col, x_r, k, v, e_t, mask,
                                        scale=C ** -0.5, csc=csc,
                                        validate=False)
        ins = [t for t in (x_r, k, v, e_t) if t is not None]
        return [out] + list(torch.autograd.grad(out, ins, go))

    for fn in (gatv2, transformer):
        res = {}
        for flag, stages in (('0', '4'), ('1', '4'), ('1', '2'), ('1', '7')):
            monkeypatch.setenv('PYG_FASTATTN_GATV2_ASYNC', flag)
            monkeypatch.setenv('PYG_FASTATTN_GATV2_STAGES', stages)
            res[flag, stages] = fn()
            names = _async_kernels(fn)
            want = ({'gatv2_fwd_kernel', 'gatv2_bwd_rows_kernel',
                     'gatv2_bwd_cols_kernel'} if flag == '1' else set())
            assert names == want, (fn.__name__, flag, stages, names)
        base = res['0', '4']
        for k_, a in enumerate(base):
            assert torch.isfinite(a).all(), (fn.__name__, k_)
        if terms:  # the skipped edges' edge-term gradient (after out and
            # the gradients of x_l, x_r, att / query, key, value)
            assert not base[4][[3, 7, E - 1]].any(), fn.__name__
        for key, got in res.items():
            for k_, (a, b) in enumerate(zip(base, got)):
                assert torch.equal(a, b), (fn.__name__, key, k_)

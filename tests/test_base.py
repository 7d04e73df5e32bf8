"""FusedAttentionConv: the README's user-written layer, run from the README
itself, against plain PyTorch."""
import re

import pytest
import torch

from conftest import DEVICES, REPO


def _readme_layer():
    text = (REPO / 'README.md').read_text()
    sec = text.split('## Your own attention layer', 1)[1]
    code = re.search(r'```python\n(.*?)```', sec, re.S).group(1)
    ns = {}
    exec(compile(code, 'README.md', 'exec'), ns)
    return ns['MyGATConv']


def _plain(conv, x, src, dst, N, mask=None):
    """The same layer in plain PyTorch: loops removed then added, softmax of
    leaky_relu(<h_j, a_src> + <h_i, a_dst>) per destination, weighted sum."""
    H, C = conv.heads, conv.out_channels
    keep = src != dst
    loops = torch.arange(N, device=x.device)
    src = torch.cat([src[keep], loops])
    dst = torch.cat([dst[keep], loops])
    h = conv.lin(x).view(-1, H, C)
    s = torch.nn.functional.leaky_relu(
        (h[src] * conv.att_src).sum(-1) + (h[dst] * conv.att_dst).sum(-1),
        0.2)
    ex = torch.exp(s - s.max())
    den = torch.zeros(N, H, dtype=x.dtype, device=x.device).index_add(
        0, dst, ex)
    alpha = ex / den[dst]
    p = alpha if mask is None else alpha * mask
    out = torch.zeros(N, H, C, dtype=x.dtype, device=x.device).index_add(
        0, dst, p.unsqueeze(-1) * h[src])
    return out.flatten(1), torch.stack([src, dst]), alpha


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('heads', [1, 4])
def test_readme_layer_matches_plain_pytorch(backend, device, heads):
    MyGATConv = _readme_layer()
    torch.manual_seed(0)
    N = 20
    conv = MyGATConv(7, 5, heads=heads).to(device, torch.float64)
    g = torch.Generator().manual_seed(0)
    ei = torch.randint(0, N - 2, (2, 80), generator=g)  # 2 isolated nodes
    ei[:, :3] = torch.tensor([[0, 4, 4], [0, 5, 5]])  # a loop, a duplicate
    ei = ei.to(device)
    x = torch.randn(N, 7, dtype=torch.float64, device=device,
                    requires_grad=True)

    out, (e, alpha) = conv(x, ei, return_attention_weights=True)
    want, e_want, a_want = _plain(conv, x, ei[0], ei[1], N)
    torch.testing.assert_close(out, want)
    assert torch.equal(e, e_want)
    torch.testing.assert_close(alpha, a_want)

    w = torch.randn_like(out)
    grads = torch.autograd.grad((conv(x, ei) * w).sum(),
                                [x] + list(conv.parameters()))
    wants = torch.autograd.grad((want * w).sum(),
                                [x] + list(conv.parameters()))
    for a, b in zip(grads, wants):
        torch.testing.assert_close(a, b)


def test_readme_layer_dropout(backend):
    """Training with dropout: the base's mask multiplies the weights."""
    MyGATConv = _readme_layer()
    torch.manual_seed(0)
    N = 15
    conv = MyGATConv(6, 3, heads=2, dropout=0.5).double().train()
    ei = torch.randint(0, N, (2, 50))
    x = torch.randn(N, 6, dtype=torch.float64)
    _, (e, alpha) = conv(x, ei, return_attention_weights=True)
    _, _, a_eval = _plain(conv, x, ei[0], ei[1], N)
    dropped = alpha == 0
    assert dropped.any() and (~dropped).any()
    torch.testing.assert_close(alpha[~dropped], 2 * a_eval[~dropped])


def test_base_needs_a_score():
    from pyg_fastattn.nn import FusedAttentionConv

    class NoScore(FusedAttentionConv):
        def __init__(self):
            super().__init__(aggr='add', node_dim=0)
            self.heads, self.dropout = 1, 0.0

        def forward(self, x, edge_index):
            h = x.view(-1, 1, x.size(1))
            g = self.prepare_graph(edge_index, h, h)
            return self.fused_propagate(g, h, h, h, None, edge_index)[0]

    with pytest.raises(NotImplementedError, match='compute_score'):
        NoScore()(torch.randn(4, 3), torch.tensor([[0, 1], [1, 2]]))

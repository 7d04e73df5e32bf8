import torch
from torch import Tensor

from .. import _build
from ._checks import check_csr, check_same_device, check_tensor


class EdgeSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: Tensor, rowptr: Tensor) -> Tensor:
        out = _build.backend_for(scores.device).edge_softmax(rowptr, scores)
        ctx.save_for_backward(rowptr, out)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        rowptr, out = ctx.saved_tensors
        grad = _build.backend_for(out.device).edge_softmax_backward(
            rowptr, out, grad_out.contiguous())
        return grad, None


def edge_softmax(scores: Tensor, rowptr: Tensor, validate: bool = True) -> Tensor:
    r"""Softmax over the edges of each CSR row, independently per head.

    Args:
        scores: [E] or [E, H] edge scores, edges sorted by row.
        rowptr: [N + 1] int32/int64 row pointer (``rowptr[-1] == E``).
        validate: check ``rowptr`` (one host sync).

    Returns:
        [E] or [E, H]: ``exp(s[e]) / sum_{e' in row(e)} exp(s[e'])``. Rows whose
        scores are all ``-inf`` give 0. Same as
        ``torch_geometric.utils.softmax(scores, ptr=rowptr)``.
    """
    check_tensor(scores, 'scores', dims=(1, 2), floating=True)
    check_tensor(rowptr, 'rowptr', dims=(1, ), floating=False)
    check_same_device(scores=scores, rowptr=rowptr)
    if validate:
        check_csr(rowptr, None, scores.size(0))
    s = scores.unsqueeze(-1) if scores.dim() == 1 else scores
    out = EdgeSoftmax.apply(s, rowptr)
    return out.squeeze(-1) if scores.dim() == 1 else out

"""``edge_softmax``: softmax over the edges of each CSR row, per head."""
from torch import Tensor

from . import _lib
from ._checks import check_csr, check_same_device, check_tensor

# out[e, h] = exp(s[e, h] - max_row) / sum_row exp(...), rows given by rowptr
# (positions past rowptr[N] give 0). A row whose scores are all -inf gives 0.
_lib.define('edge_softmax(Tensor rowptr, Tensor scores) -> Tensor')
# grad_scores = out * (grad_out - sum_row(out * grad_out)).
_lib.define('edge_softmax_backward(Tensor rowptr, Tensor out, Tensor grad_out)'
            ' -> Tensor')


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output)


def _backward(ctx, grad_out):
    rowptr, out = ctx.saved_tensors
    return None, _lib.op('edge_softmax_backward')(rowptr, out,
                                                  grad_out.contiguous())


_lib.register('edge_softmax',
              fake=lambda rowptr, scores: scores.new_empty(scores.shape),
              backward=_backward, setup_context=_setup_context, autocast=True)
_lib.register('edge_softmax_backward',
              fake=lambda rowptr, out, grad_out: out.new_empty(out.shape))


def edge_softmax(scores: Tensor, rowptr: Tensor, validate: bool = True) -> Tensor:
    r"""Softmax over the edges of each CSR row, independently per head.

    Args:
        scores: [E] or [E, H] edge scores, edges sorted by row.
        rowptr: [N + 1] int32/int64 row pointer (``rowptr[-1] == E``).
        validate: check ``rowptr`` (one host sync).

    Returns:
        [E] or [E, H]: ``exp(s[e]) / sum_{e' in row(e)} exp(s[e'])``. Rows whose
        scores are all ``-inf`` give 0. Same as
        ``torch_geometric.utils.softmax(scores, ptr=rowptr)``. Like
        ``torch.softmax`` (and unlike PyG's ``softmax``, which keeps its
        intermediates instead), the backward reads this output: modify it in
        place and the backward raises autograd's in-place error. The layers'
        outputs take in-place ops.
    """
    check_tensor(scores, 'scores', dims=(1, 2), floating=True)
    check_tensor(rowptr, 'rowptr', dims=(1, ), floating=False)
    check_same_device(scores=scores, rowptr=rowptr)
    if validate:
        check_csr(rowptr, None, scores.size(0))
    s = scores.unsqueeze(-1) if scores.dim() == 1 else scores
    out = _lib.op('edge_softmax')(rowptr, s)
    return out.squeeze(-1) if scores.dim() == 1 else out

// edge_softmax: softmax over the edges of each CSR row, per head.
#include "../common.h"
#include "autocast.h"

namespace pyg_fastattn {

// rowptr [N+1] int32/int64; scores [E, H] floating.
void check_edge_softmax(const at::Tensor& rowptr, const at::Tensor& scores) {
  check_rowptr(rowptr);
  check_float(scores, "scores", 2);
  check_same_device(rowptr, scores, "rowptr", "scores");
}

void check_edge_softmax_backward(const at::Tensor& rowptr,
                                 const at::Tensor& out,
                                 const at::Tensor& grad_out) {
  check_edge_softmax(rowptr, out);
  check_float(grad_out, "grad_out", 2);
  check_same_device(rowptr, grad_out, "rowptr", "grad_out");
  check_same_dtype(out, grad_out, "out", "grad_out");
  PFA_CHECK(out.sizes() == grad_out.sizes(), "`grad_out` must have shape ",
            out.sizes(), ", got ", grad_out.sizes());
}

}  // namespace pyg_fastattn

PFA_REGISTER_AUTOCAST("edge_softmax")

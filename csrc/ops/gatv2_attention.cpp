// gatv2_attention: input checks shared by the CPU and CUDA kernels. Schema,
// fake and autograd live in pyg_fastattn/ops/gatv2.py.
#include "../common.h"
#include "autocast.h"

namespace pyg_fastattn {

// rowptr [N+1]; col [E]; x_l [Ns, H, C]; x_r [N, H, C]; edge_term [E, H, C];
// att [H, C]; mask [E, H]; bias [H * C elements]. Float tensors share x_l's
// dtype.
void check_gatv2_attention(const at::Tensor& rowptr, const at::Tensor& col,
                           const at::Tensor& x_l, const at::Tensor& x_r,
                           const c10::optional<at::Tensor>& edge_term,
                           const at::Tensor& att,
                           const c10::optional<at::Tensor>& mask,
                           const c10::optional<at::Tensor>& bias) {
  check_rowptr(rowptr);
  check_index(col, rowptr, "col");
  check_float(x_l, "x_l", 3);
  check_same_device(rowptr, x_l, "rowptr", "x_l");
  const int64_t N = rowptr.numel() - 1, E = col.numel();
  check_rows(x_l, "x_l", x_r, "x_r", N, "one row per destination node", 3);
  if (edge_term.has_value())
    check_rows(x_l, "x_l", *edge_term, "edge_term", E, "one row per edge", 3);
  if (mask.has_value())
    check_rows(x_l, "x_l", *mask, "mask", E, "one row per edge", 2);
  check_float(att, "att", 2);
  check_same_device(x_l, att, "x_l", "att");
  check_same_dtype(x_l, att, "x_l", "att");
  check_size(att, 0, x_l.size(1), "att", "heads of `x_l`");
  check_size(att, 1, x_l.size(2), "att", "channels of `x_l`");
  if (bias.has_value()) {
    check_same_device(x_l, *bias, "x_l", "bias");
    check_same_dtype(x_l, *bias, "x_l", "bias");
    PFA_CHECK(bias->numel() == x_l.size(1) * x_l.size(2),
              "`bias` must have H * C = ", x_l.size(1) * x_l.size(2),
              " elements, got ", bias->numel());
  }
}

void check_gatv2_attention_backward(
    const at::Tensor& rowptr, const at::Tensor& col, const at::Tensor& colptr,
    const at::Tensor& csc_row, const at::Tensor& csc_perm,
    const at::Tensor& x_l, const at::Tensor& x_r,
    const c10::optional<at::Tensor>& edge_term, const at::Tensor& att,
    const c10::optional<at::Tensor>& mask,
    const c10::optional<at::Tensor>& bias, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& grad_out) {
  check_gatv2_attention(rowptr, col, x_l, x_r, edge_term, att, mask, bias);
  check_backward_state(rowptr, col, colptr, csc_row, csc_perm, x_l, "x_l", out,
                       lse, grad_out);
}

}  // namespace pyg_fastattn

PFA_REGISTER_AUTOCAST("gatv2_attention")

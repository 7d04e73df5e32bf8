// spmm and segment_sum: weighted aggregation over CSR rows.
#include "../common.h"
#include "autocast.h"

namespace pyg_fastattn {

// rowptr [N+1]; col [E]; weight [Ew, H] or None (all ones);
// weight_perm [E] or None; values [Ns, H, C].
void check_spmm(const at::Tensor& rowptr, const at::Tensor& col,
                const c10::optional<at::Tensor>& weight,
                const c10::optional<at::Tensor>& weight_perm,
                const at::Tensor& values) {
  check_rowptr(rowptr);
  check_index(col, rowptr, "col");
  check_float(values, "values", 3);
  check_same_device(rowptr, values, "rowptr", "values");
  if (weight.has_value()) {
    check_float(*weight, "weight", 2);
    check_same_device(rowptr, *weight, "rowptr", "weight");
    check_same_dtype(values, *weight, "values", "weight");
    check_size(*weight, 1, values.size(1), "weight", "heads of `values`");
    if (!weight_perm.has_value())
      check_size(*weight, 0, col.numel(), "weight", "one row per edge");
  }
  if (weight_perm.has_value()) {
    PFA_CHECK(weight.has_value(), "`weight_perm` needs `weight`");
    check_index(*weight_perm, rowptr, "weight_perm");
    check_size(*weight_perm, 0, col.numel(), "weight_perm", "one per edge");
  }
}

// rowptr [N+1]; perm [E] or None; src [Es, H].
void check_segment_sum(const at::Tensor& rowptr,
                       const c10::optional<at::Tensor>& perm,
                       const at::Tensor& src) {
  check_rowptr(rowptr);
  check_float(src, "src", 2);
  check_same_device(rowptr, src, "rowptr", "src");
  if (perm.has_value()) check_index(*perm, rowptr, "perm");
}

}  // namespace pyg_fastattn

PFA_REGISTER_AUTOCAST("spmm")
PFA_REGISTER_AUTOCAST("segment_sum")

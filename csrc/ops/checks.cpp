// Metadata checks shared by all ops (declared in common.h).
#include "../common.h"

namespace pyg_fastattn {

void check_rowptr(const at::Tensor& rowptr, const char* name) {
  PFA_CHECK(rowptr.dim() == 1, "`", name, "` must be 1-D, got shape ",
            rowptr.sizes());
  PFA_CHECK(rowptr.scalar_type() == at::kInt || rowptr.scalar_type() == at::kLong,
            "`", name, "` must be int32 or int64, got ", rowptr.scalar_type());
  PFA_CHECK(rowptr.numel() >= 1, "`", name,
            "` must hold at least one entry (N + 1 for N rows)");
}

void check_index(const at::Tensor& index, const at::Tensor& rowptr,
                 const char* name) {
  PFA_CHECK(index.dim() == 1, "`", name, "` must be 1-D, got shape ",
            index.sizes());
  PFA_CHECK(index.scalar_type() == rowptr.scalar_type(), "`", name,
            "` must have the same dtype as `rowptr` (", rowptr.scalar_type(),
            "), got ", index.scalar_type());
  check_same_device(rowptr, index, "rowptr", name);
}

void check_float(const at::Tensor& t, const char* name, int64_t dim) {
  PFA_CHECK(at::isFloatingType(t.scalar_type()), "`", name,
            "` must be a floating-point tensor, got ", t.scalar_type());
  PFA_CHECK(t.dim() == dim, "`", name, "` must be ", dim, "-D, got shape ",
            t.sizes());
}

void check_same_device(const at::Tensor& ref, const at::Tensor& t,
                       const char* ref_name, const char* name) {
  PFA_CHECK(ref.device() == t.device(), "`", name, "` is on ", t.device(),
            " but `", ref_name, "` is on ", ref.device(),
            "; all tensors must be on the same device");
}

void check_same_dtype(const at::Tensor& ref, const at::Tensor& t,
                      const char* ref_name, const char* name) {
  PFA_CHECK(ref.scalar_type() == t.scalar_type(), "`", name, "` has dtype ",
            t.scalar_type(), " but `", ref_name, "` has ", ref.scalar_type());
}

void check_size(const at::Tensor& t, int64_t dim, int64_t size,
                const char* name, const char* what) {
  PFA_CHECK(t.size(dim) == size, "`", name, "`.size(", dim, ") must be ", size,
            " (", what, "), got ", t.size(dim));
}

void check_rows(const at::Tensor& ref, const char* ref_name,
                const at::Tensor& t, const char* name, int64_t rows,
                const char* what, int64_t dim) {
  check_float(t, name, dim);
  check_same_device(ref, t, ref_name, name);
  check_same_dtype(ref, t, ref_name, name);
  check_size(t, 0, rows, name, what);
  const std::string of = std::string(" of `") + ref_name + "`";
  check_size(t, 1, ref.size(1), name, ("heads" + of).c_str());
  if (dim == 3) check_size(t, 2, ref.size(2), name, ("channels" + of).c_str());
}

void check_backward_state(const at::Tensor& rowptr, const at::Tensor& col,
                          const at::Tensor& colptr, const at::Tensor& csc_row,
                          const at::Tensor& csc_perm, const at::Tensor& src,
                          const char* src_name, const at::Tensor& out,
                          const at::Tensor& lse, const at::Tensor& grad_out) {
  const int64_t N = rowptr.numel() - 1;
  check_index(colptr, rowptr, "colptr");
  check_size(colptr, 0, src.size(0) + 1, "colptr",
             "one entry per source node plus one");
  check_index(csc_row, rowptr, "csc_row");
  check_size(csc_row, 0, col.numel(), "csc_row", "one entry per edge");
  check_index(csc_perm, rowptr, "csc_perm");
  check_size(csc_perm, 0, col.numel(), "csc_perm", "one entry per edge");
  check_rows(src, src_name, out, "out", N, "one row per destination node", 3);
  check_rows(src, src_name, grad_out, "grad_out", N,
             "one row per destination node", 3);
  check_float(lse, "lse", 2);
  check_same_device(rowptr, lse, "rowptr", "lse");
  PFA_CHECK(lse.scalar_type() == opmath_type(src.scalar_type()),
            "`lse` must have dtype ", opmath_type(src.scalar_type()), ", got ",
            lse.scalar_type());
  PFA_CHECK(lse.size(0) == N && lse.size(1) == src.size(1),
            "`lse` must have shape [", N, ", ", src.size(1), "], got ",
            lse.sizes());
}

}  // namespace pyg_fastattn

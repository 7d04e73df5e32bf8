// csr_build / csc_build: the CSR by destination (with self-loop bookkeeping)
// and its transpose, as graph preparation (pyg_fastattn/nn/graph.py) builds
// them. Schemas and checks here; kernels in csrc/cpu/graph_cpu.cpp and
// csrc/cuda/graph.cu. Outputs equal the Python path bit for bit.
#include "../common.h"

namespace pyg_fastattn {

// src, dst [E] int32/int64 (strided views allowed), one dtype and device.
// csr_build's last output, status [1] int32, holds the kGraphBad* bits of
// what its kernels saw (common.h): the validation of the input, at no extra
// pass.
void check_csr_build(const at::Tensor& src, const at::Tensor& dst,
                     int64_t num_src, int64_t num_dst, bool add_self_loops) {
  for (const auto* t : {&src, &dst}) {
    const char* name = t == &src ? "src" : "dst";
    PFA_CHECK(t->dim() == 1, "`", name, "` must be 1-D, got shape ",
              t->sizes());
    PFA_CHECK(t->scalar_type() == at::kInt || t->scalar_type() == at::kLong,
              "`", name, "` must be int32 or int64, got ", t->scalar_type());
  }
  check_same_dtype(src, dst, "src", "dst");
  check_same_device(src, dst, "src", "dst");
  PFA_CHECK(src.numel() == dst.numel(), "`src` and `dst` must have the same ",
            "length, got ", src.numel(), " and ", dst.numel());
  PFA_CHECK(num_src >= 0 && num_dst >= 0, "node counts must be >= 0, got ",
            num_src, " and ", num_dst);
  const int64_t L = add_self_loops ? std::min(num_src, num_dst) : 0;
  PFA_CHECK(std::max({src.numel() + L, num_src, num_dst}) < kGraphIndexLimit,
            "csr_build takes fewer than 2^31 - 1 edges and nodes, got ",
            src.numel() + L, " edges, ", num_src, " x ", num_dst, " nodes");
}

// rowptr [N + 1], col [E], one dtype (int32/int64) and device.
void check_csc_build(const at::Tensor& rowptr, const at::Tensor& col,
                     int64_t num_cols) {
  check_rowptr(rowptr);
  check_index(col, rowptr, "col");
  PFA_CHECK(num_cols >= 0, "`num_cols` must be >= 0, got ", num_cols);
  PFA_CHECK(std::max(col.numel(), num_cols) < kGraphIndexLimit,
            "csc_build takes fewer than 2^31 - 1 edges and columns, got ",
            col.numel(), " and ", num_cols);
}

void check_graph_lengths(const at::Tensor& rowptr, const at::Tensor& colptr) {
  check_rowptr(rowptr, "rowptr");
  check_rowptr(colptr, "colptr");
  check_same_device(rowptr, colptr, "rowptr", "colptr");
}

}  // namespace pyg_fastattn

TORCH_LIBRARY_FRAGMENT(pyg_fastattn, m) {
  m.def(
      "csr_build(Tensor src, Tensor dst, int num_src, int num_dst, "
      "bool add_self_loops, bool is_sorted) -> (Tensor rowptr, Tensor col, "
      "Tensor csr_perm, Tensor removed, Tensor status)");
  m.def(
      "csc_build(Tensor rowptr, Tensor col, int num_cols) -> (Tensor colptr, "
      "Tensor row, Tensor perm, Tensor inv)");
  // [2] int64 on the CPU: the longest row of rowptr and of colptr (0 for
  // none). From CUDA pointers the result is pinned memory that a copy on the
  // current stream fills after the call returns: read it once an event
  // recorded after the call has completed (PreparedGraph.max_lengths).
  m.def("graph_lengths(Tensor rowptr, Tensor colptr) -> Tensor");
}

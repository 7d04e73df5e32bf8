// csr_build / csc_build (CPU): stable counting sorts.
#include <tuple>
#include <vector>

#include "utils.h"

namespace pyg_fastattn {
namespace {

using Outputs4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using Outputs5 =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Augmented edges (the E input edges, then the L loops (i, i)) sorted by key
// = destination, num_dst for a removed self-loop, i for loop i: one pass
// counts keys, a prefix sum gives the row starts, a second pass places the
// edges in order, so equal keys keep input order. Serial; the same result
// for sorted and unsorted input (is_sorted only saves the GPU its sort).
// The counting pass also sets the status bits (every one of them).
Outputs5 csr_build_cpu(const at::Tensor& src, const at::Tensor& dst,
                       int64_t num_src, int64_t num_dst, bool add_self_loops,
                       bool /*is_sorted*/) {
  check_csr_build(src, dst, num_src, num_dst, add_self_loops);
  const int64_t E = src.numel();
  const int64_t L = add_self_loops ? std::min(num_src, num_dst) : 0;
  const int64_t n = E + L;
  const auto opt = src.options();
  at::Tensor rowptr = at::empty({num_dst + 1}, opt.dtype(at::kInt));
  at::Tensor col = at::empty({n}, opt.dtype(at::kInt));
  at::Tensor perm = at::empty({n}, opt.dtype(at::kLong));
  at::Tensor removed = at::empty({n}, opt.dtype(at::kBool));
  at::Tensor status = at::zeros({1}, opt.dtype(at::kInt));
  PFA_DISPATCH_INDEX(src.scalar_type(), "csr_build_cpu", [&] {
    const index_t* s = src.const_data_ptr<index_t>();
    const index_t* d = dst.const_data_ptr<index_t>();
    const int64_t ss = src.stride(0), ds = dst.stride(0);
    auto key = [&](int64_t e) -> int64_t {
      const int64_t de = d[e * ds];
      if (L > 0 && static_cast<int64_t>(s[e * ss]) == de) return num_dst;
      return cpu::clamp64(de, 0, num_dst);
    };
    std::vector<int64_t> next(num_dst + 2, 0);  // counts, then next slot
    int32_t bad = 0;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t se = s[e * ss], de = d[e * ds];
      if (se < 0 || se >= num_src) bad |= kGraphBadSrc;
      if (de < 0 || de >= num_dst) bad |= kGraphBadDst;
      if (e > 0 && static_cast<int64_t>(d[(e - 1) * ds]) > de)
        bad |= kGraphUnsorted;
      ++next[key(e) + 1];
    }
    status.data_ptr<int32_t>()[0] = bad;
    for (int64_t i = 0; i < L; ++i) ++next[i + 1];
    for (int64_t k = 0; k <= num_dst; ++k) next[k + 1] += next[k];
    int32_t* rp = rowptr.data_ptr<int32_t>();
    for (int64_t k = 0; k <= num_dst; ++k)
      rp[k] = static_cast<int32_t>(next[k]);
    int32_t* cl = col.data_ptr<int32_t>();
    int64_t* pm = perm.data_ptr<int64_t>();
    bool* rm = removed.data_ptr<bool>();
    for (int64_t e = 0; e < E; ++e) {
      const int64_t se = s[e * ss], de = d[e * ds];
      const bool loop = L > 0 && se == de;
      const int64_t p = next[key(e)]++;
      pm[p] = e;
      cl[p] = static_cast<int32_t>(se);
      rm[e] = loop;
    }
    for (int64_t i = 0; i < L; ++i) {
      const int64_t p = next[i]++;
      pm[p] = E + i;
      cl[p] = static_cast<int32_t>(i);
      rm[E + i] = false;
    }
  });
  return {rowptr, col, perm, removed, status};
}

// The transpose: CSR positions sorted by key = column (num_cols past
// rowptr[N]) with a counting sort; rows are walked alongside the positions.
Outputs4 csc_build_cpu(const at::Tensor& rowptr_, const at::Tensor& col_,
                       int64_t num_cols) {
  check_csc_build(rowptr_, col_, num_cols);
  const at::Tensor rowptr = rowptr_.contiguous(), col = col_.contiguous();
  const int64_t N = rowptr.numel() - 1, E = col.numel();
  at::Tensor colptr = at::empty({num_cols + 1}, rowptr.options());
  at::Tensor row = at::empty({E}, rowptr.options());
  at::Tensor perm = at::empty({E}, rowptr.options());
  at::Tensor inv = at::empty({E}, rowptr.options());
  PFA_DISPATCH_INDEX(rowptr.scalar_type(), "csc_build_cpu", [&] {
    const index_t* rp = rowptr.const_data_ptr<index_t>();
    const index_t* cl = col.const_data_ptr<index_t>();
    const int64_t K = cpu::clamp64(rp[N], 0, E);
    auto key = [&](int64_t e) -> int64_t {
      return e < K ? cpu::clamp64(cl[e], 0, num_cols) : num_cols;
    };
    std::vector<int64_t> next(num_cols + 2, 0);
    for (int64_t e = 0; e < E; ++e) ++next[key(e) + 1];
    for (int64_t k = 0; k <= num_cols; ++k) next[k + 1] += next[k];
    index_t* cp = colptr.data_ptr<index_t>();
    for (int64_t k = 0; k <= num_cols; ++k)
      cp[k] = static_cast<index_t>(next[k]);
    index_t* ro = row.data_ptr<index_t>();
    index_t* pm = perm.data_ptr<index_t>();
    index_t* iv = inv.data_ptr<index_t>();
    int64_t r = 0;  // rows j in [1, N] with rowptr[j] <= e (N past the rows)
    for (int64_t e = 0; e < E; ++e) {
      while (r < N && static_cast<int64_t>(rp[r + 1]) <= e) ++r;
      const int64_t k = next[key(e)]++;
      pm[k] = static_cast<index_t>(e);
      iv[e] = static_cast<index_t>(k);
      ro[k] = static_cast<index_t>(r);
    }
  });
  return {colptr, row, perm, inv};
}

// The longest row of each pointer (a decreasing step counts as 0).
at::Tensor graph_lengths_cpu(const at::Tensor& rowptr_, const at::Tensor& colptr_) {
  check_graph_lengths(rowptr_, colptr_);
  at::Tensor out = at::zeros({2}, rowptr_.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const at::Tensor ptrs[2] = {rowptr_.contiguous(), colptr_.contiguous()};
  for (int k = 0; k < 2; ++k) {
    PFA_DISPATCH_INDEX(ptrs[k].scalar_type(), "graph_lengths_cpu", [&] {
      const index_t* p = ptrs[k].const_data_ptr<index_t>();
      for (int64_t i = 0; i + 1 < ptrs[k].numel(); ++i)
        o[k] = std::max<int64_t>(o[k], static_cast<int64_t>(p[i + 1]) - p[i]);
    });
  }
  return out;
}

}  // namespace
}  // namespace pyg_fastattn

TORCH_LIBRARY_IMPL(pyg_fastattn, CPU, m) {
  m.impl("graph_lengths", &pyg_fastattn::graph_lengths_cpu);
  m.impl("csr_build", &pyg_fastattn::csr_build_cpu);
  m.impl("csc_build", &pyg_fastattn::csc_build_cpu);
}

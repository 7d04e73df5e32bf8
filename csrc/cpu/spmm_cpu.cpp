// spmm / segment_sum (CPU): weighted aggregation over CSR rows.
#include <vector>

#include "utils.h"

namespace pyg_fastattn {
namespace {

// o[i, :width] = the sums that segment(b, e, acc) adds into acc[width] for
// the edges [b, e) of row i. Rows are split over threads in chunks of
// balanced edge counts (parallel_rows), each row summed in a local buffer;
// rows over the split threshold (split_rows) are cut into fixed chunks whose
// partial sums are added in chunk order.
template <typename acc_t, typename scalar_t, typename index_t, typename Segment>
void sum_rows(const index_t* rp, int64_t N, int64_t E, int64_t width,
              scalar_t* o, const Segment& segment) {
  const cpu::SplitRows sp = cpu::split_rows(rp, N, E);
  cpu::parallel_rows(rp, N, E, width, [&](int64_t r0, int64_t r1) {
    std::vector<acc_t> acc(width);
    for (int64_t i = r0; i < r1; ++i) {
      const auto [b, e] = cpu::row_range(rp, i, E);
      if (sp.is_long(b, e)) continue;  // split below
      std::fill(acc.begin(), acc.end(), acc_t(0));
      segment(b, e, acc.data());
      for (int64_t x = 0; x < width; ++x) o[i * width + x] = scalar_t(acc[x]);
    }
  });
  std::vector<acc_t> part(sp.chunks() * width, acc_t(0));
  cpu::parallel_chunks(sp, rp, E, [&](int64_t, int64_t, int64_t b, int64_t e,
                                       int64_t q) {
    segment(b, e, part.data() + q * width);
  });
  cpu::parallel_long_rows(sp, [&](int64_t k, int64_t i) {
    std::vector<acc_t> acc(width, acc_t(0));
    for (int64_t q = sp.first[k]; q < sp.first[k + 1]; ++q)
      for (int64_t x = 0; x < width; ++x) acc[x] += part[q * width + x];
    for (int64_t x = 0; x < width; ++x) o[i * width + x] = scalar_t(acc[x]);
  });
}

at::Tensor spmm_cpu(const at::Tensor& rowptr_, const at::Tensor& col_,
                    const c10::optional<at::Tensor>& weight_,
                    const c10::optional<at::Tensor>& weight_perm_,
                    const at::Tensor& values_,
    const c10::optional<at::Tensor>& /*colptr*/,
    const c10::optional<at::Tensor>& /*csc_row*/,
    const c10::optional<at::Tensor>& /*csc_perm*/) {
  check_spmm(rowptr_, col_, weight_, weight_perm_, values_);
  const at::Tensor rowptr = rowptr_.contiguous(), col = col_.contiguous(),
                   values = values_.contiguous();
  const at::Tensor weight = cpu::contiguous_or_undefined(weight_);
  const at::Tensor weight_perm = cpu::contiguous_or_undefined(weight_perm_);
  const int64_t N = rowptr.numel() - 1, E = col.numel(), Ns = values.size(0),
                H = values.size(1), C = values.size(2), HC = H * C,
                Ew = weight.defined() ? weight.size(0) : 0;
  at::Tensor out = at::empty({N, H, C}, values.options());
  PFA_DISPATCH_INDEX(rowptr.scalar_type(), "spmm_cpu", [&] {
    PFA_DISPATCH_FLOATS(values.scalar_type(), "spmm_cpu", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const index_t* rp = rowptr.const_data_ptr<index_t>();
      const index_t* cl = col.const_data_ptr<index_t>();
      const index_t* wp = cpu::data_or_null<index_t>(weight_perm);
      const scalar_t* w = cpu::data_or_null<scalar_t>(weight);
      const scalar_t* v = values.const_data_ptr<scalar_t>();
      scalar_t* o = out.data_ptr<scalar_t>();
      // acc [H, C] += the terms of edges [b, e).
      auto segment = [&](int64_t b, int64_t e, acc_t* acc) {
        for (int64_t k = b; k < e; ++k) {
          const int64_t j = cl[k];
          if (j < 0 || j >= Ns) continue;
          const scalar_t* vj = v + j * HC;
          if (w == nullptr) {
            for (int64_t x = 0; x < HC; ++x) acc[x] += acc_t(vj[x]);
            continue;
          }
          const int64_t wk = wp ? int64_t(wp[k]) : k;
          if (wk < 0 || wk >= Ew) continue;
          for (int64_t h = 0; h < H; ++h) {
            const acc_t wh = w[wk * H + h];
            acc_t* a = acc + h * C;
            const scalar_t* vh = vj + h * C;
            for (int64_t c = 0; c < C; ++c) a[c] += acc_t(vh[c]) * wh;
          }
        }
      };
      sum_rows<acc_t>(rp, N, E, HC, o, segment);
    });
  });
  return out;
}

// Each row sums its H-wide entries of src (sum_rows, as spmm).
at::Tensor segment_sum_cpu(const at::Tensor& rowptr_,
                           const c10::optional<at::Tensor>& perm_,
                           const at::Tensor& src_) {
  check_segment_sum(rowptr_, perm_, src_);
  const at::Tensor rowptr = rowptr_.contiguous(), src = src_.contiguous();
  const at::Tensor perm = cpu::contiguous_or_undefined(perm_);
  const int64_t N = rowptr.numel() - 1, Es = src.size(0), H = src.size(1),
                E = perm.defined() ? perm.numel() : Es;
  at::Tensor out = at::empty({N, H}, src.options());
  PFA_DISPATCH_INDEX(rowptr.scalar_type(), "segment_sum_cpu", [&] {
    PFA_DISPATCH_FLOATS(src.scalar_type(), "segment_sum_cpu", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const index_t* rp = rowptr.const_data_ptr<index_t>();
      const index_t* pm = cpu::data_or_null<index_t>(perm);
      const scalar_t* s = src.const_data_ptr<scalar_t>();
      scalar_t* o = out.data_ptr<scalar_t>();
      auto segment = [&](int64_t b, int64_t e, acc_t* acc) {
        for (int64_t k = b; k < e; ++k) {
          const int64_t j = pm ? int64_t(pm[k]) : k;
          if (pm) cpu::prefetch_ahead(pm, k, E, s, Es, H);  // random rows
          if (j < 0 || j >= Es) continue;
          for (int64_t h = 0; h < H; ++h) acc[h] += acc_t(s[j * H + h]);
        }
      };
      sum_rows<acc_t>(rp, N, E, H, o, segment);
    });
  });
  return out;
}

}  // namespace
}  // namespace pyg_fastattn

TORCH_LIBRARY_IMPL(pyg_fastattn, CPU, m) {
  m.impl("spmm", &pyg_fastattn::spmm_cpu);
  m.impl("segment_sum", &pyg_fastattn::segment_sum_cpu);
}

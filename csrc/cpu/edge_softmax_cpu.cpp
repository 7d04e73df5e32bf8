// edge_softmax / edge_softmax_backward (CPU): softmax over the edges of each
// CSR row, per head.
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "utils.h"

namespace pyg_fastattn {
namespace {

// Rows are split over threads in chunks of balanced edge counts
// (parallel_rows); each thread does all heads of its rows in three passes
// over the row (max; exp, stored in out, and its sum; normalize). Rows over
// the split threshold (split_rows) are cut into fixed chunks: chunk
// statistics, combined per row in chunk order, then chunks normalized.
at::Tensor edge_softmax_cpu(const at::Tensor& rowptr_, const at::Tensor& scores_) {
  check_edge_softmax(rowptr_, scores_);
  const at::Tensor rowptr = rowptr_.contiguous(), scores = scores_.contiguous();
  const int64_t N = rowptr.numel() - 1, E = scores.size(0), H = scores.size(1);
  at::Tensor out = at::empty({E, H}, scores.options());
  PFA_DISPATCH_INDEX(rowptr.scalar_type(), "edge_softmax_cpu", [&] {
    PFA_DISPATCH_FLOATS(scores.scalar_type(), "edge_softmax_cpu", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      // float/double: out holds exp() until the last pass; half types
      // recompute it there instead of rounding it twice.
      constexpr bool exact = std::is_same_v<acc_t, scalar_t>;
      const index_t* rp = rowptr.const_data_ptr<index_t>();
      const scalar_t* s = scores.const_data_ptr<scalar_t>();
      scalar_t* o = out.data_ptr<scalar_t>();
      cpu::zero_outside_rows(out, rp, N);
      constexpr acc_t ninf = -std::numeric_limits<acc_t>::infinity();
      const cpu::SplitRows sp = cpu::split_rows(rp, N, E);
      cpu::parallel_rows(rp, N, E, H, [&](int64_t r0, int64_t r1) {
        std::vector<acc_t> m(H), den(H);
        for (int64_t i = r0; i < r1; ++i) {
          const auto [b, e] = cpu::row_range(rp, i, E);
          if (sp.is_long(b, e)) continue;  // split below
          std::fill(m.begin(), m.end(), ninf);
          std::fill(den.begin(), den.end(), acc_t(0));
          for (int64_t k = b; k < e; ++k)  // a NaN makes den, so the row, NaN
            for (int64_t h = 0; h < H; ++h)
              m[h] = std::max(m[h], acc_t(s[k * H + h]));
          for (int64_t h = 0; h < H; ++h)  // all -inf: exp gives 0, not NaN
            if (m[h] == ninf) m[h] = 0;
          for (int64_t k = b; k < e; ++k)
            for (int64_t h = 0; h < H; ++h) {
              const acc_t ex = std::exp(acc_t(s[k * H + h]) - m[h]);
              if constexpr (exact) o[k * H + h] = ex;
              den[h] += ex;
            }
          for (int64_t k = b; k < e; ++k)
            for (int64_t h = 0; h < H; ++h) {  // den == 0: empty or all -inf
              acc_t ex;
              if constexpr (exact) ex = o[k * H + h];
              else ex = std::exp(acc_t(s[k * H + h]) - m[h]);
              o[k * H + h] = den[h] == 0 ? scalar_t(0) : scalar_t(ex / den[h]);
            }
        }
      });
      // Long rows: per chunk {max, sum of exp(s - max)} (max -inf: sum 0 or
      // NaN); per row the chunks' sums rescaled to the row max and added in
      // chunk order (into the row's first chunk); then every chunk is
      // normalized.
      std::vector<acc_t> part(sp.chunks() * 2 * H);
      cpu::parallel_chunks(sp, rp, E, [&](int64_t, int64_t, int64_t b,
                                           int64_t e, int64_t q) {
        acc_t *m = part.data() + q * 2 * H, *den = m + H;
        std::fill(m, m + H, ninf);
        std::fill(den, den + H, acc_t(0));
        for (int64_t k = b; k < e; ++k)
          for (int64_t h = 0; h < H; ++h)
            m[h] = std::max(m[h], acc_t(s[k * H + h]));
        for (int64_t k = b; k < e; ++k)
          for (int64_t h = 0; h < H; ++h)
            den[h] += std::exp(acc_t(s[k * H + h]) - (m[h] == ninf ? acc_t(0) : m[h]));
      });
      std::vector<acc_t> total(sp.rows() * 2 * H);  // {max (0 if -inf), sum}
      cpu::parallel_long_rows(sp, [&](int64_t k, int64_t) {
        acc_t *m = total.data() + k * 2 * H, *den = m + H;
        std::fill(m, m + H, ninf);
        std::fill(den, den + H, acc_t(0));
        for (int64_t q = sp.first[k]; q < sp.first[k + 1]; ++q)
          for (int64_t h = 0; h < H; ++h) m[h] = std::max(m[h], part[q * 2 * H + h]);
        for (int64_t q = sp.first[k]; q < sp.first[k + 1]; ++q)
          for (int64_t h = 0; h < H; ++h) {
            const acc_t mq = part[q * 2 * H + h];
            const acc_t f = mq == ninf ? acc_t(0) : std::exp(mq - m[h]);
            den[h] += f * part[q * 2 * H + H + h];
          }
        for (int64_t h = 0; h < H; ++h)
          if (m[h] == ninf) m[h] = 0;
      });
      cpu::parallel_chunks(sp, rp, E, [&](int64_t k, int64_t, int64_t b,
                                           int64_t e, int64_t) {
        const acc_t *m = total.data() + k * 2 * H, *den = m + H;
        for (int64_t q = b; q < e; ++q)
          for (int64_t h = 0; h < H; ++h)
            o[q * H + h] = den[h] == 0 ? scalar_t(0)
                           : scalar_t(std::exp(acc_t(s[q * H + h]) - m[h]) / den[h]);
      });
    });
  });
  return out;
}

// Same split as the forward; two passes per row: sum_row(out * grad_out),
// then out * (grad_out - sum).
at::Tensor edge_softmax_backward_cpu(const at::Tensor& rowptr_,
                                     const at::Tensor& out_,
                                     const at::Tensor& grad_out_) {
  check_edge_softmax_backward(rowptr_, out_, grad_out_);
  const at::Tensor rowptr = rowptr_.contiguous(), out = out_.contiguous(),
                   grad_out = grad_out_.contiguous();
  const int64_t N = rowptr.numel() - 1, E = out.size(0), H = out.size(1);
  at::Tensor grad = at::empty({E, H}, out.options());
  PFA_DISPATCH_INDEX(rowptr.scalar_type(), "edge_softmax_backward_cpu", [&] {
    PFA_DISPATCH_FLOATS(out.scalar_type(), "edge_softmax_backward_cpu", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const index_t* rp = rowptr.const_data_ptr<index_t>();
      const scalar_t* y = out.const_data_ptr<scalar_t>();
      const scalar_t* g = grad_out.const_data_ptr<scalar_t>();
      scalar_t* gs = grad.data_ptr<scalar_t>();
      cpu::zero_outside_rows(grad, rp, N);
      const cpu::SplitRows sp = cpu::split_rows(rp, N, E);
      cpu::parallel_rows(rp, N, E, H, [&](int64_t r0, int64_t r1) {
        std::vector<acc_t> sum(H);
        for (int64_t i = r0; i < r1; ++i) {
          const auto [b, e] = cpu::row_range(rp, i, E);
          if (sp.is_long(b, e)) continue;  // split below
          std::fill(sum.begin(), sum.end(), acc_t(0));
          for (int64_t k = b; k < e; ++k)
            for (int64_t h = 0; h < H; ++h)
              sum[h] += acc_t(y[k * H + h]) * acc_t(g[k * H + h]);
          for (int64_t k = b; k < e; ++k)
            for (int64_t h = 0; h < H; ++h)
              gs[k * H + h] = scalar_t(acc_t(y[k * H + h]) *
                                       (acc_t(g[k * H + h]) - sum[h]));
        }
      });
      // Long rows: partial sums per chunk, added per row in chunk order.
      std::vector<acc_t> part(sp.chunks() * H, acc_t(0));
      cpu::parallel_chunks(sp, rp, E, [&](int64_t, int64_t, int64_t b,
                                           int64_t e, int64_t q) {
        acc_t* sum = part.data() + q * H;
        for (int64_t k = b; k < e; ++k)
          for (int64_t h = 0; h < H; ++h)
            sum[h] += acc_t(y[k * H + h]) * acc_t(g[k * H + h]);
      });
      std::vector<acc_t> total(sp.rows() * H, acc_t(0));
      cpu::parallel_long_rows(sp, [&](int64_t k, int64_t) {
        for (int64_t q = sp.first[k]; q < sp.first[k + 1]; ++q)
          for (int64_t h = 0; h < H; ++h) total[k * H + h] += part[q * H + h];
      });
      cpu::parallel_chunks(sp, rp, E, [&](int64_t k, int64_t, int64_t b,
                                           int64_t e, int64_t) {
        const acc_t* sum = total.data() + k * H;
        for (int64_t q = b; q < e; ++q)
          for (int64_t h = 0; h < H; ++h)
            gs[q * H + h] = scalar_t(acc_t(y[q * H + h]) *
                                     (acc_t(g[q * H + h]) - sum[h]));
      });
    });
  });
  return grad;
}

}  // namespace
}  // namespace pyg_fastattn

TORCH_LIBRARY_IMPL(pyg_fastattn, CPU, m) {
  m.impl("edge_softmax", &pyg_fastattn::edge_softmax_cpu);
  m.impl("edge_softmax_backward", &pyg_fastattn::edge_softmax_backward_cpu);
}

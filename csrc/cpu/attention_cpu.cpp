// attention / attention_backward (CPU): fused score, row softmax and weighted
// aggregation (GAT's core), and its gradient.
#include <cmath>
#include <limits>
#include <vector>

#include "utils.h"

namespace pyg_fastattn {
namespace {

// Score terms of attention, shared by the forward and the backward.
template <typename scalar_t>
struct Scores {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t *a_src, *a_dst, *a_edge;  // each may be nullptr (absent)
  int64_t H;
  acc_t slope;

  // For edge k = (j -> i), writes z[h] = a_src[j] + a_dst[i] + a_edge[k] and
  // s[h] = leaky_relu(z[h]) for every head h.
  void operator()(int64_t i, int64_t j, int64_t k, acc_t* z, acc_t* s) const {
    for (int64_t h = 0; h < H; ++h) {
      acc_t v = 0;
      if (a_src) v += acc_t(a_src[j * H + h]);
      if (a_dst) v += acc_t(a_dst[i * H + h]);
      if (a_edge) v += acc_t(a_edge[k * H + h]);
      z[h] = v;
      s[h] = v > 0 ? v : slope * v;
    }
  }
};

// Contiguous inputs of both ops.
struct Inputs {
  at::Tensor rowptr, col, a_src, a_dst, a_edge, mask, values;
};

Inputs contiguous_inputs(const at::Tensor& rowptr, const at::Tensor& col,
                         const c10::optional<at::Tensor>& a_src,
                         const c10::optional<at::Tensor>& a_dst,
                         const c10::optional<at::Tensor>& a_edge,
                         const c10::optional<at::Tensor>& mask,
                         const at::Tensor& values) {
  return {rowptr.contiguous(), col.contiguous(),
          cpu::contiguous_or_undefined(a_src), cpu::contiguous_or_undefined(a_dst),
          cpu::contiguous_or_undefined(a_edge), cpu::contiguous_or_undefined(mask),
          values.contiguous()};
}

template <typename scalar_t>
Scores<scalar_t> make_scores(const Inputs& in, double slope) {
  return {cpu::data_or_null<scalar_t>(in.a_src), cpu::data_or_null<scalar_t>(in.a_dst),
          cpu::data_or_null<scalar_t>(in.a_edge), in.values.size(1),
          at::opmath_type<scalar_t>(slope)};
}

// Rows are split over threads in chunks of balanced edge counts
// (parallel_rows). Per row, pass 1 gets each head's max m of s; pass 2 sums
// exp(s - m) and exp(s - m) * mask * values[j] (in a local [H, C] buffer),
// which are divided at the end: one exp per edge and head, no division.
std::tuple<at::Tensor, at::Tensor> attention_cpu(
    const at::Tensor& rowptr_, const at::Tensor& col_,
    const c10::optional<at::Tensor>& a_src_, const c10::optional<at::Tensor>& a_dst_,
    const c10::optional<at::Tensor>& a_edge_, const c10::optional<at::Tensor>& mask_,
    const at::Tensor& values_, double negative_slope) {
  check_attention(rowptr_, col_, a_src_, a_dst_, a_edge_, mask_, values_);
  const Inputs in = contiguous_inputs(rowptr_, col_, a_src_, a_dst_, a_edge_, mask_, values_);
  const int64_t N = in.rowptr.numel() - 1, E = in.col.numel(),
                Ns = in.values.size(0), H = in.values.size(1),
                C = in.values.size(2), HC = H * C;
  at::Tensor out = at::empty({N, H, C}, in.values.options());
  at::Tensor lse = at::empty(
      {N, H}, in.values.options().dtype(opmath_type(in.values.scalar_type())));
  PFA_DISPATCH_INDEX(in.rowptr.scalar_type(), "attention_cpu", [&] {
    AT_DISPATCH_FLOATING_TYPES(in.values.scalar_type(), "attention_cpu", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      constexpr acc_t inf = std::numeric_limits<acc_t>::infinity();
      const Scores<scalar_t> scores = make_scores<scalar_t>(in, negative_slope);
      const index_t* rp = in.rowptr.const_data_ptr<index_t>();
      const index_t* cl = in.col.const_data_ptr<index_t>();
      const scalar_t* mask = cpu::data_or_null<scalar_t>(in.mask);
      const scalar_t* v = in.values.const_data_ptr<scalar_t>();
      scalar_t* o = out.data_ptr<scalar_t>();
      acc_t* l = lse.data_ptr<acc_t>();
      cpu::parallel_rows(rp, N, E, HC, [&](int64_t r0, int64_t r1) {
        std::vector<acc_t> buf(HC + 4 * H);
        acc_t *acc = buf.data(), *m = acc + HC, *den = m + H, *z = den + H,
              *s = z + H;
        for (int64_t i = r0; i < r1; ++i) {
          const auto [b, e] = cpu::row_range(rp, i, E);
          std::fill(m, m + H, -inf);
          for (int64_t k = b; k < e; ++k) {  // pass 1: max of s per head
            const int64_t j = cl[k];
            if (j < 0 || j >= Ns) continue;
            scores(i, j, k, z, s);
            for (int64_t h = 0; h < H; ++h) m[h] = std::max(m[h], s[h]);
          }
          for (int64_t h = 0; h < H; ++h)  // empty or all -inf: exps are 0
            if (m[h] == -inf) m[h] = 0;
          std::fill(den, den + H, acc_t(0));
          std::fill(acc, acc + HC, acc_t(0));
          for (int64_t k = b; k < e; ++k) {  // pass 2: unnormalized sums
            const int64_t j = cl[k];
            cpu::prefetch_ahead(cl, k, E, v, Ns, HC);
            if (j < 0 || j >= Ns) continue;
            scores(i, j, k, z, s);
            for (int64_t h = 0; h < H; ++h) {
              const acc_t ex = std::exp(s[h] - m[h]);  // NaN (or two +inf) make den NaN
              den[h] += ex;
              const acc_t p = mask ? ex * acc_t(mask[k * H + h]) : ex;
              const scalar_t* vj = v + j * HC + h * C;
              acc_t* a = acc + h * C;
              for (int64_t c = 0; c < C; ++c) a[c] += p * acc_t(vj[c]);
            }
          }
          for (int64_t h = 0; h < H; ++h) {  // den == 0: all weights 0, keep acc
            l[i * H + h] = std::log(den[h]) + m[h];
            const acc_t d = den[h] == 0 ? acc_t(1) : den[h];
            for (int64_t c = 0; c < C; ++c)
              o[i * HC + h * C + c] = scalar_t(acc[h * C + c] / d);
          }
        }
      });
    });
  });
  return {out, lse};
}

// Same split as the forward; one pass per row: delta[h] = <grad_out[i, h],
// out[i, h]>, then each edge's p and grad_z from alpha = exp(s - lse).
std::tuple<at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& rowptr_, const at::Tensor& col_,
    const c10::optional<at::Tensor>& a_src_, const c10::optional<at::Tensor>& a_dst_,
    const c10::optional<at::Tensor>& a_edge_, const c10::optional<at::Tensor>& mask_,
    const at::Tensor& values_, double negative_slope, const at::Tensor& out_,
    const at::Tensor& lse_, const at::Tensor& grad_out_) {
  check_attention_backward(rowptr_, col_, a_src_, a_dst_, a_edge_, mask_,
                           values_, out_, lse_, grad_out_);
  const Inputs in = contiguous_inputs(rowptr_, col_, a_src_, a_dst_, a_edge_, mask_, values_);
  const at::Tensor out = out_.contiguous(), lse = lse_.contiguous(),
                   grad_out = grad_out_.contiguous();
  const int64_t N = in.rowptr.numel() - 1, E = in.col.numel(),
                Ns = in.values.size(0), H = in.values.size(1),
                C = in.values.size(2), HC = H * C;
  at::Tensor p_out = at::empty({E, H}, in.values.options());
  at::Tensor gz_out = at::empty({E, H}, in.values.options());
  PFA_DISPATCH_INDEX(in.rowptr.scalar_type(), "attention_backward_cpu", [&] {
    AT_DISPATCH_FLOATING_TYPES(in.values.scalar_type(), "attention_backward_cpu", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const Scores<scalar_t> scores = make_scores<scalar_t>(in, negative_slope);
      const index_t* rp = in.rowptr.const_data_ptr<index_t>();
      const index_t* cl = in.col.const_data_ptr<index_t>();
      const scalar_t* mask = cpu::data_or_null<scalar_t>(in.mask);
      const scalar_t* v = in.values.const_data_ptr<scalar_t>();
      const scalar_t* o = out.const_data_ptr<scalar_t>();
      const scalar_t* go = grad_out.const_data_ptr<scalar_t>();
      const acc_t* l = lse.const_data_ptr<acc_t>();
      scalar_t* p_ptr = p_out.data_ptr<scalar_t>();
      scalar_t* gz_ptr = gz_out.data_ptr<scalar_t>();
      cpu::zero_outside_rows(p_out, rp, N);
      cpu::zero_outside_rows(gz_out, rp, N);
      cpu::parallel_rows(rp, N, E, HC, [&](int64_t r0, int64_t r1) {
        std::vector<acc_t> buf(3 * H);
        acc_t *delta = buf.data(), *z = delta + H, *s = z + H;
        for (int64_t i = r0; i < r1; ++i) {
          const auto [b, e] = cpu::row_range(rp, i, E);
          const scalar_t* go_i = go + i * HC;
          for (int64_t h = 0; h < H; ++h)
            delta[h] = cpu::dot(go_i + h * C, o + i * HC + h * C, C);
          for (int64_t k = b; k < e; ++k) {
            const int64_t j = cl[k];
            cpu::prefetch_ahead(cl, k, E, v, Ns, HC);
            const bool ok = j >= 0 && j < Ns;
            if (ok) scores(i, j, k, z, s);
            for (int64_t h = 0; h < H; ++h) {
              const acc_t lse_ih = l[i * H + h];
              acc_t p = 0, gz = 0;
              if (ok && std::isfinite(lse_ih)) {  // else the row has no weight
                const acc_t alpha = std::exp(s[h] - lse_ih);
                const acc_t mk = mask ? acc_t(mask[k * H + h]) : acc_t(1);
                const acc_t g = mk * cpu::dot(go_i + h * C, v + j * HC + h * C, C);
                const acc_t grad_s = alpha * (g - delta[h]);
                gz = z[h] > 0 ? grad_s : grad_s * scores.slope;
                p = alpha * mk;
              }
              p_ptr[k * H + h] = scalar_t(p);
              gz_ptr[k * H + h] = scalar_t(gz);
            }
          }
        }
      });
    });
  });
  return {p_out, gz_out};
}

}  // namespace
}  // namespace pyg_fastattn

TORCH_LIBRARY_IMPL(pyg_fastattn, CPU, m) {
  m.impl("attention", &pyg_fastattn::attention_cpu);
  m.impl("attention_backward", &pyg_fastattn::attention_backward_cpu);
}

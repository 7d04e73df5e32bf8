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
      s[h] = cpu::leaky(v, slope);
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
// Rows over the split threshold (split_rows) are cut into fixed chunks, one
// partial each, combined per row in chunk order.
std::tuple<at::Tensor, at::Tensor> attention_cpu(
    const at::Tensor& rowptr_, const at::Tensor& col_,
    const c10::optional<at::Tensor>& a_src_, const c10::optional<at::Tensor>& a_dst_,
    const c10::optional<at::Tensor>& a_edge_, const c10::optional<at::Tensor>& mask_,
    const at::Tensor& values_, double negative_slope,
    const c10::optional<at::Tensor>& bias_,
    const c10::optional<at::Tensor>& /*colptr*/,
    const c10::optional<at::Tensor>& /*csc_row*/,
    const c10::optional<at::Tensor>& /*csc_perm*/,
    const c10::optional<at::Tensor>& /*csc_inv*/) {
  check_attention(rowptr_, col_, a_src_, a_dst_, a_edge_, mask_, values_, bias_);
  const at::Tensor bias = cpu::contiguous_or_undefined(bias_);
  const Inputs in = contiguous_inputs(rowptr_, col_, a_src_, a_dst_, a_edge_, mask_, values_);
  const int64_t N = in.rowptr.numel() - 1, E = in.col.numel(),
                Ns = in.values.size(0), H = in.values.size(1),
                C = in.values.size(2), HC = H * C;
  at::Tensor out = at::empty({N, H, C}, in.values.options());
  at::Tensor lse = at::empty(
      {N, H}, in.values.options().dtype(opmath_type(in.values.scalar_type())));
  PFA_DISPATCH_INDEX(in.rowptr.scalar_type(), "attention_cpu", [&] {
    PFA_DISPATCH_FLOATS(in.values.scalar_type(), "attention_cpu", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      constexpr acc_t inf = std::numeric_limits<acc_t>::infinity();
      const Scores<scalar_t> scores = make_scores<scalar_t>(in, negative_slope);
      const index_t* rp = in.rowptr.const_data_ptr<index_t>();
      const index_t* cl = in.col.const_data_ptr<index_t>();
      const scalar_t* mask = cpu::data_or_null<scalar_t>(in.mask);
      const scalar_t* v = in.values.const_data_ptr<scalar_t>();
      const scalar_t* bs = cpu::data_or_null<scalar_t>(bias);
      scalar_t* o = out.data_ptr<scalar_t>();
      acc_t* l = lse.data_ptr<acc_t>();
      // Edges [b, e) of row i: m[h] = max of s (-inf if none), den[h] =
      // sum exp(s - mz), acc[h] = sum exp(s - mz) * mask * values[j] with
      // mz = m, or 0 where m is -inf (exps are then 0, or NaN).
      auto segment = [&](int64_t i, int64_t b, int64_t e, acc_t* acc,
                         acc_t* m, acc_t* den, acc_t* z, acc_t* s) {
        std::fill(m, m + H, -inf);
        for (int64_t k = b; k < e; ++k) {  // pass 1: max of s per head
          const int64_t j = cl[k];
          if (j < 0 || j >= Ns) continue;
          scores(i, j, k, z, s);
          for (int64_t h = 0; h < H; ++h) m[h] = std::max(m[h], s[h]);
        }
        std::fill(den, den + H, acc_t(0));
        std::fill(acc, acc + HC, acc_t(0));
        for (int64_t k = b; k < e; ++k) {  // pass 2: unnormalized sums
          const int64_t j = cl[k];
          cpu::prefetch_ahead(cl, k, E, v, Ns, HC);
          if (j < 0 || j >= Ns) continue;
          scores(i, j, k, z, s);
          for (int64_t h = 0; h < H; ++h) {
            const acc_t mz = m[h] == -inf ? acc_t(0) : m[h];
            const acc_t ex = std::exp(s[h] - mz);  // NaN (or two +inf) make den NaN
            den[h] += ex;
            const acc_t p = mask ? ex * acc_t(mask[k * H + h]) : ex;
            const scalar_t* vj = v + j * HC + h * C;
            acc_t* a = acc + h * C;
            for (int64_t c = 0; c < C; ++c) a[c] += p * acc_t(vj[c]);
          }
        }
      };
      // out = acc / den (+ bias), lse = log(den) + mz.
      auto finish = [&](int64_t i, const acc_t* acc, const acc_t* m,
                        const acc_t* den) {
        for (int64_t h = 0; h < H; ++h) {  // den == 0: all weights 0, keep acc
          l[i * H + h] = std::log(den[h]) + (m[h] == -inf ? acc_t(0) : m[h]);
          const acc_t d = den[h] == 0 ? acc_t(1) : den[h];
          for (int64_t c = 0; c < C; ++c) {
            const acc_t r = acc[h * C + c] / d;
            o[i * HC + h * C + c] = scalar_t(bs ? r + acc_t(bs[h * C + c]) : r);
          }
        }
      };
      const cpu::SplitRows sp = cpu::split_rows(rp, N, E);
      cpu::parallel_rows(rp, N, E, HC, [&](int64_t r0, int64_t r1) {
        std::vector<acc_t> buf(HC + 4 * H);
        acc_t *acc = buf.data(), *m = acc + HC, *den = m + H, *z = den + H,
              *s = z + H;
        for (int64_t i = r0; i < r1; ++i) {
          const auto [b, e] = cpu::row_range(rp, i, E);
          if (sp.is_long(b, e)) continue;  // split below
          segment(i, b, e, acc, m, den, z, s);
          finish(i, acc, m, den);
        }
      });
      // Long rows: one partial {acc, m, den} per chunk, then per row the
      // partials rescaled to the row's max and summed in chunk order.
      const int64_t P = HC + 2 * H;
      std::vector<acc_t> part(sp.chunks() * P);
      cpu::parallel_chunks(sp, rp, E, [&](int64_t, int64_t i, int64_t b,
                                           int64_t e, int64_t q) {
        std::vector<acc_t> zs(2 * H);
        acc_t* p = part.data() + q * P;
        segment(i, b, e, p, p + HC, p + HC + H, zs.data(), zs.data() + H);
      });
      cpu::parallel_long_rows(sp, [&](int64_t k, int64_t i) {
        std::vector<acc_t> buf(P);
        acc_t *acc = buf.data(), *m = acc + HC, *den = m + H;
        cpu::combine_softmax_chunks(sp, k, part.data(), H, C, acc, m, den);
        finish(i, acc, m, den);
      });
    });
  });
  return {out, lse};
}

// Two steps. (1) Per destination row i and head h (rows in parallel), the
// packed terms {a_dst, lse, delta = <grad_out[i, h], out[i, h]>, 0}: one
// cache line per row for 4 heads, where three arrays took three misses.
// (2) One pass over the transpose: source nodes j split over threads by
// edge count (parallel_rows on colptr); for each out-edge e = (j -> i) (CSC
// entry k: i = row[k], e = perm[k]) alpha is recomputed from lse[i],
// grad_out[i] is read once for both the score gradient and grad_values[j],
// and grad_z is written at CSC position k (in order; CSR position e with
// grad_z_csr). The random rows of entry k + 8 (grad_out, the packed terms,
// mask / a_edge) are prefetched: the pass is bound by their latency. Each
// output has one writer, so the result does not depend on the thread count;
// columns over the split threshold are cut into fixed chunks whose partial
// sums are added in chunk order.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& rowptr_, const at::Tensor& col_, const at::Tensor& colptr_,
    const at::Tensor& row_, const at::Tensor& perm_,
    const c10::optional<at::Tensor>& a_src_, const c10::optional<at::Tensor>& a_dst_,
    const c10::optional<at::Tensor>& a_edge_, const c10::optional<at::Tensor>& mask_,
    const at::Tensor& values_, double negative_slope, const at::Tensor& out_,
    const at::Tensor& lse_, const at::Tensor& grad_out_, bool grad_z_csr,
    const c10::optional<at::Tensor>& bias_) {
  check_attention_backward(rowptr_, col_, colptr_, row_, perm_, a_src_, a_dst_,
                           a_edge_, mask_, values_, out_, lse_, grad_out_, bias_);
  const at::Tensor bias = cpu::contiguous_or_undefined(bias_);
  const Inputs in = contiguous_inputs(rowptr_, col_, a_src_, a_dst_, a_edge_, mask_, values_);
  const at::Tensor colptr = colptr_.contiguous(), row = row_.contiguous(),
                   perm = perm_.contiguous(), out = out_.contiguous(),
                   lse = lse_.contiguous(), grad_out = grad_out_.contiguous();
  const int64_t N = in.rowptr.numel() - 1, E = in.col.numel(),
                Ns = in.values.size(0), H = in.values.size(1),
                C = in.values.size(2), HC = H * C;
  at::Tensor g_values = at::empty({Ns, H, C}, in.values.options());
  // CSC order: every entry of a column is written; CSR order: skipped
  // (invalid) entries are not, so start from zeros.
  at::Tensor g_z = grad_z_csr ? at::zeros({E, H}, in.values.options())
                              : at::empty({E, H}, in.values.options());
  at::Tensor g_src = at::empty({Ns, H}, in.values.options());
  at::Tensor rinfo = at::empty({N, H, 4}, lse.options());
  PFA_DISPATCH_INDEX(in.rowptr.scalar_type(), "attention_backward_cpu", [&] {
    if (!grad_z_csr) cpu::zero_outside_rows(g_z, colptr.const_data_ptr<index_t>(), Ns);
    PFA_DISPATCH_FLOATS(in.values.scalar_type(), "attention_backward_cpu", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const index_t* cp = colptr.const_data_ptr<index_t>();
      const index_t* rw = row.const_data_ptr<index_t>();
      const index_t* pm = perm.const_data_ptr<index_t>();
      const scalar_t* a_src = cpu::data_or_null<scalar_t>(in.a_src);
      const scalar_t* a_dst = cpu::data_or_null<scalar_t>(in.a_dst);
      const scalar_t* a_edge = cpu::data_or_null<scalar_t>(in.a_edge);
      const scalar_t* mask = cpu::data_or_null<scalar_t>(in.mask);
      const acc_t slope = static_cast<acc_t>(negative_slope);
      const scalar_t* v = in.values.const_data_ptr<scalar_t>();
      const scalar_t* o = out.const_data_ptr<scalar_t>();
      const scalar_t* go = grad_out.const_data_ptr<scalar_t>();
      const scalar_t* bs = cpu::data_or_null<scalar_t>(bias);
      const acc_t* l = lse.const_data_ptr<acc_t>();
      acc_t* ri = rinfo.data_ptr<acc_t>();  // [N, H, {a_dst, lse, delta, 0}]
      scalar_t* gv_ptr = g_values.data_ptr<scalar_t>();
      scalar_t* gz_ptr = g_z.data_ptr<scalar_t>();
      scalar_t* gs_ptr = g_src.data_ptr<scalar_t>();
      at::parallel_for(0, N * H, std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(C, 1)),
                       [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
          ri[4 * t] = a_dst ? acc_t(a_dst[t]) : acc_t(0);
          ri[4 * t + 1] = l[t];
          acc_t d = cpu::dot(go + t * C, o + t * C, C);
          if (bs) d -= cpu::dot(go + t * C, bs + (t % H) * C, C);
          ri[4 * t + 2] = d;
          ri[4 * t + 3] = 0;
        }
      });
      const scalar_t* per_edge = mask ? mask : a_edge;  // one to prefetch
      // CSC entries [b, end) of column j: writes their grad_z and adds
      // their grad_values / grad_a_src terms to acc [H, C] / gsrc [H].
      auto segment = [&](int64_t j, int64_t b, int64_t end, acc_t* acc,
                         acc_t* gsrc) {
        const scalar_t* vj = v + j * HC;
        for (int64_t k = b; k < end; ++k) {
          const int64_t i = rw[k], e = pm[k];
          cpu::prefetch_ahead(rw, k, E, go, N, HC);
          cpu::prefetch_ahead(rw, k, E, ri, N, 4 * H);
          if (per_edge) cpu::prefetch_ahead(pm, k, E, per_edge, E, H);
          scalar_t* gz_k = gz_ptr + (grad_z_csr ? e : k) * H;
          if (i < 0 || i >= N || e < 0 || e >= E) {
            if (!grad_z_csr) std::fill(gz_k, gz_k + H, scalar_t(0));
            continue;
          }
          const scalar_t* go_i = go + i * HC;
          const acc_t* r_i = ri + i * H * 4;
          for (int64_t h = 0; h < H; ++h) {
            const acc_t lse_ih = r_i[4 * h + 1];
            if (!cpu::has_weight(lse_ih)) {
              gz_k[h] = scalar_t(0);
              continue;
            }
            acc_t z = 0;  // the reference's order: a_src + a_dst + a_edge
            if (a_src) z += acc_t(a_src[j * H + h]);
            z += r_i[4 * h];
            if (a_edge) z += acc_t(a_edge[e * H + h]);
            const acc_t alpha = std::exp(cpu::leaky(z, slope) - lse_ih);
            const acc_t mk = mask ? acc_t(mask[e * H + h]) : acc_t(1);
            const scalar_t* g = go_i + h * C;
            const acc_t grad_s =
                alpha * (mk * cpu::dot(g, vj + h * C, C) - r_i[4 * h + 2]);
            const acc_t gz = cpu::leaky_grad(z, slope, grad_s);
            gz_k[h] = scalar_t(gz);
            gsrc[h] += gz;
            const acc_t p = alpha * mk;
            acc_t* a = acc + h * C;
            for (int64_t c = 0; c < C; ++c) a[c] += p * acc_t(g[c]);
          }
        }
      };
      auto store = [&](int64_t j, const acc_t* acc, const acc_t* gsrc) {
        for (int64_t q = 0; q < HC; ++q) gv_ptr[j * HC + q] = scalar_t(acc[q]);
        for (int64_t h = 0; h < H; ++h) gs_ptr[j * H + h] = scalar_t(gsrc[h]);
      };
      const cpu::SplitRows sp = cpu::split_rows(cp, Ns, E);
      cpu::parallel_rows(cp, Ns, E, HC, [&](int64_t j0, int64_t j1) {
        std::vector<acc_t> buf(HC + H);
        acc_t *acc = buf.data(), *gsrc = acc + HC;
        for (int64_t j = j0; j < j1; ++j) {
          const auto [b, end] = cpu::row_range(cp, j, E);
          if (sp.is_long(b, end)) continue;  // split below
          std::fill(acc, acc + HC + H, acc_t(0));
          segment(j, b, end, acc, gsrc);
          store(j, acc, gsrc);
        }
      });
      // Long columns: one partial {acc, gsrc} per chunk, summed in order.
      const int64_t P = HC + H;
      std::vector<acc_t> part(sp.chunks() * P, acc_t(0));
      cpu::parallel_chunks(sp, cp, E, [&](int64_t, int64_t j, int64_t b,
                                           int64_t end, int64_t q) {
        acc_t* p = part.data() + q * P;
        segment(j, b, end, p, p + HC);
      });
      cpu::parallel_long_rows(sp, [&](int64_t k, int64_t j) {
        std::vector<acc_t> buf(P);
        cpu::sum_chunks(sp, k, part.data(), P, buf.data());
        store(j, buf.data(), buf.data() + HC);
      });
    });
  });
  return {g_values, g_z, g_src};
}

}  // namespace
}  // namespace pyg_fastattn

TORCH_LIBRARY_IMPL(pyg_fastattn, CPU, m) {
  m.impl("attention", &pyg_fastattn::attention_cpu);
  m.impl("attention_backward", &pyg_fastattn::attention_backward_cpu);
}

// Row-softmax attention with a per-edge score computed on the fly, shared by
// gatv2_cpu.cpp (att . leaky_relu(x_l[j] + x_r[i] + edge_term[e])) and
// transformer_cpu.cpp (scale * <query[i], key[j] + edge_term[e]>): the
// forward, the backward's per-row segment and a row-sum driver.
//
// A score policy `Pol` (acc_t = at::opmath_type<scalar_t>) provides:
//   int64_t scratch() const;       acc_t values row() / score() use
//   void prefetch(const index_t* col, int64_t k, int64_t E) const;
//   void row(int64_t i, acc_t* buf) const;       row i's state into buf
//   const V* score(int64_t j, int64_t e, acc_t* buf, acc_t* s) const;
//     after row(i, buf): the scores s [H] of edge e = (j -> i) and its value
//     row [H * C] (V: scalar_t or acc_t), j in range.
#pragma once

#include <cmath>
#include <limits>
#include <vector>

#include "utils.h"

namespace pyg_fastattn {
namespace cpu {

// Inputs of the row kernels besides the policy.
template <typename scalar_t, typename index_t>
struct RowGraph {
  const index_t* rowptr;  // [N + 1]
  const index_t* col;     // [E]
  int64_t N, E, Ns, H, C;
  const scalar_t* mask;  // [E, H] or nullptr
  const scalar_t* bias;  // [H * C] or nullptr
};

// Forward. Rows split over threads by edge count (parallel_rows). One pass
// per row with an online softmax per head: running max m, sum den of
// exp(s - m) and acc of exp(s - m) * mask * value, rescaled when m grows;
// divided at the end (plus the bias). The score is computed once per edge
// and never stored. Rows over the split threshold (split_rows) are cut into
// fixed chunks, one online-softmax partial {acc, m, den} each, combined per
// row in chunk order. Writes out [N, H, C] and lse [N, H].
template <typename scalar_t, typename index_t, typename Pol>
void attend_rows(const Pol& pol, const RowGraph<scalar_t, index_t>& g,
                 scalar_t* o, at::opmath_type<scalar_t>* l) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr acc_t inf = std::numeric_limits<acc_t>::infinity();
  const int64_t N = g.N, E = g.E, Ns = g.Ns, H = g.H, C = g.C, HC = H * C;
  const index_t* rp = g.rowptr;
  const index_t* cl = g.col;
  const scalar_t* mask = g.mask;
  const scalar_t* bs = g.bias;
  const int64_t S = pol.scratch() + H;  // segment scratch: policy's, s [H]
  // Online softmax over the edges [b, e) of row i into acc [HC], m [H],
  // den [H] (acc and den relative to m; m = -inf and both 0 if no edge has
  // a weight). buf: S scratch.
  auto segment = [&](int64_t i, int64_t b, int64_t e, acc_t* acc, acc_t* m,
                     acc_t* den, acc_t* buf) {
    acc_t* s = buf + pol.scratch();
    pol.row(i, buf);
    std::fill(m, m + H, -inf);
    std::fill(den, den + H, acc_t(0));
    std::fill(acc, acc + HC, acc_t(0));
    for (int64_t k = b; k < e; ++k) {
      const int64_t j = cl[k];
      pol.prefetch(cl, k, E);
      if (j < 0 || j >= Ns) continue;
      const auto* vj = pol.score(j, k, buf, s);
      for (int64_t h = 0; h < H; ++h) {
        const acc_t x = s[h];
        acc_t scale = 1, p;
        if (x > m[h]) {  // new maximum: rescale what was summed
          scale = std::exp(m[h] - x);
          m[h] = x;
          p = 1;
        } else if (x == -inf) {
          continue;
        } else {
          p = std::exp(x - m[h]);  // NaN propagates to den and acc
        }
        den[h] = den[h] * scale + p;
        const acc_t w = mask ? p * acc_t(mask[k * H + h]) : p;
        acc_t* a = acc + h * C;
        const auto* v = vj + h * C;
        if (scale != acc_t(1))
          for (int64_t c = 0; c < C; ++c) a[c] = a[c] * scale + w * acc_t(v[c]);
        else
          for (int64_t c = 0; c < C; ++c) a[c] += w * acc_t(v[c]);
      }
    }
  };
  // out = acc / den (+ bias), lse = log(den) + m.
  auto finish = [&](int64_t i, const acc_t* acc, const acc_t* m, acc_t* den) {
    for (int64_t h = 0; h < H; ++h) {
      // A +inf score gives NaN, as exp(inf - inf) in the reference.
      if (m[h] == inf) den[h] = std::numeric_limits<acc_t>::quiet_NaN();
      l[i * H + h] = std::log(den[h]) + (m[h] == -inf ? acc_t(0) : m[h]);
      const acc_t d = den[h] == 0 ? acc_t(1) : den[h];  // empty: acc is 0
      for (int64_t c = 0; c < C; ++c) {
        const int64_t q = h * C + c;
        const acc_t r = acc[q] / d;
        o[i * HC + q] = scalar_t(bs ? r + acc_t(bs[q]) : r);
      }
    }
  };
  const SplitRows sp = split_rows(rp, N, E);
  const int64_t P = HC + 2 * H;  // one partial: {acc, m, den}
  parallel_rows(rp, N, E, 2 * HC, [&](int64_t r0, int64_t r1) {
    std::vector<acc_t> buf(P + S);
    acc_t *acc = buf.data(), *m = acc + HC, *den = m + H;
    for (int64_t i = r0; i < r1; ++i) {
      const auto [b, e] = row_range(rp, i, E);
      if (sp.is_long(b, e)) continue;  // split below
      segment(i, b, e, acc, m, den, acc + P);
      finish(i, acc, m, den);
    }
  });
  std::vector<acc_t> part(sp.chunks() * P);
  parallel_chunks(sp, rp, E, [&](int64_t, int64_t i, int64_t b, int64_t e,
                                 int64_t q) {
    std::vector<acc_t> buf(S);
    acc_t* p = part.data() + q * P;
    segment(i, b, e, p, p + HC, p + HC + H, buf.data());
  });
  parallel_long_rows(sp, [&](int64_t k, int64_t i) {
    std::vector<acc_t> buf(P);
    acc_t *acc = buf.data(), *m = acc + HC, *den = m + H;
    combine_softmax_chunks(sp, k, part.data(), H, C, acc, m, den);
    finish(i, acc, m, den);
  });
}

// Scratch of backward_row_segment besides the tail's: the policy's, then
// s, delta, grad_s and p [H] each.
template <typename Pol>
int64_t backward_row_scratch(const Pol& pol, int64_t H) {
  return pol.scratch() + 4 * H;
}

// Backward, edges [b, e) of row i: per edge the score again, alpha =
// exp(s - lse) (0 where lse is -inf: the row has no weight), g =
// mask * <grad_out[i], value>, grad_s = alpha * (g - delta) with delta =
// <grad_out[i], out[i] - bias>, p = alpha * mask; then
// tail(k, j, buf, grad_s [H], p [H], extra) (buf: the policy's scratch after
// score(), extra: the tail's scratch). Edges whose col is out of range get
// skip(k). buf: backward_row_scratch + the tail's scratch.
template <typename scalar_t, typename index_t, typename Pol, typename Tail,
          typename Skip>
void backward_row_segment(const Pol& pol, const RowGraph<scalar_t, index_t>& g,
                          const scalar_t* out, const scalar_t* grad_out,
                          const at::opmath_type<scalar_t>* lse, int64_t i,
                          int64_t b, int64_t e,
                          at::opmath_type<scalar_t>* buf, const Tail& tail,
                          const Skip& skip) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t E = g.E, Ns = g.Ns, H = g.H, C = g.C, HC = H * C;
  const index_t* cl = g.col;
  const scalar_t* mask = g.mask;
  const scalar_t* bs = g.bias;
  acc_t *s = buf + pol.scratch(), *delta = s + H, *gsv = delta + H,
        *pv = gsv + H, *extra = pv + H;
  const scalar_t* go_i = grad_out + i * HC;
  pol.row(i, buf);
  for (int64_t h = 0; h < H; ++h) {  // <grad_out, out - bias>
    const scalar_t* o_ih = out + i * HC + h * C;
    if (bs) {
      acc_t d = 0;
      for (int64_t c = 0; c < C; ++c)
        d += acc_t(go_i[h * C + c]) * (acc_t(o_ih[c]) - acc_t(bs[h * C + c]));
      delta[h] = d;
    } else {
      delta[h] = dot(go_i + h * C, o_ih, C);
    }
  }
  for (int64_t k = b; k < e; ++k) {
    const int64_t j = cl[k];
    pol.prefetch(cl, k, E);
    if (j < 0 || j >= Ns) {
      skip(k);
      continue;
    }
    const auto* vj = pol.score(j, k, buf, s);
    for (int64_t h = 0; h < H; ++h) {
      const acc_t lse_ih = lse[i * H + h];
      acc_t gs = 0, p = 0;
      if (cpu::has_weight(lse_ih)) {
        const acc_t alpha = std::exp(s[h] - lse_ih);
        acc_t gv = dot(go_i + h * C, vj + h * C, C);
        p = alpha;
        if (mask) {
          const acc_t mk = acc_t(mask[k * H + h]);
          gv *= mk;
          p *= mk;
        }
        gs = alpha * (gv - delta[h]);
      }
      gsv[h] = gs;
      pv[h] = p;
    }
    tail(k, j, static_cast<const acc_t*>(buf), static_cast<const acc_t*>(gsv),
         static_cast<const acc_t*>(pv), extra);
  }
}

// Row sums without atomics: seg(r, b, e, acc, buf) adds the terms of the
// entries [b, e) of row r of ptr [rows + 1] into acc [P] (zeroed; buf: S
// scratch), store(r, acc) takes the row's sum. Rows over the split threshold
// are cut into fixed chunks whose partials are summed in chunk order: the
// result does not depend on the thread count.
template <typename acc_t, typename index_t, typename Seg, typename Store>
void reduce_rows(const index_t* ptr, int64_t rows, int64_t E, int64_t P,
                 int64_t S, int64_t work_per_item, const Seg& seg,
                 const Store& store) {
  const SplitRows sp = split_rows(ptr, rows, E);
  parallel_rows(ptr, rows, E, work_per_item, [&](int64_t r0, int64_t r1) {
    std::vector<acc_t> buf(P + S);
    acc_t* acc = buf.data();
    for (int64_t r = r0; r < r1; ++r) {
      const auto [b, e] = row_range(ptr, r, E);
      if (sp.is_long(b, e)) continue;  // split below
      std::fill(acc, acc + P, acc_t(0));
      seg(r, b, e, acc, acc + P);
      store(r, static_cast<const acc_t*>(acc));
    }
  });
  std::vector<acc_t> part(sp.chunks() * P, acc_t(0));
  parallel_chunks(sp, ptr, E, [&](int64_t, int64_t r, int64_t b, int64_t e,
                                  int64_t q) {
    std::vector<acc_t> buf(S);
    seg(r, b, e, part.data() + q * P, buf.data());
  });
  parallel_long_rows(sp, [&](int64_t k, int64_t r) {
    std::vector<acc_t> buf(P);
    sum_chunks(sp, k, part.data(), P, buf.data());
    store(r, static_cast<const acc_t*>(buf.data()));
  });
}

}  // namespace cpu
}  // namespace pyg_fastattn

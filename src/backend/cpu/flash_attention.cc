// PLACEHOLDER (row-at-a-time online softmax); replaced by the blocked kernel.
#include "backend/cpu/flash_attention.h"

#include <cmath>
#include <limits>
#include <vector>

namespace foldpar {

void flash_attention_forward(const AttentionDims& d, const float* q, const float* k, const float* v,
                             const int32_t* q_pos, const int32_t* k_pos, float scale, float* out, float* lse) {
  std::vector<float> acc(d.d);
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t h = 0; h < d.n_h; ++h)
      for (int64_t i = 0; i < d.sq; ++i) {
        const float* qr = q + ((b * d.sq + i) * d.n_h + h) * d.d;
        float m = -std::numeric_limits<float>::infinity(), l = 0;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = 0; j < d.sk; ++j) {
          if (k_pos[j] > q_pos[i]) continue;
          const int64_t kr = ((b * d.sk + j) * d.n_kv + h / d.group()) * d.d;
          float s = 0;
          for (int64_t e = 0; e < d.d; ++e) s += qr[e] * k[kr + e];
          s *= scale;
          const float mn = std::max(m, s), c = std::exp(m - mn), p = std::exp(s - mn);
          l = l * c + p;
          for (int64_t e = 0; e < d.d; ++e) acc[e] = acc[e] * c + p * v[kr + e];
          m = mn;
        }
        float* o = out + ((b * d.sq + i) * d.n_h + h) * d.d;
        for (int64_t e = 0; e < d.d; ++e) o[e] = l > 0 ? acc[e] / l : 0.f;
        lse[(b * d.n_h + h) * d.sq + i] = l > 0 ? m + std::log(l) : -std::numeric_limits<float>::infinity();
      }
}

void flash_attention_backward(const AttentionDims& d, const float* q, const float* k, const float* v,
                              const float* out, const float* lse, const float* d_out, const int32_t* q_pos,
                              const int32_t* k_pos, float scale, float* dq, float* dk, float* dv) {
  std::fill(dk, dk + d.batch * d.sk * d.n_kv * d.d, 0.f);
  std::fill(dv, dv + d.batch * d.sk * d.n_kv * d.d, 0.f);
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t h = 0; h < d.n_h; ++h)
      for (int64_t i = 0; i < d.sq; ++i) {
        const int64_t row = ((b * d.sq + i) * d.n_h + h) * d.d;
        float* dqr = dq + row;
        std::fill(dqr, dqr + d.d, 0.f);
        const float l = lse[(b * d.n_h + h) * d.sq + i];
        if (std::isinf(l)) continue;
        float delta = 0;
        for (int64_t e = 0; e < d.d; ++e) delta += d_out[row + e] * out[row + e];
        for (int64_t j = 0; j < d.sk; ++j) {
          if (k_pos[j] > q_pos[i]) continue;
          const int64_t kr = ((b * d.sk + j) * d.n_kv + h / d.group()) * d.d;
          float s = 0, dp = 0;
          for (int64_t e = 0; e < d.d; ++e) {
            s += q[row + e] * k[kr + e];
            dp += d_out[row + e] * v[kr + e];
          }
          const float p = std::exp(s * scale - l), ds = p * (dp - delta) * scale;
          for (int64_t e = 0; e < d.d; ++e) {
            dv[kr + e] += p * d_out[row + e];
            dqr[e] += ds * k[kr + e];
            dk[kr + e] += ds * q[row + e];
          }
        }
      }
}

}  // namespace foldpar

// The tensor-core flash attention's kernels (src/backend/cuda/flash_attention_tc.cu), run
// on the host: transform.py makes the .cu compile as C++ against shim.h, which runs every
// CUDA thread of a block as a std::thread and emulates the warp instructions the kernels use
// (mma.sync m16n8k16 bf16, ldmatrix, shuffles, ballot, cp.async landing at issue or only at
// the wait). Each case compares the kernels' forward (out, lse) and backward (dq, dk, dv)
// with an f64 reference on bf16 inputs, within 2^-7 relative to the largest reference value
// (bf16's rounding of P and dS, as in FlashAttention-2). Shared memory starts as NaN, so a
// read of a tile nobody wrote shows.
//
// Why: no GPU runs in CI; this catches index, tiling, masking and synchronization mistakes
// in the kernel's logic on every machine. It cannot catch a misreading of the PTX fragment
// layouts that the shim shares, nor anything about speed: tests/gpu/cuda_attention_test.cc
// on a GPU is the real check.
// Usage: tc_emulation [--cases i,j,...] [--both] [--seed-offset n]   (default: every case, cp.async at issue)
#include "tc_emulated.inc"
#include "core/rng.h"

#include <algorithm>
#include <random>
#include <string>

using namespace foldpar;
using namespace foldpar::cuda;

struct Case {
  std::string name;
  int64_t B, n_h, n_kv, d;
  std::vector<int32_t> qp, kp;
  int64_t window = 0;  // sliding window; 0: causal
};
// The reference's visibility: causal, and inside the window when there is one.
static bool visible(const Case& c, int32_t q, int32_t k) { return k <= q && (c.window == 0 || int64_t{q} - k < c.window); }

static std::vector<int32_t> range(int a, int b) { std::vector<int32_t> v; for (int i = a; i < b; ++i) v.push_back(i); return v; }
static std::vector<int32_t> cat(std::vector<std::vector<int32_t>> ps) { std::vector<int32_t> v; for (auto& p : ps) v.insert(v.end(), p.begin(), p.end()); return v; }
static std::vector<int32_t> shuffled(int lo, int hi) { std::vector<int32_t> v; int n = hi - lo; for (int i = 0; i < n; ++i) v.push_back(lo + (int)(((int64_t)i * 37 + 11) % n)); return v; }

static double rel(const std::vector<float>& got, const std::vector<double>& want) {
  double scale = 1e-30, worst = 0;
  for (double w : want) if (std::isfinite(w)) scale = std::max(scale, std::abs(w));
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] == want[i]) continue;
    const double d = std::abs(got[i] - want[i]);
    if (!std::isfinite(d)) return INFINITY;
    worst = std::max(worst, d / scale);
  }
  return worst;
}

static uint64_t g_seed_offset = 0;
static bool run(const Case& c, bool immediate) {
  g_immediate_copies = immediate;
  const int64_t sq = c.qp.size(), sk = c.kp.size(), d = c.d, group = c.n_h / c.n_kv;
  auto rnd = [&](int64_t n, uint64_t seed) { std::vector<uint16_t> v(n); for (int64_t i = 0; i < n; ++i) v[i] = f2bf((float)foldpar::normal_at(seed + g_seed_offset, 17, i)); return v; };
  auto Q = rnd(c.B * sq * c.n_h * d, 1), K = rnd(c.B * sk * c.n_kv * d, 2), V = rnd(c.B * sk * c.n_kv * d, 3), dO = rnd(c.B * sq * c.n_h * d, 4);
  const double scale = 1.0 / std::sqrt((double)d);
  // reference (double)
  std::vector<double> O(Q.size()), L(c.B * c.n_h * sq), dQ(Q.size(), 0), dK(K.size(), 0), dV(V.size(), 0);
  auto qi = [&](int64_t b, int64_t i, int64_t h) { return ((b * sq + i) * c.n_h + h) * d; };
  auto ki = [&](int64_t b, int64_t j, int64_t h) { return ((b * sk + j) * c.n_kv + h) * d; };
  std::vector<uint16_t> Obf(Q.size());
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.n_h; ++h)
      for (int64_t i = 0; i < sq; ++i) {
        const int64_t hk = h / group;
        std::vector<double> s(sk, -INFINITY);
        double mx = -INFINITY;
        for (int64_t j = 0; j < sk; ++j) {
          if (!visible(c, c.qp[i], c.kp[j])) continue;
          double dot = 0;
          for (int64_t e = 0; e < d; ++e) dot += (double)bf2f(Q[qi(b, i, h) + e]) * bf2f(K[ki(b, j, hk) + e]);
          s[j] = dot * scale;
          mx = std::max(mx, s[j]);
        }
        double& l = L[(b * c.n_h + h) * sq + i];
        if (mx == -INFINITY) { l = -INFINITY; continue; }
        double sum = 0;
        for (int64_t j = 0; j < sk; ++j) if (s[j] != -INFINITY) sum += std::exp(s[j] - mx);
        l = mx + std::log(sum);
        for (int64_t j = 0; j < sk; ++j) {
          if (s[j] == -INFINITY) continue;
          const double p = std::exp(s[j] - l);
          for (int64_t e = 0; e < d; ++e) O[qi(b, i, h) + e] += p * bf2f(V[ki(b, j, hk) + e]);
        }
      }
  for (size_t i = 0; i < O.size(); ++i) Obf[i] = f2bf((float)O[i]);
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.n_h; ++h)
      for (int64_t i = 0; i < sq; ++i) {
        const int64_t hk = h / group;
        const double l = L[(b * c.n_h + h) * sq + i];
        if (l == -INFINITY) continue;
        double delta = 0;
        for (int64_t e = 0; e < d; ++e) delta += (double)bf2f(dO[qi(b, i, h) + e]) * (float)O[qi(b, i, h) + e];
        for (int64_t j = 0; j < sk; ++j) {
          if (!visible(c, c.qp[i], c.kp[j])) continue;
          double dot = 0, dp = 0;
          for (int64_t e = 0; e < d; ++e) {
            dot += (double)bf2f(Q[qi(b, i, h) + e]) * bf2f(K[ki(b, j, hk) + e]);
            dp += (double)bf2f(dO[qi(b, i, h) + e]) * bf2f(V[ki(b, j, hk) + e]);
          }
          const double p = std::exp(dot * scale - l), ds = p * (dp - delta) * scale;
          for (int64_t e = 0; e < d; ++e) {
            dV[ki(b, j, hk) + e] += p * bf2f(dO[qi(b, i, h) + e]);
            dK[ki(b, j, hk) + e] += ds * bf2f(Q[qi(b, i, h) + e]);
            dQ[qi(b, i, h) + e] += ds * bf2f(K[ki(b, j, hk) + e]);
          }
        }
      }
  // kernels (garbage-filled outputs)
  const AttentionShape s{c.B, sq, sk, c.n_h, c.n_kv, d, (float)scale, c.window};
  std::vector<uint16_t> o(Q.size(), 0x7fc1), dq(Q.size(), 0x7fc1), dk(K.size(), 0x7fc1), dv(V.size(), 0x7fc1);
  std::vector<float> lse(L.size(), NAN), lse_in(L.size()), delta(L.size(), NAN);
  std::vector<int32_t> ws(attention_tc_workspace_words(s), 12345);
  launch_attention_forward_tc(s, {Q.data(), DType::kBF16}, {K.data(), DType::kBF16}, {V.data(), DType::kBF16}, c.qp.data(),
                              c.kp.data(), {o.data(), DType::kBF16}, lse.data(), ws.data(), nullptr);
  for (size_t i = 0; i < L.size(); ++i) lse_in[i] = (float)L[i];
  launch_attention_backward_tc(s, {Q.data(), DType::kBF16}, {K.data(), DType::kBF16}, {V.data(), DType::kBF16},
                               {Obf.data(), DType::kBF16}, lse_in.data(), {dO.data(), DType::kBF16}, c.qp.data(),
                               c.kp.data(), delta.data(), ws.data(), {dq.data(), DType::kBF16}, {dk.data(), DType::kBF16},
                               {dv.data(), DType::kBF16}, nullptr);
  auto tof = [](const std::vector<uint16_t>& v) { std::vector<float> f(v.size()); for (size_t i = 0; i < v.size(); ++i) f[i] = bf2f(v[i]); return f; };
  double lse_err = 0;
  bool lse_inf_ok = true;
  for (size_t i = 0; i < L.size(); ++i) {
    if (std::isinf(L[i])) { lse_inf_ok = lse_inf_ok && std::isinf(lse[i]) && lse[i] < 0; continue; }
    lse_err = std::max(lse_err, std::abs(lse[i] - L[i]) / std::max(1.0, std::abs(L[i])));
  }
  const double eo = rel(tof(o), O), eq = rel(tof(dq), dQ), ek = rel(tof(dk), dK), ev = rel(tof(dv), dV);
  const double tol = 1.0 / 128;
  const bool ok = eo <= tol && eq <= tol && ek <= tol && ev <= tol && lse_err <= 1e-4 && lse_inf_ok;
  printf("%-28s %s: out %.2e lse %.2e%s dq %.2e dk %.2e dv %.2e  %s\n", c.name.c_str(), immediate ? "imm " : "defer", eo,
         lse_err, lse_inf_ok ? "" : " (-inf WRONG)", eq, ek, ev, ok ? "ok" : "FAIL");
  return ok;
}

int main(int argc, char** argv) {
  std::vector<Case> cases = {
      // the GPU test's cases (tests/gpu/cuda_attention_test.cc), same data
      {"T tc contiguous d64", 1, 4, 4, 64, range(0, 257), range(0, 257)},
      {"T tc contiguous d128 gqa", 2, 8, 2, 128, range(0, 100), range(0, 100)},
      {"T tc zigzag rank 1", 1, 8, 2, 128, cat({range(50, 100), range(100, 150)}), cat({range(0, 50), range(150, 200), range(50, 100), range(100, 150)})},
      {"T tc zigzag rank 0", 1, 8, 2, 64, cat({range(0, 50), range(150, 200)}), cat({range(0, 50), range(150, 200), range(50, 100), range(100, 150)})},
      {"T tc suffix d128", 2, 8, 2, 128, range(157, 257), range(0, 257)},
      {"T tc suffix d64 mha", 1, 4, 4, 64, range(157, 257), range(0, 257)},
      {"T tc no key d64", 1, 2, 1, 64, range(0, 100), range(10, 130)},
      {"T tc no key d128", 1, 4, 2, 128, range(0, 70), range(10, 130)},
      {"T tc shuffled keys", 1, 4, 2, 64, range(0, 150), shuffled(0, 150)},
      {"T tc shuffled both", 1, 2, 1, 128, shuffled(20, 170), shuffled(0, 150)},
      {"contiguous d64 257", 1, 1, 1, 64, range(0, 257), range(0, 257)},
      {"contiguous d128 gqa 100", 2, 4, 2, 128, range(0, 100), range(0, 100)},
      {"zigzag rank1 d128", 1, 2, 1, 128, cat({range(50, 100), range(100, 150)}), cat({range(0, 50), range(150, 200), range(50, 100), range(100, 150)})},
      {"zigzag rank0 d64 gqa", 1, 4, 2, 64, cat({range(0, 50), range(150, 200)}), cat({range(0, 50), range(150, 200), range(50, 100), range(100, 150)})},
      {"suffix d64", 1, 2, 1, 64, range(157, 257), range(0, 257)},
      {"no key d64", 1, 2, 1, 64, range(0, 100), range(10, 130)},
      {"shuffled d64", 1, 2, 1, 64, range(0, 150), shuffled(0, 150)},
      {"shuffled both d128", 1, 1, 1, 128, shuffled(20, 170), shuffled(0, 150)},
      // Sliding windows (issue 21): under one 64-row tile (whole key tiles behind it skipped),
      // odd across tiles, two keys, on the zigzag shard and on shuffled positions.
      {"window 40 d64 300", 1, 2, 1, 64, range(0, 300), range(0, 300), 40},
      {"window 97 d128 gqa", 1, 4, 2, 128, range(0, 260), range(0, 260), 97},
      {"window 2 d64", 1, 2, 2, 64, range(0, 130), range(0, 130), 2},  // (1 would make dq, dk exactly 0: rel() has no scale)
      {"window 30 zigzag rank1", 1, 2, 1, 64, cat({range(50, 100), range(100, 150)}), cat({range(0, 50), range(150, 200), range(50, 100), range(100, 150)}), 30},
      {"window 25 shuffled both", 1, 2, 1, 128, shuffled(20, 170), shuffled(0, 150), 25},
  };
  std::vector<size_t> chosen;
  bool both = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--both") {
      both = true;
    } else if (a == "--cases" && i + 1 < argc) {
      for (const char* p = argv[++i]; *p != 0;) {
        char* end = nullptr;
        const unsigned long v = std::strtoul(p, &end, 10);
        if (end == p || v >= cases.size()) {
          std::fprintf(stderr, "tc_emulation: --cases wants indices below %zu, got '%s'\n", cases.size(), argv[i]);
          return 2;
        }
        chosen.push_back(v);
        p = *end == ',' ? end + 1 : end;
      }
    } else if (a == "--seed-offset" && i + 1 < argc) {
      g_seed_offset = std::strtoull(argv[++i], nullptr, 10);
    } else {
      std::fprintf(stderr, "tc_emulation: unknown argument '%s'\n", a.c_str());
      return 2;
    }
  }
  if (chosen.empty())
    for (size_t i = 0; i < cases.size(); ++i) chosen.push_back(i);
  bool all = true;
  for (size_t i : chosen) {
    all = run(cases[i], true) && all;
    if (both) all = run(cases[i], false) && all;
  }
  printf(all ? "ALL OK\n" : "SOME FAILED\n");
  return all ? 0 : 1;
}

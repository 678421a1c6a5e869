// Helpers of the communication tests: integer-valued data (exact in f32 and bf16 for sums
// over a few ranks), the three ways to run an operation (blocking, non-blocking + wait,
// non-blocking + test loop), exact comparison, and traffic expectations.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "tensor/dtype.h"

namespace foldpar {
// How GoogleTest prints counters in a failed expectation.
inline void PrintTo(const OpCounters& c, std::ostream* os) {
  *os << "{calls " << c.calls << ", sent " << c.bytes_sent << " B, received " << c.bytes_received << " B}";
}
}  // namespace foldpar

namespace foldpar::test {

// An integer in [-5, 5] for element i of rank r: sums over up to 4 ranks stay within
// [-20, 20], exact in bf16 (8 significant bits) and f32.
inline double value(int r, uint64_t i) { return static_cast<double>(static_cast<int64_t>((r * 7 + i * 3) % 11) - 5); }

template <typename T> T from_double(double v);
template <> inline float from_double<float>(double v) { return static_cast<float>(v); }
template <> inline double from_double<double>(double v) { return v; }
template <> inline bf16 from_double<bf16>(double v) { return f32_to_bf16(static_cast<float>(v)); }
template <> inline int32_t from_double<int32_t>(double v) { return static_cast<int32_t>(v); }
template <> inline int64_t from_double<int64_t>(double v) { return static_cast<int64_t>(v); }
inline double to_double(float x) { return x; }
inline double to_double(double x) { return x; }
inline double to_double(bf16 x) { return bf16_to_f32(x); }
inline double to_double(int32_t x) { return x; }
inline double to_double(int64_t x) { return static_cast<double>(x); }

template <typename T>
std::vector<T> filled(size_t n, const std::function<double(uint64_t)>& f) {
  std::vector<T> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = from_double<T>(f(i));
  return out;
}

// Exact comparison; on failure names the first mismatches with index and both values.
template <typename T>
void expect_values(const std::vector<T>& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int shown = 0;
  size_t bad = 0;
  std::string first;
  for (size_t i = 0; i < got.size(); ++i) {
    if (to_double(got[i]) == want[i]) continue;
    ++bad;
    if (shown++ < 4) first += " [" + std::to_string(i) + "] got " + std::to_string(to_double(got[i])) + " want " +
                              std::to_string(want[i]) + ";";
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " elements differ:" << first;
}

enum class Mode { kBlocking, kWait, kTest };
inline const char* mode_name(Mode m) {
  return m == Mode::kBlocking ? "blocking" : m == Mode::kWait ? "non-blocking+wait" : "non-blocking+test";
}
inline constexpr Mode kAllModes[] = {Mode::kBlocking, Mode::kWait, Mode::kTest};

// Runs an operation in `mode`: blocking() returns its Status, start() its CommRequest.
inline void run_in_mode(Mode mode, const std::function<Status()>& blocking,
                        const std::function<CommRequest()>& start) {
  if (mode == Mode::kBlocking) {
    const Status s = blocking();
    EXPECT_TRUE(s.ok()) << s.to_string();
    return;
  }
  CommRequest request = start();
  if (mode == Mode::kWait) {
    const Status s = request.wait();
    EXPECT_TRUE(s.ok()) << s.to_string();
    return;
  }
  bool done = false;
  while (!done) {
    const Status s = request.test(&done);
    EXPECT_TRUE(s.ok()) << s.to_string();
  }
}

// The counters of one operation: one call of `kind` with the given ELEMENT counts (times
// beta), nothing else recorded.
inline void expect_traffic(const CommStats& delta, CommOpKind kind, uint64_t sent_elems, uint64_t recv_elems,
                           size_t beta, const std::string& what) {
  const OpCounters want{1, sent_elems * beta, recv_elems * beta};
  EXPECT_EQ(delta.op(kind), want) << what << ": counted " << delta.to_string() << "expected " << comm_op_name(kind)
                                  << " 1 call, sent " << want.bytes_sent << " B, received " << want.bytes_received
                                  << " B";
  EXPECT_EQ(delta.total(), want) << what << ": other kinds were counted too: " << delta.to_string();
}

}  // namespace foldpar::test

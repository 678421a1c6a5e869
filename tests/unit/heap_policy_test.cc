// core/heap_policy.h: with the policy, a large block freed and allocated again is not faulted
// in again; without it (glibc's default) a block of 48 MiB is a fresh mapping every time.
#include <gtest/gtest.h>
#include <malloc.h>
#include <sys/resource.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "core/heap_policy.h"

namespace foldpar {
namespace {

constexpr size_t kBytes = size_t{48} << 20;  // above glibc's largest mmap threshold (32 MiB)
constexpr long kPages = static_cast<long>(kBytes / 4096);

// Keeps the compiler from dropping a malloc, memset and free of a block nobody reads.
void escape(void* p) { asm volatile("" : : "g"(p) : "memory"); }

long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

// Page faults while touching a block of kBytes that was allocated and freed once before.
long faults_of_second_touch() {
  char* first = static_cast<char*>(std::malloc(kBytes));
  EXPECT_NE(first, nullptr);
  std::memset(first, 1, kBytes);
  escape(first);
  std::free(first);
  char* again = static_cast<char*>(std::malloc(kBytes));
  EXPECT_NE(again, nullptr);
  const long before = minor_faults();
  std::memset(again, 2, kBytes);
  escape(again);
  const long faults = minor_faults() - before;
  std::free(again);
  return faults;
}

bool transparent_huge_pages_always() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string s;
  std::getline(f, s);
  return s.find("[always]") != std::string::npos;
}

TEST(HeapPolicy, AFreedLargeBlockIsReusedWithoutFreshPages) {
  const long fresh = faults_of_second_touch();
  if (!keep_freed_heap_memory()) GTEST_SKIP() << "this allocator ignores mallopt (AddressSanitizer?)";
  const long kept = faults_of_second_touch();
  // glibc's defaults again, for the tests after this one in the process.
  mallopt(M_MMAP_MAX, 65536);
  mallopt(M_TRIM_THRESHOLD, 128 * 1024);
  // Without the policy every 4 KiB page of the block faults (unless the kernel backs fresh
  // mappings with huge pages), so the check below can fail.
  if (!transparent_huge_pages_always()) {
    EXPECT_GT(fresh, kPages / 2) << "pages " << kPages;
  }
  EXPECT_LT(kept, kPages / 100) << "fresh " << fresh << ", pages " << kPages;
}

}  // namespace
}  // namespace foldpar

#include "core/heap_policy.h"

#include <malloc.h>

#include <climits>

namespace foldpar {

bool keep_freed_heap_memory() {
#if defined(__GLIBC__)
  // mallopt returns 1 on success. Under AddressSanitizer it is intercepted and returns 0.
  const bool no_mmap = mallopt(M_MMAP_MAX, 0) == 1;
  const bool no_trim = mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1;
  return no_mmap && no_trim;
#else
  return false;
#endif
}

}  // namespace foldpar

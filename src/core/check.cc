// The fatal path: print once with the process identity, then run the fatal handler.
#include "core/check.h"

#include <cstdio>
#include <cstdlib>

namespace foldpar {
namespace {
FatalHandler g_fatal_handler = nullptr;
std::string& identity_storage() {
  static std::string identity;
  return identity;
}
}  // namespace

void set_fatal_handler(FatalHandler handler) { g_fatal_handler = handler; }
void set_process_identity(const std::string& identity) { identity_storage() = identity; }
const std::string& process_identity() { return identity_storage(); }

void fatal_error(const char* file, int line, const std::string& message) {
  const std::string& who = process_identity();
  std::fprintf(stderr, "foldpar: fatal%s%s at %s:%d: %s\n", who.empty() ? "" : " on ", who.c_str(),
               file, line, message.c_str());
  std::fflush(stderr);
  if (g_fatal_handler != nullptr) g_fatal_handler(1);
  std::abort();
}

}  // namespace foldpar

// Tokenizer throughput: MB/s of English text encoded on one core by each tokenizer named
// on the command line (a tokenizer.json, a SentencePiece model, or "bytes"), over the text
// files of a directory (default: Debian's fortunes, one document per file, as prepare-data
// reads them). Prints the first pass (cold word cache: the figure for text not seen before)
// and the median of the next passes (the same text again: every word cached), each as
// wall-clock and as this thread's CPU time (the per-core rate on a machine shared with
// other work).
// A benchmark: it reports, it never asserts a speed.
//   tokenizer_bench [--text DIR] [--passes N] TOKENIZER...
#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "data/tokenizer.h"

namespace fs = std::filesystem;

double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

int main(int argc, char** argv) {
  std::string text_dir = "/usr/share/games/fortunes";
  int passes = 5;
  std::vector<std::string> specs;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--text" && i + 1 < argc) text_dir = argv[++i];
    else if (a == "--passes" && i + 1 < argc) passes = std::max(2, std::atoi(argv[++i]));
    else specs.push_back(a);
  }
  if (specs.empty()) {
    std::fprintf(stderr, "usage: tokenizer_bench [--text DIR] [--passes N] TOKENIZER...\n");
    return 2;
  }
  std::vector<std::string> docs;
  size_t bytes = 0;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(text_dir))
    if (e.is_regular_file() && e.path().filename().string().find('.') == std::string::npos) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  for (const fs::path& f : files) {
    std::ifstream in(f, std::ios::binary);
    docs.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    bytes += docs.back().size();
  }
  std::printf("text: %zu files, %.2f MB from %s\n", docs.size(), bytes / 1e6, text_dir.c_str());
  for (const std::string& spec : specs) {
    foldpar::Result<std::unique_ptr<foldpar::Tokenizer>> tok = foldpar::make_tokenizer(spec);
    if (!tok.ok()) {
      std::fprintf(stderr, "%s\n", tok.status().to_string().c_str());
      return 2;
    }
    std::vector<double> wall, cpu;
    size_t tokens = 0;
    for (int p = 0; p < passes; ++p) {
      const auto t0 = std::chrono::steady_clock::now();
      const double c0 = thread_cpu_seconds();
      tokens = 0;
      for (const std::string& d : docs) tokens += (*tok)->encode(d).size();
      cpu.push_back(bytes / 1e6 / (thread_cpu_seconds() - c0));
      wall.push_back(bytes / 1e6 / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    const auto median_after_first = [](std::vector<double> v) {
      v.erase(v.begin());
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    std::printf("%s: %zu tokens (%.2f bytes/token)\n  first pass  %.2f MB/s wall, %.2f MB/s cpu\n"
                "  cached (median of %d)  %.2f MB/s wall, %.2f MB/s cpu\n",
                (*tok)->describe().c_str(), tokens, static_cast<double>(bytes) / tokens, wall[0], cpu[0], passes - 1,
                median_after_first(wall), median_after_first(cpu));
  }
  return 0;
}

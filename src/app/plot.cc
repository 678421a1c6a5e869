// Plotting a metrics file with gnuplot: the JSON lines become whitespace-separated columns,
// and one gnuplot script draws the three figures.
#include "app/plot.h"

#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

namespace foldpar {
namespace fs = std::filesystem;

Result<std::vector<std::string>> plot_metrics(const std::string& metrics_path, const std::string& out_dir) {
  std::ifstream in(metrics_path);
  if (!in) return not_found("cannot read metrics file '{}'", metrics_path);
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) return io_error("cannot create '{}': {}", out_dir, ec.message());
  const fs::path dir(out_dir);
  std::ofstream steps(dir / "steps.dat"), val(dir / "val.dat"), mem(dir / "memory.dat");
  int64_t lines = 0, ranks = 0;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("step") || !j.contains("loss"))
      return invalid_argument("{}:{}: not a metrics line", metrics_path, n);
    const auto step = j["step"].get<int64_t>();
    steps << step << ' ' << j["loss"].get<double>() << ' ' << j.value("tokens_per_s", 0.0) << '\n';
    if (j.contains("val_loss")) val << step << ' ' << j["val_loss"].get<double>() << '\n';
    if (j.contains("ranks") && j["ranks"].is_array()) {
      mem << step;
      for (const auto& r : j["ranks"]) mem << ' ' << r.value("peak_total", int64_t{0}) / 1048576.0;
      mem << '\n';
      ranks = std::max<int64_t>(ranks, static_cast<int64_t>(j["ranks"].size()));
    }
    ++lines;
  }
  steps.close();
  val.close();
  mem.close();
  if (lines == 0) return invalid_argument("metrics file '{}' holds no steps", metrics_path);
  std::ofstream gp(dir / "plot.gp");
  gp << "set terminal pngcairo size 900,540 noenhanced\nset grid\nset key top right\nset xlabel 'step'\n";
  gp << "set output '" << (dir / "loss.png").string() << "'\nset ylabel 'loss (nats/token)'\n";
  gp << "plot '" << (dir / "steps.dat").string() << "' using 1:2 with lines title 'train'";
  if (fs::file_size(dir / "val.dat", ec) > 0)
    gp << ", '" << (dir / "val.dat").string() << "' using 1:2 with linespoints title 'validation'";
  gp << "\nset output '" << (dir / "throughput.png").string() << "'\nset ylabel 'tokens/s'\n";
  gp << "plot '" << (dir / "steps.dat").string() << "' using 1:3 with lines title 'tokens/s'\n";
  gp << "set output '" << (dir / "memory.png").string() << "'\nset ylabel 'tracked peak per step (MiB)'\n";
  gp << "plot";
  for (int64_t r = 0; r < std::max<int64_t>(ranks, 1); ++r)
    gp << (r ? "," : "") << " '" << (dir / "memory.dat").string() << "' using 1:" << r + 2 << " with lines title 'rank "
       << r << "'";
  gp << "\n";
  gp.close();
  const std::string cmd = "gnuplot '" + (dir / "plot.gp").string() + "' 2>&1";
  const int rc = std::system(cmd.c_str());
  if (rc != 0) {
    if (WIFEXITED(rc) && WEXITSTATUS(rc) == 127) return not_found("gnuplot is not installed (scripts/setup.sh installs it)");
    return Status(StatusCode::kInternal, fmt::format("gnuplot failed (status {}) on {}", rc, (dir / "plot.gp").string()));
  }
  return std::vector<std::string>{(dir / "loss.png").string(), (dir / "throughput.png").string(),
                                  (dir / "memory.png").string()};
}

}  // namespace foldpar

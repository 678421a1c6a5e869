// `foldpar generate`: text from a checkpoint or a Hugging Face directory, under mpirun. What
// generation does lives in src/app/generate.h and src/infer/; here: flags in, text out.
//
// Output (rank 0): with one prompt, the completion streams to stdout as it is generated;
// with several, each completion is printed when it finishes, after a header line
// "--- completion I (N tokens, stop|length) ---"; with --json, one JSON object per completion
// per line instead. The summary (layout, prefill and decode tokens/s, KV cache per rank) goes
// to stderr.
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "app/generate.h"
#include "cli_layout.h"
#include "commands.h"
#include "job.h"

namespace foldpar::cli {
namespace {

struct GenerateArgs {
  GenerateOptions options;  // prompts, layout options and backend filled at run time
  LayoutArgs layout;
  std::string prompt_file, device = "cpu";
  std::vector<std::string> prompts, stops;
  bool json = false, lockstep = false;
};

// "\n", "\t", "\\" in a stop sequence given on the command line.
std::string unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\' || i + 1 == s.size()) {
      out.push_back(s[i]);
      continue;
    }
    const char c = s[++i];
    out.push_back(c == 'n' ? '\n' : c == 't' ? '\t' : c);
  }
  return out;
}

// `ranks`: the job's, for the default layout tsp=<ranks>.
Result<GenerateOptions> generate_options(const GenerateArgs& a, int ranks) {
  GenerateOptions o = a.options;
  FP_ASSIGN_OR_RETURN(o.layout, layout_of(a.layout, ranks));
  if (!a.prompt_file.empty()) {
    FP_ASSIGN_OR_RETURN(o.prompts, read_prompt_file(a.prompt_file));
  }
  o.prompts.insert(o.prompts.end(), a.prompts.begin(), a.prompts.end());
  if (o.prompts.empty()) return invalid_argument("no prompt: give --prompt-file or --prompt");
  for (const std::string& s : a.stops) o.generation.stop.push_back(unescape(s));
  o.generation.in_flight = !a.lockstep;
  return o;
}

GenerationCallbacks print_callbacks(bool json, size_t prompts) {
  GenerationCallbacks cb;
  if (json) {
    cb.on_done = [](int64_t i, const Completion& c) {
      const nlohmann::json j{{"index", i}, {"prompt", c.prompt}, {"completion", c.text},
                             {"tokens", c.tokens.size()}, {"token_ids", c.tokens}, {"stop_reason", c.stop_reason}};
      std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
      std::fflush(stdout);
    };
  } else if (prompts == 1) {
    cb.on_text = [](int64_t, std::string_view piece) {
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
    };
    cb.on_done = [](int64_t, const Completion&) { std::printf("\n"); };
  } else {
    cb.on_done = [](int64_t i, const Completion& c) {
      std::printf("--- completion %lld (%zu tokens, %s) ---\n%s\n", static_cast<long long>(i), c.tokens.size(),
                  c.stop_reason.c_str(), c.text.c_str());
      std::fflush(stdout);
    };
  }
  return cb;
}

void print_summary(const GenerateResult& r, size_t prompts) {
  const GenerationReport& g = r.report;
  std::fprintf(stderr,
               "foldpar generate: %s, %zu prompts from %s\n"
               "  prefill %lld tokens in %.3f s: %.1f tokens/s\n"
               "  decode  %lld tokens in %.3f s: %.1f tokens/s (every slot of every step)\n"
               "  generated %lld tokens: %.1f tokens/s over prefill and decode\n"
               "  KV cache %.2f MiB per rank\n",
               r.layout.c_str(), prompts, r.source.c_str(), static_cast<long long>(g.prompt_tokens), g.prefill_seconds,
               g.prefill_tokens_per_second(), static_cast<long long>(g.decode_tokens), g.decode_seconds,
               g.decode_tokens_per_second(), static_cast<long long>(g.generated_tokens), g.generated_tokens_per_second(),
               static_cast<double>(g.cache_bytes) / (1 << 20));
}

int run_generate_command(const GenerateArgs& a) {
  Result<Job> job = start_job(a.device);
  if (!job.ok()) return fail(job.status());
  Result<GenerateOptions> o = generate_options(a, job->world().size());
  if (!o.ok()) return fail(o.status());
  o->backend = job->device.backend.get();
  o->axis_comm = job->device.axis_comm;
  Result<GenerateResult> r = run_generate(*o, job->world(), print_callbacks(a.json, o->prompts.size()));
  if (!r.ok()) return fail(r.status());
  if (job->root()) print_summary(*r, o->prompts.size());
  return kExitOk;
}

}  // namespace

Command add_generate_command(CLI::App& app) {
  auto a = std::make_shared<GenerateArgs>();
  GenerateOptions& o = a->options;
  CLI::App* cmd = app.add_subcommand("generate", "generate text from a checkpoint or a Hugging Face directory (run under mpirun)");
  cmd->add_option("--checkpoint", o.checkpoint, "a checkpoint (step-N), or a training directory: its newest");
  cmd->add_option("--hf", o.hf_dir, "or: a Hugging Face directory (config.json + model.safetensors)");
  cmd->add_option("--prompt-file", a->prompt_file, "prompts, one per line (or *.jsonl: a JSON string or {\"prompt\": ...} per line)");
  cmd->add_option("--prompt", a->prompts, "a prompt (repeatable; after those of --prompt-file)");
  cmd->add_option("--max-new-tokens", o.generation.max_new_tokens, "tokens generated per prompt at most");
  cmd->add_option("--temperature", o.generation.sampling.temperature, "0: greedy; > 0: sample from softmax(logits / temperature)");
  cmd->add_option("--top-k", o.generation.sampling.top_k, "sample among the k most likely tokens (0: all)");
  cmd->add_option("--top-p", o.generation.sampling.top_p, "sample among the most likely tokens whose probability reaches p (1: all)");
  cmd->add_option("--seed", o.generation.sampling.seed, "seed of the sampling");
  cmd->add_option("--stop", a->stops, "stop sequence (repeatable; \\n, \\t and \\\\ are escapes); not printed");
  cmd->add_option("--batch", o.generation.batch, "prompts decoded together (0: all)")->check(non_negative());
  cmd->add_flag("--lockstep", a->lockstep,
                "pp: decode every step through the stages in turn, the sampler between steps (default with B >= pp "
                "prompts: pp groups in flight across steps, no fill and drain per token)");
  cmd->add_option("--tokenizer", o.tokenizer, "bytes, a SentencePiece model or a tokenizer.json (default: bytes; --hf: its tokenizer.json when present)");
  add_layout_flags(cmd, a->layout, /*generation=*/true);
  cmd->add_flag("--json", a->json, "one JSON object per completion per line");
  add_device_option(cmd, a->device, "each rank: GPU local rank mod GPUs; docs/GPU.md");
  return {cmd, [a] { return run_generate_command(*a); }};
}

}  // namespace foldpar::cli

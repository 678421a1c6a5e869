// resolve_checkpoint: what --checkpoint of generate and export accepts. A step directory
// names itself; a checkpoints/ folder or a training directory names its newest complete
// checkpoint (incomplete ones, without a manifest, never count); anything else is an error
// naming the path.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "checkpoint/checkpoint.h"

namespace foldpar {
namespace {
namespace fs = std::filesystem;

class ResolveCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("foldpar-resolve-" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
                                         "-" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  // A step directory; complete when it holds a manifest (resolve_checkpoint reads no more).
  std::string make_step(const fs::path& ckpts, const std::string& name, bool complete) {
    fs::create_directories(ckpts / name);
    if (complete) std::ofstream(ckpts / name / "manifest.json") << "{}";
    return (ckpts / name).string();
  }

  fs::path root_;
};

TEST_F(ResolveCheckpoint, StepDirectoryTrainingDirectoryAndCheckpointsFolder) {
  const fs::path ckpts = root_ / "run" / "checkpoints";
  make_step(ckpts, "step-00000004", true);
  const std::string step8 = make_step(ckpts, "step-00000008", true);
  make_step(ckpts, "step-00000012", false);             // no manifest: incomplete
  make_step(ckpts, ".incomplete-step-00000016", false);

  Result<std::string> by_step = resolve_checkpoint((ckpts / "step-00000004").string());
  ASSERT_TRUE(by_step.ok()) << by_step.status().to_string();
  EXPECT_EQ(*by_step, (ckpts / "step-00000004").string());

  Result<std::string> by_run = resolve_checkpoint((root_ / "run").string());
  ASSERT_TRUE(by_run.ok()) << by_run.status().to_string();
  EXPECT_EQ(*by_run, step8);

  Result<std::string> by_folder = resolve_checkpoint(ckpts.string());
  ASSERT_TRUE(by_folder.ok()) << by_folder.status().to_string();
  EXPECT_EQ(*by_folder, step8);
}

TEST_F(ResolveCheckpoint, ErrorsNameThePath) {
  const std::string missing = (root_ / "missing").string();
  Result<std::string> r = resolve_checkpoint(missing);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find(missing), std::string::npos) << r.status().message();

  const fs::path run = root_ / "empty-run";
  make_step(run / "checkpoints", "step-00000004", false);  // only an incomplete one
  Result<std::string> none = resolve_checkpoint(run.string());
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
  EXPECT_NE(none.status().message().find("no complete checkpoint in '" + run.string() + "'"), std::string::npos)
      << none.status().message();
}

}  // namespace
}  // namespace foldpar

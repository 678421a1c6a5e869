// Mesh over real MPI processes: for every layout whose degrees multiply to the world size,
// each rank's coordinates follow the documented order (dp outermost, last axis fastest),
// each axis communicator holds exactly the ranks that share the other coordinates, moves
// data among them only, and counts its traffic separately. A layout of the wrong size is a
// Status naming both numbers. An AxisCommFactory (how `--device cuda` puts device
// communicators on the axes) wraps every axis's split, and the wrapped axis carries the
// traffic. Runs under mpirun at 1-4 ranks.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "comm/mesh.h"
#include "comm_test_util.h"
#include "mpi_test_main.h"

namespace foldpar::test {
namespace {

// Every layout over `names` (outermost first) whose degrees multiply to n.
void layouts_of(int n, const std::vector<std::string>& names, size_t i, std::string prefix,
                std::vector<std::string>& out) {
  if (i == names.size()) {
    if (n == 1) out.push_back(prefix);
    return;
  }
  for (int d = 1; d <= n; ++d) {
    if (n % d != 0) continue;
    layouts_of(n / d, names, i + 1, prefix + (prefix.empty() ? "" : ",") + fmt::format("{}={}", names[i], d), out);
  }
}

std::vector<std::string> all_layouts(int n) {
  std::vector<std::string> out;
  for (const std::vector<std::string>& names : std::vector<std::vector<std::string>>{
           {"tsp"}, {"tp", "sp"}, {"dp", "tsp"}, {"dp", "tp", "sp"}}) {
    layouts_of(n, names, 0, "", out);
  }
  return out;
}

TEST(Mesh, EveryLayoutOfTheWorldHasTheDocumentedRankOrder) {
  Communicator& world = mpi().world();
  const int p = world.rank(), N = world.size();
  for (const std::string& text : all_layouts(N)) {
    Result<Mesh> made = Mesh::create(world, text);
    ASSERT_TRUE(made.ok()) << text << ": " << made.status().to_string();
    Mesh& mesh = made.value();
    const MeshLayout& layout = mesh.layout();
    EXPECT_EQ(layout.to_string(), text);
    // Mixed radix, last axis fastest.
    int rest = p;
    std::vector<int> coords(layout.axes.size());
    for (int i = static_cast<int>(layout.axes.size()) - 1; i >= 0; --i) {
      coords[i] = rest % layout.axes[i].degree;
      rest /= layout.axes[i].degree;
    }
    EXPECT_EQ(mesh.world_rank_at(coords), p) << text;
    for (size_t i = 0; i < layout.axes.size(); ++i) {
      const std::string& axis = layout.axes[i].name;
      const std::string what = fmt::format("{} axis {}", text, axis);
      Communicator& comm = mesh.comm(axis);
      EXPECT_EQ(mesh.coord(axis), coords[i]) << what;
      EXPECT_EQ(mesh.degree(axis), layout.axes[i].degree) << what;
      EXPECT_EQ(comm.name(), axis) << what;
      EXPECT_EQ(comm.size(), layout.axes[i].degree) << what;
      EXPECT_EQ(comm.rank(), coords[i]) << what;
      // Members: the ranks with this rank's other coordinates, ordered along the axis.
      std::vector<int> members;
      for (int c = 0; c < layout.axes[i].degree; ++c) {
        std::vector<int> at = coords;
        at[i] = c;
        members.push_back(mesh.world_rank_at(at));
      }
      EXPECT_EQ(comm.world_ranks(), members) << what;
      // Data moves among exactly those members: gather their world ranks through the axis.
      std::vector<int> gathered(comm.size(), -1);
      ScopedCommCounter counter({&comm, &world});
      ASSERT_TRUE(comm.all_gather(&p, gathered.data(), 1, DType::kI32).ok());
      EXPECT_EQ(gathered, members) << what;
      EXPECT_EQ(counter.delta(comm).op(CommOpKind::kAllGather).calls, 1u) << what;
      EXPECT_EQ(counter.delta(world).total().calls, 0u) << what << ": the world counted the axis' traffic";
    }
    for (const char* absent : {"dp", "tp", "sp", "tsp"}) {
      if (mesh.has_axis(absent)) continue;
      EXPECT_EQ(mesh.degree(absent), 1) << text;
      EXPECT_EQ(mesh.coord(absent), 0) << text;
    }
    EXPECT_EQ(mesh.communicators().size(), layout.axes.size());
  }
}

// A communicator that forwards every operation to the split it wraps (as the device
// communicators do) and counts what it forwarded.
class Forwarding final : public Communicator {
 public:
  Forwarding(Communicator& host, int* forwarded)
      : Communicator(host.rank(), host.size(), host.name(), host.world_ranks()), host_(host), forwarded_(forwarded) {}
  std::unique_ptr<Communicator> split(int color, int key, std::string name) override {
    return host_.split(color, key, std::move(name));
  }

 protected:
  Status supports(const CommOp&) const override { return Status::ok_status(); }
  Status run_validated(const CommOp& op) override {
    ++*forwarded_;
    return host_.run(op);
  }
  CommRequest start_validated(const CommOp& op) override {
    ++*forwarded_;
    return host_.start(op);
  }

 private:
  Communicator& host_;
  int* forwarded_;
};

TEST(Mesh, AnAxisFactoryWrapsEveryAxisAndTheWrapperCarriesItsTraffic) {
  Communicator& world = mpi().world();
  const int N = world.size();
  for (const std::string& layout : {fmt::format("tsp={}", N), fmt::format("dp=1,tp={},sp=1", N)}) {
    SCOPED_TRACE(layout);
    int made = 0, forwarded = 0;
    std::vector<std::string> wrapped;
    AxisCommFactory factory = [&](Communicator& host) -> std::unique_ptr<Communicator> {
      ++made;
      wrapped.push_back(host.name());
      return std::make_unique<Forwarding>(host, &forwarded);
    };
    {
      Result<Mesh> mesh = Mesh::create(world, layout, factory);
      ASSERT_TRUE(mesh.ok()) << mesh.status().to_string();
      const MeshLayout& l = mesh->layout();
      EXPECT_EQ(made, static_cast<int>(l.axes.size()));
      for (size_t i = 0; i < l.axes.size(); ++i) {
        EXPECT_EQ(wrapped[i], l.axes[i].name);
        Communicator& axis = mesh->comm(l.axes[i].name);
        EXPECT_NE(dynamic_cast<Forwarding*>(&axis), nullptr) << l.axes[i].name;
        EXPECT_EQ(axis.rank(), mesh->coord(l.axes[i].name));
      }
      // The largest axis sums every rank's value through the wrapper.
      const std::string big = l.axes.size() == 1 ? l.axes[0].name : "tp";
      int64_t v = world.rank() + 1, sum = 0;
      const int before = forwarded;
      ASSERT_TRUE(mesh->comm(big).all_reduce(&v, &sum, 1, DType::kI64, ReduceOp::kSum).ok());
      EXPECT_EQ(sum, int64_t{N} * (N + 1) / 2);
      EXPECT_EQ(forwarded, before + 1);
      EXPECT_EQ(mesh->comm(big).stats().total().calls, 1u);
      // Moved, the mesh keeps its wrappers and the splits they borrow (ASan checks the rest).
      Mesh moved = std::move(mesh).value();
      ASSERT_TRUE(moved.comm(big).all_reduce(&v, &sum, 1, DType::kI64, ReduceOp::kSum).ok());
      EXPECT_EQ(sum, int64_t{N} * (N + 1) / 2);
    }
  }
}

TEST(Mesh, ALayoutOfTheWrongSizeNamesBothNumbers) {
  Communicator& world = mpi().world();
  const int N = world.size();
  Result<Mesh> mesh = Mesh::create(world, fmt::format("tp=2,sp={}", N));
  ASSERT_FALSE(mesh.ok());
  EXPECT_EQ(mesh.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(mesh.status().message(), fmt::format("layout tp=2,sp={0} needs {1} ranks (tp 2 x sp {0}), but "
                                                 "communicator world has {0}", N, 2 * N));
  Result<Mesh> bad = Mesh::create(world, "tsp=0");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace foldpar::test

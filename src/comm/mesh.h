// Mesh: the parallel axes of a job and one communicator per axis, built from the world
// communicator and a layout string ("tsp=4", "tp=2,sp=2", "dp=2,tsp=2"). The Mesh owns its
// axis communicators and borrows the world communicator, which must outlive it. Nothing is
// global: whoever needs an axis gets the Mesh or the Communicator passed in. An optional
// AxisCommFactory wraps each axis's split of world (e.g. in a device communicator,
// comm/nccl/device_communicator.h), so the strategies above talk to GPUs without this layer
// knowing about them.
//
// Rank order: axes are listed outermost first and the last axis varies fastest. pp, when
// present, must be written first and dp first or right after pp (the outer axes). A rank's coordinates are the digits
// of its world rank in the mixed radix of the degrees: for "dp=2,tp=2,sp=2", world rank
// 6 = 1*4 + 1*2 + 0 is dp 1, tp 1, sp 0. The communicator of an axis holds the ranks that
// share every other coordinate, ranked by their coordinate on that axis, so
// mesh.comm("tp").rank() == mesh.coord("tp").
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "comm/communicator.h"
#include "core/status.h"

namespace foldpar {

struct MeshAxis {
  std::string name;  // one of pp, dp, tp, sp, tsp
  int degree = 1;    // >= 1
};

struct MeshLayout {
  std::vector<MeshAxis> axes;  // outermost first

  // Parses "name=degree[,name=degree...]"; spaces around names, degrees and commas are
  // ignored. Errors name the offending text: unknown or repeated axis, degree not a positive
  // integer, dp not first, empty layout, stray commas.
  static Result<MeshLayout> parse(std::string_view text);
  int num_ranks() const;  // the product of the degrees
  std::string to_string() const;  // "dp=2,tsp=2"
};

// Makes the communicator an axis uses out of that axis's split of world (`host`), e.g. a
// device communicator over the MPI one. Collective over `host`; the result may borrow `host`,
// which the Mesh keeps alive until after the result is destroyed. Same name and ranks as
// `host`.
using AxisCommFactory = std::function<std::unique_ptr<Communicator>(Communicator& host)>;

class Mesh {
 public:
  // Collective over `world`: every rank passes the same layout. Fails with invalid_argument
  // when the layout does not parse or its product is not world.size(), e.g.
  // "layout tp=2,sp=2 needs 4 ranks (tp 2 x sp 2), but communicator world has 3".
  // With `axis_comm`, every axis communicator is axis_comm(split of world), made in layout
  // order on every rank; without, the splits themselves.
  static Result<Mesh> create(Communicator& world, std::string_view layout, const AxisCommFactory& axis_comm = {});
  static Result<Mesh> create(Communicator& world, const MeshLayout& layout, const AxisCommFactory& axis_comm = {});

  // A mesh over communicators made already, one per axis in layout order (a dry run's
  // counting communicators: comm/counting_communicator.h). Not collective. Each must have
  // the rank, size and world ranks that Mesh's rank order gives world.rank() on its axis;
  // invalid_argument naming the axis otherwise, or when the layout does not fit world.
  static Result<Mesh> from_communicators(Communicator& world, const MeshLayout& layout,
                                         std::vector<std::unique_ptr<Communicator>> comms);
  // The world ranks of the axis-`axis` group of the rank at `coords` (its communicator's
  // world_ranks()), by the rank order above.
  static std::vector<int> axis_world_ranks(const MeshLayout& layout, const std::vector<int>& coords, int axis);
  // The coordinates of `world_rank` in `layout`, one per axis.
  static std::vector<int> coords_of(const MeshLayout& layout, int world_rank);

  Mesh(Mesh&&) noexcept = default;
  Mesh& operator=(Mesh&& other) noexcept;
  ~Mesh() = default;  // comms_ before host_comms_ (declaration order), which they may borrow

  const MeshLayout& layout() const { return layout_; }
  Communicator& world() { return *world_; }
  bool has_axis(std::string_view axis) const;
  // Degree and this rank's coordinate on an axis; an axis not in the layout has degree 1
  // and coordinate 0.
  int degree(std::string_view axis) const;
  int coord(std::string_view axis) const;
  // The communicator of an axis in the layout (FP_CHECK otherwise).
  Communicator& comm(std::string_view axis);
  const Communicator& comm(std::string_view axis) const;
  // Every axis communicator, outermost first: what a ScopedCommCounter of the whole mesh
  // watches.
  std::vector<const Communicator*> communicators() const;
  // The world rank at the given coordinates, one per axis in layout order.
  int world_rank_at(const std::vector<int>& coords) const;
  // A communicator split off world by (color, key) and made through the AxisCommFactory
  // given to create, when there was one (a device or guarded communicator): how each axis is
  // made, and how groups beyond the axes are (an expert group that spans dp replicas).
  // Collective over world. The result may borrow its split, which the mesh keeps: destroy
  // the result before the mesh.
  std::unique_ptr<Communicator> split_group(int color, int key, const std::string& name);

 private:
  Mesh(Communicator& world, MeshLayout layout, const AxisCommFactory& axis_comm);
  Mesh(Communicator& world, MeshLayout layout, std::vector<std::unique_ptr<Communicator>> comms);
  int axis_index(std::string_view axis) const;  // -1 when absent

  Communicator* world_;
  MeshLayout layout_;
  std::vector<int> coords_;
  AxisCommFactory axis_comm_;                              // create's, for split_group
  std::vector<std::unique_ptr<Communicator>> host_comms_;  // with an AxisCommFactory: the splits comms_ and
                                                           // split_group's results wrap
  std::vector<std::unique_ptr<Communicator>> comms_;       // one per axis, layout order
};

}  // namespace foldpar

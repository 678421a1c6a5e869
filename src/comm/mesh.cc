// Layout parsing and the per-axis communicators of a Mesh.
#include "comm/mesh.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <utility>

#include "core/check.h"

namespace foldpar {

namespace {

constexpr std::array<std::string_view, 5> kAxisNames = {"pp", "dp", "tp", "sp", "tsp"};

std::string_view trim(std::string_view s) {
  const auto first = s.find_first_not_of(" \t");
  if (first == std::string_view::npos) return {};
  const auto last = s.find_last_not_of(" \t");
  return s.substr(first, last - first + 1);
}

Result<MeshAxis> parse_axis(std::string_view item, std::string_view layout) {
  const auto eq = item.find('=');
  if (eq == std::string_view::npos) {
    return invalid_argument("layout '{}': '{}' is not name=degree", layout, trim(item));
  }
  const std::string_view name = trim(item.substr(0, eq));
  const std::string_view degree_text = trim(item.substr(eq + 1));
  if (std::find(kAxisNames.begin(), kAxisNames.end(), name) == kAxisNames.end()) {
    return invalid_argument("layout '{}': unknown axis '{}' (known axes: pp, dp, tp, sp, tsp)", layout, name);
  }
  int degree = 0;
  const auto [end, ec] = std::from_chars(degree_text.data(), degree_text.data() + degree_text.size(), degree);
  if (degree_text.empty() || ec != std::errc() || end != degree_text.data() + degree_text.size() || degree < 1) {
    return invalid_argument("layout '{}': the degree of axis {} must be a positive integer, got '{}'", layout, name,
                            degree_text);
  }
  return MeshAxis{std::string(name), degree};
}

}  // namespace

Result<MeshLayout> MeshLayout::parse(std::string_view text) {
  MeshLayout layout;
  if (trim(text).empty()) return invalid_argument("layout is empty; expected e.g. tsp=4 or dp=2,tp=2,sp=2");
  size_t begin = 0;
  while (true) {
    const size_t comma = text.find(',', begin);
    const std::string_view item = text.substr(begin, comma == std::string_view::npos ? text.npos : comma - begin);
    if (trim(item).empty()) return invalid_argument("layout '{}': empty axis between commas", text);
    FP_ASSIGN_OR_RETURN(MeshAxis axis, parse_axis(item, text));
    for (const MeshAxis& seen : layout.axes) {
      if (seen.name == axis.name) return invalid_argument("layout '{}': axis {} appears twice", text, axis.name);
    }
    // pp outermost, then dp (docs/composition.md section 1: rank = (s*R + d)*D + r).
    if (axis.name == "pp" && !layout.axes.empty()) {
      return invalid_argument("layout '{}': pp must be the first (outermost) axis", text);
    }
    if (axis.name == "dp" && !layout.axes.empty() && !(layout.axes.size() == 1 && layout.axes[0].name == "pp")) {
      return invalid_argument("layout '{}': dp must be the first (outermost) axis, or follow pp", text);
    }
    layout.axes.push_back(std::move(axis));
    if (comma == std::string_view::npos) break;
    begin = comma + 1;
  }
  return layout;
}

int MeshLayout::num_ranks() const {
  int product = 1;
  for (const MeshAxis& a : axes) product *= a.degree;
  return product;
}

std::string MeshLayout::to_string() const {
  std::string out;
  for (const MeshAxis& a : axes) out += fmt::format("{}{}={}", out.empty() ? "" : ",", a.name, a.degree);
  return out;
}

Result<Mesh> Mesh::create(Communicator& world, std::string_view layout, const AxisCommFactory& axis_comm) {
  FP_ASSIGN_OR_RETURN(MeshLayout parsed, MeshLayout::parse(layout));
  return create(world, parsed, axis_comm);
}

Result<Mesh> Mesh::create(Communicator& world, const MeshLayout& layout, const AxisCommFactory& axis_comm) {
  // A layout built by hand obeys the same rules as a parsed one.
  FP_RETURN_IF_ERROR(MeshLayout::parse(layout.to_string()).status());
  if (layout.num_ranks() != world.size()) {
    std::string factors;
    for (const MeshAxis& a : layout.axes) factors += fmt::format("{}{} {}", factors.empty() ? "" : " x ", a.name, a.degree);
    return invalid_argument("layout {} needs {} ranks ({}), but communicator {} has {}", layout.to_string(),
                            layout.num_ranks(), factors, world.name(), world.size());
  }
  return Mesh(world, layout, axis_comm);
}

Mesh::Mesh(Communicator& world, MeshLayout layout, const AxisCommFactory& axis_comm)
    : world_(&world), layout_(std::move(layout)), axis_comm_(axis_comm) {
  const int n_axes = static_cast<int>(layout_.axes.size());
  coords_.resize(n_axes);
  int rest = world.rank();
  for (int i = n_axes - 1; i >= 0; --i) {
    coords_[i] = rest % layout_.axes[i].degree;
    rest /= layout_.axes[i].degree;
  }
  // Axis i: color = the rank with coordinate i zeroed (same for every rank of the group),
  // key = the coordinate on axis i. Every rank splits for every axis in the same order.
  for (int i = 0; i < n_axes; ++i) {
    std::vector<int> others = coords_;
    others[i] = 0;
    comms_.push_back(split_group(world_rank_at(others), coords_[i], layout_.axes[i].name));
    FP_CHECK(comms_.back()->rank() == coords_[i] && comms_.back()->size() == layout_.axes[i].degree,
             "axis {}: rank {} of {}, expected {} of {}", layout_.axes[i].name, comms_.back()->rank(),
             comms_.back()->size(), coords_[i], layout_.axes[i].degree);
  }
}

std::vector<int> Mesh::coords_of(const MeshLayout& layout, int world_rank) {
  std::vector<int> coords(layout.axes.size());
  for (int i = static_cast<int>(layout.axes.size()) - 1; i >= 0; --i) {
    coords[i] = world_rank % layout.axes[i].degree;
    world_rank /= layout.axes[i].degree;
  }
  return coords;
}

std::vector<int> Mesh::axis_world_ranks(const MeshLayout& layout, const std::vector<int>& coords, int axis) {
  std::vector<int> ranks;
  std::vector<int> at = coords;
  for (int c = 0; c < layout.axes[axis].degree; ++c) {
    at[axis] = c;
    int rank = 0;
    for (size_t i = 0; i < at.size(); ++i) rank = rank * layout.axes[i].degree + at[i];
    ranks.push_back(rank);
  }
  return ranks;
}

Result<Mesh> Mesh::from_communicators(Communicator& world, const MeshLayout& layout,
                                      std::vector<std::unique_ptr<Communicator>> comms) {
  FP_RETURN_IF_ERROR(MeshLayout::parse(layout.to_string()).status());
  if (layout.num_ranks() != world.size()) {
    return invalid_argument("layout {} needs {} ranks, but communicator {} has {}", layout.to_string(),
                            layout.num_ranks(), world.name(), world.size());
  }
  if (comms.size() != layout.axes.size()) {
    return invalid_argument("layout {} has {} axes, but {} communicators were given", layout.to_string(),
                            layout.axes.size(), comms.size());
  }
  const std::vector<int> coords = coords_of(layout, world.rank());
  for (size_t i = 0; i < comms.size(); ++i) {
    const MeshAxis& a = layout.axes[i];
    const std::vector<int> expected = axis_world_ranks(layout, coords, static_cast<int>(i));
    if (comms[i] == nullptr || comms[i]->rank() != coords[i] || comms[i]->size() != a.degree ||
        comms[i]->world_ranks() != expected) {
      return invalid_argument("axis {} of layout {} at world rank {}: the communicator given is {}, expected rank {} "
                              "of {} over world ranks {}",
                              a.name, layout.to_string(), world.rank(),
                              comms[i] ? comms[i]->describe() : std::string("null"), coords[i], a.degree,
                              fmt::join(expected, ","));
    }
  }
  return Mesh(world, layout, std::move(comms));
}

Mesh::Mesh(Communicator& world, MeshLayout layout, std::vector<std::unique_ptr<Communicator>> comms)
    : world_(&world), layout_(std::move(layout)), comms_(std::move(comms)) {
  coords_ = coords_of(layout_, world.rank());
}

std::unique_ptr<Communicator> Mesh::split_group(int color, int key, const std::string& name) {
  std::unique_ptr<Communicator> split = world_->split(color, key, name);
  if (!axis_comm_) return split;
  host_comms_.push_back(std::move(split));
  std::unique_ptr<Communicator> made = axis_comm_(*host_comms_.back());
  FP_CHECK(made != nullptr, "{}: the AxisCommFactory returned no communicator", name);
  return made;
}

// Not member by member in declaration order: assigning host_comms_ first would destroy the
// communicators that the old comms_ still borrow.
Mesh& Mesh::operator=(Mesh&& other) noexcept {
  if (this == &other) return *this;
  comms_.clear();
  host_comms_.clear();
  world_ = other.world_;
  axis_comm_ = std::move(other.axis_comm_);
  layout_ = std::move(other.layout_);
  coords_ = std::move(other.coords_);
  host_comms_ = std::move(other.host_comms_);
  comms_ = std::move(other.comms_);
  return *this;
}

int Mesh::axis_index(std::string_view axis) const {
  for (size_t i = 0; i < layout_.axes.size(); ++i) {
    if (layout_.axes[i].name == axis) return static_cast<int>(i);
  }
  return -1;
}

bool Mesh::has_axis(std::string_view axis) const { return axis_index(axis) >= 0; }

int Mesh::degree(std::string_view axis) const {
  const int i = axis_index(axis);
  return i < 0 ? 1 : layout_.axes[i].degree;
}

int Mesh::coord(std::string_view axis) const {
  const int i = axis_index(axis);
  return i < 0 ? 0 : coords_[i];
}

Communicator& Mesh::comm(std::string_view axis) {
  const int i = axis_index(axis);
  FP_CHECK(i >= 0, "axis {} is not in layout {}", axis, layout_.to_string());
  return *comms_[i];
}

const Communicator& Mesh::comm(std::string_view axis) const { return const_cast<Mesh*>(this)->comm(axis); }

std::vector<const Communicator*> Mesh::communicators() const {
  std::vector<const Communicator*> out;
  for (const auto& c : comms_) out.push_back(c.get());
  return out;
}

int Mesh::world_rank_at(const std::vector<int>& coords) const {
  FP_CHECK(coords.size() == layout_.axes.size(), "{} coordinates for {} axes", coords.size(), layout_.axes.size());
  int rank = 0;
  for (size_t i = 0; i < coords.size(); ++i) {
    FP_CHECK(coords[i] >= 0 && coords[i] < layout_.axes[i].degree, "coordinate {} on axis {} of degree {}",
             coords[i], layout_.axes[i].name, layout_.axes[i].degree);
    rank = rank * layout_.axes[i].degree + coords[i];
  }
  return rank;
}

}  // namespace foldpar

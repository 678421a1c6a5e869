// Safetensors header validation, pure (bytes in, SafetensorsHeader or Status out).
// Order: the length prefix against the cap and the file size; the first byte; then a
// streaming parse that validates each member (entry or "__metadata__") as it closes and
// stops at the first problem; then the tiling of the data section. nlohmann exceptions are
// caught here and never leave the io layer. File access lives in safetensors.cc.
#include "io/safetensors.h"

#include <algorithm>
#include <array>
#include <limits>
#include <nlohmann/json.hpp>
#include <tuple>

namespace foldpar {
namespace {

using json = nlohmann::json;

// A valid header nests 3 deep (header, entry, shape) and an entry holds at most 12 values
// (itself, 3 fields, 6 extents, 2 offsets); the caps leave room and bound the memory a
// hostile header can claim.
constexpr int kMaxJsonDepth = 8;
constexpr int kMaxEntryJsonValues = 64;
// Quoted into error messages; a parse error can quote a whole (huge) string token.
constexpr size_t kMaxQuotedChars = 200;

// Valid safetensors dtypes that foldpar cannot hold (kUnimplemented rather than kCorrupt).
constexpr std::array<std::string_view, 15> kUnsupportedDtypes = {
    "BOOL", "U8", "I8", "I16", "U16", "F16", "U32", "U64", "C64",
    "F8_E5M2", "F8_E4M3", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2"};

// A name or value from the file, quoted into a message: at most kMaxQuotedChars bytes, and
// control characters escaped, so a hostile name (holding a newline or a terminal escape
// sequence) can neither forge lines of output nor drive the terminal.
std::string clip(std::string_view s) {
  std::string out;
  for (unsigned char c : s.substr(0, kMaxQuotedChars)) {
    if (c < 0x20 || c == 0x7f) {
      out += fmt::format("\\x{:02x}", c);
    } else {
      out += static_cast<char>(c);
    }
  }
  if (s.size() > kMaxQuotedChars) out += fmt::format("... ({} bytes)", s.size());
  return out;
}

// nlohmann quotes the offending bytes raw; escape what a terminal would garble.
std::string printable(std::string_view s) {
  std::string out;
  for (unsigned char c : s) {
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      out += fmt::format("\\x{:02x}", c);
    }
  }
  return out;
}

uint64_t load_le_u64(std::string_view bytes) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(bytes[i]);
  return v;
}

}  // namespace

Result<uint64_t> parse_safetensors_header_length(std::string_view first_bytes, uint64_t file_size) {
  if (file_size < kSafetensorsLengthBytes) {
    return corrupt("file is {} bytes, shorter than the 8-byte header length prefix", file_size);
  }
  if (first_bytes.size() < kSafetensorsLengthBytes) {
    return invalid_argument("{} first bytes given for a file of {} bytes; need at least 8", first_bytes.size(),
                            file_size);
  }
  const uint64_t n = load_le_u64(first_bytes);
  if (n > kSafetensorsMaxHeaderBytes) {
    return corrupt("header length {} exceeds the limit of {} bytes", n, kSafetensorsMaxHeaderBytes);
  }
  if (n > file_size - kSafetensorsLengthBytes) {
    return corrupt("header length {} runs past the end of the file ({} bytes, so at most {} header bytes)", n,
                   file_size, file_size - kSafetensorsLengthBytes);
  }
  return n;
}

namespace {

// A JSON integer >= 0 that fits in `max`.
bool get_count(const json& v, uint64_t max, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
  } else if (v.is_number_integer() && v.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(v.get<int64_t>());
  } else {
    return false;
  }
  return *out <= max;
}

Status parse_dtype(const json& v, DType* out) {
  if (!v.is_string()) return corrupt("\"dtype\" must be a string, not {}", v.type_name());
  const std::string& name = v.get_ref<const std::string&>();
  if (dtype_from_name(name, out)) return Status::ok_status();
  if (std::find(kUnsupportedDtypes.begin(), kUnsupportedDtypes.end(), name) != kUnsupportedDtypes.end()) {
    return unimplemented("unsupported dtype '{}' (foldpar reads F32, F64, BF16, I32, I64)", name);
  }
  return corrupt("unknown dtype '{}'", clip(name));
}

// The shape and its byte size in `dtype`, with every overflow checked.
Status parse_shape(const json& v, DType dtype, Shape* shape, uint64_t* bytes) {
  if (!v.is_array()) return corrupt("\"shape\" must be an array, not {}", v.type_name());
  if (v.size() > static_cast<size_t>(Shape::kMaxRank)) {
    return unimplemented("rank {} is above the {} foldpar supports (shape {})", v.size(), Shape::kMaxRank,
                         clip(v.dump()));
  }
  uint64_t numel = 1;
  for (size_t i = 0; i < v.size(); ++i) {
    uint64_t extent = 0;
    if (!get_count(v[i], static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), &extent)) {
      return corrupt("shape {} extent {} is {}, not an integer in [0, 2^63)", clip(v.dump()), i,
                     clip(v[i].dump()));
    }
    if (__builtin_mul_overflow(numel, extent, &numel) || numel > uint64_t{std::numeric_limits<int64_t>::max()}) {
      return corrupt("shape {} has more than 2^63 elements", clip(v.dump()));
    }
    shape->push_back(static_cast<int64_t>(extent));
  }
  if (__builtin_mul_overflow(numel, uint64_t{dtype_size(dtype)}, bytes)) {
    return corrupt("shape {} of {} needs more than 2^64 bytes", clip(v.dump()), dtype_name(dtype));
  }
  return Status::ok_status();
}

Status parse_offsets(const json& v, SafetensorsEntry* e) {
  if (!v.is_array() || v.size() != 2 || !get_count(v[0], UINT64_MAX, &e->data_begin) ||
      !get_count(v[1], UINT64_MAX, &e->data_end)) {
    return corrupt("\"data_offsets\" must be two non-negative integers, not {}", clip(v.dump()));
  }
  if (e->data_begin > e->data_end) {
    return corrupt("data_offsets [{}, {}] begin after they end", e->data_begin, e->data_end);
  }
  return Status::ok_status();
}

Status parse_entry_fields(const json& v, uint64_t data_bytes, SafetensorsEntry* e) {
  if (!v.is_object()) return corrupt("entry must be an object, not {}", v.type_name());
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!v.contains(key)) return corrupt("entry lacks \"{}\"", key);
  }
  for (const auto& [key, unused] : v.items()) {
    // An unknown key (strides? byte order?) could change what the bytes mean.
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      return corrupt("entry has the unknown key '{}'", clip(key));
    }
  }
  FP_RETURN_IF_ERROR(parse_dtype(v["dtype"], &e->dtype));
  uint64_t bytes = 0;
  FP_RETURN_IF_ERROR(parse_shape(v["shape"], e->dtype, &e->shape, &bytes));
  FP_RETURN_IF_ERROR(parse_offsets(v["data_offsets"], e));
  if (bytes != e->nbytes()) {
    return corrupt("shape {} of {} needs {} bytes but data_offsets [{}, {}] hold {}", e->shape.to_string(),
                   dtype_name(e->dtype), bytes, e->data_begin, e->data_end, e->nbytes());
  }
  if (e->data_end > data_bytes) {
    return corrupt("data_offsets [{}, {}] run past the end of the data section ({} bytes)", e->data_begin,
                   e->data_end, data_bytes);
  }
  return Status::ok_status();
}

Status parse_metadata(const json& v, std::map<std::string, std::string>* out) {
  if (!v.is_object()) return corrupt("\"__metadata__\" must be an object of strings, not {}", v.type_name());
  for (const auto& [key, value] : v.items()) {
    if (!value.is_string()) {
      return corrupt("\"__metadata__\" value of '{}' must be a string, not {}", clip(key), value.type_name());
    }
    (*out)[key] = value.get<std::string>();
  }
  return Status::ok_status();
}

// The entries sorted by offset must cover [0, data_bytes) exactly once, as in the reference
// implementation: a gap hides bytes nobody accounts for; an overlap aliases two tensors.
Status check_tiling(const std::vector<SafetensorsEntry>& entries, uint64_t data_bytes) {
  std::vector<const SafetensorsEntry*> by_offset;
  for (const SafetensorsEntry& e : entries) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](const SafetensorsEntry* a, const SafetensorsEntry* b) {
    return std::tie(a->data_begin, a->data_end) < std::tie(b->data_begin, b->data_end);
  });
  uint64_t covered = 0;
  const SafetensorsEntry* prev = nullptr;
  for (const SafetensorsEntry* e : by_offset) {
    if (e->data_begin < covered) {
      return corrupt("tensor '{}' data_offsets [{}, {}] overlap tensor '{}' [{}, {}]", clip(e->name),
                     e->data_begin, e->data_end, clip(prev->name), prev->data_begin, prev->data_end);
    }
    if (e->data_begin > covered) {
      return corrupt("gap of {} bytes in the data section: bytes [{}, {}) before tensor '{}' belong to no tensor",
                     e->data_begin - covered, covered, e->data_begin, clip(e->name));
    }
    covered = e->data_end;
    prev = e;
  }
  if (covered != data_bytes) {
    return corrupt("data section holds {} bytes but the tensors cover only the first {} ({} trailing bytes)",
                   data_bytes, covered, data_bytes - covered);
  }
  return Status::ok_status();
}

// Streams the header JSON, building a small DOM for one top-level member at a time and
// validating it as soon as it closes, so a hostile header costs memory in proportion to its
// valid entries, never to its garbage: the parse stops at the first bad member, each entry
// may hold at most kMaxEntryJsonValues values, and metadata values must be strings.
class HeaderSax final : public json::json_sax_t {
 public:
  explicit HeaderSax(uint64_t data_bytes) : data_bytes_(data_bytes) {}

  // After a failed parse: why. After a successful one: ok, and entries()/metadata() hold it.
  const Status& status() const { return status_; }
  std::map<std::string, SafetensorsEntry>& entries() { return entries_; }
  std::map<std::string, std::string>& metadata() { return metadata_; }

  bool null() override { return add_scalar(json(nullptr)); }
  bool boolean(bool v) override { return add_scalar(json(v)); }
  bool number_integer(number_integer_t v) override { return add_scalar(json(v)); }
  bool number_unsigned(number_unsigned_t v) override { return add_scalar(json(v)); }
  bool number_float(number_float_t v, const string_t&) override { return add_scalar(json(v)); }
  bool string(string_t& v) override { return add_scalar(json(std::move(v))); }
  bool binary(binary_t&) override { return fail(corrupt("header JSON holds a binary value")); }
  bool start_object(std::size_t) override;
  bool key(string_t& k) override;
  bool end_object() override { return close_container(); }
  bool start_array(std::size_t) override { return open_container(json::array()); }
  bool end_array() override { return close_container(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::json::exception& e) override {
    return fail(corrupt("header is not valid JSON: {}", printable(clip(e.what()))));
  }

 private:
  bool fail(Status s) {
    if (status_.ok()) status_ = std::move(s);
    return false;
  }
  bool in_metadata() const { return member_name_ == "__metadata__"; }
  json* place(json&& v);
  bool add_scalar(json&& v);
  bool open_container(json&& c);
  bool close_container();
  bool finish_member();

  const uint64_t data_bytes_;
  Status status_;
  std::map<std::string, SafetensorsEntry> entries_;  // sorted by name, as the header promises
  std::map<std::string, std::string> metadata_;
  bool seen_metadata_ = false;
  bool in_top_object_ = false;
  std::string member_name_;     // the top-level key being parsed
  json member_;                 // its value, while it is being built
  int member_values_ = 0;       // JSON values in member_ so far
  std::vector<json*> open_;     // containers open inside member_, innermost last
  std::string last_key_;        // the last key inside member_
  json* object_slot_ = nullptr;  // where the value of last_key_ goes
};

bool HeaderSax::start_object(std::size_t) {
  if (!in_top_object_) {
    in_top_object_ = true;  // the header itself; its members are validated one at a time
    return true;
  }
  return open_container(json::object());
}

bool HeaderSax::key(string_t& k) {
  if (open_.empty()) {  // a tensor name, or "__metadata__"
    if (entries_.count(k) != 0 || (k == "__metadata__" && seen_metadata_)) {
      return fail(corrupt("the name '{}' appears twice in the header", clip(k)));
    }
    member_name_ = std::move(k);
    return true;
  }
  json& object = *open_.back();
  if (object.contains(k)) {
    return fail(corrupt("the key '{}' appears twice in one object of the header (in '{}')", clip(k),
                        clip(member_name_)));
  }
  last_key_ = k;
  object_slot_ = &object[k];
  return true;
}

json* HeaderSax::place(json&& v) {
  if (in_metadata() && open_.empty() && !v.is_object()) {
    fail(corrupt("\"__metadata__\" must be an object of strings, not {}", v.type_name()));
    return nullptr;
  }
  if (in_metadata() && !open_.empty() && !v.is_string()) {
    fail(corrupt("\"__metadata__\" value of '{}' must be a string, not {}", clip(last_key_), v.type_name()));
    return nullptr;
  }
  if (!in_metadata() && ++member_values_ > kMaxEntryJsonValues) {
    fail(corrupt("tensor '{}': entry holds more than {} JSON values", clip(member_name_), kMaxEntryJsonValues));
    return nullptr;
  }
  if (open_.empty()) {
    member_ = std::move(v);
    return &member_;
  }
  json& parent = *open_.back();
  if (parent.is_array()) {
    parent.push_back(std::move(v));
    return &parent.back();  // stable: the array grows only after this value closes
  }
  *object_slot_ = std::move(v);
  return object_slot_;
}

bool HeaderSax::add_scalar(json&& v) {
  if (!in_top_object_) return fail(corrupt("header must be a JSON object, not {}", v.type_name()));
  if (place(std::move(v)) == nullptr) return false;
  return open_.empty() ? finish_member() : true;
}

bool HeaderSax::open_container(json&& c) {
  if (!in_top_object_) return fail(corrupt("header must be a JSON object, not {}", c.type_name()));
  if (open_.size() + 2 > static_cast<size_t>(kMaxJsonDepth)) {  // +1 the header, +1 this one
    return fail(corrupt("header JSON nests deeper than {} levels (in '{}')", kMaxJsonDepth, clip(member_name_)));
  }
  json* p = place(std::move(c));
  if (p == nullptr) return false;
  open_.push_back(p);
  return true;
}

bool HeaderSax::close_container() {
  if (open_.empty()) {  // the end of the header object
    in_top_object_ = false;
    return true;
  }
  open_.pop_back();
  return open_.empty() ? finish_member() : true;
}

bool HeaderSax::finish_member() {
  Status s;
  if (in_metadata()) {
    seen_metadata_ = true;
    s = parse_metadata(member_, &metadata_);
  } else {
    SafetensorsEntry e;
    e.name = member_name_;
    s = parse_entry_fields(member_, data_bytes_, &e);
    if (s.ok()) {
      entries_.emplace(member_name_, std::move(e));
    } else {
      s = s.with_context(fmt::format("tensor '{}'", clip(member_name_)));
    }
  }
  member_ = json();
  member_values_ = 0;
  return s.ok() ? true : fail(std::move(s));
}

}  // namespace

const SafetensorsEntry* SafetensorsHeader::find(std::string_view name) const {
  auto it = std::lower_bound(entries.begin(), entries.end(), name,
                             [](const SafetensorsEntry& e, std::string_view n) { return e.name < n; });
  return it != entries.end() && it->name == name ? &*it : nullptr;
}

Result<SafetensorsHeader> parse_safetensors_header(std::string_view file_prefix, uint64_t file_size) {
  FP_ASSIGN_OR_RETURN(const uint64_t n, parse_safetensors_header_length(file_prefix, file_size));
  if (file_prefix.size() - kSafetensorsLengthBytes < n) {
    return invalid_argument("prefix of {} bytes given, but the header ends at byte {}", file_prefix.size(),
                            kSafetensorsLengthBytes + n);
  }
  SafetensorsHeader header;
  header.header_bytes = n;
  header.data_start = kSafetensorsLengthBytes + n;
  header.data_bytes = file_size - header.data_start;
  const std::string_view text = file_prefix.substr(kSafetensorsLengthBytes, n);
  if (text.empty()) return corrupt("the header is empty (header length 0)");
  if (text.front() != '{') {
    return corrupt("header must be a JSON object beginning with '{{' (first byte is 0x{:02x})",
                   static_cast<unsigned char>(text.front()));
  }
  HeaderSax sax(header.data_bytes);
  bool parsed = false;
  try {
    parsed = json::sax_parse(text.begin(), text.end(), &sax, json::input_format_t::json, /*strict=*/true);
  } catch (const json::exception& e) {
    return corrupt("header is not valid JSON: {}", printable(clip(e.what())));
  }
  if (!parsed) return sax.status().ok() ? corrupt("header is not valid JSON") : sax.status();
  for (auto& [name, entry] : sax.entries()) header.entries.push_back(std::move(entry));
  header.metadata = std::move(sax.metadata());
  FP_RETURN_IF_ERROR(check_tiling(header.entries, header.data_bytes));
  return header;
}

}  // namespace foldpar

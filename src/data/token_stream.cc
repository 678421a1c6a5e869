// Raw and NumPy token arrays.
#include "data/token_stream.h"

#include <fstream>
#include <sstream>

namespace foldpar {
namespace {

uint64_t load_le(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

// A header value quoted into a message: printable ASCII, at most 40 bytes (the header is
// untrusted; an error stays one short line).
std::string quoted(std::string_view v) {
  std::string out;
  for (char c : v.substr(0, 40)) out += (c >= 0x20 && c < 0x7f) ? c : '?';
  return v.size() > 40 ? out + "..." : out;
}

// The value of `key` in a Python dict literal as NumPy writes it: "'key': value" up to the
// next top-level ',' or '}' (a shape tuple keeps its commas). Empty when absent.
std::string dict_value(std::string_view dict, std::string_view key) {
  const std::string quoted = "'" + std::string(key) + "'";
  const size_t k = dict.find(quoted);
  if (k == std::string_view::npos) return "";
  size_t p = dict.find(':', k + quoted.size());
  if (p == std::string_view::npos) return "";
  ++p;
  while (p < dict.size() && dict[p] == ' ') ++p;
  size_t end = p;
  int depth = 0;
  for (; end < dict.size(); ++end) {
    const char c = dict[end];
    if (c == '(') ++depth;
    if (c == ')') --depth;
    if (depth == 0 && (c == ',' || c == '}')) break;
  }
  std::string v(dict.substr(p, end - p));
  while (!v.empty() && v.back() == ' ') v.pop_back();
  return v;
}

// "(3, 4)", "(5,)" or "()" -> the product of the dimensions.
Result<uint64_t> shape_count(const std::string& shape, const std::string& name) {
  if (shape.size() < 2 || shape.front() != '(' || shape.back() != ')')
    return corrupt("{}: the .npy shape '{}' is not a tuple", name, quoted(shape));
  uint64_t count = 1;
  std::istringstream in(shape.substr(1, shape.size() - 2));
  for (std::string dim; std::getline(in, dim, ',');) {
    const size_t a = dim.find_first_not_of(' '), b = dim.find_last_not_of(' ');
    if (a == std::string::npos) continue;  // the empty part after "(5,"
    dim = dim.substr(a, b - a + 1);
    if (dim.find_first_not_of("0123456789") != std::string::npos || dim.size() > 18)
      return corrupt("{}: the .npy shape '{}' has a dimension '{}' that is not a count", name, quoted(shape),
                     quoted(dim));
    if (__builtin_mul_overflow(count, std::stoull(dim), &count))
      return corrupt("{}: the .npy shape '{}' has more elements than 2^64", name, quoted(shape));
  }
  return count;
}

Status check_descr(const std::string& descr, const std::string& name, NpyHeader& h) {
  if (descr.size() == 5 && descr.front() == '\'' && descr.back() == '\'') {
    const std::string d = descr.substr(1, 3);
    if (d == "<u2" || d == "<u4" || d == "<u8" || d == "<i4" || d == "<i8") {
      h.width = d[2] - '0';
      h.is_signed = d[1] == 'i';
      return Status::ok_status();
    }
    if (d[0] == '>')
      return invalid_argument("{}: the .npy array is big-endian (descr {}); save it little-endian (astype('<{}'))", name,
                              quoted(descr), quoted(d.substr(1)));
  }
  return invalid_argument("{}: .npy descr {} is not a token type ('<u2', '<u4', '<i4', '<i8' or '<u8')", name,
                          quoted(descr));
}

template <typename Emit>
Status decode_elements(std::string_view b, uint64_t offset, uint64_t count, int width, bool is_signed,
                       uint32_t vocab_size, const std::string& name, Emit emit) {
  for (uint64_t i = 0; i < count; ++i) {
    const uint64_t at = offset + i * width;
    const uint64_t raw = load_le(b.data() + at, width);
    int64_t v = static_cast<int64_t>(raw);
    if (is_signed && width == 4) v = static_cast<int32_t>(static_cast<uint32_t>(raw));
    if ((is_signed && v < 0) || (!is_signed && raw >= vocab_size) || (is_signed && v >= static_cast<int64_t>(vocab_size))) {
      if (is_signed && v < 0) return invalid_argument("{}: token {} at byte offset {} is negative", name, v, at);
      return invalid_argument("{}: token {} at byte offset {} is not below the vocabulary size {}", name, raw, at,
                              vocab_size);
    }
    emit(static_cast<int32_t>(v));
  }
  return Status::ok_status();
}

}  // namespace

Result<TokenInputFormat> token_input_format_from_name(const std::string& name) {
  if (name == "text") return TokenInputFormat::kText;
  if (name == "bin-u16") return TokenInputFormat::kBinU16;
  if (name == "bin-u32") return TokenInputFormat::kBinU32;
  if (name == "npy") return TokenInputFormat::kNpy;
  return invalid_argument("unknown --input-format '{}' (text, bin-u16, bin-u32 or npy)", name);
}

std::string token_input_format_name(TokenInputFormat f) {
  switch (f) {
    case TokenInputFormat::kText: return "text";
    case TokenInputFormat::kBinU16: return "bin-u16";
    case TokenInputFormat::kBinU32: return "bin-u32";
    case TokenInputFormat::kNpy: return "npy";
  }
  return "?";
}

Result<NpyHeader> parse_npy_header(std::string_view b, const std::string& name) {
  if (b.size() < 10 || b.substr(0, 6) != std::string_view("\x93NUMPY", 6))
    return corrupt("{}: not a .npy file (bad magic)", name);
  const int major = static_cast<unsigned char>(b[6]);
  if (major < 1 || major > 3) return corrupt("{}: .npy format version {} (this build reads 1 to 3)", name, major);
  const int len_bytes = major == 1 ? 2 : 4;
  if (b.size() < 8u + len_bytes) return corrupt("{}: the .npy header is truncated", name);
  const uint64_t header_len = load_le(b.data() + 8, len_bytes);
  NpyHeader h;
  h.data_offset = 8 + len_bytes + header_len;
  if (h.data_offset > b.size())
    return corrupt("{}: the .npy header says {} bytes, the file has {}", name, header_len, b.size());
  const std::string_view dict = b.substr(8 + len_bytes, header_len);
  if (dict.find('{') == std::string_view::npos || dict.find('}') == std::string_view::npos)
    return corrupt("{}: the .npy header is not a dict", name);
  const std::string descr = dict_value(dict, "descr"), fortran = dict_value(dict, "fortran_order"),
                    shape = dict_value(dict, "shape");
  if (descr.empty() || fortran.empty() || shape.empty())
    return corrupt("{}: the .npy header lacks descr, fortran_order or shape", name);
  FP_RETURN_IF_ERROR(check_descr(descr, name, h));
  if (fortran != "False")
    return invalid_argument("{}: the .npy array has fortran_order {}; save it in C order (np.ascontiguousarray)", name,
                            quoted(fortran));
  FP_ASSIGN_OR_RETURN(h.count, shape_count(shape, name));
  return h;
}

Result<std::vector<int32_t>> decode_token_stream(std::string_view b, TokenInputFormat format, uint32_t vocab_size,
                                                 const std::string& name) {
  NpyHeader h;
  if (format == TokenInputFormat::kNpy) {
    FP_ASSIGN_OR_RETURN(h, parse_npy_header(b, name));
    const uint64_t have = b.size() - h.data_offset;
    if (have % h.width != 0 || have / h.width != h.count)
      return corrupt("{}: the .npy array holds {} elements of {} bytes ({} bytes), the file has {} after its header",
                     name, h.count, h.width, h.count * h.width, have);
  } else if (format == TokenInputFormat::kBinU16 || format == TokenInputFormat::kBinU32) {
    h.width = format == TokenInputFormat::kBinU16 ? 2 : 4;
    if (b.size() % h.width != 0)
      return corrupt("{}: {} bytes is not a whole number of {}-byte tokens ({})", name, b.size(), h.width,
                     token_input_format_name(format));
    h.count = b.size() / h.width;
  } else {
    return invalid_argument("{}: text is not a token stream", name);
  }
  std::vector<int32_t> ids;
  ids.reserve(h.count);
  FP_RETURN_IF_ERROR(decode_elements(b, h.data_offset, h.count, h.width, h.is_signed, vocab_size, name,
                                     [&](int32_t v) { ids.push_back(v); }));
  return ids;
}

Result<std::vector<int32_t>> read_token_stream(const std::string& path, TokenInputFormat format, uint32_t vocab_size) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found("cannot read '{}'", path);
  std::stringstream ss;
  ss << in.rdbuf();
  return decode_token_stream(ss.str(), format, vocab_size, path);
}

}  // namespace foldpar

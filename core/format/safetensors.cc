#include "core/format/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"
#include "nlohmann/json.hpp"

namespace kvrelay {
namespace {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

struct DTypeInfo {
  StDType dtype;
  absl::string_view name;
  size_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {StDType::kBool, "BOOL", 1}, {StDType::kU8, "U8", 1},          {StDType::kI8, "I8", 1},
    {StDType::kU16, "U16", 2},   {StDType::kI16, "I16", 2},        {StDType::kF16, "F16", 2},
    {StDType::kBF16, "BF16", 2}, {StDType::kU32, "U32", 4},        {StDType::kI32, "I32", 4},
    {StDType::kF32, "F32", 4},   {StDType::kU64, "U64", 8},        {StDType::kI64, "I64", 8},
    {StDType::kF64, "F64", 8},   {StDType::kF8E4M3, "F8_E4M3", 1}, {StDType::kF8E5M2, "F8_E5M2", 1},
};

std::string AllDTypeNames() {
  std::vector<absl::string_view> names;
  for (const DTypeInfo& d : kDTypes) names.push_back(d.name);
  return absl::StrJoin(names, ", ");
}

// A short rendering of a JSON value for error messages.
std::string Show(const Json& j) {
  // Containers holding containers are summarized rather than dumped: dump()
  // recurses, and a hostile header can nest deeply.
  if (j.is_structured()) {
    for (const Json& e : j) {
      if (e.is_structured()) {
        return absl::StrCat(j.is_array() ? "an array of " : "an object of ", j.size(), " elements");
      }
    }
  }
  std::string s = j.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

std::string TensorPrefix(absl::string_view name) {
  return absl::StrCat("safetensors: tensor '", name, "': ");
}

// Reads a non-negative JSON integer; `what` names it in the error.
absl::StatusOr<uint64_t> NonNegativeInt(const Json& j, absl::string_view prefix,
                                        absl::string_view what) {
  if (j.is_number_unsigned()) return j.get<uint64_t>();
  if (j.is_number_integer() && j.get<int64_t>() >= 0)
    return static_cast<uint64_t>(j.get<int64_t>());
  return absl::InvalidArgumentError(
      absl::StrCat(prefix, what, " is ", Show(j), ", expected a non-negative integer"));
}

uint64_t LoadLe64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void StoreLe64(uint64_t v, char* p) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

// Builds the padded header (length field included) for `tensors`.
absl::StatusOr<std::string> BuildHeader(absl::Span<const StTensor> tensors,
                                        const StMetadata& metadata) {
  OrderedJson header = OrderedJson::object();
  if (!metadata.empty()) {
    OrderedJson meta = OrderedJson::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header["__metadata__"] = std::move(meta);
  }
  std::set<absl::string_view> seen;
  uint64_t offset = 0;
  for (const StTensor& t : tensors) {
    if (t.name.empty()) return absl::InvalidArgumentError("safetensors: tensor with an empty name");
    if (t.name == "__metadata__") {
      return absl::InvalidArgumentError(
          "safetensors: tensor '__metadata__': the name is reserved for metadata");
    }
    if (!seen.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat(TensorPrefix(t.name), "duplicate name"));
    }
    for (int64_t d : t.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(absl::StrCat(TensorPrefix(t.name), "shape ",
                                                       ShapeString(t.shape),
                                                       ", expected non-negative dimensions"));
      }
    }
    const uint64_t expected = static_cast<uint64_t>(t.NumElements()) * StDTypeSize(t.dtype);
    if (t.data.size() != expected) {
      return absl::InvalidArgumentError(absl::StrCat(
          TensorPrefix(t.name), "data is ", t.data.size(), " bytes, expected ", expected,
          " (shape ", ShapeString(t.shape), " x ", StDTypeName(t.dtype), ")"));
    }
    OrderedJson entry = OrderedJson::object();
    entry["dtype"] = std::string(StDTypeName(t.dtype));
    entry["shape"] = t.shape;
    entry["data_offsets"] = {offset, offset + expected};
    header[t.name] = std::move(entry);
    offset += expected;
  }
  std::string json;
  try {
    json = header.dump();
  } catch (const OrderedJson::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        "safetensors: a tensor name or metadata string is not valid UTF-8 (", e.what(), ")"));
  }
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  StoreLe64(json.size(), out.data());
  out += json;
  return out;
}

}  // namespace

absl::string_view StDTypeName(StDType dtype) {
  for (const DTypeInfo& d : kDTypes) {
    if (d.dtype == dtype) return d.name;
  }
  return "?";
}

std::optional<StDType> ParseStDType(absl::string_view name) {
  for (const DTypeInfo& d : kDTypes) {
    if (d.name == name) return d.dtype;
  }
  return std::nullopt;
}

size_t StDTypeSize(StDType dtype) {
  for (const DTypeInfo& d : kDTypes) {
    if (d.dtype == dtype) return d.size;
  }
  return 1;
}

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

int64_t StTensor::NumElements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<SafetensorsReader> SafetensorsReader::ParseView(absl::Span<const uint8_t> bytes) {
  SafetensorsReader reader;
  absl::Status s = reader.Parse(bytes);
  if (!s.ok()) return s;
  return reader;
}

absl::StatusOr<SafetensorsReader> SafetensorsReader::ParseOwned(std::string buffer) {
  SafetensorsReader reader;
  reader.owned_ = std::make_shared<const std::string>(std::move(buffer));
  absl::Status s = reader.Parse(AsBytes(*reader.owned_));
  if (!s.ok()) return s;
  return reader;
}

absl::StatusOr<SafetensorsReader> SafetensorsReader::ReadFile(const std::string& path) {
  absl::StatusOr<std::string> bytes = ReadFileToString(path);
  if (!bytes.ok()) return bytes.status();
  absl::StatusOr<SafetensorsReader> reader = ParseOwned(*std::move(bytes));
  if (!reader.ok()) {
    return absl::Status(reader.status().code(),
                        absl::StrCat(path, ": ", reader.status().message()));
  }
  return reader;
}

std::optional<absl::string_view> SafetensorsReader::GetMetadata(absl::string_view key) const {
  auto it = metadata_.find(std::string(key));
  if (it == metadata_.end()) return std::nullopt;
  return absl::string_view(it->second);
}

const StTensor* SafetensorsReader::Find(absl::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

namespace {

// "{prefix}{what} is {json} (a {type}), expected {expected}": a header value
// of the wrong JSON type.
absl::Status WrongType(absl::string_view prefix, absl::string_view what, const Json& j,
                       absl::string_view expected) {
  return absl::InvalidArgumentError(
      absl::StrCat(prefix, what, " is ", Show(j), " (a ", j.type_name(), "), expected ", expected));
}

// The 8-byte little-endian header length, checked against the cap and the
// bytes that follow it.
absl::StatusOr<uint64_t> HeaderLength(absl::Span<const uint8_t> bytes) {
  if (bytes.size() < 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        "safetensors: file is ", bytes.size(), " bytes, expected at least 8 (the header length)"));
  }
  const uint64_t n = LoadLe64(bytes.data());
  if (n > kMaxSafetensorsHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors: header length ", n,
                                                   " bytes, expected at most ",
                                                   kMaxSafetensorsHeaderBytes, " (16 MiB)"));
  }
  if (n > bytes.size() - 8) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors: header length ", n,
                                                   " bytes exceeds the ", bytes.size() - 8,
                                                   " bytes after the length field"));
  }
  return n;
}

// Parses the JSON header into an object. Duplicate keys would be silently
// resolved by the parser (the last one wins); they are caught with the
// parse callback, at the top level and inside each entry (a tensor's
// fields, __metadata__), and reported after the JSON and its type. Nesting
// deeper than a header needs (root > tensor > shape > dimension) aborts the
// parse at once, before the parser builds a deep tree.
absl::StatusOr<Json> ParseHeaderJson(const char* begin, const char* end) {
  struct TooDeep {};
  constexpr int kMaxDepth = 3;
  std::string duplicate;
  std::set<std::string> top_keys, entry_keys;
  std::string entry;  // the top-level key whose object is being parsed
  Json::parser_callback_t cb = [&](int depth, Json::parse_event_t event, Json& parsed) {
    if (depth > kMaxDepth) throw TooDeep{};
    if (event == Json::parse_event_t::key && parsed.is_string() && (depth == 1 || depth == 2)) {
      const std::string key = parsed.get<std::string>();
      if (depth == 1) {
        entry = key;
        entry_keys.clear();
      }
      if (!(depth == 1 ? top_keys : entry_keys).insert(key).second && duplicate.empty()) {
        duplicate = depth == 1 ? key : absl::StrCat(entry, ".", key);
      }
    }
    return true;
  };
  Json root;
  try {
    root = Json::parse(begin, end, cb, /*allow_exceptions=*/true);
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors: header is not valid JSON: ", e.what()));
  } catch (const TooDeep&) {
    return absl::InvalidArgumentError(absl::StrCat(
        "safetensors: header nests deeper than ", kMaxDepth, " levels, expected {name: {dtype, shape, data_offsets}}"));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors: header is a JSON ", root.type_name(), ", expected an object"));
  }
  if (!duplicate.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors: key '", duplicate, "' appears more than once in the header"));
  }
  return root;
}

// Adds the __metadata__ entry's keys to `*metadata`: an object of strings.
absl::Status ParseMetadataEntry(const Json& entry, StMetadata* metadata) {
  if (!entry.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors: __metadata__ is a JSON ",
                                                   entry.type_name(), ", expected an object"));
  }
  for (auto m = entry.begin(); m != entry.end(); ++m) {
    if (!m.value().is_string()) {
      return WrongType("safetensors: __metadata__.", m.key(), m.value(), "a string");
    }
    (*metadata)[m.key()] = m.value().get<std::string>();
  }
  return absl::OkStatus();
}

// A tensor entry is an object with exactly dtype, shape and data_offsets.
absl::Status CheckEntryFields(const std::string& prefix, const Json& entry) {
  if (!entry.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "entry is a JSON ", entry.type_name(),
                                                   ", expected an object with dtype, shape "
                                                   "and data_offsets"));
  }
  for (auto f = entry.begin(); f != entry.end(); ++f) {
    if (f.key() != "dtype" && f.key() != "shape" && f.key() != "data_offsets") {
      return absl::InvalidArgumentError(absl::StrCat(
          prefix, "unknown field '", f.key(), "', expected dtype, shape and data_offsets"));
    }
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!entry.contains(field)) {
      return absl::InvalidArgumentError(absl::StrCat(prefix, "missing field '", field, "'"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<StDType> ParseEntryDType(const std::string& prefix, const Json& jd) {
  if (!jd.is_string()) return WrongType(prefix, "dtype", jd, "a string");
  std::optional<StDType> dt = ParseStDType(jd.get<std::string>());
  if (!dt) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "unknown dtype '",
                                                   jd.get<std::string>(), "', expected one of ",
                                                   AllDTypeNames()));
  }
  return *dt;
}

// Reads the shape into `t->shape` and returns its element count, which
// must fit in int64 with room for 8-byte elements.
absl::StatusOr<uint64_t> ParseEntryShape(const std::string& prefix, const Json& js, StTensor* t) {
  if (!js.is_array()) return WrongType(prefix, "shape", js, "an array of integers");
  const uint64_t max_elements = static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / 8;
  std::vector<uint64_t> dims;
  for (size_t i = 0; i < js.size(); ++i) {
    KVRELAY_ASSIGN_OR_RETURN(const uint64_t d, NonNegativeInt(js[i], prefix, absl::StrCat("shape[", i, "]")));
    dims.push_back(d);
  }
  // The product of the non-zero dimensions must fit too (NumElements()
  // multiplies them all, in order, before a 0 makes it 0).
  uint64_t numel = 1;
  bool too_big = false, has_zero = false;
  for (uint64_t d : dims) {
    if (d == 0) {
      has_zero = true;
      continue;
    }
    if (d > max_elements || numel > max_elements / d) {
      too_big = true;
      break;
    }
    numel *= d;
  }
  if (has_zero) numel = 0;
  if (too_big) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "shape ", Show(js), " has too many elements"));
  }
  for (uint64_t d : dims) t->shape.push_back(static_cast<int64_t>(d));
  return numel;
}

// The byte range [begin, end) of the tensor's data: inside `data` (the
// bytes after the header) and exactly `numel` elements of t.dtype.
absl::StatusOr<std::pair<uint64_t, uint64_t>> ParseEntryOffsets(const std::string& prefix, const Json& jo,
                                                                 const StTensor& t, uint64_t numel,
                                                                 size_t data_size) {
  if (!jo.is_array() || jo.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "data_offsets is ", Show(jo), ", expected an array [begin, end]"));
  }
  KVRELAY_ASSIGN_OR_RETURN(const uint64_t begin, NonNegativeInt(jo[0], prefix, "data_offsets[0]"));
  KVRELAY_ASSIGN_OR_RETURN(const uint64_t end, NonNegativeInt(jo[1], prefix, "data_offsets[1]"));
  const std::string offsets = absl::StrCat("data_offsets [", begin, ",", end, "]");
  if (end < begin) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, offsets, ": end before begin"));
  }
  if (end > data_size) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, offsets, " exceed the ", data_size,
                                                   " bytes of data after the header"));
  }
  const uint64_t expected = numel * StDTypeSize(t.dtype);
  if (end - begin != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, offsets, " hold ", end - begin, " bytes, expected ", expected,
                     " (shape ", ShapeString(t.shape), " x ", StDTypeName(t.dtype), ": ", numel,
                     " elements of ", StDTypeSize(t.dtype), " bytes)"));
  }
  return std::make_pair(begin, end);
}

// A tensor entry of the header, its data a view into `data` from offset
// `*begin`.
absl::StatusOr<StTensor> ParseTensorEntry(const std::string& name, const Json& entry,
                                          absl::Span<const uint8_t> data, uint64_t* begin) {
  if (name.empty()) return absl::InvalidArgumentError("safetensors: tensor with an empty name");
  const std::string prefix = TensorPrefix(name);
  KVRELAY_RETURN_IF_ERROR(CheckEntryFields(prefix, entry));
  StTensor t;
  t.name = name;
  KVRELAY_ASSIGN_OR_RETURN(t.dtype, ParseEntryDType(prefix, entry["dtype"]));
  KVRELAY_ASSIGN_OR_RETURN(const uint64_t numel, ParseEntryShape(prefix, entry["shape"], &t));
  KVRELAY_ASSIGN_OR_RETURN(const auto range,
                           ParseEntryOffsets(prefix, entry["data_offsets"], t, numel, data.size()));
  *begin = range.first;
  t.data = data.subspan(range.first, range.second - range.first);
  return t;
}

// A tensor's data range and its position in the parsed list.
struct Range {
  uint64_t begin, end;
  size_t tensor;
};

// Sorts `ranges` into file order (ties by name, so the order is
// deterministic) and checks that no two non-empty ranges overlap.
absl::Status SortAndCheckOverlap(const std::vector<StTensor>& tensors, std::vector<Range>* ranges) {
  std::sort(ranges->begin(), ranges->end(), [&](const Range& a, const Range& b) {
    if (a.begin != b.begin) return a.begin < b.begin;
    if (a.end != b.end) return a.end < b.end;
    return tensors[a.tensor].name < tensors[b.tensor].name;
  });
  const Range* last = nullptr;  // the non-empty range reaching furthest so far
  for (const Range& r : *ranges) {
    if (r.begin == r.end) continue;  // an empty tensor overlaps nothing
    if (last != nullptr && r.begin < last->end) {
      return absl::InvalidArgumentError(
          absl::StrCat(TensorPrefix(tensors[r.tensor].name), "data_offsets [", r.begin, ",", r.end,
                       "] overlap tensor '", tensors[last->tensor].name, "' (data_offsets [",
                       last->begin, ",", last->end, "])"));
    }
    last = &r;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status SafetensorsReader::Parse(absl::Span<const uint8_t> bytes) {
  KVRELAY_ASSIGN_OR_RETURN(const uint64_t n, HeaderLength(bytes));
  header_bytes_ = n;
  const char* hb = reinterpret_cast<const char*>(bytes.data() + 8);
  const absl::Span<const uint8_t> data = bytes.subspan(8 + n);
  KVRELAY_ASSIGN_OR_RETURN(const Json root, ParseHeaderJson(hb, hb + n));

  metadata_.clear();
  tensors_.clear();
  index_.clear();
  std::vector<Range> ranges;
  for (auto it = root.begin(); it != root.end(); ++it) {
    if (it.key() == "__metadata__") {
      KVRELAY_RETURN_IF_ERROR(ParseMetadataEntry(it.value(), &metadata_));
      continue;
    }
    uint64_t begin = 0;
    KVRELAY_ASSIGN_OR_RETURN(StTensor t, ParseTensorEntry(it.key(), it.value(), data, &begin));
    ranges.push_back({begin, begin + t.data.size(), tensors_.size()});
    tensors_.push_back(std::move(t));
  }
  KVRELAY_RETURN_IF_ERROR(SortAndCheckOverlap(tensors_, &ranges));
  std::vector<StTensor> sorted;
  sorted.reserve(tensors_.size());
  for (const Range& r : ranges) sorted.push_back(std::move(tensors_[r.tensor]));
  tensors_ = std::move(sorted);
  for (size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
  return absl::OkStatus();
}

absl::StatusOr<std::string> SafetensorsHeader(absl::Span<const StTensor> tensors, const StMetadata& metadata) {
  return BuildHeader(tensors, metadata);
}

absl::StatusOr<std::string> SerializeSafetensors(absl::Span<const StTensor> tensors,
                                                 const StMetadata& metadata) {
  absl::StatusOr<std::string> out = BuildHeader(tensors, metadata);
  if (!out.ok()) return out;
  size_t total = out->size();
  for (const StTensor& t : tensors) total += t.data.size();
  out->reserve(total);
  for (const StTensor& t : tensors) {
    out->append(reinterpret_cast<const char*>(t.data.data()), t.data.size());
  }
  return out;
}

namespace {

// Writes the header and the tensors' bytes to `fd`; 0 or the errno.
int WriteAll(int fd, const std::string& header, absl::Span<const StTensor> tensors) {
  auto put = [fd](const uint8_t* p, size_t n) {
    while (n > 0) {
      const ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t{1} << 30));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) return w < 0 ? errno : EIO;
      p += w;
      n -= static_cast<size_t>(w);
    }
    return 0;
  };
  if (int e = put(reinterpret_cast<const uint8_t*>(header.data()), header.size())) return e;
  for (const StTensor& t : tensors) {
    if (int e = put(t.data.data(), t.data.size())) return e;
  }
  return 0;
}

}  // namespace

absl::Status WriteSafetensorsFile(const std::string& path, absl::Span<const StTensor> tensors,
                                  const StMetadata& metadata) {
  absl::StatusOr<std::string> header = BuildHeader(tensors, metadata);
  if (!header.ok()) return header.status();
  auto fail = [&path](const char* what, int e) {
    return absl::InternalError(absl::StrCat(path, ": ", what, ": ", std::strerror(e)));
  };
  struct stat st;
  const bool exists = ::lstat(path.c_str(), &st) == 0;
  // A regular file of ours with one name is replaced only once the new one
  // is complete, so that a failed write (disk full, a file size limit) leaves
  // the old file, or none. Anything else is written in place, as a plain
  // open would: a device, FIFO or symbolic link (/dev/stdout, ...), a file
  // with other hard links or another owner (a rename would cut the links or
  // change the owner), or where no file can be created beside it.
  bool in_place = exists && (!S_ISREG(st.st_mode) || st.st_nlink > 1 || st.st_uid != ::geteuid());
  if (exists && !in_place && ::access(path.c_str(), W_OK) != 0) return fail("cannot open for writing", errno);
  int fd = -1;
  std::string tmp;
  if (!in_place) {
    // Created with the old file's mode (the new one's: 0666 less the umask),
    // so the data is never more readable than the file it replaces.
    const mode_t mode = exists ? (st.st_mode & 0777) : 0666;
    for (int attempt = 0; fd < 0 && attempt < 16; ++attempt) {
      tmp = absl::StrCat(path, ".tmp-", ::getpid(), "-", attempt);
      fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
      if (fd < 0 && errno != EEXIST) break;
    }
    if (fd < 0) {
      const int e = errno;
      if (!(e == ENAMETOOLONG || (exists && (e == EACCES || e == EPERM || e == EROFS)))) {
        return fail("cannot open for writing", e);
      }
      in_place = true;
    }
  }
  if (in_place) {
    fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (fd < 0) return fail("cannot open for writing", errno);
    int e = WriteAll(fd, *header, tensors);
    if (::close(fd) != 0 && e == 0) e = errno;
    return e == 0 ? absl::OkStatus() : fail("write failed", e);
  }
  int e = exists && ::fchmod(fd, st.st_mode & 07777) != 0 ? errno : 0;
  if (e == 0) e = WriteAll(fd, *header, tensors);
  if (::close(fd) != 0 && e == 0) e = errno;
  if (e == 0 && ::rename(tmp.c_str(), path.c_str()) != 0) e = errno;
  if (e != 0) {
    ::unlink(tmp.c_str());
    return fail("write failed", e);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    const int e = errno;
    const std::string msg = absl::StrCat(path, ": cannot open: ", std::strerror(e));
    return e == ENOENT ? absl::NotFoundError(msg) : absl::InternalError(msg);
  }
  std::string out;
  struct stat st;
  if (fstat(fileno(f), &st) == 0 && S_ISDIR(st.st_mode)) {
    std::fclose(f);
    return absl::InvalidArgumentError(absl::StrCat(path, ": is a directory, expected a file"));
  }
  if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
    std::fclose(f);
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a regular file, expected a safetensors file"));
  }
  if (fstat(fileno(f), &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0) {
    // Read straight into the buffer; keep reading in case the file grew.
    out.resize(static_cast<size_t>(st.st_size));
    out.resize(std::fread(out.data(), 1, out.size(), f));
  }
  char buf[1 << 16];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, got);
  const bool failed = std::ferror(f) != 0;
  const int e = errno;
  std::fclose(f);
  if (failed) return absl::InternalError(absl::StrCat(path, ": read failed: ", std::strerror(e)));
  return out;
}

}  // namespace kvrelay

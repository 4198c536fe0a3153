#include "core/format/safetensors.h"

#include <dirent.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>

#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvrelay {
namespace {

using ::testing::HasSubstr;

// 8-byte little-endian length + header + data.
std::string RawFile(const std::string& header, const std::string& data = "",
                    std::optional<uint64_t> length = std::nullopt) {
  const uint64_t n = length.value_or(header.size());
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

void ExpectInvalid(const std::string& bytes, const std::string& substr) {
  absl::StatusOr<SafetensorsReader> r = SafetensorsReader::ParseView(AsBytes(bytes));
  ASSERT_FALSE(r.ok()) << "parsed unexpectedly";
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(substr));
}

// A valid 16-byte F32 [2,2] tensor "a" at [0,16).
const char kOneTensor[] = R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";

std::vector<uint8_t> Iota(size_t n, uint8_t start = 0) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(start + i);
  return v;
}

StTensor Tensor(std::string name, StDType dtype, std::vector<int64_t> shape,
                const std::vector<uint8_t>& data) {
  StTensor t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.data = data;
  return t;
}

TEST(SafetensorsDTypeTest, NamesAndSizes) {
  for (auto [name, size] : std::vector<std::pair<std::string, size_t>>{{"BOOL", 1},
                                                                       {"U8", 1},
                                                                       {"I8", 1},
                                                                       {"U16", 2},
                                                                       {"I16", 2},
                                                                       {"F16", 2},
                                                                       {"BF16", 2},
                                                                       {"U32", 4},
                                                                       {"I32", 4},
                                                                       {"F32", 4},
                                                                       {"U64", 8},
                                                                       {"I64", 8},
                                                                       {"F64", 8},
                                                                       {"F8_E4M3", 1},
                                                                       {"F8_E5M2", 1}}) {
    std::optional<StDType> d = ParseStDType(name);
    ASSERT_TRUE(d.has_value()) << name;
    EXPECT_EQ(StDTypeName(*d), name);
    EXPECT_EQ(StDTypeSize(*d), size) << name;
  }
  EXPECT_FALSE(ParseStDType("f32").has_value());
  EXPECT_FALSE(ParseStDType("").has_value());
}

TEST(SafetensorsTest, RoundTripPreservesTensorsMetadataAndOrder) {
  const std::vector<uint8_t> a = Iota(2 * 3 * 2), b = Iota(4 * 4, 100), c = Iota(5, 7),
                             d = Iota(8, 9), e;
  std::vector<StTensor> tensors = {
      Tensor("z.first", StDType::kBF16, {2, 3}, a), Tensor("a.second", StDType::kF32, {4}, b),
      Tensor("u8", StDType::kU8, {5}, c), Tensor("scalar.f64", StDType::kF64, {}, d),
      Tensor("empty", StDType::kI32, {0, 3}, e)};
  StMetadata meta = {{"key", "value"}, {"other", ""}};
  absl::StatusOr<std::string> bytes = SerializeSafetensors(tensors, meta);
  ASSERT_TRUE(bytes.ok()) << bytes.status();

  absl::StatusOr<SafetensorsReader> r = SafetensorsReader::ParseView(AsBytes(*bytes));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->metadata(), meta);
  ASSERT_EQ(r->tensors().size(), tensors.size());
  // Data is laid out in the order given; the reader returns file order, with
  // the empty tensor (at the end offset) sorted by its offset.
  std::vector<std::string> names;
  for (const StTensor& t : r->tensors()) names.push_back(t.name);
  EXPECT_THAT(names, ::testing::ElementsAre("z.first", "a.second", "u8", "scalar.f64", "empty"));
  for (const StTensor& want : tensors) {
    const StTensor* got = r->Find(want.name);
    ASSERT_NE(got, nullptr) << want.name;
    EXPECT_EQ(got->dtype, want.dtype);
    EXPECT_EQ(got->shape, want.shape);
    EXPECT_EQ(std::vector<uint8_t>(got->data.begin(), got->data.end()),
              std::vector<uint8_t>(want.data.begin(), want.data.end()))
        << want.name;
  }
  EXPECT_EQ(r->Find("missing"), nullptr);
  EXPECT_EQ(r->GetMetadata("key").value_or("?"), "value");
  EXPECT_FALSE(r->GetMetadata("nope").has_value());
  EXPECT_EQ(r->Find("scalar.f64")->NumElements(), 1);
  EXPECT_EQ(r->Find("empty")->NumElements(), 0);

  // Header padded with spaces: data starts at a multiple of 8.
  EXPECT_EQ(r->header_bytes() % 8, 0u);
  EXPECT_EQ(
      (*bytes)[8 + r->header_bytes() - 1] == ' ' || (*bytes)[8 + r->header_bytes() - 1] == '}',
      true);
  EXPECT_EQ(bytes->size(), 8 + r->header_bytes() + a.size() + b.size() + c.size() + d.size());
  // Metadata comes first in the header, tensors in the order given.
  const std::string header = bytes->substr(8, r->header_bytes());
  EXPECT_LT(header.find("__metadata__"), header.find("z.first"));
  EXPECT_LT(header.find("z.first"), header.find("a.second"));
}

TEST(SafetensorsTest, SerializationIsDeterministicAndMatchesFileWriter) {
  const std::vector<uint8_t> a = Iota(12), b = Iota(3);
  std::vector<StTensor> tensors = {Tensor("x", StDType::kF16, {2, 3}, a),
                                   Tensor("y", StDType::kU8, {3}, b)};
  StMetadata meta = {{"b", "2"}, {"a", "1"}};
  absl::StatusOr<std::string> one = SerializeSafetensors(tensors, meta);
  absl::StatusOr<std::string> two = SerializeSafetensors(tensors, meta);
  ASSERT_TRUE(one.ok() && two.ok());
  EXPECT_EQ(*one, *two);

  const std::string path = ::testing::TempDir() + "/st_writer_" + std::to_string(getpid());
  ASSERT_TRUE(WriteSafetensorsFile(path, tensors, meta).ok());
  absl::StatusOr<std::string> file = ReadFileToString(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(*file, *one);
  absl::StatusOr<SafetensorsReader> r = SafetensorsReader::ReadFile(path);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tensors().size(), 2u);
  std::remove(path.c_str());
}

TEST(SafetensorsTest, NoMetadataOmitsTheKey) {
  const std::vector<uint8_t> a = Iota(4);
  absl::StatusOr<std::string> bytes =
      SerializeSafetensors({Tensor("t", StDType::kI32, {1}, a)}, {});
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(bytes->find("__metadata__"), std::string::npos);
  absl::StatusOr<SafetensorsReader> r = SafetensorsReader::ParseView(AsBytes(*bytes));
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->metadata().empty());
}

TEST(SafetensorsTest, ParseViewHandsOutSpansIntoTheBuffer) {
  const std::string bytes = RawFile(kOneTensor, std::string(16, 'x'));
  absl::StatusOr<SafetensorsReader> r = SafetensorsReader::ParseView(AsBytes(bytes));
  ASSERT_TRUE(r.ok()) << r.status();
  const uint8_t* p = r->Find("a")->data.data();
  EXPECT_GE(p, reinterpret_cast<const uint8_t*>(bytes.data()));
  EXPECT_LT(p, reinterpret_cast<const uint8_t*>(bytes.data() + bytes.size()));
}

TEST(SafetensorsTest, ParseOwnedKeepsDataAliveInCopies) {
  std::optional<SafetensorsReader> copy;
  {
    absl::StatusOr<SafetensorsReader> r =
        SafetensorsReader::ParseOwned(RawFile(kOneTensor, std::string(16, 'q')));
    ASSERT_TRUE(r.ok()) << r.status();
    copy = *r;
  }
  const StTensor* t = copy->Find("a");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(std::string(t->data.begin(), t->data.end()), std::string(16, 'q'));
}

TEST(SafetensorsTest, AcceptsForeignDtypesGapsAndTrailingHeaderSpaces) {
  const std::string header = R"({"d":{"dtype":"F64","shape":[1],"data_offsets":[8,16]},)"
                             R"("i":{"dtype":"I64","shape":[1],"data_offsets":[0,8]},)"
                             R"("b":{"dtype":"BOOL","shape":[2],"data_offsets":[20,22]}}    )";
  absl::StatusOr<SafetensorsReader> r =
      SafetensorsReader::ParseOwned(RawFile(header, std::string(22, '\1')));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->tensors().size(), 3u);
  EXPECT_EQ(r->tensors()[0].name, "i");  // file order
  EXPECT_EQ(r->Find("d")->dtype, StDType::kF64);
  EXPECT_EQ(r->Find("i")->dtype, StDType::kI64);
}

// ---- Malformed files: one case each. ----

TEST(SafetensorsMalformedTest, EmptyFile) {
  ExpectInvalid("", "file is 0 bytes, expected at least 8");
}

TEST(SafetensorsMalformedTest, ShorterThanLengthField) {
  ExpectInvalid("abcde", "file is 5 bytes, expected at least 8");
}

TEST(SafetensorsMalformedTest, HeaderLengthBeyondFile) {
  ExpectInvalid(RawFile("{}", "", 100),
                "header length 100 bytes exceeds the 2 bytes after the length field");
}

TEST(SafetensorsMalformedTest, AbsurdHeaderLength) {
  ExpectInvalid(RawFile("{}", "", uint64_t{1} << 40),
                "header length 1099511627776 bytes, expected at most 16777216");
  ExpectInvalid(RawFile("{}", "", ~uint64_t{0}), "expected at most 16777216");
}

TEST(SafetensorsMalformedTest, DeepNestingIsRejectedWithoutRecursing) {
  // 200k levels would overflow the stack of a recursive dump or parse.
  const int depth = 200000;
  std::string shape = std::string(depth, '[') + std::string(depth, ']');
  ExpectInvalid(RawFile(R"({"a":{"dtype":"F32","shape":)" + shape + R"(,"data_offsets":[0,0]}})"),
                "header nests deeper than 3 levels");
  ExpectInvalid(RawFile(R"({"__metadata__":{"k":)" + shape + "}}"), "header nests deeper than 3 levels");
}

TEST(SafetensorsMalformedTest, HeaderNotJson) {
  ExpectInvalid(RawFile("{\"a\": nope}"), "header is not valid JSON");
  ExpectInvalid(RawFile(""), "header is not valid JSON");
  ExpectInvalid(RawFile(std::string(kOneTensor) + "}"), "header is not valid JSON");
}

TEST(SafetensorsMalformedTest, HeaderNotObject) {
  ExpectInvalid(RawFile("[1,2]"), "header is a JSON array, expected an object");
  ExpectInvalid(RawFile("\"str\""), "header is a JSON string, expected an object");
}

TEST(SafetensorsMalformedTest, DuplicateTensorName) {
  ExpectInvalid(RawFile(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                        R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                        "xx"),
                "key 'a' appears more than once");
}

// Inside an entry too: the parser would keep the last value, so two readers
// (or the writer's intent) could disagree about the same file.
TEST(SafetensorsMalformedTest, DuplicateKeyInsideAnEntry) {
  ExpectInvalid(RawFile(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"dtype":"F64"}})", "x"),
                "key 'a.dtype' appears more than once");
  ExpectInvalid(RawFile(R"({"__metadata__":{"first_agent":"true","first_agent":"false"}})"),
                "key '__metadata__.first_agent' appears more than once");
  // The same field name in two entries is fine.
  absl::StatusOr<SafetensorsReader> r = SafetensorsReader::ParseOwned(
      RawFile(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
              R"("b":{"dtype":"U8","shape":[1],"data_offsets":[1,2]},"__metadata__":{"dtype":"x"}})",
              "xy"));
  EXPECT_TRUE(r.ok()) << r.status();
}

TEST(SafetensorsMalformedTest, EntryNotObject) {
  ExpectInvalid(RawFile(R"({"a":[1,2]})"), "tensor 'a': entry is a JSON array, expected an object");
}

TEST(SafetensorsMalformedTest, EmptyTensorName) {
  ExpectInvalid(RawFile(R"({"":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "x"),
                "tensor with an empty name");
}

TEST(SafetensorsMalformedTest, MissingDtype) {
  ExpectInvalid(RawFile(R"({"a":{"shape":[2,2],"data_offsets":[0,16]}})", std::string(16, 0)),
                "tensor 'a': missing field 'dtype'");
}

TEST(SafetensorsMalformedTest, MissingShape) {
  ExpectInvalid(RawFile(R"({"a":{"dtype":"F32","data_offsets":[0,16]}})", std::string(16, 0)),
                "tensor 'a': missing field 'shape'");
}

TEST(SafetensorsMalformedTest, MissingDataOffsets) {
  ExpectInvalid(RawFile(R"({"a":{"dtype":"F32","shape":[2,2]}})", std::string(16, 0)),
                "tensor 'a': missing field 'data_offsets'");
}

TEST(SafetensorsMalformedTest, UnknownField) {
  ExpectInvalid(RawFile(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16],"extra":1}})",
                        std::string(16, 0)),
                "tensor 'a': unknown field 'extra'");
}

TEST(SafetensorsMalformedTest, DtypeNotString) {
  ExpectInvalid(
      RawFile(R"({"a":{"dtype":7,"shape":[2,2],"data_offsets":[0,16]}})", std::string(16, 0)),
      "tensor 'a': dtype is 7 (a number), expected a string");
}

TEST(SafetensorsMalformedTest, UnknownDtype) {
  ExpectInvalid(
      RawFile(R"({"a":{"dtype":"F128","shape":[2,2],"data_offsets":[0,16]}})", std::string(16, 0)),
      "tensor 'a': unknown dtype 'F128', expected one of BOOL, U8");
}

TEST(SafetensorsMalformedTest, ShapeNotArray) {
  ExpectInvalid(
      RawFile(R"({"a":{"dtype":"F32","shape":4,"data_offsets":[0,16]}})", std::string(16, 0)),
      "tensor 'a': shape is 4 (a number), expected an array of integers");
}

TEST(SafetensorsMalformedTest, NegativeShape) {
  ExpectInvalid(
      RawFile(R"({"a":{"dtype":"F32","shape":[2,-2],"data_offsets":[0,16]}})", std::string(16, 0)),
      "tensor 'a': shape[1] is -2, expected a non-negative integer");
}

TEST(SafetensorsMalformedTest, NonIntegerShape) {
  ExpectInvalid(
      RawFile(R"({"a":{"dtype":"F32","shape":[2,2.5],"data_offsets":[0,16]}})", std::string(16, 0)),
      "tensor 'a': shape[1] is 2.5, expected a non-negative integer");
  ExpectInvalid(
      RawFile(R"({"a":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}})", std::string(8, 0)),
      "tensor 'a': shape[0] is \"2\", expected a non-negative integer");
}

TEST(SafetensorsMalformedTest, ShapeWithTooManyElements) {
  ExpectInvalid(RawFile(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],)"
                        R"("data_offsets":[0,16]}})",
                        std::string(16, 0)),
                "tensor 'a': shape [4294967296,4294967296] has too many elements");
  // With a 0 the tensor is empty, but NumElements() multiplies the others
  // first: they must not overflow either.
  ExpectInvalid(RawFile(R"({"a":{"dtype":"F32","shape":[576460752303423488,576460752303423488,0],)"
                        R"("data_offsets":[0,0]}})"),
                "has too many elements");
  absl::StatusOr<SafetensorsReader> r = SafetensorsReader::ParseOwned(
      RawFile(R"({"a":{"dtype":"F32","shape":[4294967296,0,8],"data_offsets":[0,0]}})"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->Find("a")->NumElements(), 0);
}

TEST(SafetensorsMalformedTest, DataOffsetsWrongArity) {
  ExpectInvalid(
      RawFile(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,8,16]}})", std::string(16, 0)),
      "tensor 'a': data_offsets is [0,8,16], expected an array [begin, end]");
}

TEST(SafetensorsMalformedTest, DataOffsetsNegative) {
  ExpectInvalid(
      RawFile(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[-16,0]}})", std::string(16, 0)),
      "tensor 'a': data_offsets[0] is -16, expected a non-negative integer");
}

TEST(SafetensorsMalformedTest, DataOffsetsOutOfRange) {
  ExpectInvalid(RawFile(kOneTensor, std::string(12, 0)),
                "tensor 'a': data_offsets [0,16] exceed the 12 bytes of data after the header");
}

TEST(SafetensorsMalformedTest, EndBeforeBegin) {
  ExpectInvalid(
      RawFile(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[16,0]}})", std::string(16, 0)),
      "tensor 'a': data_offsets [16,0]: end before begin");
}

TEST(SafetensorsMalformedTest, ByteSizeMismatch) {
  ExpectInvalid(
      RawFile(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}})", std::string(16, 0)),
      "tensor 'a': data_offsets [0,12] hold 12 bytes, expected 16 (shape [2,2] x F32");
}

TEST(SafetensorsMalformedTest, OverlappingTensors) {
  ExpectInvalid(RawFile(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                        R"("b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
                        std::string(24, 0)),
                "tensor 'b': data_offsets [8,24] overlap tensor 'a' (data_offsets [0,16])");
  // Identical ranges overlap too.
  ExpectInvalid(RawFile(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                        R"("b":{"dtype":"U8","shape":[16],"data_offsets":[0,16]}})",
                        std::string(16, 0)),
                "overlap tensor");
}

TEST(SafetensorsMalformedTest, MetadataNotObject) {
  ExpectInvalid(RawFile(R"({"__metadata__":["a"]})"),
                "__metadata__ is a JSON array, expected an object");
}

TEST(SafetensorsMalformedTest, MetadataValueNotString) {
  ExpectInvalid(RawFile(R"({"__metadata__":{"ok":"x","n":3}})"),
                "__metadata__.n is 3 (a number), expected a string");
}

TEST(SafetensorsMalformedTest, ReadFileNamesThePath) {
  const std::string path = ::testing::TempDir() + "/st_bad_" + std::to_string(getpid());
  std::FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  std::fputs("abc", f);
  std::fclose(f);
  absl::StatusOr<SafetensorsReader> r = SafetensorsReader::ReadFile(path);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr(path + ": safetensors: file is 3 bytes"));
  std::remove(path.c_str());
}

TEST(SafetensorsFileTest, MissingFileIsNotFound) {
  absl::StatusOr<SafetensorsReader> r =
      SafetensorsReader::ReadFile(::testing::TempDir() + "/does/not/exist.safetensors");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("exist.safetensors"));
}

// ---- Writer errors ----

void ExpectWriteInvalid(const std::vector<StTensor>& tensors, const std::string& substr) {
  absl::StatusOr<std::string> s = SerializeSafetensors(tensors, {});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr(substr));
}

TEST(SafetensorsWriterTest, RejectsDuplicateNames) {
  const std::vector<uint8_t> a = Iota(4);
  ExpectWriteInvalid({Tensor("t", StDType::kU8, {4}, a), Tensor("t", StDType::kU8, {4}, a)},
                     "tensor 't': duplicate name");
}

TEST(SafetensorsWriterTest, RejectsReservedAndEmptyNames) {
  const std::vector<uint8_t> a = Iota(4);
  ExpectWriteInvalid({Tensor("__metadata__", StDType::kU8, {4}, a)}, "reserved");
  ExpectWriteInvalid({Tensor("", StDType::kU8, {4}, a)}, "empty name");
}

TEST(SafetensorsWriterTest, RejectsSizeMismatch) {
  const std::vector<uint8_t> a = Iota(6);
  ExpectWriteInvalid({Tensor("t", StDType::kF32, {2}, a)},
                     "tensor 't': data is 6 bytes, expected 8 (shape [2] x F32)");
}

TEST(SafetensorsWriterTest, RejectsNegativeDimension) {
  const std::vector<uint8_t> a;
  ExpectWriteInvalid({Tensor("t", StDType::kF32, {-1, 0}, a)},
                     "tensor 't': shape [-1,0], expected non-negative dimensions");
}

TEST(SafetensorsWriterTest, UnwritablePathIsAnError) {
  const std::vector<uint8_t> a = Iota(4);
  absl::Status s = WriteSafetensorsFile(::testing::TempDir() + "/no/such/dir/x.safetensors",
                                        {Tensor("t", StDType::kU8, {4}, a)}, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
}

// A write that fails midway (here a file size limit, as a full disk would)
// leaves the file that was there intact and no temporary file behind; a
// successful one replaces it and keeps its mode.
TEST(SafetensorsWriterTest, AFailedWriteKeepsTheOldFile) {
  const std::string dir = ::testing::TempDir() + "/st_atomic_" + std::to_string(getpid());
  ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
  const std::string path = dir + "/m.safetensors";
  const std::vector<uint8_t> small = Iota(16);
  const std::vector<StTensor> old_tensors = {Tensor("old", StDType::kU8, {16}, small)};
  ASSERT_TRUE(WriteSafetensorsFile(path, old_tensors, {}).ok());
  ASSERT_EQ(::chmod(path.c_str(), 0640), 0);
  const std::string before = *ReadFileToString(path);

  std::vector<uint8_t> big(1 << 20, 7);
  const std::vector<StTensor> big_tensors = {Tensor("big", StDType::kU8, {1 << 20}, big)};
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::signal(SIGXFSZ, SIG_IGN);
    struct rlimit lim = {64 << 10, 64 << 10};
    ::setrlimit(RLIMIT_FSIZE, &lim);
    const absl::Status s = WriteSafetensorsFile(path, big_tensors, {});
    ::_exit(s.code() == absl::StatusCode::kInternal &&
                    std::string(s.message()).find("write failed") != std::string::npos
                ? 0
                : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the write did not fail as expected";
  EXPECT_EQ(*ReadFileToString(path), before);
  auto entries = [&dir] {
    std::vector<std::string> names;
    DIR* d = ::opendir(dir.c_str());
    while (dirent* e = ::readdir(d)) {
      if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) names.push_back(e->d_name);
    }
    ::closedir(d);
    return names;
  };
  EXPECT_THAT(entries(), ::testing::ElementsAre("m.safetensors"));

  ASSERT_TRUE(WriteSafetensorsFile(path, big_tensors, {}).ok());
  absl::StatusOr<SafetensorsReader> r = SafetensorsReader::ReadFile(path);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tensors()[0].name, "big");
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0640u);
  EXPECT_THAT(entries(), ::testing::ElementsAre("m.safetensors"));

  // A file with another hard link is written in place: both names see it.
  const std::string link = dir + "/link.safetensors";
  ASSERT_EQ(::link(path.c_str(), link.c_str()), 0);
  ASSERT_TRUE(WriteSafetensorsFile(path, old_tensors, {}).ok());
  EXPECT_EQ(*ReadFileToString(link), before);
  EXPECT_THAT(entries(), ::testing::UnorderedElementsAre("m.safetensors", "link.safetensors"));
  std::remove(link.c_str());
  std::remove(path.c_str());
  ::rmdir(dir.c_str());
}

}  // namespace
}  // namespace kvrelay

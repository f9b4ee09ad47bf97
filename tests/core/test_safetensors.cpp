// safetensors reader: round trip, sharded checkpoints, and every malformed-header case, each a
// clear error naming the file and tensor (run under ASan in CI: no out-of-bounds reads).
#include "core/check.h"
#include "core/safetensors.h"
#include "test_helpers.h"

#include <nlohmann/json.hpp>

namespace kestrel {
namespace {

using testing::expect_error;
using testing::TempDir;

// A raw safetensors file from a header JSON string and a data section.
std::string raw_file(const std::string& header, const std::string& data, int64_t len_override = -1) {
  std::string s(8, '\0');
  const uint64_t n = len_override >= 0 ? uint64_t(len_override) : header.size();
  std::memcpy(s.data(), &n, 8);
  return s + header + data;
}

TEST(Safetensors, RoundTrip) {
  TempDir d;
  std::vector<uint8_t> a(24), b(6);
  for (size_t i = 0; i < a.size(); ++i) a[i] = uint8_t(i);
  for (size_t i = 0; i < b.size(); ++i) b[i] = uint8_t(100 + i);
  write_safetensors(d.path / "model.safetensors",
                    {{"a", DType::F32, {2, 3}, a}, {"b", DType::BF16, {3}, b}}, {{"format", "pt"}});
  auto ck = Checkpoint::open(d.path);
  ASSERT_EQ(ck->all().size(), 2u);
  const TensorInfo* t = ck->find("a");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype, DType::F32);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(std::memcmp(t->data, a.data(), 24), 0);
  EXPECT_EQ(std::memcmp(ck->find("b")->data, b.data(), 6), 0);
  EXPECT_EQ(ck->find("c"), nullptr);
}

TEST(Safetensors, RecognisesQuantizedDtypes) {
  TempDir d;
  std::vector<uint8_t> x(16);
  write_safetensors(d.path / "model.safetensors",
                    {{"u8", DType::U8, {16}, x}, {"u32", DType::U32, {4}, x},
                     {"i8", DType::I8, {16}, x}, {"f8", DType::F8_E4M3, {16}, x},
                     {"f16", DType::F16, {8}, x}});
  auto ck = Checkpoint::open(d.path);
  EXPECT_EQ(ck->find("u32")->dtype, DType::U32);
  EXPECT_EQ(ck->find("f8")->dtype, DType::F8_E4M3);
  EXPECT_EQ(ck->find("i8")->dtype, DType::I8);
}

struct BadCase {
  const char* what;
  std::string file;
  std::string expect;
};

TEST(Safetensors, MalformedFilesAreClearErrors) {
  const std::string ok_hdr = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string data8(8, '\1');
  const std::vector<BadCase> cases = {
      {"empty file", "", "truncated"},
      {"7 bytes", std::string(7, '\0'), "truncated"},
      {"header longer than file", raw_file(ok_hdr, data8, 1 << 20), "exceeds the file"},
      {"huge header length", raw_file(ok_hdr, data8, int64_t(1) << 62), "exceeds the file"},
      {"header not JSON", raw_file("{not json", data8), "malformed safetensors header"},
      {"header not object", raw_file("[1,2]", data8), "not a JSON object"},
      {"unknown dtype", raw_file(R"({"w":{"dtype":"Q9","shape":[2],"data_offsets":[0,8]}})", data8), "unknown dtype"},
      {"end beyond data", raw_file(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", data8), "outside the data section"},
      {"begin after end", raw_file(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})", data8), "outside the data section"},
      {"size mismatch", raw_file(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", data8), "bytes expected"},
      {"negative dim", raw_file(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", data8), "non-negative"},
      {"overflowing shape", raw_file(R"({"w":{"dtype":"F32","shape":[2199023255552],"data_offsets":[0,8]}})", data8), "too large"},
      {"overflowing product", raw_file(R"({"w":{"dtype":"F32","shape":[1099511627776,1099511627776],"data_offsets":[0,8]}})", data8), "overflows"},
      {"negative offset", raw_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})", data8), "data_offsets"},
      {"offsets not pair", raw_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", data8), "data_offsets"},
      {"missing shape", raw_file(R"({"w":{"dtype":"F32","data_offsets":[0,8]}})", data8), "missing shape"},
      {"overlap", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", data8), "overlap"},
      {"metadata not strings", raw_file(R"({"__metadata__":{"k":1},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", data8), "__metadata__"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    TempDir d;
    testing::write_file(d.path / "model.safetensors", c.file);
    expect_error([&] { Checkpoint::open(d.path); }, {c.expect, "model.safetensors"});
  }
}

TEST(Safetensors, ShardedCheckpoint) {
  TempDir d;
  std::vector<uint8_t> a(8, 1), b(8, 2);
  write_safetensors(d.path / "model-00001-of-00002.safetensors", {{"a", DType::F32, {2}, a}});
  write_safetensors(d.path / "model-00002-of-00002.safetensors", {{"b", DType::F32, {2}, b}});
  nlohmann::json idx = {{"metadata", {{"total_size", 16}}},
                        {"weight_map",
                         {{"a", "model-00001-of-00002.safetensors"},
                          {"b", "model-00002-of-00002.safetensors"}}}};
  testing::write_file(d.path / "model.safetensors.index.json", idx.dump());
  auto ck = Checkpoint::open(d.path);
  EXPECT_EQ(ck->all().size(), 2u);
  EXPECT_EQ(ck->find("b")->data[0], 2);
  EXPECT_EQ(ck->find("b")->file, "model-00002-of-00002.safetensors");

  // Index naming a tensor the shard does not hold.
  idx["weight_map"]["c"] = "model-00002-of-00002.safetensors";
  testing::write_file(d.path / "model.safetensors.index.json", idx.dump());
  expect_error([&] { Checkpoint::open(d.path); }, {"'c'", "listed in the index"});
  // Index naming a missing shard.
  idx["weight_map"].erase("c");
  idx["weight_map"]["a"] = "model-00003-of-00002.safetensors";
  testing::write_file(d.path / "model.safetensors.index.json", idx.dump());
  expect_error([&] { Checkpoint::open(d.path); }, {"does not exist"});
  // A shard holding a tensor the index does not list.
  idx["weight_map"]["a"] = "model-00001-of-00002.safetensors";
  testing::write_file(d.path / "model.safetensors.index.json", idx.dump());
  write_safetensors(d.path / "model-00001-of-00002.safetensors",
                    {{"a", DType::F32, {2}, a}, {"z", DType::F32, {2}, b}});
  expect_error([&] { Checkpoint::open(d.path); }, {"the index lists 2"});
  // Path traversal in the index.
  idx["weight_map"]["a"] = "../etc/passwd";
  testing::write_file(d.path / "model.safetensors.index.json", idx.dump());
  expect_error([&] { Checkpoint::open(d.path); }, {"not a plain file name"});
  // Malformed index.
  testing::write_file(d.path / "model.safetensors.index.json", "{\"weight_map\": 3}");
  expect_error([&] { Checkpoint::open(d.path); }, {"weight_map"});
}

TEST(Safetensors, MissingCheckpoint) {
  TempDir d;
  expect_error([&] { Checkpoint::open(d.path); }, {"neither model.safetensors"});
}

}  // namespace
}  // namespace kestrel

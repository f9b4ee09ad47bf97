// Exact parity with Hugging Face tokenizers 0.23.2 (expected ids made on the GPU machine by
// tools/tokenizer/hf_expected.py via tools/device/tok.sh) for the 2,085-string corpus, with added
// tokens off (message content) and on (raw prompts), for the full-size Qwen3 tokenizer.json, its
// Qwen3.6-style variant and the tiny fixture tokenizer; plus decode parity (lossy UTF-8, skip_special)
// and decode(encode(s)) == NFC(s).
#include <gtest/gtest.h>

#include "helpers.h"

namespace kestrel::test {
namespace {

using nlohmann::json;

struct Set {
  const char* name;
  const Tokenizer& (*tok)();
};

void PrintTo(const Set& s, std::ostream* os) { *os << s.name; }

class Parity : public ::testing::TestWithParam<Set> {};

TEST_P(Parity, EncodeMatchesHfTokenizers) {
  const Tokenizer& tok = GetParam().tok();
  const auto texts = corpus();
  const auto lines = read_lines(fixtures() / (std::string("tokenizer/expected_") + GetParam().name + ".jsonl.gz"));
  ASSERT_EQ(texts.size(), lines.size());
  ASSERT_GE(texts.size(), 2000u);
  size_t bad_plain = 0, bad_special = 0, bad_roundtrip = 0, n_special_cases = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    const json e = json::parse(lines[i]);
    const auto want_plain = e["p"].get<std::vector<int32_t>>();
    const auto want_special = e.contains("s") ? e["s"].get<std::vector<int32_t>>() : want_plain;
    n_special_cases += e.contains("s");
    const auto got_plain = tok.encode(texts[i], false);
    const auto got_special = tok.encode(texts[i], true);
    if (got_plain != want_plain && bad_plain++ < 5)
      ADD_FAILURE() << GetParam().name << " string " << i << " " << json(texts[i]).dump() << "\n want "
                    << ids_str(want_plain) << "\n got  " << ids_str(got_plain);
    if (got_special != want_special && bad_special++ < 5)
      ADD_FAILURE() << GetParam().name << " (special) string " << i << " " << json(texts[i]).dump()
                    << "\n want " << ids_str(want_special) << "\n got  " << ids_str(got_special);
    if (tok.decode(got_plain) != nfc(texts[i]) && bad_roundtrip++ < 5)
      ADD_FAILURE() << GetParam().name << " roundtrip " << i << " " << json(texts[i]).dump();
  }
  EXPECT_EQ(bad_plain, 0u);
  EXPECT_EQ(bad_special, 0u);
  EXPECT_EQ(bad_roundtrip, 0u);
  EXPECT_GT(n_special_cases, 100u);  // the corpus does exercise added-token matching
  std::printf("[parity] %s: %zu strings x 2 modes, %zu with added tokens\n", GetParam().name, texts.size(),
              n_special_cases);
}

TEST_P(Parity, DecodeMatchesHfTokenizers) {
  const Tokenizer& tok = GetParam().tok();
  const json cases = json::parse(read_file(fixtures() / (std::string("tokenizer/decode_") + GetParam().name + ".json")));
  ASSERT_GE(cases.size(), 400u);
  size_t bad = 0;
  for (const json& c : cases) {
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    const std::string want = c["text"], want_skip = c["text_skip"];
    const std::string got = tok.decode(ids, false), got_skip = tok.decode(ids, true);
    if ((got != want || got_skip != want_skip) && bad++ < 5)
      ADD_FAILURE() << "ids " << ids_str(ids) << "\n want " << json(want).dump() << " / " << json(want_skip).dump()
                    << "\n got  " << json(got).dump() << " / " << json(got_skip).dump();
    // The streaming detokenizer produces the same text.
    for (bool skip : {false, true}) {
      StreamDecoder sd(tok, skip);
      std::string s;
      for (int32_t id : ids) s += sd.push(id);
      s += sd.flush();
      if (s != (skip ? want_skip : want) && bad++ < 5)
        ADD_FAILURE() << "stream ids " << ids_str(ids) << " skip=" << skip << " got " << json(s).dump();
    }
  }
  EXPECT_EQ(bad, 0u);
}

INSTANTIATE_TEST_SUITE_P(Hf, Parity,
                         ::testing::Values(Set{"qwen3", &qwen3}, Set{"qwen36v", &qwen36v}, Set{"tiny", &tiny}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace kestrel::test

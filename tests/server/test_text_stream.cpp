// Strict request JSON, UTF-8 assembly and stop-string hold-back.
#include "server/api_error.h"
#include "server/text_stream.h"

#include <gtest/gtest.h>

using namespace kestrel::server;

TEST(ParseJsonBody, AcceptsObjectsRejectsTheRest) {
  EXPECT_TRUE(parse_json_body(R"({"a":1})").is_object());
  for (std::string bad : {"", "[]", "1", "\"s\"", "null", "{", "{\"a\":}", "{'a':1}", "{\"a\":1}x",
                          "{\"a\":\"\xff\"}", "{\"a\":\"\\ud800\"}"}) {
    try {
      parse_json_body(bad);
      ADD_FAILURE() << "accepted: " << bad;
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status, 400);
      EXPECT_EQ(std::string(e.what()).find("\xff"), std::string::npos);
    }
  }
}

TEST(ParseJsonBody, DepthLimit) {
  auto nested = [](int d) { return "{\"x\":" + std::string(size_t(d - 1), '[') + std::string(size_t(d - 1), ']') + "}"; };
  EXPECT_NO_THROW(parse_json_body(nested(64)));
  EXPECT_THROW(parse_json_body(nested(65)), ApiError);
  EXPECT_THROW(parse_json_body("{\"x\":" + std::string(100000, '[')), ApiError);
  try {
    parse_json_body(nested(1000));
  } catch (const ApiError& e) {
    EXPECT_NE(std::string(e.what()).find("64"), std::string::npos);
  }
}

TEST(Utf8, Validation) {
  EXPECT_TRUE(is_valid_utf8("abc 你好 😀"));
  EXPECT_FALSE(is_valid_utf8("\xC0\x80"));          // overlong
  EXPECT_FALSE(is_valid_utf8("\xED\xA0\x80"));      // surrogate
  EXPECT_FALSE(is_valid_utf8("\xF4\x90\x80\x80"));  // > U+10FFFF
  EXPECT_FALSE(is_valid_utf8("\xE4\xBD"));          // truncated
  EXPECT_EQ(utf8_sanitize("a\xffz"), "a\xEF\xBF\xBDz");
}

TEST(Utf8Assembler, HoldsPartialSequences) {
  Utf8Assembler a;
  std::string emoji = "😀";  // 4 bytes
  EXPECT_EQ(a.push(emoji.substr(0, 1)), "");
  EXPECT_EQ(a.push(emoji.substr(1, 2)), "");
  EXPECT_EQ(a.push(emoji.substr(3) + "x"), emoji + "x");
  EXPECT_EQ(a.push("\xE4\xBD"), "");
  EXPECT_EQ(a.flush(), "\xEF\xBF\xBD");
  EXPECT_EQ(a.push("\xff" "a"), "\xEF\xBF\xBD" "a");
}

TEST(StopMatcher, HoldsPrefixAndStops) {
  StopMatcher m({"STOP", "\n\n"});
  EXPECT_EQ(m.push("hello ST"), "hello ");
  EXPECT_EQ(m.push("O"), "");
  EXPECT_EQ(m.push("x"), "STOx");
  EXPECT_EQ(m.push(" and S"), " and ");
  EXPECT_EQ(m.push("TOP more"), "");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.matched(), "STOP");
  EXPECT_EQ(m.push("later"), "");
  EXPECT_EQ(m.flush(), "");
}

TEST(StopMatcher, FlushReleasesPendingPrefix) {
  StopMatcher m({"END"});
  EXPECT_EQ(m.push("abcE"), "abc");
  EXPECT_FALSE(m.stopped());
  EXPECT_EQ(m.flush(), "E");
}

TEST(StopMatcher, NoStops) {
  StopMatcher m({});
  EXPECT_EQ(m.push("x"), "x");
}

TEST(StopMatcher, MultibyteStop) {
  StopMatcher m({"你好"});
  EXPECT_EQ(m.push("a你"), "a");
  EXPECT_EQ(m.push("好b"), "");
  EXPECT_TRUE(m.stopped());
}

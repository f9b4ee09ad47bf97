// Reasoning + Qwen XML tool-call parser: the grammar, the bugs of openai-api.md §2.3, and chunking
// invariance (streamed == whole for every split).
#include "server/output_parser.h"

#include <gtest/gtest.h>

#include <random>

using namespace kestrel::server;
using nlohmann::json;

namespace {

struct Call {
  std::string id, name, args;
};
struct Result {
  std::string reasoning, content;
  std::vector<Call> calls;
  bool operator==(const Result& o) const {
    if (reasoning != o.reasoning || content != o.content || calls.size() != o.calls.size()) return false;
    for (size_t i = 0; i < calls.size(); ++i)
      if (calls[i].name != o.calls[i].name || calls[i].args != o.calls[i].args) return false;
    return true;
  }
};

void absorb(Result& r, const std::vector<ParserEvent>& evs) {
  for (const auto& e : evs) {
    switch (e.kind) {
      case ParserEvent::Kind::Reasoning: r.reasoning += e.text; break;
      case ParserEvent::Kind::Content: r.content += e.text; break;
      case ParserEvent::Kind::ToolStart:
        ASSERT_EQ(size_t(e.index), r.calls.size());
        r.calls.push_back({e.id, e.name, ""});
        break;
      case ParserEvent::Kind::ToolArgs:
        ASSERT_LT(size_t(e.index), r.calls.size());
        r.calls[size_t(e.index)].args += e.text;
        break;
    }
  }
}

json weather_tools() {
  return json::parse(R"([{"type":"function","function":{"name":"get_weather","parameters":{"type":"object",
    "properties":{"city":{"type":"string"},"days":{"type":"integer"},"metric":{"type":"boolean"},
    "temp":{"type":"number"},"opts":{"type":"object"},"tags":{"type":"array","items":{"type":"string"}},
    "note":{"type":["string","null"]},"limit":{"anyOf":[{"type":"null"},{"type":"integer"}]}}}}},
    {"type":"function","function":{"name":"search","parameters":{"type":"object","properties":{"q":{"type":"string"}}}}}])");
}

ParserOptions opts(bool reasoning, bool tools = true) {
  ParserOptions o;
  o.start_in_reasoning = reasoning;
  o.parse_tools = tools;
  o.tools = weather_tools();
  o.id_seed = 42;
  return o;
}

Result run(const std::string& text, const ParserOptions& o, const std::vector<size_t>& cuts = {}) {
  OutputParser p(o);
  Result r;
  size_t prev = 0;
  for (size_t c : cuts) {
    absorb(r, p.feed(text.substr(prev, c - prev)));
    prev = c;
  }
  absorb(r, p.feed(text.substr(prev)));
  absorb(r, p.finish());
  return r;
}

// Whole, every single-character split, and 50 random chunkings must agree.
Result run_all_chunkings(const std::string& text, const ParserOptions& o) {
  Result whole = run(text, o);
  std::vector<size_t> chars;
  for (size_t i = 1; i < text.size(); ++i) chars.push_back(i);
  Result per_char = run(text, o, chars);
  EXPECT_TRUE(per_char == whole) << "per-char chunking differs for: " << text << "\nwhole content=["
                                 << whole.content << "] per-char content=[" << per_char.content << "]";
  std::mt19937 rng(7);
  for (int t = 0; t < 50; ++t) {
    std::vector<size_t> cuts;
    for (size_t i = 1; i < text.size(); ++i)
      if (rng() % 4 == 0) cuts.push_back(i);
    Result r = run(text, o, cuts);
    EXPECT_TRUE(r == whole) << "random chunking " << t << " differs for: " << text;
  }
  for (const auto& c : whole.calls) {
    json a;
    EXPECT_NO_THROW(a = json::parse(c.args)) << c.args;
    EXPECT_TRUE(a.is_object()) << c.args;
    EXPECT_EQ(c.id.size(), 29u);
    EXPECT_EQ(c.id.rfind("call_", 0), 0u);
  }
  return whole;
}

const std::string kCall =
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
    "</parameter>\n</function>\n</tool_call>";

}  // namespace

TEST(OutputParser, PlainContent) {
  Result r = run_all_chunkings("Hello, world! 你好 😀", opts(false));
  EXPECT_EQ(r.content, "Hello, world! 你好 😀");
  EXPECT_TRUE(r.reasoning.empty());
  EXPECT_TRUE(r.calls.empty());
}

TEST(OutputParser, ReasoningThenContent) {
  Result r = run_all_chunkings("The user says hi.\nI answer.\n</think>\n\nHi there!", opts(true));
  EXPECT_EQ(r.reasoning, "The user says hi.\nI answer.");
  EXPECT_EQ(r.content, "Hi there!");
}

TEST(OutputParser, ThinkingNeverLeaksIntoContent) {
  Result r = run_all_chunkings("<think>\nhmm\n</think>\n\nok", opts(true));
  EXPECT_EQ(r.reasoning, "hmm");
  EXPECT_EQ(r.content, "ok");
  // Thinking off, but the model opens a think block anyway at the start.
  Result r2 = run_all_chunkings("<think>\nhmm\n</think>\n\nok", opts(false));
  EXPECT_EQ(r2.reasoning, "hmm");
  EXPECT_EQ(r2.content, "ok");
}

TEST(OutputParser, TruncatedReasoningStaysReasoning) {
  Result r = run_all_chunkings("still thinking about </thi", opts(true));
  EXPECT_EQ(r.reasoning, "still thinking about </thi");
  EXPECT_EQ(r.content, "");
}

TEST(OutputParser, SingleToolCallTypedArguments) {
  Result r = run_all_chunkings("Let me check.\n\n" + kCall, opts(false));
  EXPECT_EQ(r.content, "Let me check.");
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].name, "get_weather");
  EXPECT_EQ(json::parse(r.calls[0].args), json::parse(R"({"city":"Paris","days":3})"));
}

TEST(OutputParser, AllSchemaTypes) {
  std::string t =
      "<tool_call>\n<function=get_weather>\n"
      "<parameter=city>\nNew \"York\"\n\\ line2\n</parameter>\n"
      "<parameter=days>\nseven\n</parameter>\n"
      "<parameter=metric>\nTrue\n</parameter>\n"
      "<parameter=temp>\n21.5\n</parameter>\n"
      "<parameter=opts>\n{'unit': 'C', 'verbose': True, 'x': None}\n</parameter>\n"
      "<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n"
      "<parameter=note>\nNone\n</parameter>\n"
      "<parameter=limit>\nNone\n</parameter>\n"
      "<parameter=unknown>\n42\n</parameter>\n"
      "</function>\n</tool_call>";
  Result r = run_all_chunkings(t, opts(false));
  ASSERT_EQ(r.calls.size(), 1u);
  json a = json::parse(r.calls[0].args);
  EXPECT_EQ(a["city"], "New \"York\"\n\\ line2");
  EXPECT_EQ(a["days"], "seven");  // not an integer: kept as the string
  EXPECT_EQ(a["metric"], true);
  EXPECT_EQ(a["temp"], 21.5);
  EXPECT_EQ(a["opts"], json::parse(R"({"unit":"C","verbose":true,"x":null})"));
  EXPECT_EQ(a["tags"], json::parse(R"(["a","b"])"));
  EXPECT_EQ(a["note"], "None");  // string-typed (nullable string): raw text
  EXPECT_TRUE(a["limit"].is_null());
  EXPECT_EQ(a["unknown"], "42");  // not in the schema: a string
}

TEST(OutputParser, ValuesAreNeverEvaluated) {
  std::string t = "<tool_call>\n<function=get_weather>\n<parameter=opts>\n__import__('os').system('x')\n"
                  "</parameter>\n</function>\n</tool_call>";
  Result r = run_all_chunkings(t, opts(false));
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(json::parse(r.calls[0].args)["opts"], "__import__('os').system('x')");
}

TEST(OutputParser, SeveralCallsInOneTurn) {
  // llama.cpp #22878 / QwenPaw #3560: two parallel calls must not abort the stream.
  std::string t = kCall + "\n" +
                  "<tool_call>\n<function=search>\n<parameter=q>\nrain\n</parameter>\n</function>\n</tool_call>";
  Result r = run_all_chunkings(t, opts(false));
  ASSERT_EQ(r.calls.size(), 2u);
  EXPECT_EQ(r.calls[1].name, "search");
  EXPECT_EQ(json::parse(r.calls[1].args), json::parse(R"({"q":"rain"})"));
  EXPECT_NE(r.calls[0].id, r.calls[1].id);
  EXPECT_EQ(r.content, "");
}

TEST(OutputParser, ParallelToolCallsFalseKeepsFirst) {
  auto o = opts(false);
  o.parallel_tool_calls = false;
  std::string t = kCall + "\n<tool_call>\n<function=search>\n<parameter=q>\nx\n</parameter>\n</function>\n</tool_call>";
  Result r = run_all_chunkings(t, o);
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].name, "get_weather");
}

TEST(OutputParser, ToolCallInsideThinkingIsNotLost) {
  // vLLM #39056: a call emitted before </think> went to reasoning and was lost.
  Result r = run_all_chunkings("I should look it up.\n" + kCall, opts(true));
  EXPECT_EQ(r.reasoning, "I should look it up.");
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].name, "get_weather");
}

TEST(OutputParser, ToolCallAfterReasoning) {
  Result r = run_all_chunkings("think\n</think>\n\n" + kCall, opts(true));
  EXPECT_EQ(r.reasoning, "think");
  EXPECT_EQ(r.content, "");
  ASSERT_EQ(r.calls.size(), 1u);
}

TEST(OutputParser, TextBeforeToolCall) {
  // llama.cpp #20260: text before <tool_call> made the parser fail.
  Result r = run_all_chunkings("Sure! I'll call the tool now: " + kCall + "\nDone.", opts(false));
  EXPECT_EQ(r.content, "Sure! I'll call the tool now: Done.");
  ASSERT_EQ(r.calls.size(), 1u);
}

TEST(OutputParser, LiteralToolCallInProseDoesNotSilenceTheStream) {
  // club-3090 #72: a literal <tool_call> in prose flipped the parser into tool mode for good.
  std::string t = "Use the <tool_call> tag to call tools, then <function=x> ... ok";
  OutputParser p(opts(false));
  Result streamed;
  absorb(streamed, p.feed("Use the <tool_call> tag"));
  EXPECT_EQ(streamed.content, "Use the <tool_call> tag");  // released as soon as it diverges
  Result r = run_all_chunkings(t, opts(false));
  EXPECT_EQ(r.content, t);
  EXPECT_TRUE(r.calls.empty());
}

TEST(OutputParser, ToolsDisabledMeansContent) {
  Result r = run_all_chunkings(kCall, opts(false, /*tools=*/false));
  EXPECT_EQ(r.content, kCall);
  EXPECT_TRUE(r.calls.empty());
}

TEST(OutputParser, DuplicateClosingParameter) {
  // llama.cpp #24807: a duplicated </parameter> dropped the call and aborted the stream.
  std::string t = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</parameter>\n"
                  "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>";
  Result r = run_all_chunkings(t, opts(false));
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(json::parse(r.calls[0].args), json::parse(R"({"city":"Paris","days":2})"));
}

TEST(OutputParser, ParameterCloserInsideValueIsLiteral) {
  // vLLM PR #33965 / #43074: </parameter> leaking / splitting values. Here the value contains the
  // literal closing tag followed by ordinary text.
  std::string t = "<tool_call>\n<function=search>\n<parameter=q>\nwrite </parameter> in xml\n</parameter>\n"
                  "</function>\n</tool_call>";
  Result r = run_all_chunkings(t, opts(false));
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(json::parse(r.calls[0].args)["q"], "write </parameter> in xml");
  EXPECT_EQ(r.content, "");
}

TEST(OutputParser, MissingParameterCloserRecovered) {
  // reliability-plan 18: a missing </parameter> leaked into the next value.
  std::string t = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n4\n"
                  "</parameter>\n</function>\n</tool_call>";
  Result r = run_all_chunkings(t, opts(false));
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(json::parse(r.calls[0].args), json::parse(R"({"city":"Paris","days":4})"));
}

TEST(OutputParser, LastParameterAndCloserTogether) {
  // club-3090 #145 (MTP put the last parameter and </function> in one delta -> empty tool_calls).
  OutputParser p(opts(false));
  Result r;
  absorb(r, p.feed("<tool_call>\n<function=search>\n"));
  absorb(r, p.feed("<parameter=q>\nx\n</parameter>\n</function>\n</tool_call>"));
  absorb(r, p.finish());
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(json::parse(r.calls[0].args), json::parse(R"({"q":"x"})"));
}

TEST(OutputParser, ArgumentsStreamIncrementally) {
  // vLLM #30439: arguments were not streamed. String values grow token by token.
  OutputParser p(opts(false));
  Result r;
  absorb(r, p.feed("<tool_call>\n<function=search>\n<parameter=q>\nhello"));
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].args, "{\"q\": \"hello");
  absorb(r, p.feed(" wor"));
  EXPECT_EQ(r.calls[0].args, "{\"q\": \"hello wor");
  absorb(r, p.feed("ld\n</parameter>\n</function>\n</tool_call>"));
  absorb(r, p.finish());
  EXPECT_EQ(r.calls[0].args, "{\"q\": \"hello world\"}");
}

TEST(OutputParser, HeaderDeltaAtFunctionName) {
  OutputParser p(opts(false));
  auto evs = p.feed("<tool_call>\n<function=get_weather>");
  ASSERT_EQ(evs.size(), 1u);
  EXPECT_EQ(evs[0].kind, ParserEvent::Kind::ToolStart);
  EXPECT_EQ(evs[0].name, "get_weather");
  EXPECT_EQ(evs[0].index, 0);
}

TEST(OutputParser, TruncatedCallIsClosedValidJson) {
  for (std::string t : {"<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
                        "<tool_call>\n<function=get_weather>\n<parameter=days>\n1",
                        "<tool_call>\n<function=get_weather>\n<parameter=ci",
                        "<tool_call>\n<function=get_weather>\n"}) {
    Result r = run_all_chunkings(t, opts(false));
    ASSERT_EQ(r.calls.size(), 1u) << t;
    EXPECT_TRUE(json::parse(r.calls[0].args).is_object());
  }
}

TEST(OutputParser, TruncatedBeforeCommitFallsBackToText) {
  for (std::string t : {"<tool_call>", "<tool_call>\n<func", "<tool_call>\n<function=get_wea", "<tool_ca"}) {
    Result r = run_all_chunkings(t, opts(false));
    EXPECT_TRUE(r.calls.empty()) << t;
    EXPECT_EQ(r.content, t);
  }
}

TEST(OutputParser, MalformedShapesNeverCrash) {
  for (std::string t : std::vector<std::string>
       {"<tool_call><function=></function></tool_call>", "<tool_call>\n<function=a<b>\n</tool_call>",
        "</tool_call></function></parameter>", "<tool_call>\n<function=search>\n{\"q\": \"json body\"}\n</function>\n</tool_call>",
        "<tool_call>\n<function=search>\n<parameter=>\nx\n</parameter>\n</function>",
        "<tool_call>\n<function=search>\n<parameter=q>\n</parameter></parameter></parameter>",
        "<tool_call>\n<function=search>\n</function>\n</function>\n</tool_call></tool_call>",
        std::string(300, '<') + "<tool_call>" + std::string(200, 'a') + ">"}) {
    Result r = run_all_chunkings(t, opts(false));
    (void)r;
  }
  Result r = run("<tool_call>\n<function=search>\n{\"q\": \"json body\"}\n</function>\n</tool_call>", opts(false));
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(json::parse(r.calls[0].args), json::parse(R"({"q":"json body"})"));
}

TEST(OutputParser, LongValue) {
  std::string v(1 << 20, 'x');
  std::string t = "<tool_call>\n<function=search>\n<parameter=q>\n" + v + "\n</parameter>\n</function>\n</tool_call>";
  Result r = run(t, opts(false));
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(json::parse(r.calls[0].args)["q"].get<std::string>().size(), v.size());
}

TEST(ConvertParam, Table) {
  json s_int = {{"type", "integer"}}, s_num = {{"type", "number"}}, s_bool = {{"type", "boolean"}};
  EXPECT_EQ(convert_param_value("12", &s_int), 12);
  EXPECT_EQ(convert_param_value("1.5", &s_int), "1.5");
  EXPECT_EQ(convert_param_value("3.0", &s_num), 3);
  EXPECT_EQ(convert_param_value("nan", &s_num), "nan");
  EXPECT_EQ(convert_param_value("1e999", &s_num), "1e999");
  EXPECT_EQ(convert_param_value("FALSE", &s_bool), false);
  EXPECT_EQ(convert_param_value("true", &s_bool), true);
  EXPECT_EQ(convert_param_value("x", nullptr), "x");
  json s_obj = {{"type", "object"}};
  EXPECT_EQ(convert_param_value("\"{\\\"a\\\": 1}\"", &s_obj), json::parse(R"({"a":1})"));  // double-encoded
  EXPECT_EQ(convert_param_value("not json", &s_obj), "not json");
}

TEST(OutputParser, RandomOutputsAnyChunkingSameResultValidJson) {
  // reliability-plan T20: many generated outputs (valid, missing closers, stray tags, JSON values,
  // interleaved think markers), each whole and in random chunkings.
  const std::vector<std::string> frags = {
      "<tool_call>", "</tool_call>", "<function=get_weather>", "<function=search>", "</function>", "<parameter=city>",
      "<parameter=days>", "<parameter=opts>", "<parameter=q>", "</parameter>", "<think>", "</think>", "\n", "\n\n", " ",
      "Paris", "42", "true", "{\"a\": [1, 2]}", "text", "é", "你好", "😀", "<", ">", "=", "</", "<tool_", "<param",
      "\"quoted\"", "back\\slash", "None"};
  std::mt19937 rng(12345);
  int with_calls = 0;
  for (int t = 0; t < 600; ++t) {
    std::string text;
    const int n = 1 + int(rng() % 24);
    for (int i = 0; i < n; ++i) text += frags[rng() % frags.size()];
    if (t % 3 == 0) text = "<tool_call>\n<function=get_weather>\n<parameter=city>\n" + text;  // bias towards calls
    for (bool reasoning : {false, true}) {
      Result whole = run(text, opts(reasoning));
      for (int k = 0; k < 5; ++k) {
        std::vector<size_t> cuts;
        for (size_t i = 1; i < text.size(); ++i)
          if (rng() % 3 == 0 && (static_cast<unsigned char>(text[i]) & 0xC0) != 0x80) cuts.push_back(i);
        ASSERT_TRUE(run(text, opts(reasoning), cuts) == whole) << "chunking differs for: " << text;
      }
      for (const auto& c : whole.calls) {
        json a;
        ASSERT_NO_THROW(a = json::parse(c.args)) << text << "\nargs: " << c.args;
        ASSERT_TRUE(a.is_object()) << c.args;
      }
      with_calls += !whole.calls.empty();
    }
  }
  EXPECT_GT(with_calls, 300);
}

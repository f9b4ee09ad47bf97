// HTTP routing, the OpenAI response shapes (non-streaming and SSE), errors and limits.
#include "server/server.h"

#include "core/check.h"
#include "server/api_error.h"
#include "server/text_stream.h"

#include <httplib.h>
#include <spdlog/spdlog.h>

#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <random>

namespace kestrel::server {

namespace {
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

std::string random_hex(size_t n) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) s += hex[rng() & 15];
  return s;
}

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

void send_json(httplib::Response& res, int status, const json& j) {
  res.status = status;
  res.set_content(dump(j), "application/json");
}

void send_error(httplib::Response& res, const ApiError& e) {
  if (e.status == 429) {
    res.set_header("Retry-After", "1");
  }
  if (e.status >= 400 && e.status < 500 && e.status != 429 && e.status != 408) res.set_header("x-should-retry", "false");
  send_json(res, e.status, e.to_json());
}

// Constant-time comparison (the time depends only on the lengths).
bool ct_equal(std::string_view a, std::string_view b) {
  size_t n = std::max(a.size(), b.size());
  unsigned char d = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    d |= x ^ y;
  }
  return d == 0;
}

std::string normalize_path(const std::string& p) {
  std::string out;
  for (char c : p) {
    if (c == '/' && !out.empty() && out.back() == '/') continue;
    out += c;
  }
  while (out.size() > 1 && out.back() == '/') out.pop_back();
  return out.empty() ? "/" : out;
}

// Turns generation events into the OpenAI shapes (chat or text completion, streamed or not).
class Responder {
 public:
  Responder(const ModelInfo& mi, PreparedRequest& pr, std::shared_ptr<GenStream> gs, std::string model,
            std::string reasoning_field, Metrics& metrics, Clock::time_point t0)
      : mi_(mi), pr_(pr), gs_(std::move(gs)), model_(std::move(model)), rfield_(std::move(reasoning_field)),
        metrics_(metrics), t0_(t0), stop_(pr.stop), parser_(pr.parser) {
    id_ = (pr.chat ? "chatcmpl-" : "cmpl-") + random_hex(24);
    created_ = int64_t(std::time(nullptr));
    for (const char* m : {"<think>", "</think>", "<tool_call>", "</tool_call>"})
      if (auto id = mi.tok->token_id(m)) keep_.push_back(*id);
  }

  // A stream whose client went away is still counted and logged.
  ~Responder() { record(); }

  // ---- streaming ----
  std::string sse_begin() {
    if (!pr_.chat) return {};
    return chunk(json{{"role", "assistant"}, {"content", ""}}, nullptr);
  }
  std::string sse_events(const std::vector<GenEvent>& evs) {
    std::string out;
    for (const auto& ev : evs) out += consume(ev, true);
    return out;
  }
  std::string sse_finish() {
    std::string out = drain(true);
    GenEnd end = gs_->end();
    if (!stopped_by_string_ && (end == GenEnd::Error || end == GenEnd::Shutdown)) {
      json err = end == GenEnd::Shutdown
                     ? json{{"error", {{"message", "the server is shutting down"}, {"type", "server_error"},
                                       {"param", nullptr}, {"code", "server_shutdown"}}}}
                     : json{{"error", {{"message", "internal error during generation"}, {"type", "server_error"},
                                       {"param", nullptr}, {"code", "internal_error"}}}};
      spdlog::warn("request {} ended with an error: {}", id_, gs_->error());
      out += "data: " + dump(err) + "\n\n";
      record();
      return out;
    }
    const std::string reason = finish_reason();
    if (pr_.chat) {
      json c = base("chat.completion.chunk");
      c["choices"] = json::array({json{{"index", 0}, {"delta", json::object()}, {"logprobs", take_logprobs()},
                                       {"finish_reason", reason}}});
      c["usage"] = nullptr;
      out += "data: " + dump(c) + "\n\n";
    } else {
      json c = base("text_completion");
      c["choices"] = json::array({json{{"index", 0}, {"text", ""}, {"logprobs", take_logprobs()}, {"finish_reason", reason}}});
      c["usage"] = nullptr;
      out += "data: " + dump(c) + "\n\n";
    }
    if (pr_.include_usage) {
      json u = base(pr_.chat ? "chat.completion.chunk" : "text_completion");
      u["choices"] = json::array();
      u["usage"] = usage();
      out += "data: " + dump(u) + "\n\n";
    }
    out += "data: [DONE]\n\n";
    record();
    return out;
  }

  // ---- non-streaming ----
  void consume_all(const std::vector<GenEvent>& evs) {
    for (const auto& ev : evs) consume(ev, false);
  }
  // Returns the status and body.
  std::pair<int, json> final_response() {
    drain(false);
    GenEnd end = gs_->end();
    if (!stopped_by_string_ && (end == GenEnd::Error || end == GenEnd::Shutdown)) {
      record();
      spdlog::warn("request {} ended with an error: {}", id_, gs_->error());
      if (end == GenEnd::Shutdown)
        return {503, ApiError(503, "server_error", "the server is shutting down", "", "server_shutdown").to_json()};
      return {500, ApiError(500, "server_error", "internal error during generation", "", "internal_error").to_json()};
    }
    const std::string reason = finish_reason();
    json r = base(pr_.chat ? "chat.completion" : "text_completion");
    if (pr_.chat) {
      json msg = {{"role", "assistant"}, {"content", nullptr}, {"refusal", nullptr}};
      if (!content_.empty() || calls_.empty()) msg["content"] = content_;
      if (!reasoning_.empty()) set_reasoning(msg, reasoning_);
      if (!calls_.empty()) {
        json tc = json::array();
        for (const auto& c : calls_)
          tc.push_back({{"id", c.id}, {"type", "function"}, {"function", {{"name", c.name}, {"arguments", c.args}}}});
        msg["tool_calls"] = tc;
      }
      json lp = nullptr;
      if (pr_.logprobs) lp = json{{"content", lp_all_}};
      r["choices"] = json::array({json{{"index", 0}, {"message", msg}, {"logprobs", lp}, {"finish_reason", reason}}});
    } else {
      json lp = nullptr;
      if (pr_.logprobs) {
        json toks = json::array(), lps = json::array(), tops = json::array(), offs = json::array();
        size_t off = 0;
        for (const auto& e : lp_all_) {
          toks.push_back(e["token"]);
          lps.push_back(e["logprob"]);
          json t = json::object();
          for (const auto& a : e["top_logprobs"]) t[a["token"].get<std::string>()] = a["logprob"];
          tops.push_back(t);
          offs.push_back(off);
          off += e["token"].get<std::string>().size();
        }
        lp = json{{"tokens", toks}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offs}};
      }
      r["choices"] = json::array({json{{"index", 0}, {"text", content_}, {"logprobs", lp}, {"finish_reason", reason}}});
    }
    r["usage"] = usage();
    record();
    return {200, r};
  }

  void cancel() { gs_->cancel(); }
  const std::string& id() const { return id_; }

 private:
  struct Call {
    std::string id, name, args;
  };

  json base(const char* object) const {
    return json{{"id", id_}, {"object", object}, {"created", created_}, {"model", model_}, {"system_fingerprint", nullptr}};
  }
  void set_reasoning(json& obj, const std::string& text) const {
    if (rfield_ == "both") {
      obj["reasoning_content"] = text;
      obj["reasoning"] = text;
    } else {
      obj[rfield_] = text;
    }
  }
  json take_logprobs() {
    if (!pr_.logprobs || lp_pending_.empty()) return nullptr;
    json lp;
    if (pr_.chat) {
      lp = json{{"content", lp_pending_}};
    } else {
      json toks = json::array(), lps = json::array(), tops = json::array();
      for (const auto& e : lp_pending_) {
        toks.push_back(e["token"]);
        lps.push_back(e["logprob"]);
        json t = json::object();
        for (const auto& a : e["top_logprobs"]) t[a["token"].get<std::string>()] = a["logprob"];
        tops.push_back(t);
      }
      lp = json{{"tokens", toks}, {"token_logprobs", lps}, {"top_logprobs", tops}};
    }
    lp_pending_ = json::array();
    return lp;
  }
  std::string chunk(const json& delta, const json* /*unused*/) {
    json c = base("chat.completion.chunk");
    c["choices"] = json::array({json{{"index", 0}, {"delta", delta}, {"logprobs", take_logprobs()}, {"finish_reason", nullptr}}});
    c["usage"] = nullptr;
    return "data: " + dump(c) + "\n\n";
  }
  std::string text_chunk(const std::string& text) {
    json c = base("text_completion");
    c["choices"] = json::array({json{{"index", 0}, {"text", text}, {"logprobs", take_logprobs()}, {"finish_reason", nullptr}}});
    c["usage"] = nullptr;
    return "data: " + dump(c) + "\n\n";
  }
  json usage() const {
    json u = {{"prompt_tokens", pr_.prompt_tokens}, {"completion_tokens", completion_tokens_},
              {"total_tokens", pr_.prompt_tokens + completion_tokens_}};
    if (pr_.chat) {
      u["prompt_tokens_details"] = {{"cached_tokens", 0}};
      u["completion_tokens_details"] = {{"reasoning_tokens", reasoning_tokens_}};
    }
    return u;
  }
  std::string finish_reason() const {
    GenEnd end = gs_->end();
    if (stopped_by_string_ || end == GenEnd::Eos) return parser_.tool_calls() > 0 ? "tool_calls" : "stop";
    if (end == GenEnd::Length) return "length";
    return parser_.tool_calls() > 0 ? "tool_calls" : "stop";
  }
  void record() {
    if (recorded_) return;
    recorded_ = true;
    metrics_.tokens(uint64_t(pr_.prompt_tokens), uint64_t(completion_tokens_));
    if (completion_tokens_ > 1)
      metrics_.tpot(std::chrono::duration<double>(t_last_ - t_first_).count() / double(completion_tokens_ - 1));
    spdlog::info("{} prompt={} completion={} ttft={:.1f}ms finish={}", id_, pr_.prompt_tokens, completion_tokens_,
                 completion_tokens_ ? std::chrono::duration<double, std::milli>(t_first_ - t0_).count() : 0.0,
                 gs_->end() == GenEnd::Error         ? "error"
                 : gs_->end() == GenEnd::Shutdown    ? "shutdown"
                 : gs_->end() == GenEnd::Cancelled && !stopped_by_string_ ? "cancelled"
                 : gs_->end() == GenEnd::None        ? "cancelled"
                                                     : finish_reason());
  }

  std::string emit_text(std::string text, bool stream) {
    if (text.empty()) return {};
    if (!pr_.chat) {
      content_ += text;
      return stream ? text_chunk(text) : std::string();
    }
    return emit_parsed(parser_.feed(text), stream);
  }
  std::string emit_parsed(const std::vector<ParserEvent>& evs, bool stream) {
    std::string out;
    for (const auto& e : evs) {
      json delta = json::object();
      switch (e.kind) {
        case ParserEvent::Kind::Reasoning:
          reasoning_ += e.text;
          set_reasoning(delta, e.text);
          break;
        case ParserEvent::Kind::Content:
          content_ += e.text;
          delta["content"] = e.text;
          break;
        case ParserEvent::Kind::ToolStart:
          calls_.push_back({e.id, e.name, ""});
          delta["tool_calls"] = json::array({json{{"index", e.index}, {"id", e.id}, {"type", "function"},
                                                  {"function", {{"name", e.name}, {"arguments", ""}}}}});
          break;
        case ParserEvent::Kind::ToolArgs:
          if (size_t(e.index) < calls_.size()) calls_[size_t(e.index)].args += e.text;
          delta["tool_calls"] = json::array({json{{"index", e.index}, {"function", {{"arguments", e.text}}}}});
          break;
      }
      if (stream) out += chunk(delta, nullptr);
    }
    return out;
  }

  std::string consume(const GenEvent& ev, bool stream) {
    if (stopped_by_string_) return {};
    auto now = Clock::now();
    if (completion_tokens_ == 0) {
      t_first_ = now;
      metrics_.ttft(std::chrono::duration<double>(now - t0_).count());
    }
    t_last_ = now;
    ++completion_tokens_;
    if (pr_.chat && parser_.in_reasoning()) ++reasoning_tokens_;
    if (pr_.logprobs && !ev.eos && ev.token < mi_.tok->vocab_size()) {
      auto entry = [&](int32_t id, float lp) {
        std::string b = mi_.tok->token_bytes(id);
        json bytes = json::array();
        for (unsigned char c : b) bytes.push_back(int(c));
        return json{{"token", utf8_sanitize(b)}, {"logprob", lp}, {"bytes", bytes}};
      };
      json e = entry(ev.token, ev.logprob);
      json top = json::array();
      for (const auto& t : ev.top)
        if (t.id >= 0 && t.id < mi_.tok->vocab_size()) top.push_back(entry(t.id, t.logprob));
      e["top_logprobs"] = top;
      lp_pending_.push_back(e);
      lp_all_.push_back(e);
    }
    if (ev.eos) return {};
    // Ids past the tokenizer's table (the model's padded vocabulary rows) have no text.
    if (ev.token < 0 || ev.token >= mi_.tok->vocab_size()) return {};
    bool show = !mi_.tok->is_special(ev.token) ||
                std::find(keep_.begin(), keep_.end(), ev.token) != keep_.end();
    if (!show) return {};
    std::string text = stop_.push(utf8_.push(mi_.tok->token_bytes(ev.token)));
    if (stop_.stopped()) {
      stopped_by_string_ = true;
      gs_->cancel();
    }
    return emit_text(std::move(text), stream);
  }

  // End of generation: flush the UTF-8 assembler, the stop matcher and the parser.
  std::string drain(bool stream) {
    std::string out;
    if (!stopped_by_string_) {
      std::string tail = stop_.push(utf8_.flush());
      if (stop_.stopped()) stopped_by_string_ = true;
      tail += stop_.flush();
      out += emit_text(std::move(tail), stream);
    }
    if (pr_.chat) out += emit_parsed(parser_.finish(), stream);
    return out;
  }

  const ModelInfo& mi_;
  PreparedRequest& pr_;
  std::shared_ptr<GenStream> gs_;
  std::string model_, rfield_;
  Metrics& metrics_;
  Clock::time_point t0_, t_first_, t_last_;
  std::string id_;
  int64_t created_ = 0;
  Utf8Assembler utf8_;
  StopMatcher stop_;
  OutputParser parser_;
  std::vector<int32_t> keep_;
  bool stopped_by_string_ = false;
  bool recorded_ = false;
  int completion_tokens_ = 0, reasoning_tokens_ = 0;
  std::string content_, reasoning_;
  std::vector<Call> calls_;
  json lp_pending_ = json::array(), lp_all_ = json::array();
};

struct Route {
  const char* path;
  const char* methods;  // comma list for Allow
  const char* label;    // metrics label
};
constexpr Route kRoutes[] = {
    {"/health", "GET", "health"},          {"/v1/health", "GET", "health"},
    {"/metrics", "GET", "metrics"},        {"/v1/models", "GET", "models"},
    {"/v1/chat/completions", "POST", "chat"}, {"/v1/completions", "POST", "completions"},
    {"/tokenize", "POST", "tokenize"},     {"/detokenize", "POST", "detokenize"},
    {"/apply-template", "POST", "apply_template"},
};

}  // namespace

HttpServer::HttpServer(ServerOptions opts) : opts_(std::move(opts)), svr_(std::make_unique<httplib::Server>()) {
  KESTREL_CHECK(opts_.reasoning_field == "reasoning_content" || opts_.reasoning_field == "reasoning" ||
                    opts_.reasoning_field == "both",
                "--reasoning-field must be reasoning_content, reasoning or both; got '{}'", opts_.reasoning_field);
  KESTREL_CHECK(opts_.threads_http >= 4 && opts_.threads_http <= 4096, "--threads-http {} not in [4, 4096]",
                opts_.threads_http);
  created_ = int64_t(std::time(nullptr));
  auto& s = *svr_;
  const int nthreads = opts_.threads_http;
  s.new_task_queue = [nthreads] { return new httplib::ThreadPool(size_t(nthreads)); };
  s.set_tcp_nodelay(true);
  s.set_keep_alive_max_count(1000);
  s.set_keep_alive_timeout(opts_.keep_alive_timeout_s);
  s.set_read_timeout(opts_.read_timeout_s, 0);
  s.set_write_timeout(opts_.write_timeout_s, 0);
  s.set_payload_max_length(opts_.max_body);
  // A Content-Length that is not a plain decimal number (httplib would read "-5" as 2^64-5 and wait
  // for that body) is refused before any body is read.
  s.set_pre_routing_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!req.has_header("Content-Length")) return httplib::Server::HandlerResponse::Unhandled;
    const std::string v = req.get_header_value("Content-Length");
    if (!v.empty() && v.size() <= 19 && std::all_of(v.begin(), v.end(), ::isdigit))
      return httplib::Server::HandlerResponse::Unhandled;
    res.set_header("Connection", "close");
    send_json(res, 400, ApiError(400, "invalid_request_error", "invalid Content-Length").to_json());
    return httplib::Server::HandlerResponse::Handled;
  });
  auto handler = [this](const httplib::Request& req, httplib::Response& res) { dispatch(req, res); };
  for (auto reg : {&httplib::Server::Get, &httplib::Server::Post, &httplib::Server::Put, &httplib::Server::Delete,
                   &httplib::Server::Patch, &httplib::Server::Options}) {
    (s.*reg)(R"(.*)", handler);
  }
  s.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    try {
      if (ep) std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      spdlog::error("unhandled exception in a handler: {}", e.what());
    } catch (...) {
      spdlog::error("unhandled non-standard exception in a handler");
    }
    send_json(res, 500, ApiError(500, "server_error", "internal server error").to_json());
  });
  // httplib's own failures (bad request line, 413 payload, 414 URI, unknown method) get JSON bodies.
  s.set_error_handler(httplib::Server::HandlerWithResponse([](const httplib::Request&, httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    std::string msg = res.status == 413   ? "request body too large (limit 8 MiB)"
                      : res.status == 414 ? "request URI too long"
                      : res.status == 404 ? "not found"
                      : res.status == 405 ? "method not allowed"
                                          : "bad request";
    std::string type = res.status >= 500 ? "server_error" : "invalid_request_error";
    send_json(res, res.status, ApiError(res.status, type, msg).to_json());
    return httplib::Server::HandlerResponse::Handled;
  }));
}

HttpServer::~HttpServer() = default;

int HttpServer::bind() {
  if (opts_.port == 0) {
    int p = svr_->bind_to_any_port(opts_.host);
    KESTREL_CHECK(p > 0, "cannot bind {}:(any port)", opts_.host);
    opts_.port = p;
  } else {
    KESTREL_CHECK(svr_->bind_to_port(opts_.host, opts_.port), "cannot bind {}:{} (in use, or not a local address?)",
                  opts_.host, opts_.port);
  }
  widen_backlog(opts_.port);
  return opts_.port;
}

// The packaged httplib listens with a backlog of 5 (compiled into the .so): a burst of connections
// (16 clients starting at once) overflows it and the kernel drops SYNs, which clients retry after
// 1 s. Re-listening on the same socket raises the backlog; the socket is found as the listening
// socket bound to our port.
void HttpServer::widen_backlog(int port) {
  for (int fd = 0; fd < 4096; ++fd) {
    int acc = 0;
    socklen_t len = sizeof(acc);
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &acc, &len) != 0 || !acc) continue;
    sockaddr_storage ss{};
    socklen_t sl = sizeof(ss);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &sl) != 0) continue;
    int p = ss.ss_family == AF_INET ? ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port)
            : ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port) : -1;
    if (p == port && ::listen(fd, 1024) == 0) return;
  }
  spdlog::warn("could not raise the listen backlog; bursts of connections may see 1 s SYN retries");
}

void HttpServer::run() { svr_->listen_after_bind(); }
void HttpServer::stop() { svr_->stop(); }

void HttpServer::set_ready(ModelInfo mi, Scheduler* sched, std::string backend_name) {
  mi_ = std::move(mi);
  sched_ = sched;
  backend_name_ = std::move(backend_name);
  ready_.store(true);
}

bool HttpServer::authorized(const httplib::Request& req) const {
  if (opts_.api_key.empty()) return true;
  std::string auth = req.get_header_value("Authorization");
  std::string key;
  if (auth.size() > 7 && (auth.compare(0, 7, "Bearer ") == 0 || auth.compare(0, 7, "bearer ") == 0))
    key = auth.substr(7);
  else if (req.has_header("x-api-key"))
    key = req.get_header_value("x-api-key");
  else
    return false;
  return ct_equal(key, opts_.api_key);
}

void HttpServer::dispatch(const httplib::Request& req, httplib::Response& res) {
  const std::string path = normalize_path(req.path);
  const Route* route = nullptr;
  std::string model_id;
  for (const auto& r : kRoutes)
    if (path == r.path) route = &r;
  static const Route kModelRoute{"/v1/models/{id}", "GET", "models"};
  if (!route && path.rfind("/v1/models/", 0) == 0 && path.size() > 11) {
    route = &kModelRoute;
    model_id = path.substr(11);
  }
  const std::string label = route ? route->label : "other";
  try {
    if (!route) throw ApiError(404, "invalid_request_error", "unknown route", "", "not_found");
    if (req.method == "OPTIONS") {
      res.status = 204;
      res.set_header("Allow", std::string(route->methods) + ", OPTIONS");
      metrics_.request(label, 204);
      return;
    }
    if (req.method != route->methods && !(req.method == "HEAD" && std::string(route->methods) == "GET")) {
      res.set_header("Allow", route->methods);
      throw ApiError(405, "invalid_request_error", fmt::format("method {} is not allowed here; use {}", req.method, route->methods));
    }
    if (label == "health") {
      if (!ready_.load()) {
        send_json(res, 503, json{{"error", {{"message", "Loading model"}, {"type", "unavailable_error"}, {"param", nullptr}, {"code", "model_loading"}}}});
      } else if (draining_.load()) {
        send_json(res, 503, json{{"error", {{"message", "Shutting down"}, {"type", "unavailable_error"}, {"param", nullptr}, {"code", "server_shutdown"}}}});
      } else {
        send_json(res, 200, json{{"status", "ok"}, {"backend", backend_name_}});
      }
      metrics_.request(label, res.status);
      return;
    }
    if (!authorized(req))
      throw ApiError(401, "invalid_request_error", "Incorrect or missing API key (send Authorization: Bearer <key>)", "",
                     "invalid_api_key");
    if (label == "metrics") {
      Gauges g;
      g.ready = ready_.load();
      if (sched_) {
        g.queued = sched_->queued();
        g.running = sched_->running();
        g.nonfinite = sched_->nonfinite_total();
        g.cancelled = sched_->cancelled_total();
        g.steps = sched_->steps_total();
      }
      res.status = 200;
      res.set_content(metrics_.render(g), "text/plain; version=0.0.4");
      metrics_.request(label, 200);
      return;
    }
    if (!ready_.load()) throw ApiError(503, "unavailable_error", "Loading model", "", "model_loading");
    if (draining_.load()) throw ApiError(503, "unavailable_error", "the server is shutting down", "", "server_shutdown");
    if (req.method == "POST") {
      std::string ct = req.get_header_value("Content-Type");
      std::string base = ct.substr(0, ct.find(';'));
      while (!base.empty() && base.back() == ' ') base.pop_back();
      if (!ct.empty() && base != "application/json")
        throw ApiError(415, "invalid_request_error",
                       "Content-Type must be application/json (with curl: -H 'Content-Type: application/json')");
    }
    if (label == "chat") handle_generate(req, res, true);
    else if (label == "completions") handle_generate(req, res, false);
    else if (label == "models") handle_models(model_id, res);
    else if (label == "tokenize") handle_tokenize(req, res);
    else if (label == "detokenize") handle_detokenize(req, res);
    else if (label == "apply_template") handle_apply_template(req, res);
  } catch (const ApiError& e) {
    send_error(res, e);
  } catch (const std::exception& e) {
    spdlog::error("internal error on {} {}: {}", req.method, label, e.what());
    send_json(res, 500, ApiError(500, "server_error", "internal server error").to_json());
  }
  metrics_.request(label, res.status);
}

void HttpServer::handle_models(const std::string& id, httplib::Response& res) {
  auto model = [&](const std::string& name) {
    return json{{"id", name},        {"object", "model"},      {"created", created_},
                {"owned_by", "kestrel"}, {"max_model_len", mi_.ctx}, {"context_length", mi_.ctx},
                {"backend", backend_name_}};
  };
  if (!id.empty()) {
    if (std::find(mi_.served_names.begin(), mi_.served_names.end(), id) == mi_.served_names.end())
      throw ApiError(404, "invalid_request_error", "The model does not exist", "model", "model_not_found");
    send_json(res, 200, model(id));
    return;
  }
  send_json(res, 200, json{{"object", "list"}, {"data", json::array({model(mi_.served_names.at(0))})}});
}

void HttpServer::handle_tokenize(const httplib::Request& req, httplib::Response& res) {
  json body = parse_json_body(req.body);
  std::vector<int32_t> ids;
  if (body.contains("messages")) {
    ids = render_chat_request(body, mi_).ids;
  } else {
    auto it = body.find("content");
    if (it == body.end()) it = body.find("prompt");
    if (it == body.end() || !it->is_string()) throw invalid("'content' (a string) or 'messages' is required", "content");
    bool parse_special = false;
    if (body.contains("parse_special")) {
      if (!body["parse_special"].is_boolean()) throw invalid("'parse_special' must be a boolean", "parse_special");
      parse_special = body["parse_special"].get<bool>();
    }
    try {
      ids = mi_.tok->encode(it->get<std::string>(), parse_special);
    } catch (const kestrel::Error& e) {
      throw invalid(fmt::format("tokenizer: {}", e.what()), "content");
    }
  }
  json out = {{"tokens", ids}, {"count", ids.size()}, {"max_model_len", mi_.ctx}};
  if (body.value("with_pieces", false)) {
    json pieces = json::array();
    for (int32_t id : ids) pieces.push_back({{"id", id}, {"piece", utf8_sanitize(mi_.tok->token_bytes(id))}});
    out["tokens"] = pieces;
  }
  send_json(res, 200, out);
}

void HttpServer::handle_detokenize(const httplib::Request& req, httplib::Response& res) {
  json body = parse_json_body(req.body);
  if (!body.contains("tokens") || !body["tokens"].is_array()) throw invalid("'tokens' must be an array of token ids", "tokens");
  std::vector<int32_t> ids;
  for (const auto& v : body["tokens"]) {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= mi_.tok->vocab_size())
      throw invalid(fmt::format("'tokens' must hold integers in [0, {})", mi_.tok->vocab_size()), "tokens");
    ids.push_back(v.get<int32_t>());
  }
  send_json(res, 200, json{{"content", mi_.tok->decode(ids, false)}});
}

void HttpServer::handle_apply_template(const httplib::Request& req, httplib::Response& res) {
  json body = parse_json_body(req.body);
  RenderedChat rc = render_chat_request(body, mi_);
  send_json(res, 200, json{{"prompt", rc.text}, {"tokens", rc.ids.size()}});
}

void HttpServer::handle_generate(const httplib::Request& req, httplib::Response& res, bool chat) {
  const auto t0 = Clock::now();
  json body = parse_json_body(req.body);
  auto pr = std::make_shared<PreparedRequest>(chat ? prepare_chat(body, mi_) : prepare_completion(body, mi_));
  std::shared_ptr<GenStream> gs;
  try {
    gs = sched_->submit(pr->job);
  } catch (const QueueFull& e) {
    throw ApiError(429, "rate_limit_error", std::string(e.what()) + "; retry later", "", "queue_full");
  } catch (const ShuttingDown&) {
    throw ApiError(503, "unavailable_error", "the server is shutting down", "", "server_shutdown");
  }
  auto resp = std::make_shared<Responder>(mi_, *pr, gs, mi_.served_names.at(0), opts_.reasoning_field, metrics_, t0);
  res.set_header("x-request-id", resp->id());
  if (!pr->stream) {
    std::vector<GenEvent> evs;
    for (;;) {
      evs.clear();
      bool done = gs->wait(evs, std::chrono::milliseconds(50));
      resp->consume_all(evs);
      if (done) break;
    }
    auto [status, j] = resp->final_response();
    send_json(res, status, j);
    return;
  }
  res.status = 200;
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  auto started = std::make_shared<bool>(false);
  auto last_write = std::make_shared<Clock::time_point>(Clock::now());
  res.set_chunked_content_provider(
      "text/event-stream",
      [pr, gs, resp, started, last_write](size_t, httplib::DataSink& sink) {
        std::string out;
        if (!*started) {
          *started = true;
          out = resp->sse_begin();
        }
        std::vector<GenEvent> evs;
        bool done = gs->wait(evs, std::chrono::milliseconds(out.empty() ? 20 : 0));
        out += resp->sse_events(evs);
        if (done) out += resp->sse_finish();
        // An SSE comment every 15 s keeps proxies and clients from timing out during a long prefill.
        if (out.empty() && Clock::now() - *last_write > std::chrono::seconds(15)) out = ": keep-alive\n\n";
        if (!out.empty()) *last_write = Clock::now();
        // A client that went away cancels its generation (checked at least every 20 ms).
        if (!sink.is_writable() || (!out.empty() && !sink.write(out.data(), out.size()))) {
          resp->cancel();
          return false;
        }
        if (done) sink.done();
        return true;
      },
      [gs](bool success) {
        if (!success) gs->cancel();
      });
}

}  // namespace kestrel::server

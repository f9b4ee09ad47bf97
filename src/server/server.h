// The OpenAI-compatible HTTP server over cpp-httplib 0.11.4 (Debian). Owns routing (one dispatcher
// for every method, so unknown routes are 404 and wrong methods 405 with an Allow header), auth
// (Bearer or x-api-key, constant-time comparison; /health stays open), our limits (body 8 MiB -> 413,
// header and read timeouts), loading / draining states (503), the OpenAI error object for every
// failure (500s carry a generic message; the cause is logged), SSE streaming with cancellation on
// disconnect, and the metrics.
#pragma once
#include "server/chat.h"
#include "server/metrics.h"
#include "server/scheduler.h"

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace kestrel::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;
  std::string api_key;                 // empty = no auth
  std::string reasoning_field = "reasoning_content";  // or "reasoning", or "both"
  size_t max_body = 8u << 20;
  int threads_http = 64;
  int read_timeout_s = 10;
  int write_timeout_s = 60;
  int keep_alive_timeout_s = 30;
};

class HttpServer {
 public:
  explicit HttpServer(ServerOptions opts);
  ~HttpServer();
  // Binds the socket (port 0 picks a free one); returns the bound port. Throws on failure.
  int bind();
  // Serves until stop(); blocking.
  void run();
  void stop();
  // The model is loaded: start answering the API.
  void set_ready(ModelInfo mi, Scheduler* sched, std::string backend_name);
  // Shutdown has begun: new requests get 503.
  void begin_drain() { draining_.store(true); }
  const ServerOptions& options() const { return opts_; }

 private:
  void dispatch(const httplib::Request& req, httplib::Response& res);
  void handle_generate(const httplib::Request& req, httplib::Response& res, bool chat);
  void handle_models(const std::string& id, httplib::Response& res);
  void handle_tokenize(const httplib::Request& req, httplib::Response& res);
  void handle_detokenize(const httplib::Request& req, httplib::Response& res);
  void handle_apply_template(const httplib::Request& req, httplib::Response& res);
  bool authorized(const httplib::Request& req) const;
  void widen_backlog(int port);

  ServerOptions opts_;
  std::unique_ptr<httplib::Server> svr_;
  std::atomic<bool> ready_{false}, draining_{false};
  ModelInfo mi_;
  Scheduler* sched_ = nullptr;
  std::string backend_name_;
  Metrics metrics_;
  int64_t created_ = 0;
};

}  // namespace kestrel::server

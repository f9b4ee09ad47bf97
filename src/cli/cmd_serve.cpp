// `kestrel serve`: the OpenAI-compatible server. Binds first (so /health answers 503 while the
// weights load), loads tokenizer + backend with a progress bar, then serves. SIGINT/SIGTERM: new
// requests get 503, in-flight ones may finish for --drain-timeout seconds, then every remaining
// stream gets a final error event (server_shutdown) and the process exits 0; a second signal skips
// the drain.
#include "cli/commands.h"
#include "core/check.h"
#include "core/config.h"
#include "engine/engine.h"
#include "server/chat.h"
#include "server/scheduler.h"
#include "server/script_backend.h"
#include "server/server.h"
#include "tokenizer/tokenizer.h"

#include <spdlog/spdlog.h>

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>

namespace {

struct ServeArgs {
  std::string model;
  std::string host = "127.0.0.1";
  int port = 8080;
  std::string device = "cpu";
  std::string api_key;
  int64_t ctx = 0;
  int max_queue = 64;
  int parallel = 4;
  std::string served_name;
  std::string reasoning_field = "reasoning_content";
  int threads = 0;
  int threads_http = 64;
  int read_timeout = 10;
  double drain_timeout = 10;
  std::string test_script;
  std::string thinking = "on";
};

void progress_bar(const kestrel::LoadProgress& p) {
  static auto last = std::chrono::steady_clock::now() - std::chrono::seconds(10);
  static const bool tty = isatty(STDERR_FILENO);
  auto now = std::chrono::steady_clock::now();
  const bool end = p.total_bytes > 0 && p.done_bytes >= p.total_bytes;
  if (!end && now - last < std::chrono::milliseconds(tty ? 100 : 2000)) return;
  last = now;
  double f = p.total_bytes ? double(p.done_bytes) / double(p.total_bytes) : 0.0;
  int w = 40, n = int(f * w);
  std::string bar(size_t(n), '#');
  bar += std::string(size_t(w - n), '.');
  std::fprintf(stderr, "%sloading weights [%s] %5.1f%% %.1f/%.1f MiB%s", tty ? "\r" : "", bar.c_str(), f * 100,
               double(p.done_bytes) / 1048576.0, double(p.total_bytes) / 1048576.0, tty && !end ? "" : "\n");
  std::fflush(stderr);
}

int run_serve(const ServeArgs& a) {
  using namespace kestrel;
  using namespace kestrel::server;
  KESTREL_CHECK(a.port >= 0 && a.port <= 65535, "--port {} out of range", a.port);
  KESTREL_CHECK(a.ctx >= 0, "--ctx {} must be >= 0", a.ctx);
  KESTREL_CHECK(a.thinking == "on" || a.thinking == "off", "--thinking must be on or off, got '{}'", a.thinking);
  const DeviceKind device = parse_device(a.device);

  // Signals are taken by sigwait in this thread only.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGUSR1);  // the loader finished (ok or failed)
  pthread_sigmask(SIG_BLOCK, &set, nullptr);

  ServerOptions so;
  so.host = a.host;
  so.port = a.port;
  so.api_key = a.api_key;
  so.reasoning_field = a.reasoning_field;
  so.threads_http = a.threads_http;
  so.read_timeout_s = a.read_timeout;
  HttpServer http(so);
  const int port = http.bind();
  std::atomic<bool> http_done{false};
  std::thread http_thread([&] {
    http.run();
    http_done.store(true);
  });
  std::printf("listening on http://%s:%d/v1\n", a.host.c_str(), port);
  std::fflush(stdout);

  std::unique_ptr<Tokenizer> tok;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Scheduler> sched;
  std::string load_error;
  std::atomic<bool> loaded{false};
  const pid_t self = getpid();
  std::thread loader([&] {
    try {
      tok = Tokenizer::load(a.model);
      if (!a.test_script.empty()) {
        spdlog::warn("=================================================================");
        spdlog::warn("TEST-ONLY --test-script {}: outputs are scripted, NOT the model's", a.test_script);
        spdlog::warn("=================================================================");
        auto eos = tok->eos_token_id();
        KESTREL_CHECK(eos.has_value(), "--test-script needs a tokenizer with an eos_token");
        backend = std::make_unique<ScriptBackend>(a.test_script, load_config(a.model), *tok, *eos);
      } else {
        BackendOptions bo;
        bo.device = device;
        bo.threads = a.threads;
        bo.load.progress = progress_bar;
        backend = load_backend(a.model, bo);
      }
      loaded.store(true);
    } catch (const std::exception& e) {
      load_error = e.what();
    }
    kill(self, SIGUSR1);
  });

  auto stop_http = [&](int exit_code) {
    http.stop();
    // httplib 0.11.4 lets idle keep-alive connections wait out their timeout after stop(); do not
    // hold the exit for them: nothing is in flight any more at this point.
    for (int i = 0; i < 100 && !http_done.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (!http_done.load()) {
      spdlog::info("stopped (idle keep-alive connections closed)");
      spdlog::default_logger()->flush();
      std::fflush(stdout);
      std::fflush(stderr);
      std::_Exit(exit_code);
    }
    if (http_thread.joinable()) http_thread.join();
  };
  int sig = 0;
  sigwait(&set, &sig);
  if (sig != SIGUSR1) {
    // Interrupted while loading: nothing is in flight, leave at once.
    std::fprintf(stderr, "interrupted while loading\n");
    std::fflush(stderr);
    std::_Exit(130);
  }
  loader.join();
  if (!loaded.load()) {
    std::fprintf(stderr, "error: cannot load the model from '%s': %s\n", a.model.c_str(), load_error.c_str());
    stop_http(1);
    return 1;
  }

  const ModelConfig& cfg = backend->config();
  ModelInfo mi;
  mi.tok = tok.get();
  mi.vocab = cfg.vocab_size;
  // Each sequence's state is allocated up front for its whole budget, so the default context is the
  // model's, capped at 32768 (Qwen's recommended output budget); --ctx raises it.
  constexpr int64_t kDefaultCtxCap = 32768;
  mi.ctx = a.ctx > 0 ? a.ctx : std::min<int64_t>(cfg.max_position_embeddings, kDefaultCtxCap);
  if (a.ctx == 0 && cfg.max_position_embeddings > kDefaultCtxCap)
    spdlog::info("context {} tokens per request (the model allows {}; raise with --ctx)", mi.ctx,
                 cfg.max_position_embeddings);
  KESTREL_CHECK(mi.ctx > 0, "the model config has no max_position_embeddings; pass --ctx");
  if (cfg.max_position_embeddings > 0 && mi.ctx > cfg.max_position_embeddings)
    spdlog::warn("--ctx {} exceeds the model's max_position_embeddings {}", mi.ctx, cfg.max_position_embeddings);
  for (int id : cfg.eos_token_ids) mi.stop_ids.push_back(id);
  load_generation_defaults(a.model, mi);
  if (auto e = tok->eos_token_id())
    if (std::find(mi.stop_ids.begin(), mi.stop_ids.end(), *e) == mi.stop_ids.end()) mi.stop_ids.push_back(*e);
  index_added_tokens(mi);
  std::string name = a.served_name;
  if (name.empty()) {
    auto p = std::filesystem::path(a.model);
    name = (p.has_filename() ? p.filename() : p.parent_path().filename()).string();
  }
  mi.served_names = {name, a.model};
  if (a.thinking == "off") mi.default_enable_thinking = false;
  SchedulerOptions sopt;
  sopt.max_queue = a.max_queue;
  sopt.max_running = a.parallel;
  sched = std::make_unique<Scheduler>(*backend, sopt);
  http.set_ready(mi, sched.get(), backend->name());
  spdlog::info("ready: model '{}' ({}), backend {}, context {}, parallel {}, queue {}{}", name, a.model,
               backend->name(), mi.ctx, a.parallel, a.max_queue, a.api_key.empty() ? "" : ", api key required");
  std::printf("ready on http://%s:%d/v1 (model %s)\n", a.host.c_str(), port, name.c_str());
  std::fflush(stdout);

  do {
    sigwait(&set, &sig);
  } while (sig == SIGUSR1);
  spdlog::info("signal {}: draining (up to {:.0f} s; a second signal cancels now)", sig, a.drain_timeout);
  http.begin_drain();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(a.drain_timeout);
  while (std::chrono::steady_clock::now() < deadline && (sched->running() > 0 || sched->queued() > 0)) {
    timespec ts{0, 20 * 1000 * 1000};
    if (sigtimedwait(&set, nullptr, &ts) > 0) break;
  }
  sched->shutdown();  // remaining streams end with a server_shutdown error event
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  stop_http(0);
  spdlog::info("stopped");
  return 0;
}

void setup_serve(CLI::App& root) {
  auto a = std::make_shared<ServeArgs>();
  auto* c = root.add_subcommand("serve", "Serve the model over an OpenAI-compatible HTTP API");
  c->add_option("-m,--model", a->model, "Model directory (config.json, safetensors, tokenizer)")->required();
  c->add_option("--host", a->host, "Address to bind (default loopback)");
  c->add_option("--port", a->port, "Port (0 = any free port)");
  c->add_option("--device", a->device, "cpu | cuda");
  c->add_option("--api-key", a->api_key, "Require this key (Authorization: Bearer or x-api-key)")->envname("KESTREL_API_KEY");
  c->add_option("-c,--ctx", a->ctx, "Context length per request (0 = the model's max_position_embeddings, at most 32768)");
  c->add_option("--max-queue", a->max_queue, "Requests that may wait for a slot; more get 429");
  c->add_option("--parallel", a->parallel, "Sequences generated together");
  c->add_option("--served-model-name", a->served_name, "Model id reported and accepted (default: directory name)");
  c->add_option("--reasoning-field", a->reasoning_field, "reasoning_content | reasoning | both");
  c->add_option("--thinking", a->thinking, "Default thinking mode when a request does not choose: on | off");
  c->add_option("--threads", a->threads, "CPU backend threads (0 = all cores)");
  c->add_option("--threads-http", a->threads_http, "HTTP worker threads (each open connection holds one)");
  c->add_option("--read-timeout", a->read_timeout, "Seconds to receive a request's headers and body");
  c->add_option("--drain-timeout", a->drain_timeout, "Seconds in-flight requests may finish after SIGINT/SIGTERM");
  c->add_option("--test-script", a->test_script,
                "TEST ONLY: replay scripted outputs instead of running the model (see docs/server.md)");
  c->callback([a] {
    int rc = run_serve(*a);
    if (rc != 0) std::exit(rc);
  });
}

}  // namespace

KESTREL_COMMAND(setup_serve);

// Progress bar and resident-memory probe; see progress.h.
#include "quant/progress.h"

#include <fstream>
#include <memory>
#include <string>

#include <sys/mman.h>
#include <unistd.h>

namespace kestrel::quant {

ProgressFn progress_bar(const std::string& label, std::FILE* out) {
  struct State {
    int last_pct = -1, next_mark = 10;
  };
  auto st = std::make_shared<State>();
  const bool tty = isatty(fileno(out));
  return [st, tty, label, out](const LoadProgress& p) {
    const int pct = p.total_bytes ? int(100.0 * double(p.done_bytes) / double(p.total_bytes)) : 100;
    if (pct == st->last_pct) return;
    st->last_pct = pct;
    if (tty) {
      const int w = 40, fill = pct * w / 100;
      std::fprintf(out, "\r%s [%.*s%*s] %3d%% (%.2f / %.2f GB)", label.c_str(), fill,
                   "########################################", w - fill, "", pct,
                   double(p.done_bytes) / 1e9, double(p.total_bytes) / 1e9);
      if (pct >= 100) std::fprintf(out, "\n");
    } else if (pct >= st->next_mark) {
      std::fprintf(out, "%s: %d%% (%.2f / %.2f GB)\n", label.c_str(), pct,
                   double(p.done_bytes) / 1e9, double(p.total_bytes) / 1e9);
      st->next_mark = pct / 10 * 10 + 10;
    }
    std::fflush(out);
  };
}

size_t resident_bytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return size_t(std::stoull(line.substr(6))) * 1024;  // kB
  }
  return 0;
}

void release_pages(const void* p, size_t n) {
  static const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  const uintptr_t a = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
  const uintptr_t b = (reinterpret_cast<uintptr_t>(p) + n) / page * page;
  // Advice only: a failure (e.g. not a mapping) leaves the pages resident, nothing else changes.
  if (b > a) (void)madvise(reinterpret_cast<void*>(a), b - a, MADV_DONTNEED);
}

}  // namespace kestrel::quant

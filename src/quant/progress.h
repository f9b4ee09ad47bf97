// Load/convert progress on stderr and the process's resident memory, for the CLI front ends
// (issue 5: "a progress bar while loading; load time and resident memory reported").
#pragma once
#include "core/weights.h"

#include <cstdio>
#include <string>

namespace kestrel::quant {

// A LoadOptions::progress callback: a redrawn bar when `out` is a terminal, otherwise one line
// per 10% (logs stay readable). Writes a final newline at 100% on a terminal.
ProgressFn progress_bar(const std::string& label, std::FILE* out = stderr);

// Resident set size of this process in bytes (VmRSS of /proc/self/status), 0 if unavailable.
size_t resident_bytes();

// Drops this process's resident pages of [p, p + n) inside a read-only file mapping (the whole
// pages inside the range only, so neighbouring tensors keep theirs). The data stays valid: a later
// read faults it back in from the file (page cache). Quantizing a bf16 checkpoint (at load or in
// `kestrel quantize`) calls this after each source tensor, so the bf16 pages do not stay resident
// next to the quantized copy.
void release_pages(const void* p, size_t n);

}  // namespace kestrel::quant

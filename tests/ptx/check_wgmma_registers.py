#!/usr/bin/env python3
"""Checks the PTX of the CUDA sources for the register hazard of wgmma with A in registers.

PTX ISA (wgmma.mma_async): writing a register that holds a fragment of matrix A of a
wgmma.mma_async before the wgmma.wait_group that waits for its group is undefined. The compiler
does not prevent it: when the C++ no longer uses the fragments after their last wgmma, it may build
the next fragments in the same PTX registers between commit and wait (prefill_pipe.cu's transposed
kernel did at 6e65da4: NaNs on the GPU). This compiles each source that issues such a wgmma to PTX
and fails if any instruction between a wgmma.commit_group and the next wgmma.wait_group writes a
register that a wgmma of that group reads as A.

Usage: check_wgmma_registers.py NVCC SOURCE_DIR [FILE ...]   (default files: every src/cuda/*.cu)
"""
import os
import re
import subprocess
import sys
import tempfile

RS_WGMMA = re.compile(r"wgmma\.mma_async\S*\s+\{[^}]*\},\s*\{([^}]*)\}")
DEST = re.compile(r"^\s*(?:@!?%p\d+\s+)?[a-z][\w.]*\s+(%\w+)\s*,")


def hazards(ptx_text):
    """(entry, line number, instruction, register) of every write to an in-flight A register."""
    found = []
    entry = "?"
    in_flight = set()  # A registers of the wgmma issued since the last wait
    pending = set()    # A registers of the wgmma not yet committed
    for n, line in enumerate(ptx_text.splitlines(), 1):
        m = re.match(r"\s*(?:\.visible\s+|\.weak\s+)?\.entry\s+(\w+)", line)
        if m:
            entry, in_flight, pending = m.group(1), set(), set()
            continue
        m = RS_WGMMA.search(line)
        if m:
            pending |= {r.strip() for r in m.group(1).split(",")}
            continue
        if "wgmma.commit_group" in line:
            in_flight |= pending
            pending = set()
            continue
        if "wgmma.wait_group" in line:
            if re.search(r"wait_group\.sync\.aligned\s+0\s*;", line):
                in_flight = set()
            continue
        m = DEST.match(line)
        if m and m.group(1) in in_flight:
            found.append((entry, n, line.strip(), m.group(1)))
    return found


def main():
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    nvcc, root = sys.argv[1], sys.argv[2]
    files = sys.argv[3:] or sorted(
        os.path.join(root, "src/cuda", f) for f in os.listdir(os.path.join(root, "src/cuda")) if f.endswith(".cu"))
    checked, bad = 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        for f in files:
            if not re.search(r"mma_m64n\w*_rs\b", open(f).read()):
                continue  # no wgmma with A in registers
            ptx = os.path.join(tmp, os.path.basename(f) + ".ptx")
            subprocess.run([nvcc, "-std=c++20", "-O3", "-gencode=arch=compute_90a,code=sm_90a",
                            "--expt-relaxed-constexpr", "-I", os.path.join(root, "src"), "-ptx", f, "-o", ptx],
                           check=True)
            text = open(ptx).read()
            n_rs = len(RS_WGMMA.findall(text))
            if n_rs == 0:
                print(f"FAIL {f}: no wgmma with A in registers found in its PTX (the check would be vacuous)")
                bad += 1
                continue
            checked += 1
            h = hazards(text)
            for entry, n, ins, reg in h[:20]:
                print(f"FAIL {f}: {entry}: PTX line {n} writes {reg}, an A operand of a wgmma in flight: {ins}")
            bad += len(h)
            print(f"{f}: {n_rs} wgmma with A in registers, {len(h)} writes to them in flight")
    if checked == 0 and bad == 0:
        print("FAIL: no source with a wgmma with A in registers was checked")
        return 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

// Hopper warpgroup MMA (wgmma.mma_async, sm_90a) with both operands in shared memory, or A in
// registers: the matrix descriptors of K-major tiles in the 128-byte swizzle, the fences and the
// m64n128k16 bf16 instruction with fp32 accumulators. Written by hand (CUTLASS/CuTe wrap the same instructions in
// a template layer this one kernel does not need); PTX ISA "Asynchronous Warpgroup Level Matrix
// Multiply-Accumulate" gives the formats.
#pragma once
#ifndef __CUDACC__
#error "wgmma.cuh is device code: include it from .cu files only"
#endif
#include <cstdint>

namespace kestrel::cuda::wg {

// The 64 accumulator operands of an m64n128 step, d[16][4] in order (asm output list).
#define KESTREL_WG_D64(d)                                                                                 \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),     \
      "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), \
      "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), \
      "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
      "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), \
      "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), \
      "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),         \
      "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]),         \
      "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),         \
      "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
#define KESTREL_WG_D64_LIST                                                                                 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "   \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"


// The 32 accumulator operands of an m64n64 step, d[8][4] in order.
#define KESTREL_WG_D32(d)                                                                                  \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),     \
      "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), \
      "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), \
      "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
      "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define KESTREL_WG_D32_LIST                                                                                 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"

// Descriptor of a K-major tile whose rows are 128 bytes (64 bf16) in the 128-byte swizzle (16-byte
// chunk c of row r at r * 128 + ((c ^ (r & 7)) << 4), the tile 1024-byte aligned): start address,
// leading offset 16 B (unused by this layout), stride 1024 B between 8-row groups, swizzle mode 1.
// A k16 step further along the rows is the same descriptor with the start advanced by 32 bytes.
// Byte offset of 16-byte chunk c of row r in such a tile.
__device__ __forceinline__ int sw128_off(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }
__device__ __forceinline__ uint64_t desc_sw128(uint32_t smem_addr) {
  return uint64_t((smem_addr & 0x3ffff) >> 4) | (uint64_t(16 >> 4) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Generic-proxy writes to shared memory (st.shared, cp.async) made visible to the async proxy
// that wgmma reads through; before the barrier that publishes them.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// d (+)= A B for a 64 x 128 x 16 step of the warpgroup: A [64, 16] and B [128, 16] K-major in
// shared memory; d[j][e] is row 16 (warp % 4) + lane / 4 + 8 (e / 2), column 8 j + 2 (lane % 4) +
// (e % 2) (the mma.sync m16n8 layout per 8 columns). accumulate = false: d = A B.
__device__ __forceinline__ void mma_m64n128k16_bf16(float (&d)[16][4], uint64_t da, uint64_t db,
                                                    bool accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      KESTREL_WG_D64_LIST ", %64, %65, p, 1, 1, 0, 0;\n"
      "}\n"
      : KESTREL_WG_D64(d)
      : "l"(da), "l"(db), "r"(int(accumulate)));
}

// The same step with A from registers (wgmma's RS form): a[4] is this thread's A fragment of the
// warp's 16 rows (16 (warp % 4) + ...), laid out as mma.sync m16n8k16's A: a[0] (row lane / 4,
// k 2 (lane % 4) + 0, 1), a[1] (row + 8, same k), a[2] (row, k + 8), a[3] (row + 8, k + 8). The
// registers must hold until the group is waited for.
__device__ __forceinline__ void mma_m64n128k16_bf16_rs(float (&d)[16][4], const uint32_t (&a)[4], uint64_t db,
                                                       bool accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      KESTREL_WG_D64_LIST ", {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n"
      "}\n"
      : KESTREL_WG_D64(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(int(accumulate)));
}

// The RS step with 64 columns (B [64, 16]): d[j][e] as above for j < 8 (the tail tiles of the
// transposed kernel). TRANS_B = 1 (imm-trans-b): B MN-major, 16 rows of k each holding 64 n
// contiguous (128 bytes) in the 128-byte swizzle, 8-row groups 1024 bytes apart (PTX ISA canonical
// layout ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)) with one 64-wide atom along n, so desc_sw128's SBO
// applies): the prompt attention's P V over one 64-wide chunk of the head dimension.
template <int TRANS_B = 0>
__device__ __forceinline__ void mma_m64n64k16_bf16_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t db,
                                                      bool accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      KESTREL_WG_D32_LIST ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n"
      "}\n"
      : KESTREL_WG_D32(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(int(accumulate)), "n"(TRANS_B));
}

// d (+)= A B for a 64 x 32 x 16 step, both operands K-major in shared memory (the prompt
// attention's Q K^T over a 32-key tile): d[j][e] as above for j < 4.
__device__ __forceinline__ void mma_m64n32k16_bf16(float (&d)[4][4], uint64_t da, uint64_t db, bool accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3])
      : "l"(da), "l"(db), "r"(int(accumulate)));
}

// d (+)= A B for a 64 x 64 x 16 step, both operands K-major in shared memory (the wide prompt
// attention's Q K^T over a 64-key tile): d[j][e] as above for j < 8. accumulate = false: d = A B.
__device__ __forceinline__ void mma_m64n64k16_bf16(float (&d)[8][4], uint64_t da, uint64_t db, bool accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      KESTREL_WG_D32_LIST ", %32, %33, p, 1, 1, 0, 0;\n"
      "}\n"
      : KESTREL_WG_D32(d)
      : "l"(da), "l"(db), "r"(int(accumulate)));
}

// d (+)= A B for a 64 x 256 x 16 step (B [256, 16]), both operands K-major in shared memory,
// accumulating: d[j][e] as the m64n128 step's for j < 32 (128 accumulators per thread).
#define KESTREL_WG_D128_LIST \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, " \
  "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, " \
  "%59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, " \
  "%78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, " \
  "%97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, " \
  "%113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
__device__ __forceinline__ void mma_m64n256k16_bf16(float (&d)[32][4], uint64_t da, uint64_t db) {
  auto& d0 = reinterpret_cast<float(&)[16][4]>(d[0]);
  auto& d1 = reinterpret_cast<float(&)[16][4]>(d[16]);
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " KESTREL_WG_D128_LIST ", %128, %129, p, 1, 1, 0, 0;\n"
      "}\n"
      : KESTREL_WG_D64(d0), KESTREL_WG_D64(d1)
      : "l"(da), "l"(db), "r"(1));
}

// Pins accumulator registers after a wait: the compiler may not move their reads above it.
template <int N>
__device__ __forceinline__ void fence_acc(float (&d)[N][4]) {
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}

}  // namespace kestrel::cuda::wg

// Element types of checkpoint tensors and the scalar conversions the CPU backend needs.
#pragma once
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace kestrel {

enum class DType : uint8_t { BF16, F16, F32, F64, U8, I8, U16, I16, U32, I32, U64, I64, BOOL, F8_E4M3 };

// Bytes per element.
constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::BF16: case DType::F16: case DType::U16: case DType::I16: return 2;
    case DType::F32: case DType::U32: case DType::I32: return 4;
    case DType::F64: case DType::U64: case DType::I64: return 8;
    case DType::U8: case DType::I8: case DType::BOOL: case DType::F8_E4M3: return 1;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::F32: return "F32";
    case DType::F64: return "F64";
    case DType::U8: return "U8";
    case DType::I8: return "I8";
    case DType::U16: return "U16";
    case DType::I16: return "I16";
    case DType::U32: return "U32";
    case DType::I32: return "I32";
    case DType::U64: return "U64";
    case DType::I64: return "I64";
    case DType::BOOL: return "BOOL";
    case DType::F8_E4M3: return "F8_E4M3";
  }
  return "?";
}

inline std::optional<DType> dtype_from_name(std::string_view s) {
  for (DType t : {DType::BF16, DType::F16, DType::F32, DType::F64, DType::U8, DType::I8, DType::U16,
                  DType::I16, DType::U32, DType::I32, DType::U64, DType::I64, DType::BOOL,
                  DType::F8_E4M3})
    if (dtype_name(t) == s) return t;
  return std::nullopt;
}

inline float bf16_to_f32(uint16_t h) { return std::bit_cast<float>(uint32_t(h) << 16); }

// Round-to-nearest-even, NaN preserved (as torch does).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do { ++e; man <<= 1; } while (!(man & 0x400u));
      u = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | man << 13;
  } else {
    u = sign | (exp + 112) << 23 | man << 13;
  }
  return std::bit_cast<float>(u);
}

inline float f8e4m3_to_f32(uint8_t v) {
  const float sign = (v & 0x80) ? -1.f : 1.f;
  const int exp = (v >> 3) & 0xf, man = v & 7;
  if (exp == 15 && man == 7) return NAN;
  if (exp == 0) return sign * std::ldexp(float(man) / 8.f, -6);
  return sign * std::ldexp(1.f + float(man) / 8.f, exp - 7);
}

}  // namespace kestrel

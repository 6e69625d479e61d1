// Cache and query elements widened to fp32 one at a time (paged_attention.cpp's scalar paths).
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace {

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_f(c10::Half x) { return static_cast<float>(x); }

// FP8 cache entries widen through a 256-entry table (the formats' own conversion is bit fiddling per value).
template <typename C>
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) v[i] = static_cast<float>(C(static_cast<uint8_t>(i), C::from_bits()));
  }
};
const Fp8Table<c10::Float8_e4m3fn> kE4M3;
const Fp8Table<c10::Float8_e5m2> kE5M2;
inline float to_f(c10::Float8_e4m3fn x) { return kE4M3.v[x.x]; }
inline float to_f(c10::Float8_e5m2 x) { return kE5M2.v[x.x]; }

}  // namespace

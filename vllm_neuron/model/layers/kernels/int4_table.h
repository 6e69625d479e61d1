// One int4 superblock widened to bf16 by table (AVX512-BF16 builds): the band widening of the decode kernel
// (linear_quant.cpp) and the prefill path's unpack (quant_unpack.cpp) share it, so both give oneDNN and VDPBF16PS
// the same weights.
//
// A 32-weight group has only 16 values (q * scale + min, q = 0..15): the superblock's two groups' 32 are computed
// once (two FMAs on 0..15, one conversion) into one zmm that VPERMW reads by code, 32 weights per lookup, where
// widening each weight took a conversion to fp32, an FMA and a conversion back per 16 of them. The table holds
// the same fp32 FMA rounded to nearest even: the same bf16 weights as widening each one.
// Layout (quant_bands.py): 32 bytes, byte j holding weight j's code in its low nibble and weight j + 32's in its
// high one; scales (scale, min) of the first group, then of the second.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace vn_int4 {

// The superblock at p (scales at sc) -> dst[0 .. 63] bf16.
inline void superblock_bf16(const uint8_t* p, const float* sc, uint16_t* dst) {
  const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 first = _mm512_fmadd_ps(codes, _mm512_set1_ps(sc[0]), _mm512_set1_ps(sc[1]));
  const __m512 second = _mm512_fmadd_ps(codes, _mm512_set1_ps(sc[2]), _mm512_set1_ps(sc[3]));
  const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(second, first);  // lanes 0-15: the first group's, 16-31
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i lo = _mm512_and_si512(v, _mm512_set1_epi16(15));
  const __m512i hi = _mm512_or_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi16(16));  // the second group's
  _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(lo, table));
  _mm512_storeu_si512(dst + 32, _mm512_permutexvar_epi16(hi, table));
}

}  // namespace vn_int4

// Which of the library's ops this build has, by the compiler's target: one VN_OPS_* macro per group, read by
// the sources that define the ops and by op_registry.cpp that registers them, so that the two never disagree.
// No includes: a source whose group is off compiles to nothing in no time.
#pragma once

// Paged attention, the sampler, the MLP activation, the tile-copy lookup and LoRA: every build.

// linear_bf16 / linear_f32 (linear_bf16.cpp).
#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
#define VN_OPS_LINEAR_BF16 1
#endif

// linear_int8 / linear_int4 (linear_quant.cpp), unpack_int8 / unpack_int4 (quant_unpack.cpp).
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define VN_OPS_LINEAR_QUANT 1
#endif

// linear_quant_path (linear_quant.cpp): the AVX2 build's two int8 / int4 paths by name.
#if defined(__AVX2__) && !defined(__AVX512F__) && defined(__FMA__)
#define VN_OPS_QUANT_PATH 1
#endif

// linear_dot_tiles (linear_dot_tiles.cpp).
#if defined(__AVX512BF16__)
#define VN_OPS_DOT_TILES 1
#endif

// linear_int4_tiles (linear_int4_tiles.cpp), linear_int8_tiles (linear_int8_tiles.cpp).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define VN_OPS_INT_TILES 1
#endif

// linear_int8_amx (linear_int8_tiles.cpp).
#if defined(VN_OPS_INT_TILES) && defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define VN_OPS_INT8_AMX 1
#endif

// linear_amx (linear_amx.cpp).
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define VN_OPS_LINEAR_AMX 1
#endif

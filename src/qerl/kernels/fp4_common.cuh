// Device helpers shared by the FP4 kernels compiled with NVRTC (fp4_gemv.cu, fp4_rows.cu):
// the 16-byte chunk, coherent loads, the e2m1 decode into f16 pairs, group scales, the
// mma.m16n8k16, a tile's rows in up to three stacked weights, bf16 rounding and stores.
// MX (0 NVFP4, 1 MXFP4) must be defined before it is included.
#pragma once

#ifndef MX
#define MX 0
#endif

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;

struct __align__(16) U4 { u32 x, y, z, w; };

// A coherent 16-byte load that skips L1 (ld.global.cg). The activations are written by the
// kernel before this one, which with programmatic dependent launch may still run after this one
// starts: the read-only (.nc) path that __restrict__ const allows could then serve stale lines.
__device__ __forceinline__ U4 load_coherent(const U4* p) {
  U4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
  u32 d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Saturating: an activation beyond f16's range (|x| > 65504, which bf16 can hold) becomes +-65504,
// not an infinity that would turn the whole output row into NaN (inf times a zero code).
__device__ __forceinline__ u32 f32x2_to_f16x2(float lo, float hi) {
  u32 d;
  asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

__device__ __forceinline__ void mma16816(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Pairs (q, q + 4), q = 0..3, of the 8 codes in w, as f16x2 of e2m1 * 2^-14.
__device__ __forceinline__ void decode8(u32 w, u32 (&p)[4]) {
  p[3] = (w & 0x80008000u) | ((w >> 3) & 0x0E000E00u);
  w <<= 4;
  p[2] = (w & 0x80008000u) | ((w >> 3) & 0x0E000E00u);
  w <<= 4;
  p[1] = (w & 0x80008000u) | ((w >> 3) & 0x0E000E00u);
  w <<= 4;
  p[0] = (w & 0x80008000u) | ((w >> 3) & 0x0E000E00u);
}

// The group scales of a lane's 32 codes of one feature as f16x2 {s, s}: [0] codes 0-15, [1] 16-31.
__device__ __forceinline__ void scales_f16(const u8* __restrict__ s, int mx_bias, u32 (&out)[2]) {
#if MX
  int e = (int)(*s) - mx_bias;
  e = e < 0 ? 0 : (e > 30 ? 30 : e);
  u32 h = (u32)e << 10;
  out[0] = out[1] = h | (h << 16);
#else
  u16 two = *reinterpret_cast<const u16*>(s);
  u32 h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(two));
  h = hmul2(h, 0x58005800u);  // * 2^7, exact (E4M3 <= 448)
  out[0] = __byte_perm(h, 0, 0x1010);
  out[1] = __byte_perm(h, 0, 0x3232);
#endif
}

// The rows of features g and g + 8 of the tile at row0 (clamped into its member weight, whose
// rows start at row `start`; members hold whole tiles), as pointers to lane t's first 16-byte
// chunk of codes and to their first group scale.
struct Rows {
  const U4 *wa, *wb;
  const u8 *sa, *sb;
};
__device__ __forceinline__ Rows tile_rows(int row0, int g, int t, const U4* w0, const u8* s0,
                                          const U4* w1, const u8* s1, const U4* w2,
                                          const u8* s2, int end0, int end1, int N, int chunks,
                                          int sgroups) {
  const int r0 = min(row0, N - 1);
  const int mem = r0 >= end1 ? 2 : (r0 >= end0 ? 1 : 0);
  const U4* w = mem == 0 ? w0 : (mem == 1 ? w1 : w2);
  const u8* scale = mem == 0 ? s0 : (mem == 1 ? s1 : s2);
  const int start = mem == 0 ? 0 : (mem == 1 ? end0 : end1);
  const int last = (mem == 0 ? end0 : (mem == 1 ? end1 : N)) - 1;
  const int ra = min(r0 + g, last) - start, rb = min(r0 + g + 8, last) - start;
  return {w + (u64)ra * chunks + t, w + (u64)rb * chunks + t, scale + (u64)ra * sgroups,
          scale + (u64)rb * sgroups};
}

// The bf16 bits of y, rounded to nearest even (infinities and NaN kept).
__device__ __forceinline__ u32 bf16_bits(float y) {
  u32 bits = __float_as_uint(y);
  if ((bits & 0x7F800000u) == 0x7F800000u) return bits >> 16;
  return (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
}

// Lane (g, t)'s four sums of a tile at row0 (the mma.m16n8k16 accumulator layout; its 8 rows
// from m0) times colscale, plus add (the LoRA's), as bf16 into out[m, n] for the M valid rows
// and N valid features.
__device__ __forceinline__ void store_tile(const float (&c)[4], const float (&add)[4], int row0,
                                           int g, int t, int M, int N,
                                           const float* __restrict__ colscale,
                                           u16* __restrict__ out, int ldo, int m0 = 0) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int m = m0 + 2 * t + (i & 1);
    const int n = row0 + g + ((i & 2) ? 8 : 0);
    if (m < M && n < N) out[(u64)m * ldo + n] = (u16)bf16_bits(c[i] * colscale[n] + add[i]);
  }
}

// The pair-ordered f16 of 8 bf16 (x0..x7 -> (x0, x4), (x1, x5), (x2, x6), (x3, x7)).
__device__ __forceinline__ U4 pair_order(U4 v) {
  U4 o;
  o.x = f32x2_to_f16x2(__uint_as_float(v.x << 16), __uint_as_float(v.z << 16));
  o.y = f32x2_to_f16x2(__uint_as_float(v.x & 0xFFFF0000u), __uint_as_float(v.z & 0xFFFF0000u));
  o.z = f32x2_to_f16x2(__uint_as_float(v.y << 16), __uint_as_float(v.w << 16));
  o.w = f32x2_to_f16x2(__uint_as_float(v.y & 0xFFFF0000u), __uint_as_float(v.w & 0xFFFF0000u));
  return o;
}

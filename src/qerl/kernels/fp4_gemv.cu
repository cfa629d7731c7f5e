// FP4 weights times a few activation rows (M <= 8) on Hopper tensor cores: y = x @ W^T.
//
// Reads the compressed-tensors tensors where they are (codes [N_i, K/2] bytes, low nibble first;
// NVFP4: E4M3 group scales [N_i, K/16]; MXFP4: E8M0 group scales [N_i, K/32]) of up to three
// weights that share the input, side by side along N (rows [0, end0), [end0, end1), [end1, N);
// each but the last a whole number of 16-row tiles), and computes, per output feature n and row m,
// colscale[n] * sum_k x[m, k] * code(n, k) * scale(n, k / group).
//
// A CTA loops over groups of FT tiles of 16 output features (as many CTAs as the caller lets fit
// beside what runs next); its NWARPS warps split K in steps of 128. In a step, lane
// (g = lane / 4, t = lane % 4) loads 16 bytes (32 codes) of feature g and of feature g + 8, at
// codes [128 s + 32 t, +32). A mma.m16n8k16 sums over 16 "logical" k of a lane group; which
// physical k a logical k stands for is free as long as the weight (A) and activation (B) operands
// agree, so each lane decodes its own 32 codes in place and reads the activations at the same
// physical k from shared memory (stored there once per CTA as fp16, in the pair order the
// decode produces: codes q and q + 4 of each 32-bit word). Columns of B beyond M are zero.
//
// Decode: nibble q of a word becomes the f16 bits (sign << 15 | magnitude << 9) = e2m1 * 2^-14
// (exact, e2m1's subnormal 0.5 included), two codes per f16x2; then one multiply by the group
// scale as f16 (NVFP4: E4M3 * 2^7, exact; MXFP4: 2^(e - mx_bias - 15)), accumulated in fp32 by
// the tensor core; colscale folds the 2^-7 (or the MXFP4 bias) and 1 / global scale back in.
//
// Compile-time: MX (0 NVFP4, 1 MXFP4), NWARPS (warps a CTA), UNR (steps a warp loads at once),
// PIPE (1: the next UNR steps load while these compute; 0: after), MROWS (rows compiled for),
// FT (tiles of 16 features a CTA computes at once: its warps load FT times the weights against
// one load of the activations, which every CTA reads from L2).
// LORA (0: off; else the rank window, a multiple of 8 up to 128): the group's LoRA in the same
// launch, y += round_bf16(x A^T) B^T (A = a_cat [R, K], B = b_full [N, R] block diagonal, bf16).
// Every CTA computes its tiles as without LoRA (one group of tiles a CTA: grid = groups) and,
// while its first weights load, takes a ticket from a 64-bit counter that only grows (ticket t is
// local ticket t mod grid of launch t div grid, in the order CTAs started): the first `split`
// local tickets also do one shrink item each first (x A^T over 128 inputs and up to LORA_RB
// ranks, added into the launch's float32 [8, R] buffer, one of two used by alternate launches;
// they clear their share of the other one, whose readers are done), then count it done
// (release). Before its store a CTA loads its rows of B (the member's window [rs, rs + LORA)),
// waits until the done count covers every shrink item of this launch (acquire) and adds the
// expand. A CTA does its items before it waits, and the items it waits for are taken by CTAs
// that start later, so every launch finishes as long as all items or all CTAs fit on the GPU at
// once (checked by the Python side: min(split, grid) <= CTAs resident).
// SPLITK (0: off; 1: the runtime ks may be above 1): K split over ks CTAs a group of tiles (a
// short N with a long K, the 7B down projection's 224 tiles on 132 multiprocessors): each adds
// its partial sums into a float32 workspace [N, 8] (atomics at L2), then counts itself on the
// group's counter; the last of the ks takes the sums out (atomicExch leaves zeros behind),
// resets the counter and stores. Nothing waits, so any grid finishes; the workspace and counters
// are zeros between launches (launches of one GEMV must not overlap: one stream).
// Requirements (checked by the Python side): K % 128 == 0, x rows contiguous, M <= 8; LORA: at
// least the largest member rank (a member's window [rs_i, rs_i + LORA) is read below R: its
// columns of other members are zeros on its rows).

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;

#ifndef MX
#define MX 0
#endif
#ifndef NWARPS
#define NWARPS 8
#endif
#ifndef UNR
#define UNR 2
#endif
#ifndef PIPE
#define PIPE 1
#endif
#ifndef FT
#define FT 1
#endif
#ifndef LORA
#define LORA 0
#endif
#ifndef SPLITK
#define SPLITK 0
#endif
#ifdef MINB  // CTAs a multiprocessor must hold (the LoRA variants: the plain one's occupancy)
#define BOUNDS __launch_bounds__(NWARPS * 32, MINB)
#else
#define BOUNDS __launch_bounds__(NWARPS * 32)
#endif
#define LORA_RB (NWARPS * 16)  // ranks a shrink item covers (8 a thread, 16 threads a rank)
#define ACC_ROWS 8  // rows of a LoRA accumulator buffer (the kernel's most rows)

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

// Lane (g, t)'s four sums of a tile at row0 (the mma.m16n8k16 accumulator layout) times colscale,
// plus add (the LoRA's), as bf16 into out[m, n] for the M valid rows and N valid features.
__device__ __forceinline__ void store_tile(const float (&c)[4], const float (&add)[4], int row0,
                                           int g, int t, int M, int N,
                                           const float* __restrict__ colscale,
                                           u16* __restrict__ out, int ldo) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int m = 2 * t + (i & 1);
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

// One 16-column step of a lane: decode its 32 codes of features g and g + 8 (words a, b; group
// scales sa, sb as f16x2), multiply by the activations xb[j] (pair-ordered f16, B fragments).
__device__ __forceinline__ void mma_step(float (&c0)[4], float (&c1)[4], const u32 (&a)[4],
                                         const u32 (&b)[4], const u32 (&sa)[2],
                                         const u32 (&sb)[2], const U4 (&xb)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    u32 pa[4], pb[4];
    decode8(a[j], pa);
    decode8(b[j], pb);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      pa[q] = hmul2(pa[q], sa[j >> 1]);
      pb[q] = hmul2(pb[q], sb[j >> 1]);
    }
    mma16816(c0, pa[0], pb[0], pa[1], pb[1], xb[j].x, xb[j].y);
    mma16816(c1, pa[2], pb[2], pa[3], pb[3], xb[j].z, xb[j].w);
  }
}

#ifndef MROWS
#define MROWS 1
#endif
#define XR ((MROWS + 1) / 2)  // 16-byte activation chunks a lane loads a step (16 lanes a row)
static_assert(NWARPS * UNR * MROWS * 256 + NWARPS * 512 * FT
                  + (LORA ? FT * (LORA * 32 + 64 * MROWS) + MROWS * 12 * LORA + 8 : 0) <= 48 * 1024,
              "shared memory (fp4_gemv.py's _smem_bytes)");
static_assert(LORA % 8 == 0 && LORA <= 128, "LORA: a multiple of 8 up to 128");
static_assert(!(LORA && SPLITK), "a launch with LoRA does not split K");

__device__ __forceinline__ u64 load_acquire(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// 8 bf16 (a 16-byte chunk) as float32.
__device__ __forceinline__ void bf16x8(U4 v, float (&f)[8]) {
  const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    f[2 * j] = __uint_as_float(w[j] << 16);
    f[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
  }
}

// A shrink item: x[m, k] A[r, k] over one 128-input slice of K for one block of LORA_RB ranks
// (a thread: 8 inputs of 8 ranks, loaded before the wait, as the tiles load their weights), added
// into the launch's buffer cur [8, R]; it also clears its share of the other buffer (after the
// wait: the launch before, which read it, is done even when it is this GEMV's own, launched just
// before with PDL), then counts itself done (release).
__device__ void lora_shrink(int item, int split, const U4* x, int M, int K,
                            const U4* __restrict__ la, float* cur, float* other, int R,
                            u64* done) {
  const int blocks = (R + LORA_RB - 1) / LORA_RB;
  const int slice = item / blocks, r0 = (item % blocks) * LORA_RB + (threadIdx.x >> 4);
  const int kc = slice * 16 + (threadIdx.x & 15);  // this thread's 16-byte chunk of a row
  U4 a[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int r = r0 + j * (NWARPS * 2);
    a[j] = U4{0u, 0u, 0u, 0u};
    if (r < R) a[j] = la[(u64)r * (K >> 3) + kc];
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");  // x is written; the launch before is done
  const int share = (ACC_ROWS * R + split - 1) / split;
  for (int i = threadIdx.x; i < share && item * share + i < ACC_ROWS * R; i += NWARPS * 32)
    other[item * share + i] = 0.f;
  float xv[MROWS][8];
#pragma unroll
  for (int m = 0; m < MROWS; ++m) {
    U4 v = U4{0u, 0u, 0u, 0u};
    if (m < M) v = load_coherent(x + (u64)m * (K >> 3) + kc);
    bf16x8(v, xv[m]);
  }
  asm volatile("griddepcontrol.launch_dependents;");
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float av[8];
    bf16x8(a[j], av);
    const int r = r0 + j * (NWARPS * 2);
#pragma unroll
    for (int m = 0; m < MROWS; ++m) {
      float p = 0.f;
#pragma unroll
      for (int q = 0; q < 8; ++q) p = fmaf(av[q], xv[m][q], p);
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) p += __shfl_xor_sync(0xFFFFFFFFu, p, o);  // 16 threads a row
      if ((threadIdx.x & 15) == 0 && m < M && r < R) atomicAdd(cur + m * R + r, p);
    }
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(done, 1ull);
}

// The first rank of b_full's window for output feature n: its member's (members 1 and 2 start at
// rows end0 and end1).
__device__ __forceinline__ int rank_start(int n, int end0, int end1, int rs0, int rs1, int rs2) {
  return n >= end1 ? rs2 : (n >= end0 ? rs1 : rs0);
}

// The LoRA terms of a group of tiles, one (feature, row) a thread: the shrink's row m (staged in
// xa, already rounded to bf16 as the two-GEMM path rounds it) at the feature's member's ranks
// [rs, rs + LORA) (those below R) times the feature's row of B staged in bs, into ladd[f][m].
__device__ __forceinline__ void lora_expand(const float* xa, int R, int row0, int M, int N,
                                            int end0, int end1, int rs0, int rs1, int rs2,
                                            const U4 (*bs)[LORA / 8 + (LORA == 0)],
                                            float (*ladd)[MROWS]) {
  for (int i = threadIdx.x; i < FT * 16 * MROWS; i += NWARPS * 32) {
    const int f = i / MROWS, m = i % MROWS;
    const int rs = rank_start(min(row0 + f, N - 1), end0, end1, rs0, rs1, rs2);
    float acc = 0.f;
    if (m < M) {
#pragma unroll 4
      for (int c = 0; c < LORA / 8; ++c) {
        float b[8];
        bf16x8(bs[f][c], b);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int r = rs + 8 * c + j;
          acc = fmaf(r < R ? xa[m * R + r] : 0.f, b[j], acc);
        }
      }
    }
    ladd[f][m] = acc;
  }
}

// A split group's partial sums y (warp 0's lanes, the mma layout) added into the workspace; for
// the last of its ks CTAs to count itself, the group's whole sums (taken out, leaving zeros) and
// true, else false (nothing to store).
__device__ __forceinline__ bool split_last(float (&y)[FT][4], int row0, int g, int t, int M,
                                           int N, float* ws, unsigned* cnt, int ks) {
#pragma unroll
  for (int f = 0; f < FT; ++f)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int m = 2 * t + (i & 1), n = row0 + 16 * f + g + ((i & 2) ? 8 : 0);
      if (m < M && n < N) atomicAdd(ws + (u64)n * ACC_ROWS + m, y[f][i]);
    }
  __threadfence();  // the sums before the count (release)
  __syncwarp();
  unsigned before = 0;
  if (threadIdx.x == 0) before = atomicAdd(cnt, 1u);
  if (__shfl_sync(0xFFFFFFFFu, before, 0) != (unsigned)ks - 1) return false;
  __syncwarp();  // lane 0's read of the count before every lane's fence
  __threadfence();  // the count before the sums (acquire)
#pragma unroll
  for (int f = 0; f < FT; ++f)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int m = 2 * t + (i & 1), n = row0 + 16 * f + g + ((i & 2) ? 8 : 0);
      if (m < M && n < N) y[f][i] = atomicExch(ws + (u64)n * ACC_ROWS + m, 0.f);
    }
  if (threadIdx.x == 0) *cnt = 0u;  // seen by the next launch, which starts after this one ends
  return true;
}

struct Step {
  U4 a[FT], b[FT];           // 32 codes of feature g and of feature g + 8 of each tile
  u32 sa[FT][2], sb[FT][2];  // their group scales as f16x2
  U4 xr[XR];  // 8 bf16 activations of rows 2 i + lane / 16, at 8 (lane % 16) in the step
};

extern "C" __global__ void BOUNDS
    fp4_gemv(const U4* x, const U4* __restrict__ w0, const u8* __restrict__ s0,
             const U4* __restrict__ w1, const u8* __restrict__ s1, const U4* __restrict__ w2,
             const u8* __restrict__ s2, int end0, int end1, const float* __restrict__ colscale,
             u16* __restrict__ out, int M, int N, int K, int ldo, int mx_bias,
             const U4* __restrict__ la, const u16* __restrict__ lb, float* lacc, u64* lcnt,
             int R, int split, int rs0, int rs1, int rs2, float* ksws, unsigned* kscnt,
             int ksplit) {
  __shared__ U4 xs[NWARPS][UNR][MROWS][16];  // a warp's activations of its UNR steps, f16 pairs
  __shared__ float red[NWARPS][32][FT][4];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#if LORA
  __shared__ U4 bs[FT * 16][LORA / 8];  // the tiles' rows of B in their member's rank window
  __shared__ float ladd[FT * 16][MROWS];  // their LoRA terms
  __shared__ float lxa[MROWS * 3 * LORA];  // the shrink's rows (R <= 3 LORA: 3 members at most)
  __shared__ u64 ticket_s;
  u64 launch = 0;
  float* lbuf = lacc;
#endif
  const int g = lane >> 2, t = lane & 3;
  const int chunks = K >> 5;  // 16-byte chunks a feature
  const int steps = K >> 7;
  const int xstride = K >> 3;  // 16-byte chunks of an activation row
#if MX
  const int sgroups = K >> 5;
#else
  const int sgroups = K >> 4;
#endif
  // Persistent over items (groups of FT tiles of 16 features, times ks parts of K with SPLITK; a
  // grid smaller than the items leaves room beside it). K's steps go round the vwarps warps of an
  // item's ks CTAs; this warp is the vw-th.
#if SPLITK
  const int ks = ksplit, vwarps = NWARPS * ks;
#else
  const int ks = 1, vwarps = NWARPS;  // ksplit is 1
#endif
  const int items = (N + 16 * FT - 1) / (16 * FT) * ks;
  for (int item = blockIdx.x, first_tile = 1; item < items; item += gridDim.x, first_tile = 0) {
    const int tile = item / ks, vw = (item - tile * ks) * NWARPS + warp;
    const int row0 = tile * 16 * FT;
    Rows rows[FT];
#pragma unroll
    for (int f = 0; f < FT; ++f)
      rows[f] = tile_rows(row0 + 16 * f, g, t, w0, s0, w1, s1, w2, s2, end0, end1, N, chunks,
                          sgroups);

    auto load_w = [&](Step (&s)[UNR], int first) {
#pragma unroll
      for (int u = 0; u < UNR; ++u) {
        const int st = first + u * vwarps;
        if (st < steps) {
#pragma unroll
          for (int f = 0; f < FT; ++f) {
            s[u].a[f] = rows[f].wa[st * 4];
            s[u].b[f] = rows[f].wb[st * 4];
#if MX
            scales_f16(rows[f].sa + st * 4 + t, mx_bias, s[u].sa[f]);
            scales_f16(rows[f].sb + st * 4 + t, mx_bias, s[u].sb[f]);
#else
            scales_f16(rows[f].sa + st * 8 + 2 * t, mx_bias, s[u].sa[f]);
            scales_f16(rows[f].sb + st * 8 + 2 * t, mx_bias, s[u].sb[f]);
#endif
          }
        }
      }
    };
    auto load_x = [&](Step (&s)[UNR], int first) {
#pragma unroll
      for (int u = 0; u < UNR; ++u) {
        const int st = first + u * vwarps;
#pragma unroll
        for (int i = 0; i < XR; ++i) {
          const int row = 2 * i + (lane >> 4);
          if (st < steps && row < M)
            s[u].xr[i] = load_coherent(x + (u64)row * xstride + st * 16 + (lane & 15));
        }
      }
    };
    float c[FT][2][4] = {};  // per tile: the partial sums of codes 0-15 and 16-31 of each word
    auto compute = [&](Step (&s)[UNR], int first) {
      __syncwarp();
#pragma unroll
      for (int u = 0; u < UNR; ++u) {
#pragma unroll
        for (int i = 0; i < XR; ++i) {
          const int row = 2 * i + (lane >> 4);
          if (row < M && first + u * vwarps < steps)
            xs[warp][u][row][lane & 15] = pair_order(s[u].xr[i]);
        }
      }
      __syncwarp();
#pragma unroll
      for (int u = 0; u < UNR; ++u) {
        if (first + u * vwarps < steps) {
          U4 xb[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            xb[j] = U4{0u, 0u, 0u, 0u};
            if (g < M) xb[j] = xs[warp][u][g][4 * t + j];
          }
#pragma unroll
          for (int f = 0; f < FT; ++f) {
            const u32 a4[4] = {s[u].a[f].x, s[u].a[f].y, s[u].a[f].z, s[u].a[f].w};
            const u32 b4[4] = {s[u].b[f].x, s[u].b[f].y, s[u].b[f].z, s[u].b[f].w};
            mma_step(c[f][0], c[f][1], a4, b4, s[u].sa[f], s[u].sb[f], xb);
          }
        }
      }
    };

    Step cur[UNR];
    load_w(cur, vw);  // the weights do not depend on the kernel before: load them before waiting
#if LORA
    if (first_tile) {  // the ticket (while the weights load): the first `split` do the shrink
      if (threadIdx.x == 0) ticket_s = atomicAdd(lcnt, 1ull);
      __syncthreads();
      launch = ticket_s / gridDim.x;
      lbuf = lacc + (launch & 1) * ACC_ROWS * R;  // this launch's buffer
      for (int item = (int)(ticket_s - launch * gridDim.x); item < split; item += gridDim.x)
        lora_shrink(item, split, x, M, K, la, lbuf, lacc + (1 - (launch & 1)) * ACC_ROWS * R, R,
                    lcnt + 1);
    }
#endif
    if (first_tile) asm volatile("griddepcontrol.wait;" ::: "memory");
    load_x(cur, vw);
    if (first_tile) asm volatile("griddepcontrol.launch_dependents;");
#if PIPE
    // Two batches of UNR steps in flight: the next one loads while this one computes.
    Step nxt[UNR];
    for (int first = vw; first < steps; first += 2 * vwarps * UNR) {
      const int second = first + vwarps * UNR;
      load_w(nxt, second);
      load_x(nxt, second);
      compute(cur, first);
      if (second >= steps) break;
      load_w(cur, second + vwarps * UNR);
      load_x(cur, second + vwarps * UNR);
      compute(nxt, second);
    }
#else
    // One batch in flight (fewer registers, more warps): load the next batch after this one.
    for (int first = vw; first < steps; first += vwarps * UNR) {
      compute(cur, first);
      load_w(cur, first + vwarps * UNR);
      load_x(cur, first + vwarps * UNR);
    }
#endif
    // Sum the warps' partial tiles, then write the M valid columns.
#pragma unroll
    for (int f = 0; f < FT; ++f)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[warp][lane][f][i] = c[f][0][i] + c[f][1][i];
#if LORA
    // the tiles' rows of B (their member's rank window), staged while the shrink items finish
    for (int i = threadIdx.x; i < FT * 16 * LORA; i += NWARPS * 32) {
      const int n = min(row0 + i / LORA, N - 1);
      const int r = rank_start(n, end0, end1, rs0, rs1, rs2) + i % LORA;
      reinterpret_cast<u16*>(bs)[i] = r < R ? lb[(u64)n * R + r] : (u16)0;
    }
    if (threadIdx.x == 0) {  // every shrink of this launch (and of the earlier ones) is done
      const u64 want = (launch + 1) * (u64)split;
      while (load_acquire(lcnt + 1) < want) __nanosleep(100);  // few polls at the counter's L2
      __threadfence();  // then the barrier: the CTA's reads of the buffer come after (as grid.sync)
    }
    __syncthreads();
    for (int i = threadIdx.x; i < M * R; i += NWARPS * 32) {  // the shrink's rows: one round trip
      float v;
      asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(lbuf + i) : "memory");
      lxa[i] = __uint_as_float(bf16_bits(v) << 16);
    }
    __syncthreads();
    lora_expand(lxa, R, row0, M, N, end0, end1, rs0, rs1, rs2, bs, ladd);
#endif
    __syncthreads();
    if (warp == 0) {
      float y[FT][4], add[FT][4] = {};
#pragma unroll
      for (int f = 0; f < FT; ++f) {
#pragma unroll
        for (int i = 0; i < 4; ++i) y[f][i] = red[0][lane][f][i];
#pragma unroll
        for (int v = 1; v < NWARPS; ++v)
#pragma unroll
          for (int i = 0; i < 4; ++i) y[f][i] += red[v][lane][f][i];
#if LORA
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int m = 2 * t + (i & 1);
          if (m < M) add[f][i] = ladd[16 * f + g + ((i & 2) ? 8 : 0)][m];
        }
#endif
      }
#if SPLITK
      const bool store = ks == 1 || split_last(y, row0, g, t, M, N, ksws, kscnt + tile, ks);
#else
      const bool store = true;
#endif
      if (store) {
#pragma unroll
        for (int f = 0; f < FT; ++f)
          store_tile(y[f], add[f], row0 + 16 * f, g, t, M, N, colscale, out, ldo);
      }
    }
    __syncthreads();  // red is rewritten by the next tile
  }
}

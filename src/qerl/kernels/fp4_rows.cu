// FP4 weights times a few dozen activation rows (9 <= M <= 64: decode waves) on Hopper tensor
// cores: y = x @ W^T, the stored compressed-tensors tensors read in place as fp4_gemv.cu reads them
// (up to three weights side by side along N; the same decode, group scales and column factors).
//
// Why a second kernel: the GEMV splits K over the warps of a CTA, so every warp stages its own
// activations; at M rows that is M * 2 bytes of activations per input against 8 bytes of weights
// for a tile of 16 features, which at M = 32 or 64 would read the activations from L2 several
// times over for every weight byte. Here the warps of a CTA split the features instead (NWARPS
// warps of FT tiles of 16 features each) and go through the same inputs together: a step of 128
// inputs of all M rows is staged once per CTA in shared memory (as pair-ordered f16, the order
// the decode produces; two buffers, one barrier a step) and every warp multiplies its own tiles
// by it. Each weight byte is loaded once, 16 bytes a lane straight into registers, UNR steps
// ahead; the tensor core tile is mma.m16n8k16 with the weights as A (16 features) and the
// activations as B (8 rows a tile, NT tiles: MROWS = 8 NT rows; rows beyond M are zeros).
//
// The activations' shared-memory layout: row r, 16-byte chunk c (8 inputs of the step) at chunk
// c ^ ((c >> 3 & 1) << 1) ^ (r & 1) of the row, so that the 8 lanes of each quarter warp (rows
// g, g + 1 of an n tile; chunks 4 t + j, t = 0..3) read 8 different bank groups.
//
// Items: a block of NWARPS * FT tiles times one of ks parts of K (SPLITK; a short N with a long
// K: the down projections). The grid may be smaller than the items (each CTA then loops over
// them, leaving multiprocessors to what runs beside it). With ks > 1 each CTA adds its partial
// sums into a float32 workspace [N, MROWS] (reductions at L2) and counts itself on its block's
// counter; the last of the ks stores the whole sums, leaving the workspace and counter zero
// (launches of one such GEMM must not overlap: one stream).
//
// Compile-time: MX (0 NVFP4, 1 MXFP4), NWARPS, FT (tiles of 16 features a warp), NT (tiles of 8
// rows), UNR (steps of weights a warp has in flight), SPLITK (0 / 1), MINB (CTAs a
// multiprocessor, optional). Requirements (checked by the Python side, fp4_gemv.Fp4Gemv):
// K % 128 == 0, x rows contiguous and 16-byte aligned, M <= MROWS.

#ifndef MX
#define MX 0
#endif
#ifndef NWARPS
#define NWARPS 4
#endif
#ifndef FT
#define FT 2
#endif
#ifndef NT
#define NT 4
#endif
#ifndef UNR
#define UNR 2
#endif
#ifndef SPLITK
#define SPLITK 0
#endif
#ifdef MINB
#define BOUNDS __launch_bounds__(NWARPS * 32, MINB)
#else
#define BOUNDS __launch_bounds__(NWARPS * 32)
#endif
#define MROWS (8 * NT)
#define XPT (MROWS * 16 / (NWARPS * 32))  // 16-byte activation chunks a thread stages a step

#include "fp4_common.cuh"

static_assert((MROWS * 16) % (NWARPS * 32) == 0, "every thread stages whole chunks");
static_assert(2 * MROWS * 16 * 16 <= 48 * 1024, "shared memory: two steps of activations");

// Where chunk c of activation row r sits in its row of shared memory (see the top).
__device__ __forceinline__ int swz(int r, int c) { return c ^ (((c >> 3) & 1) << 1) ^ (r & 1); }

struct WStep {
  U4 a[FT], b[FT];           // 32 codes of feature g and of feature g + 8 of each tile
  u32 sa[FT][2], sb[FT][2];  // their group scales as f16x2
};

extern "C" __global__ void BOUNDS
    fp4_rows(const U4* x, const U4* __restrict__ w0, const u8* __restrict__ s0,
             const U4* __restrict__ w1, const u8* __restrict__ s1, const U4* __restrict__ w2,
             const u8* __restrict__ s2, int end0, int end1, const float* __restrict__ colscale,
             u16* __restrict__ out, int M, int N, int K, int ldo, int mx_bias, float* ksws,
             unsigned* kscnt, int ks) {
  __shared__ U4 xs[2][MROWS][16];  // two steps of activations, pair-ordered f16, swizzled
  __shared__ unsigned last_s;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int chunks = K >> 5;  // 16-byte chunks of codes a feature
  const int steps = K >> 7;
  const int xstride = K >> 3;  // 16-byte chunks of an activation row
#if MX
  const int sgroups = K >> 5;
#else
  const int sgroups = K >> 4;
#endif
#if !SPLITK
  ks = 1;
#endif
  const int blocks = (N + 16 * FT * NWARPS - 1) / (16 * FT * NWARPS);
  const int items = blocks * ks;
  for (int item = blockIdx.x, first_item = 1; item < items; item += gridDim.x, first_item = 0) {
    const int blk = item / ks, part = item - blk * ks;
    const int st0 = part * steps / ks, st1 = (part + 1) * steps / ks;
    const int row0 = (blk * NWARPS + warp) * 16 * FT;  // this warp's first feature
    Rows rows[FT];
#pragma unroll
    for (int f = 0; f < FT; ++f)
      rows[f] = tile_rows(row0 + 16 * f, g, t, w0, s0, w1, s1, w2, s2, end0, end1, N, chunks,
                          sgroups);
    auto load_w = [&](WStep& s, int st) {
      if (st < st1) {
#pragma unroll
        for (int f = 0; f < FT; ++f) {
          s.a[f] = rows[f].wa[st * 4];
          s.b[f] = rows[f].wb[st * 4];
#if MX
          scales_f16(rows[f].sa + st * 4 + t, mx_bias, s.sa[f]);
          scales_f16(rows[f].sb + st * 4 + t, mx_bias, s.sb[f]);
#else
          scales_f16(rows[f].sa + st * 8 + 2 * t, mx_bias, s.sa[f]);
          scales_f16(rows[f].sb + st * 8 + 2 * t, mx_bias, s.sb[f]);
#endif
        }
      }
    };
    U4 xr[XPT];  // the next step's activations, on their way to shared memory
    auto load_x = [&](int st) {
#pragma unroll
      for (int i = 0; i < XPT; ++i) {
        const int idx = threadIdx.x + i * NWARPS * 32, r = idx >> 4;
        xr[i] = U4{0u, 0u, 0u, 0u};
        if (st < st1 && r < M) xr[i] = load_coherent(x + (u64)r * xstride + st * 16 + (idx & 15));
      }
    };
    auto store_x = [&](int buf) {
#pragma unroll
      for (int i = 0; i < XPT; ++i) {
        const int idx = threadIdx.x + i * NWARPS * 32, r = idx >> 4;
        xs[buf][r][swz(r, idx & 15)] = pair_order(xr[i]);
      }
    };
    float c[FT][NT][4] = {};
    auto compute = [&](const WStep& s, int buf) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // word j of each lane's 16 bytes: inputs 8 (4 t + j) + ..8
        U4 xb[NT];
#pragma unroll
        for (int n = 0; n < NT; ++n) xb[n] = xs[buf][8 * n + g][swz(8 * n + g, 4 * t + j)];
#pragma unroll
        for (int f = 0; f < FT; ++f) {
          const u32 wa = j == 0 ? s.a[f].x : (j == 1 ? s.a[f].y : (j == 2 ? s.a[f].z : s.a[f].w));
          const u32 wb = j == 0 ? s.b[f].x : (j == 1 ? s.b[f].y : (j == 2 ? s.b[f].z : s.b[f].w));
          u32 pa[4], pb[4];
          decode8(wa, pa);
          decode8(wb, pb);
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            pa[q] = hmul2(pa[q], s.sa[f][j >> 1]);
            pb[q] = hmul2(pb[q], s.sb[f][j >> 1]);
          }
#pragma unroll
          for (int n = 0; n < NT; ++n) mma16816(c[f][n], pa[0], pb[0], pa[1], pb[1], xb[n].x, xb[n].y);
#pragma unroll
          for (int n = 0; n < NT; ++n) mma16816(c[f][n], pa[2], pb[2], pa[3], pb[3], xb[n].z, xb[n].w);
        }
      }
    };

    WStep w[UNR];
#pragma unroll
    for (int u = 0; u < UNR; ++u) load_w(w[u], st0 + u);  // before the wait: not the writer's
    if (first_item) asm volatile("griddepcontrol.wait;" ::: "memory");
    load_x(st0);
    if (first_item) asm volatile("griddepcontrol.launch_dependents;");
    store_x(0);
    __syncthreads();
    for (int base = st0; base < st1; base += UNR) {
#pragma unroll
      for (int u = 0; u < UNR; ++u) {
        const int st = base + u;
        if (st < st1) {  // the same for every thread of the CTA: the barrier below is reached
          const int buf = (st - st0) & 1;
          load_x(st + 1);
          compute(w[u], buf);
          load_w(w[u], st + UNR);
          store_x(buf ^ 1);  // read by the step before, which every warp has finished
          __syncthreads();
        }
      }
    }
#if SPLITK
    if (ks > 1) {
#pragma unroll
      for (int f = 0; f < FT; ++f)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int m = 8 * n + 2 * t + (i & 1), col = row0 + 16 * f + g + ((i & 2) ? 8 : 0);
            if (m < M && col < N) atomicAdd(ksws + (u64)col * MROWS + m, c[f][n][i]);
          }
      __threadfence();  // the sums before the count (release)
      __syncthreads();
      if (threadIdx.x == 0) last_s = atomicAdd(kscnt + blk, 1u) == (unsigned)ks - 1;
      __syncthreads();
      if (!last_s) continue;  // the same for the whole CTA (no barrier skipped by a part)
      __threadfence();  // the count before the sums (acquire)
#pragma unroll
      for (int f = 0; f < FT; ++f)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int m = 8 * n + 2 * t + (i & 1), col = row0 + 16 * f + g + ((i & 2) ? 8 : 0);
            if (m < M && col < N) c[f][n][i] = atomicExch(ksws + (u64)col * MROWS + m, 0.f);
          }
      if (threadIdx.x == 0) kscnt[blk] = 0u;  // seen by the next launch (after this one ends)
    }
#endif
    const float none[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int f = 0; f < FT; ++f)
#pragma unroll
      for (int n = 0; n < NT; ++n)
        store_tile(c[f][n], none, row0 + 16 * f, g, t, M, N, colscale, out, ldo, 8 * n);
  }
}

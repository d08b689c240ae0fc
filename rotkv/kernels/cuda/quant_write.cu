// Quantize-on-write in CUDA: x [T, H, D] bf16 -> (x R - mu R) or (x - mu) -> per-row clip ->
// per-group INT2/INT4 with fp16 (or, ROTKV_META8, e4m3) scale and lo -> planar pack -> pool rows at slots [T].
//
// Same arithmetic as rotkv.quant.quantizer (and the Triton kernel in rotkv/kernels/write.py):
//   clip threshold t = the r-th largest |x| of the row (ties counted, = kthvalue), x clamped to [-t, t];
//   lo16 = lo rounded down to fp16, s16 = ((hi - lo16) / levels) rounded up to fp16 (IEEE division);
//   code = round-half-even((x - lo16) / s16) (IEEE division), clamped to [0, levels].
// Built without -use_fast_math, so every one of these is IEEE. Without rotation the bytes equal the
// quantizer's run on the CPU; with rotation they differ where the rotated value differs.
//
// Layout of the work: a warp owns a tile of tokens of one KV head and handles one row (token) at a
// time in a *strided* register layout: lane l holds dims l + 32 i (i < D / 32). That layout makes
// the rest cheap:
//   - the clip threshold is found by r rounds of "warp max of every lane's largest remaining |x|,
//     count the lanes that hold it, drop it" (redux.sync max + one ballot per round; each lane
//     sorts its D / 32 values once), so ties are counted exactly as kthvalue does;
//   - a quantization group (G a multiple of 32) is G / 32 whole registers of every lane, so its
//     min and max are one redux.sync each (floats mapped to order-preserving ints);
//   - planar packing puts dims j, j + D/4, j + D/2, j + 3D/4 (INT2) in byte j, i.e. the registers of
//     one lane (D >= 128) or of lanes l and l + 16 (D = 64, one shuffle).
// Rotation (ROT): the tile is 16 tokens, x R is mma.sync m16n8k16 in bf16 (x is bf16, exact) with R
// from shared memory, as bf16 (SPLIT = 1) or as the sum of two bf16 parts R = R_hi + R_lo (SPLIT = 2,
// error ~2^-16 relative, near the fp32 reference). mu R (the mean, rotated) is computed by the caller
// in fp32 and subtracted after the product. The fp32 product tile goes through shared memory into
// the strided layout.
//
// Layout of the pool (Int2PagePool, tests/kernels/paged_fixture.py): codes [NP, H, P, D * BITS / 8] u8,
// scale/lo [NP, H, P, D / G] fp16; row of (token, head) = (page * H + h) * P + offset, slot =
// page * P + offset.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#ifndef ROTKV_D
#define ROTKV_D 128
#endif
#ifndef ROTKV_G
#define ROTKV_G 64
#endif
#ifndef ROTKV_BITS
#define ROTKV_BITS 2
#endif
#ifndef ROTKV_SPLIT
#define ROTKV_SPLIT 2
#endif
#ifndef ROTKV_NW
#define ROTKV_NW 4
#endif
#ifndef ROTKV_REDUX
#define ROTKV_REDUX 1  // warp max/min by redux.sync (1) or by a shuffle butterfly (0)
#endif
#ifndef ROTKV_META8
#define ROTKV_META8 0  // scale and lo as e4m3 bytes (1) or fp16 (0)
#endif
#ifndef ROTKV_FASTDIV
#define ROTKV_FASTDIV 1  // codes by the reciprocal, with the division where it could round otherwise (1)
#endif

#define DEVI __device__ __forceinline__

#if ROTKV_META8
typedef uint8_t meta_t;  // e4m3fn bytes, written by e4m3_dir
#else
typedef __half meta_t;
#endif

namespace {

constexpr int D = ROTKV_D, G = ROTKV_G, BITS = ROTKV_BITS, SPLIT = ROTKV_SPLIT;
constexpr int NW = ROTKV_NW;  // warps per block of the rotating kernel (they share R in shared memory)
constexpr int PNW = 4;        // warps per block of the plain kernel
constexpr int V = D / 32;            // values per lane per row
constexpr int NG = D / G;            // groups per row
constexpr int GV = G / 32;           // registers per group per lane
constexpr int LEVELS = (1 << BITS) - 1;
constexpr int PER = 8 / BITS;        // codes per byte (planes)
constexpr int Q = D / PER;           // bytes per row
constexpr int NB = Q >= 32 ? Q / 32 : 1;  // bytes each lane stores per row
constexpr int RS = D + 8;            // shared R row stride (bf16): conflict-free fragment loads
constexpr int CS = D + 4;            // shared product tile row stride (fp32)
constexpr int TILE_ROT = 16;
constexpr unsigned FULL = 0xffffffffu;

static_assert(D == 64 || D == 128 || D == 256, "head_dim 64, 128 or 256");
static_assert(G % 32 == 0 && D % G == 0, "group size a multiple of 32 dividing head_dim");
static_assert(BITS == 2 || BITS == 4, "2 or 4 bits");
static_assert(Q % 32 == 0 || Q == 16, "bytes per row");

DEVI int order_key(float f) {  // float -> int with the same order (no NaN)
  int b = __float_as_int(f);
  return b ^ ((b >> 31) & 0x7fffffff);
}
DEVI float order_val(int k) { return __int_as_float(k ^ ((k >> 31) & 0x7fffffff)); }

DEVI uint32_t warp_umax(uint32_t v) {
#if ROTKV_REDUX
  return __reduce_max_sync(FULL, v);
#else
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(FULL, v, o));
  return v;
#endif
}
DEVI int warp_imax(int v) {
#if ROTKV_REDUX
  return __reduce_max_sync(FULL, v);
#else
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(FULL, v, o));
  return v;
#endif
}
DEVI int warp_imin(int v) {
#if ROTKV_REDUX
  return __reduce_min_sync(FULL, v);
#else
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(FULL, v, o));
  return v;
#endif
}

// round-half-even(fl(d / s)), the reference's code: the reciprocal gives the same integer unless
// d / s lies within a few ulps of a half-integer, where the IEEE division decides (rare)
DEVI float code_of(float d, float s, float inv) {
#if ROTKV_FASTDIV
  const float q = d * inv;
  const float f = q - floorf(q);
  if (fabsf(f - 0.5f) < 1e-3f) return rintf(__fdiv_rn(d, s));
  return rintf(q);
#else
  return rintf(__fdiv_rn(d, s));
#endif
}

DEVI void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Clip, quantize, pack and store one row held in the strided layout. One row at a time per warp:
// interleaving 4 rows (their warp reductions in flight together) takes more registers and was slower,
// and so was a bounded for-loop in place of the while (docs/kernel-notes.md).
#if ROTKV_META8
// float32 -> e4m3fn rounded towards +inf (up) or -inf, as rotkv.quant.quantizer._round_dir; returns the
// byte and sets val to its value. Integer arithmetic on the bits, as the Triton write does
// (rotkv/kernels/write.py, _fp8_round): the top 3 mantissa bits under the exponent (floor(|x| * 512)
// below 2^-6, where the subnormals meet the normal codes at 8), plus one where a remainder was cut and
// the rounding goes away from zero; past 448 (and inf/NaN) the code is 127, e4m3fn's NaN, which the
// pools' check turns into an error (the reference raises).
// host and device: tests/kernels/test_cuda_build.py runs it on the CPU against the reference
template <typename To, typename From>
__host__ __device__ __forceinline__ To bit_cast(From x) {  // memcpy: a register move on the device
  static_assert(sizeof(To) == sizeof(From), "bit_cast between types of one size");
  To y;
  memcpy(&y, &x, sizeof(To));
  return y;
}

__host__ __device__ __forceinline__ uint8_t e4m3_dir(float x, bool up, float& val) {
  const uint32_t bits = bit_cast<uint32_t>(x);
  const bool neg = bits >> 31;
  const uint32_t ab = bits & 0x7FFFFFFFu;
  int code;
  bool cut;
  const bool small = ab < 0x3C800000u;
  if (small) {
    const float s = bit_cast<float>(ab) * 512.0f;  // exact: a power-of-two scale below 2^-6
    const float f = floorf(s);
    code = (int)f;
    cut = s != f;
  } else {
    const int e = (int)(ab >> 23) - 127;
    code = e > 8 ? 127 : (((e + 7) << 3) | (int)((ab >> 20) & 7));
    cut = e <= 8 && (ab & 0xFFFFFu) != 0;
  }
  if (cut && (up ? !neg : neg)) ++code;
  if (code > 126) code = 127;
  const float mag = code < 8 ? (float)code * 0.001953125f
                             : bit_cast<float>(((uint32_t)((code >> 3) + 120) << 23) | ((uint32_t)(code & 7) << 20));
  val = neg ? -mag : mag;
  return (uint8_t)(code | (neg ? 128 : 0));
}
#endif

DEVI void quant_row(float (&v)[V], int clip_r, long long row, uint8_t* __restrict__ codes,
                    meta_t* __restrict__ scale, meta_t* __restrict__ lo, int lane) {
  if (clip_r > 0) {
    uint32_t a[V];
#pragma unroll
    for (int i = 0; i < V; ++i) a[i] = __float_as_uint(fabsf(v[i]));  // |x| bits keep the order
#pragma unroll
    for (int s = 0; s < V; ++s)  // odd-even transposition sort, descending
#pragma unroll
      for (int i = s & 1; i + 1 < V; i += 2) {
        uint32_t hi = max(a[i], a[i + 1]), lw = min(a[i], a[i + 1]);
        a[i] = hi;
        a[i + 1] = lw;
      }
    // r rounds: warp max of every lane's largest remaining |x|, count the lanes holding it, drop it
    // (each round drops at least one value; warp-uniform)
    int removed = 0;
    uint32_t t = 0;
    while (removed < clip_r) {
      t = warp_umax(a[0]);
      const bool hit = a[0] == t;
      removed += __popc(__ballot_sync(FULL, hit));
      if (hit) {
#pragma unroll
        for (int i = 0; i + 1 < V; ++i) a[i] = a[i + 1];
        a[V - 1] = 0;
      }
    }
    const float tf = __uint_as_float(t);
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = fminf(fmaxf(v[i], -tf), tf);
  }
  float lof[NG], sdiv[NG], inv[NG];
  meta_t lo16[NG], s16[NG];
#pragma unroll
  for (int g = 0; g < NG; ++g) {
    float mn = v[g * GV], mx = v[g * GV];
#pragma unroll
    for (int i = 1; i < GV; ++i) {
      mn = fminf(mn, v[g * GV + i]);
      mx = fmaxf(mx, v[g * GV + i]);
    }
    mn = order_val(warp_imin(order_key(mn)));
    mx = order_val(warp_imax(order_key(mx)));
#if ROTKV_META8
    lo16[g] = e4m3_dir(mn, false, lof[g]);
    float sf;
    // hi - lo >= 0: the sign bit goes (-0 - -0 can give -0)
    s16[g] = e4m3_dir(__fdiv_rn(__fsub_rn(mx, lof[g]), (float)LEVELS), true, sf) & 127;
    sf = fabsf(sf);
#else
    lo16[g] = __float2half_rd(mn);
    lof[g] = __half2float(lo16[g]);
    s16[g] = __float2half_ru(__fdiv_rn(__fsub_rn(mx, lof[g]), (float)LEVELS));
    const float sf = __half2float(s16[g]);
#endif
    sdiv[g] = sf > 0.f ? sf : 1.f;  // a constant group divides by 1 (every code 0), as the reference
    inv[g] = __frcp_rn(sdiv[g]);
  }
  int c[V];
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int g = i / GV;
    const float y = code_of(__fsub_rn(v[i], lof[g]), sdiv[g], inv[g]);
    c[i] = (int)fminf(fmaxf(y, 0.f), (float)LEVELS);
  }
  uint8_t* crow = codes + row * Q;
  if constexpr (Q >= 32) {
    // dim l + 32 i -> byte (l + 32 i) % Q = l + 32 (i % NB), plane i / NB
#pragma unroll
    for (int k = 0; k < NB; ++k) {
      uint32_t b = 0;
#pragma unroll
      for (int p = 0; p < PER; ++p) b |= (uint32_t)c[p * NB + k] << (BITS * p);
      crow[lane + 32 * k] = (uint8_t)b;
    }
  } else {  // D = 64, INT2 (Q = 16): dim l -> byte l % 16, plane l / 16; dim l + 32 -> plane 2 + l / 16
    const int pl = lane >> 4;
    uint32_t part = ((uint32_t)c[0] << (2 * pl)) | ((uint32_t)c[1] << (2 * (2 + pl)));
    part |= __shfl_down_sync(FULL, part, 16);
    if (lane < 16) crow[lane] = (uint8_t)part;
  }
#pragma unroll
  for (int g = 0; g < NG; ++g)
    if (lane == g) {
      scale[row * NG + g] = s16[g];
      lo[row * NG + g] = lo16[g];
    }
}

// dst row of token t (page * H + h) * P + offset, from its slot
DEVI long long dst_row(const long long* __restrict__ slots, int t, int T, int h, int H, int P) {
  if (t >= T) return -1;
  const long long s = slots[t];
  const long long page = s / P;
  return (page * H + h) * P + (s - page * P);
}

DEVI float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
DEVI float to_f(__half v) { return __half2float(v); }
DEVI float to_f(float v) { return v; }

template <typename XT>
__global__ void __launch_bounds__(PNW * 32) write_plain(const XT* __restrict__ x, long long sxt,
                                                       long long sxh, const float* __restrict__ mu,
                                                       const long long* __restrict__ slots,
                                                       uint8_t* __restrict__ codes, meta_t* __restrict__ scale,
                                                       meta_t* __restrict__ lo, int T, int H, int P, int clip_r) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, h = blockIdx.y;
  float m[V];
#pragma unroll
  for (int i = 0; i < V; ++i) m[i] = mu ? mu[h * D + lane + 32 * i] : 0.f;
  const int n_tiles = (T + 31) / 32;
  for (int tile = blockIdx.x * PNW + warp; tile < n_tiles; tile += gridDim.x * PNW) {
    const int t0 = tile * 32;
    const long long my_row = dst_row(slots, t0 + lane, T, h, H, P);  // one division per lane per 32 rows
    const int n = min(32, T - t0);
    // one row at a time, loaded where it is used: loading 4 rows ahead was slower (more registers,
    // fewer warps per SM; the warps in flight already cover the load latency)
    for (int rr = 0; rr < n; ++rr) {
      const long long row = __shfl_sync(FULL, my_row, rr);
      const XT* src = x + (long long)(t0 + rr) * sxt + (long long)h * sxh;
      float v[V];
#pragma unroll
      for (int i = 0; i < V; ++i) v[i] = __fsub_rn(to_f(src[lane + 32 * i]), m[i]);
      quant_row(v, clip_r, row, codes, scale, lo, lane);
    }
  }
}

__global__ void __launch_bounds__(NW * 32) write_rot(const __nv_bfloat16* __restrict__ x, long long sxt,
                                                     long long sxh, const float* __restrict__ rot,
                                                     const float* __restrict__ mu_rot,
                                                     const long long* __restrict__ slots,
                                                     uint8_t* __restrict__ codes, meta_t* __restrict__ scale,
                                                     meta_t* __restrict__ lo, int T, int H, int P, int clip_r) {
  extern __shared__ __align__(16) unsigned char smem[];
  __nv_bfloat16* rt = reinterpret_cast<__nv_bfloat16*>(smem);  // [SPLIT][D (n)][RS (k)]: R transposed
  float* ctile = reinterpret_cast<float*>(smem + SPLIT * D * RS * 2) + (threadIdx.x >> 5) * TILE_ROT * CS;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, h = blockIdx.y;
  const float* rh = rot + (long long)h * D * D;
  for (int idx = threadIdx.x; idx < D * D; idx += NW * 32) {
    const int k = idx / D, n = idx % D;  // coalesced read of R[k][n]
    const float r = rh[idx];
    const __nv_bfloat16 hi = __float2bfloat16_rn(r);
    rt[n * RS + k] = hi;
    if (SPLIT == 2) rt[D * RS + n * RS + k] = __float2bfloat16_rn(r - __bfloat162float(hi));
  }
  float m[V];
#pragma unroll
  for (int i = 0; i < V; ++i) m[i] = mu_rot ? mu_rot[h * D + lane + 32 * i] : 0.f;
  __syncthreads();
  const int g = lane >> 2, q = lane & 3;
  const int n_tiles = (T + TILE_ROT - 1) / TILE_ROT;
  constexpr int NCH = D > 128 ? 128 : D;  // output columns per accumulator pass (register budget)
  uint32_t a[D / 16][4];  // A fragments of the 16 x D bf16 tile: rows g, g + 8; k pairs 2q, 2q + 8 of each 16
  auto load_a = [&](int t0) {
    const bool ok0 = t0 + g < T, ok1 = t0 + g + 8 < T;
    const uint32_t* x0 = reinterpret_cast<const uint32_t*>(x + (long long)(t0 + g) * sxt + (long long)h * sxh);
    const uint32_t* x1 = reinterpret_cast<const uint32_t*>(x + (long long)(t0 + g + 8) * sxt + (long long)h * sxh);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      a[kk][0] = ok0 ? x0[kk * 8 + q] : 0u;
      a[kk][1] = ok1 ? x1[kk * 8 + q] : 0u;
      a[kk][2] = ok0 ? x0[kk * 8 + 4 + q] : 0u;
      a[kk][3] = ok1 ? x1[kk * 8 + 4 + q] : 0u;
    }
  };
  const int first = blockIdx.x * NW + warp, stride = gridDim.x * NW;
  if (first < n_tiles) load_a(first * TILE_ROT);
  for (int tile = first; tile < n_tiles; tile += stride) {
    const int t0 = tile * TILE_ROT;
    const long long my_row = lane < TILE_ROT ? dst_row(slots, t0 + lane, T, h, H, P) : -1;
#pragma unroll
    for (int n0 = 0; n0 < D; n0 += NCH) {
      float acc[NCH / 8][4];
#pragma unroll
      for (int j = 0; j < NCH / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll
      for (int s = SPLIT - 1; s >= 0; --s) {  // the small part first
        const __nv_bfloat16* rs = rt + s * D * RS;
#pragma unroll
        for (int j = 0; j < NCH / 8; ++j) {
          const uint32_t* br = reinterpret_cast<const uint32_t*>(rs + (n0 + 8 * j + g) * RS);
#pragma unroll
          for (int kk = 0; kk < D / 16; ++kk) mma_bf16(acc[j], a[kk], br[kk * 8 + q], br[kk * 8 + 4 + q]);
        }
      }
#pragma unroll
      for (int j = 0; j < NCH / 8; ++j) {
        *reinterpret_cast<float2*>(ctile + g * CS + n0 + 8 * j + 2 * q) = make_float2(acc[j][0], acc[j][1]);
        *reinterpret_cast<float2*>(ctile + (g + 8) * CS + n0 + 8 * j + 2 * q) = make_float2(acc[j][2], acc[j][3]);
      }
    }
    if (tile + stride < n_tiles) load_a((tile + stride) * TILE_ROT);  // in flight while the rows are quantized
    __syncwarp();
    const int n = min(TILE_ROT, T - t0);
    for (int rr = 0; rr < n; ++rr) {
      const long long row = __shfl_sync(FULL, my_row, rr);
      float v[V];
#pragma unroll
      for (int i = 0; i < V; ++i) v[i] = __fsub_rn(ctile[rr * CS + lane + 32 * i], m[i]);
      quant_row(v, clip_r, row, codes, scale, lo, lane);
    }
    __syncwarp();
  }
}

constexpr size_t rot_smem() { return (size_t)SPLIT * D * RS * 2 + (size_t)NW * TILE_ROT * CS * 4; }

}  // namespace

template <typename XT>
int launch_plain(const void* x, long long sxt, long long sxh, const void* mu, const void* slots, void* codes,
                 void* scale, void* lo, int T_, int H, int P, int clip_r, int nb, int want, int sms, cudaStream_t st) {
  int per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, write_plain<XT>, PNW * 32, 0);
  if (nb <= 0) nb = (per_sm * sms + H - 1) / H;
  nb = nb < want ? nb : want;
  write_plain<XT><<<dim3(nb > 0 ? nb : 1, H), PNW * 32, 0, st>>>(
      (const XT*)x, sxt, sxh, (const float*)mu, (const long long*)slots, (uint8_t*)codes, (meta_t*)scale,
      (meta_t*)lo, T_, H, P, clip_r);
  return 0;
}

// Returns 0, or -1 (variant mismatch), -2 (bad arguments), or a CUDA error code + 1000.
// x_dtype: 0 bf16, 1 fp16, 2 fp32 (the rotation takes bf16 only).
// blocks_per_head <= 0: sized from the occupancy (every SM busy).
extern "C" int rotkv_quant_write(int d, int g, int bits, int split, int nw, int meta8, int x_dtype, const void* x, long long sxt, long long sxh,
                                 const void* rot, const void* mu, const void* slots, void* codes, void* scale,
                                 void* lo, int T, int H, int P, int clip_r, int blocks_per_head, void* stream) {
  if (d != D || g != G || bits != BITS || split != SPLIT || nw != NW || meta8 != ROTKV_META8) return -1;
  if (T <= 0) return 0;
  if (H <= 0 || P <= 0 || clip_r < 0 || clip_r > D || x_dtype < 0 || x_dtype > 2 || (rot && x_dtype != 0)) return -2;
  cudaStream_t st = (cudaStream_t)stream;
  int dev = 0, sms = 0, per_sm = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const int tile = rot ? TILE_ROT : 32;
  const int n_tiles = (T + tile - 1) / tile;
  const int want = (n_tiles + (rot ? NW : PNW) - 1) / (rot ? NW : PNW);
  if (rot) {
    static bool attr = false;
    const size_t sm = rot_smem();
    if (!attr) {
      cudaError_t e = cudaFuncSetAttribute(write_rot, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm);
      if (e != cudaSuccess) return 1000 + (int)e;
      attr = true;
    }
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, write_rot, NW * 32, sm);
    int nb = blocks_per_head > 0 ? blocks_per_head : (per_sm * sms + H - 1) / H;
    nb = nb < want ? nb : want;
    write_rot<<<dim3(nb > 0 ? nb : 1, H), NW * 32, sm, st>>>(
        (const __nv_bfloat16*)x, sxt, sxh, (const float*)rot, (const float*)mu, (const long long*)slots,
        (uint8_t*)codes, (meta_t*)scale, (meta_t*)lo, T, H, P, clip_r);
  } else if (x_dtype == 0) {
    launch_plain<__nv_bfloat16>(x, sxt, sxh, mu, slots, codes, scale, lo, T, H, P, clip_r, blocks_per_head, want, sms, st);
  } else if (x_dtype == 1) {
    launch_plain<__half>(x, sxt, sxh, mu, slots, codes, scale, lo, T, H, P, clip_r, blocks_per_head, want, sms, st);
  } else {
    launch_plain<float>(x, sxt, sxh, mu, slots, codes, scale, lo, T, H, P, clip_r, blocks_per_head, want, sms, st);
  }
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? 0 : 1000 + (int)e;
}

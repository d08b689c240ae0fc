// Split-K decode attention over a paged INT2 body, one warp per (request, KV head, split).
//
// Why CUDA and not Triton: the Triton kernel (rotkv/kernels/decode.py) reaches 1.2-1.3x bf16
// because every code tile goes through shared memory to reach the MMA operand layout and the
// query rows are padded to 16. Here the codes are loaded from global memory straight into the
// registers of the mma.sync fragments, and the MMAs are transposed so that tokens are the M
// dimension and query heads the N dimension (8: GQA 1..8 without padding to 16):
//
//   scores   S^T [16 tok, 8 heads] = C [16 tok, 32 dims of one chunk] (int8 codes 0..3)
//                                    x Q^T [32, 8] (int8 query, one scale per head)   (mma m16n8k32)
//   values   O^T [16 dims, 8 heads] += (1024 + 4^i C)^T [16 dims, 16 tok] (fp16 0x6400|code bits)
//                                      x P~^T [16 tok, 8 heads] (fp16 p * s_v)        (mma m16n8k16)
//            (ROTKV_VF16, the default build; otherwise bf16 0x4300|c with offset 128, plane 3 shifted)
//
// ROTKV_QF16 (1 or 2) scores with an fp16 query instead (no int8 rounding of the query; what the
// plan runs where the int8 query costs accuracy, head_dim 64): one m16n8k16 per (code word, plane),
//
//   scores   S^T [16 tok, 8 heads] += A [16 tok, 16 dims: 4 bytes x 4 tokens' worth of one plane]
//                                     x Q^T [16, 8] (fp16 q / qsc / 4^i, qsc = amax / 2^14 per head)
//
// where the k index pairs (2t, 2t+1) and (2t+8, 2t+9) of lane (g, t) are bytes (0, 1) and (2, 3) of
// its code word, i.e. 4 consecutive dims of plane i (the same permutation on both sides). A holds
// 4^i c exactly: QF16 = 1 keeps the masked bits as fp16 subnormals (4^i c * 2^-24, one LOP3 per
// register, the 2^24 folded into the head's scale); QF16 = 2 ORs in fp16 1024 and subtracts it
// (one LOP3 and one HSUB2). Both products are exact in the fp32 accumulator.
//
// P~^T is the S^T accumulator transposed in registers by movmatrix. Scale and minimum stay out of
// the products: q.k = qsc * sum_g s_g (q_g . c_g) + sum_g lo_g * sum(q_g), and
// sum_n p_n v_n = sum_n (p_n s_n) (OFF + c_n) + sum_n p_n lo_n - OFF * sum_n (p_n s_n), the last
// sum taken by one more MMA against an all-ones A so that it uses the same rounded p~.
//
// Planar packing: byte j of a token row holds dims j, j + D/4, j + D/2, j + 3D/4 (plane i = bits
// 2i..2i+1). A K-chunk of 32 int8 codes covers dims [32c, 32c + 32) and lies in one quantization
// group (G % 32 == 0). Value rows of one m16 tile cover 16 dims of one plane inside 32 consecutive
// dims, so they share a group too.
//
// ROTKV_REFINE: the refine tier (rotkv/cache/refine.py). Each request's newest min(RK, ceil(n / RE)) body
// pages (n its page count, computed here in integers as rotkv.quant.refine.refined_pages) keep 2 more bits
// per key (ring rk) and value (ring rv) element, in rings uint8 [B, RK, H, P, D/4] (slot = page index mod RK)
// packed as the codes. A refined element reads lo + s (h + (j - 1.5) / 4) = (lo - 3 s / 8) + (s / 4) (4 h + j):
// a refined tile (one page: P % 16 == 0, so the flag is warp-uniform) is a 4-bit tile with codes 4 h + j,
// scale s / 4 and minimum lo - 3 s / 8. The merged codes take each product's operand as the 2-bit ones did:
// int8 bytes 0..15; fp16 subnormals or 1024 + x for 4^i (4 h + j) <= 960 < 1024, every plane in place; so a
// refined tile runs the same MMAs, with the ring's bits merged into the operand registers (the values need
// the fp16 product, ROTKV_VF16). Unrefined tiles, and builds without ROTKV_REFINE, are unchanged.
//
// ROTKV_K4: the keys are INT4 (codes [NP, H, P, D/2], rotkv.quant.packing: byte j holds dims j (bits 0-3) and
// j + D/2 (bits 4-7)), the values INT2 as above; element lo + s c with the page's own scale and minimum, c 0..15.
// The thread loads, for each INT2-layout code word at byte offset o (0 <= o < D/4), the INT4 row's words at o
// (dims o.. of planes 0 and 2: a) and at o + D/4 (planes 1 and 3: b). Plane i's 4 codes are then one nibble
// of every byte: a & 0x0F (i 0), b & 0x0F (1), a >> 4 (2), b >> 4 (3). Such a word is the refined tile's
// merged code 4 h + j with h the high and j the low 2 bits (H = ((a >> 2) & 0x33333333) | (b & 0xCCCCCCCC),
// L = (a & 0x33333333) | ((b << 2) & 0xCCCCCCCC) as INT2 words), so every key tile takes the refined tile's
// operands (int8 bytes 0..15, fp16 4^i c <= 960 < 1024 in place) straight from the nibbles, one or two
// instructions each, and keeps its page's scale and minimum. 4-bit keys have no refine ring (rk null); with
// ROTKV_REFINE the values' ring (rv) is read as in the INT2 build.
//
// Layout (as Int2PagePool, tests/kernels/paged_fixture.py): codes [NP, H, P, D/4] u8 (the keys' [NP, H, P, D/2]
// with ROTKV_K4), scale/lo [NP, H, P, D/G]
// fp16 (the values' e4m3 with ROTKV_VMETA8, oscar-mix's layout: converted to fp16 exactly), page table kv_indptr [B+1], kv_indices, kv_last_page_len [B] (int32), P % 16 == 0.
// Output: unnormalized partials o [B, HQ, NS, D] fp32, running max m and sum l [B, HQ, NS]
// (base 2: the query scale carries log2 e), merged by the Triton merge kernel.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#define DEVI __device__ __forceinline__

#ifndef ROTKV_PREFETCH  // 1: the next step's loads are issued before this step's math
#define ROTKV_PREFETCH 0
#endif
#ifndef ROTKV_VF16  // 1: value product in fp16 with the codes in place (one LOP3 per operand register)
#define ROTKV_VF16 0
#endif
#ifndef ROTKV_VFLUSH  // > 0: every this many steps, the value accumulators drop their offset (see below)
#define ROTKV_VFLUSH 0
#endif
#ifndef ROTKV_QF16  // score product: 0 int8 query (m16n8k32); 1 or 2 fp16 query (m16n8k16, see below)
#define ROTKV_QF16 0
#endif
#ifndef ROTKV_VMETA8  // 1: the values' scale and lo are e4m3 (one byte each), the keys' stay fp16
#define ROTKV_VMETA8 0
#endif
#ifndef ROTKV_REFINE  // 1: the kernel reads the refine tier's rings (Params rk, rv; either may be null)
#define ROTKV_REFINE 0
#endif
#ifndef ROTKV_K4  // 1: the keys are INT4 (code rows of D/2 bytes), the values INT2
#define ROTKV_K4 0
#endif
static_assert(!ROTKV_REFINE || ROTKV_VF16, "the refine tier's merged value codes need the fp16 value product");
#define ROTKV_KREF (ROTKV_REFINE && !ROTKV_K4)  // the keys may have a refine ring (INT2 keys only)

namespace {

struct Params {
  const __nv_bfloat16* q;  // [B, HQ, D]
  const uint8_t* kc;
  const __half* ks;
  const __half* kl;
  const uint8_t* vc;
  const __half* vs;
  const __half* vl;
  const int* indptr;
  const int* indices;
  const int* last;
  float* o;
  float* m;
  float* l;
  int H, HQ, rep, P, NS, n_splits, tokens_per_split, n_work;
  float qk_scale;
  // fused mode (fuse != 0, n_splits % 4 == 0): the 4 warps of a block (4 consecutive splits of one
  // (request, KV head)) merge their partials in shared memory into slot s / 4; with counters set, the
  // last block of each (request, KV head) merges all NS slots (its own, the other blocks' and the
  // tier's, written by an earlier launch) into out and resets its counter for the next call
  int fuse;
  int* counters;   // [B * H] int32, zero between calls (or null: partials only)
  void* out;       // [B, HQ, D]
  int out_kind;    // 0 float32, 1 bfloat16, 2 float16
  // the refine tier (ROTKV_REFINE): key and value rings uint8 [B, RK, H, P, D/4] (null: that side has
  // none; rk always with ROTKV_K4), RK slots per request, one refined page per RE body pages (RE >= 1)
  const uint8_t* rk;
  const uint8_t* rv;
  int RK, RE;
};

template <bool B> struct Tag { static constexpr bool value = B; };

DEVI uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

DEVI void mma_s8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

DEVI void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

DEVI void mma_f16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// over the 4 lanes of a quad (t = 0..3: one query head's lanes)
DEVI float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
DEVI float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

DEVI uint32_t movmatrix_t(uint32_t x) {
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}

DEVI uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <uint32_t MASK>
DEVI uint32_t and_or(uint32_t x, uint32_t bits) {  // (x & MASK) | bits as one LOP3 (bits in a register)
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(x), "n"(MASK), "r"(bits));
  return r;
}

// the value operands' element type: bf16 (0x4300 | x = 128 + x for x < 128: planes 0-2 in place,
// plane 3 shifted down) or fp16 (0x6400 | x = 1024 + x for x < 1024: all four planes in place)
constexpr float V_OFFSET = ROTKV_VF16 ? 1024.f : 128.f;
constexpr uint32_t V_ONES = ROTKV_VF16 ? 0x3C003C00u : 0x3F803F80u;  // (1, 1) in fp16 / bf16
DEVI void mma_v(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  if constexpr (ROTKV_VF16) mma_f16(c, a0, a1, a2, a3, b0, b1);
  else mma_bf16(c, a0, a1, a2, a3, b0, b1);
}

// NG fp16 values of one token, kept as raw bits until used
template <int NG> struct MetaRaw;
template <> struct MetaRaw<1> { using T = unsigned short; static DEVI T zero() { return 0; } };
template <> struct MetaRaw<2> { using T = uint32_t; static DEVI T zero() { return 0u; } };
template <> struct MetaRaw<4> { using T = uint2; static DEVI T zero() { return make_uint2(0u, 0u); } };
template <> struct MetaRaw<8> { using T = uint4; static DEVI T zero() { return make_uint4(0u, 0u, 0u, 0u); } };

template <int NG>
DEVI __half meta_half(const typename MetaRaw<NG>::T& raw, int k) {
  uint32_t w;
  if constexpr (NG == 1) w = raw;
  else if constexpr (NG == 2) w = raw;
  else if constexpr (NG == 4) w = (k >> 1) ? raw.y : raw.x;
  else w = (k >> 1) == 0 ? raw.x : (k >> 1) == 1 ? raw.y : (k >> 1) == 2 ? raw.z : raw.w;
  const unsigned short bits = (NG == 1 || (k & 1) == 0) ? (unsigned short)(w & 0xffffu) : (unsigned short)(w >> 16);
  return __ushort_as_half(bits);
}

template <int NG>
DEVI float meta_at(const typename MetaRaw<NG>::T& raw, int k) {
  return __half2float(meta_half<NG>(raw, k));
}

// NG e4m3 values of one token (ROTKV_VMETA8), raw bytes until used; every e4m3 value is an fp16 value
template <int NG> struct Meta8Raw;
template <> struct Meta8Raw<1> { using T = uint8_t; static DEVI T zero() { return 0; } };
template <> struct Meta8Raw<2> { using T = unsigned short; static DEVI T zero() { return 0; } };
template <> struct Meta8Raw<4> { using T = uint32_t; static DEVI T zero() { return 0u; } };
template <> struct Meta8Raw<8> { using T = uint2; static DEVI T zero() { return make_uint2(0u, 0u); } };

template <int NG>
DEVI __half meta8_half(const typename Meta8Raw<NG>::T& raw, int k) {
  uint32_t w;
  if constexpr (NG == 8) w = (k >> 2) ? raw.y : raw.x;
  else w = (uint32_t)raw;
  const __nv_fp8_storage_t b = (__nv_fp8_storage_t)((w >> (8 * (k & 3))) & 0xffu);
  return __half(__nv_cvt_fp8_to_halfraw(b, __NV_E4M3));
}

// the values' metadata: fp16 as the keys', or e4m3 (ROTKV_VMETA8)
#if ROTKV_VMETA8
template <int NG> using VMetaRaw = Meta8Raw<NG>;
constexpr int VMETA_BYTES = 1;
#else
template <int NG> using VMetaRaw = MetaRaw<NG>;
constexpr int VMETA_BYTES = 2;
#endif

template <int NG>
DEVI __half vmeta_half(const typename VMetaRaw<NG>::T& raw, int k) {
#if ROTKV_VMETA8
  return meta8_half<NG>(raw, k);
#else
  return meta_half<NG>(raw, k);
#endif
}

template <int NG>
DEVI float vmeta_at(const typename VMetaRaw<NG>::T& raw, int k) {
  return __half2float(vmeta_half<NG>(raw, k));
}

// ---- K side: per token, the thread (g, t) loads KW words; chunk cc (dims [32cc, 32cc+32)) takes
// its A registers (k 4t..4t+3 and 16+4t..16+4t+3) from (word, plane) pairs and its query B
// registers from the dims those bytes hold.
template <int D> struct KMap;
template <> struct KMap<64> {   // one word at byte 4t; chunk cc: planes 2cc (lo) and 2cc+1 (hi)
  static constexpr int KW = 1;
  static DEVI int byte_off(int t, int w) { return 4 * t; }
  static DEVI int lo_word(int cc) { return 0; }
  static DEVI int hi_word(int cc) { return 0; }
  static DEVI constexpr int lo_plane(int cc) { return 2 * cc; }
  static DEVI constexpr int hi_plane(int cc) { return 2 * cc + 1; }
  static DEVI int lo_dim(int cc, int t) { return 2 * cc * 16 + 4 * t; }
  static DEVI int hi_dim(int cc, int t) { return (2 * cc + 1) * 16 + 4 * t; }
};
template <> struct KMap<128> {  // 8 bytes at 8t; chunk cc = plane: lo word bytes 8t.., hi 8t+4..
  static constexpr int KW = 2;
  static DEVI int byte_off(int t, int w) { return 8 * t + 4 * w; }
  static DEVI int lo_word(int cc) { return 0; }
  static DEVI int hi_word(int cc) { return 1; }
  static DEVI constexpr int lo_plane(int cc) { return cc; }
  static DEVI constexpr int hi_plane(int cc) { return cc; }
  static DEVI int lo_dim(int cc, int t) { return 32 * cc + 8 * t; }
  static DEVI int hi_dim(int cc, int t) { return 32 * cc + 8 * t + 4; }
};
template <> struct KMap<256> {  // 8 bytes at 8t and at 32+8t; chunk cc = 2i + c
  static constexpr int KW = 4;
  static DEVI int byte_off(int t, int w) { return 32 * (w >> 1) + 8 * t + 4 * (w & 1); }
  static DEVI int lo_word(int cc) { return 2 * (cc & 1); }
  static DEVI int hi_word(int cc) { return 2 * (cc & 1) + 1; }
  static DEVI constexpr int lo_plane(int cc) { return cc >> 1; }
  static DEVI constexpr int hi_plane(int cc) { return cc >> 1; }
  static DEVI int lo_dim(int cc, int t) { return 64 * (cc >> 1) + 32 * (cc & 1) + 8 * t; }
  static DEVI int hi_dim(int cc, int t) { return 64 * (cc >> 1) + 32 * (cc & 1) + 8 * t + 4; }
};

// ---- V side: the thread (g, t) loads VW words of tokens 2t, 2t+1, 2t+8, 2t+9; m-tile mt's rows
// g and g+8 are (word slot, byte, plane) -> a dim.
template <int D> struct VMap;
template <> struct VMap<64> {   // word g&3, byte pair g>>2; m-tile = plane
  static constexpr int VW = 1, NMT = 4;
  static DEVI int byte_off(int g, int w) { return 4 * (g & 3); }
  static DEVI int slot(int mt) { return 0; }
  static DEVI int bp(int mt, int g) { return g >> 2; }
  static constexpr int BPS = 1;  // distinct byte pairs per thread (fp16 path: one pairing word set each)
  static DEVI constexpr int bpi(int mt) { return 0; }
  static DEVI constexpr int plane(int mt) { return mt; }
  static DEVI int dim(int mt, int g) { return 16 * mt + 4 * (g & 3) + 2 * (g >> 2); }
  static DEVI constexpr int dim_base(int mt) { return 16 * mt; }
};
template <> struct VMap<128> {  // word g; m-tile (i, bp)
  static constexpr int VW = 1, NMT = 8;
  static DEVI int byte_off(int g, int w) { return 4 * g; }
  static DEVI int slot(int mt) { return 0; }
  static DEVI int bp(int mt, int g) { return mt & 1; }
  static constexpr int BPS = 2;
  static DEVI constexpr int bpi(int mt) { return mt & 1; }
  static DEVI constexpr int plane(int mt) { return mt >> 1; }
  static DEVI int dim(int mt, int g) { return 32 * (mt >> 1) + 4 * g + 2 * (mt & 1); }
  static DEVI constexpr int dim_base(int mt) { return 32 * (mt >> 1); }
};
template <> struct VMap<256> {  // words g and g+8; m-tile (i, c, bp)
  static constexpr int VW = 2, NMT = 16;
  static DEVI int byte_off(int g, int w) { return 32 * w + 4 * g; }
  static DEVI int slot(int mt) { return (mt >> 1) & 1; }
  static DEVI int bp(int mt, int g) { return mt & 1; }
  static constexpr int BPS = 2;
  static DEVI constexpr int bpi(int mt) { return mt & 1; }
  static DEVI constexpr int plane(int mt) { return mt >> 2; }
  static DEVI int dim(int mt, int g) { return 64 * (mt >> 2) + 32 * ((mt >> 1) & 1) + 4 * g + 2 * (mt & 1); }
  static DEVI constexpr int dim_base(int mt) { return 64 * (mt >> 2) + 32 * ((mt >> 1) & 1); }
};

constexpr int MERGE_MAX_SLOTS = 512;  // fused final merge: slots whose weights fit in shared memory

template <int D>
struct MergeSmem {  // the block's four partials, then (reused) the final merge's weights
  union {
    float o[4][8][D];
    float w[8][MERGE_MAX_SLOTS];
  };
  float m[4][8], l[4][8], den[8];
  int last;
};

DEVI void store_out(void* out, int kind, int64_t i, float v) {
  if (kind == 1) reinterpret_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(v);
  else if (kind == 2) reinterpret_cast<__half*>(out)[i] = __float2half_rn(v);
  else reinterpret_cast<float*>(out)[i] = v;
}

template <int D, int NG, int TILES, int MINB>
__global__ void __launch_bounds__(128, MINB) int2_decode_kernel(const Params p) {
  using KM = KMap<D>;
  using VM = VMap<D>;
  constexpr int NB = D / 4, G = D / NG, NCH = D / 32, NMT = VM::NMT, KW = KM::KW, VW = VM::VW;
  constexpr int NBK = ROTKV_K4 ? D / 2 : NB;  // bytes of a key code row
  static_assert(G % 32 == 0, "group_size must be a multiple of 32");
  const int warp = blockIdx.x * 4 + (threadIdx.x >> 5);
  if (warp >= p.n_work) return;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int s = warp % p.n_splits, bh = warp / p.n_splits;
  const int b = bh / p.H, h = bh % p.H;

  const int start = p.indptr[b];
  const int npages = p.indptr[b + 1] - start;
  const int seq = npages > 0 ? (npages - 1) * p.P + p.last[b] : 0;
  const int tok_lo = s * p.tokens_per_split;
  const int tok_hi = min(seq, tok_lo + p.tokens_per_split);

  float qsg_own[NG];
  float qsc_own;
#if ROTKV_QF16
  // ---- query: head g's fp16 fragments per (code word w, plane i) (index 4w + i), per-head scale
  constexpr int NQ = 4 * KW;
  uint32_t qh0[NQ], qh1[NQ];
  {
    float qv[NQ][4];
    const bool live = g < p.rep;
    const __nv_bfloat16* qp = p.q + ((int64_t)b * p.HQ + (int64_t)h * p.rep + g) * D;
    float amax = 0.f;
#pragma unroll
    for (int w = 0; w < KW; ++w) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int d0 = i * (D / 4) + KM::byte_off(t, w);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          qv[4 * w + i][e] = live ? __bfloat162float(qp[d0 + e]) * p.qk_scale : 0.f;
          amax = fmaxf(amax, fabsf(qv[4 * w + i][e]));
        }
      }
    }
    amax = quad_max(amax);
    qsc_own = amax > 0.f ? amax * (1.f / 16384.f) : 1.f;
    const float inv = 1.f / qsc_own;
#pragma unroll
    for (int k = 0; k < NG; ++k) qsg_own[k] = 0.f;
#pragma unroll
    for (int w = 0; w < KW; ++w) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float sc = inv * (i == 0 ? 1.f : i == 1 ? 0.25f : i == 2 ? 0.0625f : 0.015625f);
        const float* x = qv[4 * w + i];
        const __half2 lo = __floats2half2_rn(x[0] * sc, x[1] * sc), hi = __floats2half2_rn(x[2] * sc, x[3] * sc);
        qh0[4 * w + i] = *reinterpret_cast<const uint32_t*>(&lo);
        qh1[4 * w + i] = *reinterpret_cast<const uint32_t*>(&hi);
        qsg_own[(i * (D / 4) + KM::byte_off(0, w)) / G] += x[0] + x[1] + x[2] + x[3];
      }
    }
#pragma unroll
    for (int k = 0; k < NG; ++k) qsg_own[k] = quad_sum(qsg_own[k]);
    if (ROTKV_QF16 == 1) qsc_own *= 16777216.f;  // the subnormal operands carry 2^-24
  }
#else
  // ---- query: head g's int8 fragments, per-head scale, per-group float sums
  uint32_t qb0[NCH], qb1[NCH];
  {
    float qv[NCH][8];
    const bool live = g < p.rep;
    const __nv_bfloat16* qp = p.q + ((int64_t)b * p.HQ + (int64_t)h * p.rep + g) * D;
    float amax = 0.f;
#pragma unroll
    for (int cc = 0; cc < NCH; ++cc) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        qv[cc][e] = live ? __bfloat162float(qp[KM::lo_dim(cc, t) + e]) * p.qk_scale : 0.f;
        qv[cc][4 + e] = live ? __bfloat162float(qp[KM::hi_dim(cc, t) + e]) * p.qk_scale : 0.f;
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(qv[cc][e]));
    }
    amax = quad_max(amax);
    qsc_own = amax > 0.f ? amax / 127.f : 1.f;
    const float inv = 1.f / qsc_own;
#pragma unroll
    for (int k = 0; k < NG; ++k) qsg_own[k] = 0.f;
#pragma unroll
    for (int cc = 0; cc < NCH; ++cc) {
      uint32_t lo = 0, hi = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int a = (int)floorf(qv[cc][e] * inv + 0.5f);
        int c = (int)floorf(qv[cc][4 + e] * inv + 0.5f);
        lo |= (uint32_t)(a & 0xff) << (8 * e);
        hi |= (uint32_t)(c & 0xff) << (8 * e);
        qsg_own[(32 * cc) / G] += qv[cc][e] + qv[cc][4 + e];
      }
      qb0[cc] = lo;
      qb1[cc] = hi;
    }
#pragma unroll
    for (int k = 0; k < NG; ++k) qsg_own[k] = quad_sum(qsg_own[k]);
  }
#endif
  // the accumulator columns are heads 2t and 2t+1: fetch their scale and sums from lanes 4*head
  float qsc[2], qsg[2][NG];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    qsc[j] = __shfl_sync(0xffffffffu, qsc_own, 4 * (2 * t + j));
#pragma unroll
    for (int k = 0; k < NG; ++k) qsg[j][k] = __shfl_sync(0xffffffffu, qsg_own[k], 4 * (2 * t + j));
  }

  float acc[NMT][4];
  float psum[NG][4];  // sum over tokens of bf16 p~ per group (rows all equal; c0/c1 = heads 2t/2t+1)
  float crl[NG][2];   // sum_n p_n lo_n per group, partial over this thread's tokens
#pragma unroll
  for (int mt = 0; mt < NMT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
#pragma unroll
  for (int k = 0; k < NG; ++k) {
    psum[k][0] = psum[k][1] = psum[k][2] = psum[k][3] = 0.f;
    crl[k][0] = crl[k][1] = 0.f;
  }
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  // The value accumulators carry OFFSET * sum p~ beside the signal sum p~ 4^i c (OFFSET = 128 for bf16,
  // 1024 for fp16 operands). The output error grows with the accumulators' magnitude, i.e. with the
  // offset (docs/kernel-notes.md), as it would if the tensor
  // cores' accumulation truncated relative to its largest addend (our reading; not documented). Subtracting OFFSET * psum from them every ROTKV_VFLUSH steps (and zeroing psum) keeps
  // them at the size of a few steps' products. The step count comes from blk (no counter register).
  static_assert((ROTKV_VFLUSH & (ROTKV_VFLUSH - 1)) == 0, "ROTKV_VFLUSH must be 0 or a power of two");

  const uint32_t ONES = V_ONES;
#if ROTKV_VF16
  // pairing selectors: [token A's byte k, -, token B's byte k, -] for the byte k = 2 bp + row
  uint32_t vsel[VM::BPS][2];
#pragma unroll
  for (int bi = 0; bi < VM::BPS; ++bi) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t k = 2u * (uint32_t)VM::bp(bi, g) + r;  // bp(mt, g) depends on mt only through mt & 1
      vsel[bi][r] = k | (k << 4) | ((4u + k) << 8) | ((4u + k) << 12);
    }
  }
  const uint32_t F16_EXP = 0x64006400u;  // fp16 (1024, 1024)
#else
  const uint32_t MAGIC = 0x43434343u;
#endif

  // loop-invariant byte offsets of this thread's words inside a 16-token tile
  int koff[2], voff[4];
#pragma unroll
  for (int r = 0; r < 2; ++r) koff[r] = (g + 8 * r) * NBK + KM::byte_off(t, 0);
#pragma unroll
  for (int u = 0; u < 4; ++u) voff[u] = (2 * t + (u & 1) + 8 * (u >> 1)) * NB + VM::byte_off(g, 0);
  using MetaT = typename MetaRaw<NG>::T;
  using VMetaT = typename VMetaRaw<NG>::T;
  // this thread's loop-invariant bases (token row 0 of the pool): K row g, V row 2t, meta row g
  const uint8_t* kc_t = p.kc + koff[0];
  const uint8_t* vc_t = p.vc + voff[0];
  const uint8_t* ks_t = reinterpret_cast<const uint8_t*>(p.ks) + g * 2 * NG;
  const uint8_t* kl_t = reinterpret_cast<const uint8_t*>(p.kl) + g * 2 * NG;
  const uint8_t* vs_t = reinterpret_cast<const uint8_t*>(p.vs) + g * VMETA_BYTES * NG;
  const uint8_t* vl_t = reinterpret_cast<const uint8_t*>(p.vl) + g * VMETA_BYTES * NG;
  int pslot = start + tok_lo / p.P, poff = tok_lo % p.P;  // page-table slot and offset of the next tile
#if ROTKV_REFINE
  // the request's first refined page (rotkv.quant.refine.refined_pages: its newest min(RK, ceil(n / RE)))
  const int rfirst = npages - min(p.RK, (npages + p.RE - 1) / p.RE);
#endif

  // one softmax step's registers: TILES tiles of 16 tokens (a tile never crosses a page: P % 16 == 0)
  struct Step {
    uint32_t kw[TILES][2][KW];        // tokens g, g+8 (ROTKV_K4: the INT4 row's words at o, planes 0 and 2)
#if ROTKV_K4
    uint32_t kx[TILES][2][KW];        // and at o + D/4 (planes 1 and 3)
#endif
    uint32_t vw[TILES][4][VW];        // tokens 2t, 2t+1, 2t+8, 2t+9
    MetaT ksr[TILES][2], klr[TILES][2];    // raw fp16 metadata, tokens g, g+8
    VMetaT vsr[TILES][2], vlr[TILES][2];   // the values' (fp16 or e4m3)
#if ROTKV_REFINE
#if ROTKV_KREF
    uint32_t rkw[TILES][2][KW];       // the rings' words, as kw and vw (read only where rf says so)
#endif
    uint32_t rvw[TILES][4][VW];
    uint32_t rf;                      // bit 2 ti: tile ti's keys are refined, bit 2 ti + 1: its values
#endif
  };
  // a tile's code words: keys (tokens g, g+8; rows of rs bytes) and values (tokens 2t, 2t+1, 2t+8, 2t+9) at
  // this thread's base
  auto load_kw = [&](uint32_t (&kw)[2][KW], const uint8_t* kb, const int rs) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if constexpr (KW == 1) {
        kw[r][0] = *reinterpret_cast<const uint32_t*>(kb + 8 * r * rs);
      } else {
#pragma unroll
        for (int w = 0; w < KW; w += 2) {
          uint2 x = *reinterpret_cast<const uint2*>(kb + 8 * r * rs + 32 * (w >> 1));
          kw[r][w] = x.x;
          kw[r][w + 1] = x.y;
        }
      }
    }
  };
  auto load_vw = [&](uint32_t (&vw)[4][VW], const uint8_t* vb) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
#pragma unroll
      for (int w = 0; w < VW; ++w)
        vw[u][w] = *reinterpret_cast<const uint32_t*>(vb + ((u & 1) + 8 * (u >> 1)) * NB + 32 * w);
    }
  };
  // issue the loads of the step at blk (advances the page slot and offset)
  auto load = [&](Step& st, const int blk) {
    auto& kw = st.kw;
    auto& vw = st.vw;
    auto& ksr = st.ksr;
    auto& klr = st.klr;
    auto& vsr = st.vsr;
    auto& vlr = st.vlr;
#if ROTKV_REFINE
    st.rf = 0u;
#endif
#pragma unroll
    for (int ti = 0; ti < TILES; ++ti) {
      const int t0 = blk + 16 * ti;
      if (t0 < tok_hi) {
        // 32-bit row index (the loader checks NP * H * P < 2^32); one wide multiply-add per tensor
        // onto this thread's loop-invariant base, the rest are immediate offsets
        const uint32_t row0 = ((uint32_t)p.indices[pslot] * (uint32_t)p.H + (uint32_t)h) * (uint32_t)p.P + poff;
        const uint8_t* kb = kc_t + (uint64_t)row0 * NBK;
        const uint8_t* vb = vc_t + (uint64_t)row0 * NB;
        const uint8_t* ksb = ks_t + (uint64_t)row0 * (2 * NG);
        const uint8_t* klb = kl_t + (uint64_t)row0 * (2 * NG);
        const uint8_t* vsb = vs_t + (uint64_t)row0 * (VMETA_BYTES * NG);
        const uint8_t* vlb = vl_t + (uint64_t)row0 * (VMETA_BYTES * NG);
        load_kw(kw[ti], kb, NBK);
#if ROTKV_K4
        load_kw(st.kx[ti], kb + D / 4, NBK);
#endif
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if (t0 + g + 8 * r < tok_hi) {  // beyond the split: zeros, so that p~ and p*lo stay 0
            const int mo = 8 * r * 2 * NG, vmo = 8 * r * VMETA_BYTES * NG;
            ksr[ti][r] = *reinterpret_cast<const MetaT*>(ksb + mo);
            klr[ti][r] = *reinterpret_cast<const MetaT*>(klb + mo);
            vsr[ti][r] = *reinterpret_cast<const VMetaT*>(vsb + vmo);
            vlr[ti][r] = *reinterpret_cast<const VMetaT*>(vlb + vmo);
          } else {
            ksr[ti][r] = klr[ti][r] = MetaRaw<NG>::zero();
            vsr[ti][r] = vlr[ti][r] = VMetaRaw<NG>::zero();
          }
        }
        load_vw(vw[ti], vb);
#if ROTKV_REFINE
        const int pidx = pslot - start;  // the tile's page index in its request
        if (pidx >= rfirst) {            // a refined page: its ring slot pidx mod RK
          // the tile's first ring row (the pointers and offsets recomputed here: no registers held)
          const uint64_t rrow = (((uint64_t)b * (uint64_t)p.RK + (uint64_t)(pidx % p.RK)) * (uint64_t)p.H
                                 + (uint64_t)h) * (uint64_t)p.P + (uint64_t)poff;
#if ROTKV_KREF
          if (p.rk != nullptr) {  // this thread's words at K row g, as kc_t
            load_kw(st.rkw[ti], p.rk + rrow * NB + (g * NB + KM::byte_off(t, 0)), NB);
            st.rf |= 1u << (2 * ti);
          }
#endif
          if (p.rv != nullptr) {  // at V row 2t, as vc_t
            load_vw(st.rvw[ti], p.rv + rrow * NB + (2 * t * NB + VM::byte_off(g, 0)));
            st.rf |= 2u << (2 * ti);
          }
        }
#endif
      }
      poff += 16;
      if (poff == p.P) poff = 0, ++pslot;
    }
  };
  auto compute = [&](const Step& st, const int blk) {
    const auto& kw = st.kw;
    const auto& vw = st.vw;
    const auto& ksr = st.ksr;
    const auto& klr = st.klr;
    const auto& vsr = st.vsr;
    const auto& vlr = st.vlr;
    // ---- scores S^T, folded, masked
    float sc[TILES][4];
    float bmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int ti = 0; ti < TILES; ++ti) {
      const int t0 = blk + 16 * ti;
#if ROTKV_QF16
      float d[NG][4];
#pragma unroll
      for (int k = 0; k < NG; ++k) d[k][0] = d[k][1] = d[k][2] = d[k][3] = 0.f;
      // the products of the tile's codes (R: refined, the ring's bits merged in: 4^i (4 h + j) <= 960, in place)
      auto kdots = [&](auto rtag) {
        constexpr bool R = decltype(rtag)::value;
#pragma unroll
        for (int w = 0; w < KW; ++w) {
          // [byte 0, -, byte 1, -] and [byte 2, -, byte 3, -] of tokens g (r 0) and g+8 (r 1)
          const uint32_t x00 = prmt(kw[ti][0][w], 0u, 0x4140u), x10 = prmt(kw[ti][1][w], 0u, 0x4140u);
          const uint32_t x01 = prmt(kw[ti][0][w], 0u, 0x4342u), x11 = prmt(kw[ti][1][w], 0u, 0x4342u);
          uint32_t y00 = 0u, y10 = 0u, y01 = 0u, y11 = 0u;  // the ring's, as x00..x11
#if ROTKV_KREF
          if constexpr (R) {
            y00 = prmt(st.rkw[ti][0][w], 0u, 0x4140u), y10 = prmt(st.rkw[ti][1][w], 0u, 0x4140u);
            y01 = prmt(st.rkw[ti][0][w], 0u, 0x4342u), y11 = prmt(st.rkw[ti][1][w], 0u, 0x4342u);
          }
#endif
#pragma unroll
          for (int ii = 0; ii < 4; ++ii) {
            const int i = ROTKV_K4 ? 2 * (ii & 1) + (ii >> 1) : ii;  // ROTKV_K4: planes 0, 2 (kw), then 1, 3 (kx)
            constexpr uint32_t M = 0x00030003u;
            auto op = [&](uint32_t x, uint32_t y) {
              uint32_t m;
              if constexpr (ROTKV_K4) {  // 4^i c: plane i's nibble, its lanes two bits up for planes 1 and 3
                m = i == 0 ? x & 0x000F000Fu : i == 1 ? x & 0x003C003Cu : i == 2 ? x & 0x00F000F0u : x & 0x03C003C0u;
              } else {
                m = i == 0 ? x & M : i == 1 ? x & (M << 2) : i == 2 ? x & (M << 4) : x & (M << 6);
              }
              if constexpr (R) {  // 4^i (4 h + j): h two bits up, j in h's place
                const uint32_t x4 = x << 2;
                m = i == 0 ? and_or<M>(y, x4 & (M << 2)) : i == 1 ? and_or<(M << 2)>(y, x4 & (M << 4))
                  : i == 2 ? and_or<(M << 4)>(y, x4 & (M << 6)) : and_or<(M << 6)>(y, x4 & (M << 8));
              }
              if constexpr (ROTKV_QF16 == 1) {
                return m;  // fp16 subnormal 4^i c * 2^-24
              } else {
                const uint32_t y = m | 0x64006400u;  // fp16 1024 + 4^i c
                const __half2 z = __hsub2(*reinterpret_cast<const __half2*>(&y), __float2half2_rn(1024.f));
                return *reinterpret_cast<const uint32_t*>(&z);  // 4^i c
              }
            };
#if ROTKV_K4
            // the plane's word (kw: planes 0 and 2, kx: 1 and 3) as x00..x11, planes 1 and 3 two bits up
            auto lanes = [&](const int r, const uint32_t sel) {
              const uint32_t v = prmt(i & 1 ? st.kx[ti][r][w] : kw[ti][r][w], 0u, sel);
              return i & 1 ? v << 2 : v;
            };
            mma_f16(d[(i * (D / 4) + KM::byte_off(0, w)) / G], op(lanes(0, 0x4140u), 0u), op(lanes(1, 0x4140u), 0u),
                    op(lanes(0, 0x4342u), 0u), op(lanes(1, 0x4342u), 0u), qh0[4 * w + i], qh1[4 * w + i]);
#else
            mma_f16(d[(i * (D / 4) + KM::byte_off(0, w)) / G], op(x00, y00), op(x10, y10), op(x01, y01),
                    op(x11, y11), qh0[4 * w + i], qh1[4 * w + i]);
#endif
          }
        }
      };
#else
      int d[NG][4];
#pragma unroll
      for (int k = 0; k < NG; ++k) d[k][0] = d[k][1] = d[k][2] = d[k][3] = 0;
      // the products of the tile's codes (R: refined, the ring's bits merged in: bytes 4 h + j)
      auto kdots = [&](auto rtag) {
        constexpr bool R = decltype(rtag)::value;
#pragma unroll
        for (int cc = 0; cc < NCH; ++cc) {
          const int gi = (32 * cc) / G;
          const uint32_t lw0 = kw[ti][0][KM::lo_word(cc)], lw1 = kw[ti][1][KM::lo_word(cc)];
          const uint32_t hw0 = kw[ti][0][KM::hi_word(cc)], hw1 = kw[ti][1][KM::hi_word(cc)];
          const int pl = 2 * KM::lo_plane(cc), ph = 2 * KM::hi_plane(cc);  // constants once unrolled
          uint32_t a0 = (lw0 >> pl) & 0x03030303u, a1 = (lw1 >> pl) & 0x03030303u;
          uint32_t a2 = (hw0 >> ph) & 0x03030303u, a3 = (hw1 >> ph) & 0x03030303u;
#if ROTKV_K4
          {  // plane i's nibbles: planes 0 and 2 in kw (low, high nibbles), 1 and 3 in kx
            auto nib = [&](const int r, const int w, const int i) {
              return ((i & 1 ? st.kx[ti][r][w] : kw[ti][r][w]) >> (4 * (i >> 1))) & 0x0F0F0F0Fu;
            };
            a0 = nib(0, KM::lo_word(cc), KM::lo_plane(cc)), a1 = nib(1, KM::lo_word(cc), KM::lo_plane(cc));
            a2 = nib(0, KM::hi_word(cc), KM::hi_plane(cc)), a3 = nib(1, KM::hi_word(cc), KM::hi_plane(cc));
          }
#endif
#if ROTKV_KREF
          if constexpr (R) {
            const uint32_t rl0 = st.rkw[ti][0][KM::lo_word(cc)], rl1 = st.rkw[ti][1][KM::lo_word(cc)];
            const uint32_t rh0 = st.rkw[ti][0][KM::hi_word(cc)], rh1 = st.rkw[ti][1][KM::hi_word(cc)];
            a0 = and_or<0x03030303u>(rl0 >> pl, a0 << 2), a1 = and_or<0x03030303u>(rl1 >> pl, a1 << 2);
            a2 = and_or<0x03030303u>(rh0 >> ph, a2 << 2), a3 = and_or<0x03030303u>(rh1 >> ph, a3 << 2);
          }
#endif
          mma_s8(d[gi], a0, a1, a2, a3, qb0[cc], qb1[cc]);
        }
      };
#endif
      // a refined tile: scale s / 4 and minimum lo - 3 s / 8 (its products read 4 h + j)
      bool rk_on = false;
#if ROTKV_KREF
      rk_on = (st.rf >> (2 * ti)) & 1u;
#endif
      if (t0 < tok_hi) {
        if (rk_on) kdots(Tag<ROTKV_KREF != 0>{});
        else kdots(Tag<false>{});
      }
      float ksf[2][NG], lot[2][2];  // token scales; the lo term sum_g lo_g * sum(q_g) per (token, head)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float klo[NG];
#pragma unroll
        for (int k = 0; k < NG; ++k) {
          ksf[r][k] = meta_at<NG>(ksr[ti][r], k);
          klo[k] = meta_at<NG>(klr[ti][r], k);
          if (rk_on) klo[k] -= 0.375f * ksf[r][k], ksf[r][k] *= 0.25f;
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          float x = 0.f;
#pragma unroll
          for (int k = 0; k < NG; ++k) x += klo[k] * qsg[j][k];
          lot[r][j] = x;
        }
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1, j = e & 1;
        float v = ksf[r][0] * (float)d[0][e];
#pragma unroll
        for (int k = 1; k < NG; ++k) v += ksf[r][k] * (float)d[k][e];
        v = v * qsc[j] + lot[r][j];
        const bool ok = t0 + g + 8 * r < tok_hi;
        sc[ti][e] = ok ? v : -INFINITY;
        bmax[j] = fmaxf(bmax[j], sc[ti][e]);
      }
    }
    // ---- online softmax over the block (per head: reduce over the 8 lanes sharing t)
    float alpha[2], m_use[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float x = bmax[j];
      x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
      x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
      x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
      const float m_new = fmaxf(m_run[j], x);
      m_use[j] = m_new == -INFINITY ? 0.f : m_new;
      alpha[j] = exp2f(m_run[j] - m_use[j]);
      m_run[j] = m_new;
      l_run[j] *= alpha[j];
    }
    // rescale only when some head's max moved (after the first blocks it seldom does)
    if (!__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) {
#pragma unroll
      for (int mt = 0; mt < NMT; ++mt) {
        acc[mt][0] *= alpha[0], acc[mt][1] *= alpha[1], acc[mt][2] *= alpha[0], acc[mt][3] *= alpha[1];
      }
#pragma unroll
      for (int k = 0; k < NG; ++k) {
        psum[k][0] *= alpha[0], psum[k][1] *= alpha[1], psum[k][2] *= alpha[0], psum[k][3] *= alpha[1];
        crl[k][0] *= alpha[0], crl[k][1] *= alpha[1];
      }
    }
    // ---- values
#pragma unroll
    for (int ti = 0; ti < TILES; ++ti) {
      const int t0 = blk + 16 * ti;
      if (t0 >= tok_hi) continue;
      float pr[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = e & 1;
        pr[e] = exp2f(sc[ti][e] - m_use[j]);
        l_run[j] += pr[e];
      }
      uint32_t pb0[NG], pb1[NG];
      // a refined tile: P~ = p * s / 4 and minimum lo - 3 s / 8 (its value operands read 4 h + j)
      bool rv_on = false;
#if ROTKV_REFINE
      rv_on = (st.rf >> (2 * ti + 1)) & 1u;
#endif
#if ROTKV_VF16
      // p rounded to fp16 once, then p * s_v per group by one HMUL2 per token row (s_v is fp16 already)
      const float pq = rv_on ? 0.25f : 1.f;
      const __half2 p01 = __floats2half2_rn(pr[0] * pq, pr[1] * pq), p23 = __floats2half2_rn(pr[2] * pq, pr[3] * pq);
#endif
#pragma unroll
      for (int k = 0; k < NG; ++k) {
        // P~[tok][head] for tokens g (row 0) and g+8 (row 1), heads 2t, 2t+1, then transposed
        float vl0 = vmeta_at<NG>(vlr[ti][0], k), vl1 = vmeta_at<NG>(vlr[ti][1], k);
        if (rv_on) vl0 -= 0.375f * vmeta_at<NG>(vsr[ti][0], k), vl1 -= 0.375f * vmeta_at<NG>(vsr[ti][1], k);
#if ROTKV_VF16
        const __half2 t0 = __hmul2(p01, __half2half2(vmeta_half<NG>(vsr[ti][0], k)));
        const __half2 t1 = __hmul2(p23, __half2half2(vmeta_half<NG>(vsr[ti][1], k)));
        pb0[k] = movmatrix_t(*reinterpret_cast<const uint32_t*>(&t0));
        pb1[k] = movmatrix_t(*reinterpret_cast<const uint32_t*>(&t1));
#else
        const float vs0 = vmeta_at<NG>(vsr[ti][0], k), vs1 = vmeta_at<NG>(vsr[ti][1], k);
        pb0[k] = movmatrix_t(pack_bf16(pr[0] * vs0, pr[1] * vs0));
        pb1[k] = movmatrix_t(pack_bf16(pr[2] * vs1, pr[3] * vs1));
#endif
        crl[k][0] += pr[0] * vl0 + pr[2] * vl1;
        crl[k][1] += pr[1] * vl0 + pr[3] * vl1;
        mma_v(psum[k], ONES, ONES, ONES, ONES, pb0[k], pb1[k]);
      }
      // token pairs (2t, 2t+1) -> u 0/1, (2t+8, 2t+9) -> u 2/3
#if ROTKV_VF16
      // out[slot][bp][row][pair] of a tile's value words w (the codes, or the ring's): token 2t's (2t+8's)
      // byte in the low half, 2t+1's (2t+9's) in the high half
      auto pair_words = [&](const uint32_t (&w)[4][VW], uint32_t (&out)[VW][VM::BPS][2][2]) {
#pragma unroll
        for (int sl = 0; sl < VW; ++sl)
#pragma unroll
          for (int bi = 0; bi < VM::BPS; ++bi)
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
              for (int u2 = 0; u2 < 2; ++u2)
                out[sl][bi][r][u2] = prmt(w[2 * u2][sl], w[2 * u2 + 1][sl], vsel[bi][r]);
      };
      // each operand register is then (wp & plane mask) | fp16 1024, one LOP3
      uint32_t wp[VW][VM::BPS][2][2];
      pair_words(vw[ti], wp);
      // the products (R: refined, the ring's bits merged in: fp16 1024 + 4^i (4 h + j), every plane in place)
      auto vdots = [&](auto rtag) {
        constexpr bool R = decltype(rtag)::value;
        uint32_t yp[VW][VM::BPS][2][2];  // the ring's, as wp (R only)
#if ROTKV_REFINE
        if constexpr (R) pair_words(st.rvw[ti], yp);
#endif
#pragma unroll
        for (int mt = 0; mt < NMT; ++mt) {
          const int gi = VM::dim_base(mt) / G;
          const int sl = VM::slot(mt), bi = VM::bpi(mt);
          constexpr uint32_t M = 0x00030003u;
          const int pl = VM::plane(mt);
          auto op = [&](uint32_t w, uint32_t y) {
            if constexpr (R) {  // h two bits up, j in h's place
              const uint32_t w4 = w << 2;
              return pl == 0 ? and_or<M>(y, and_or<(M << 2)>(w4, F16_EXP))
                   : pl == 1 ? and_or<(M << 2)>(y, and_or<(M << 4)>(w4, F16_EXP))
                   : pl == 2 ? and_or<(M << 4)>(y, and_or<(M << 6)>(w4, F16_EXP))
                             : and_or<(M << 6)>(y, and_or<(M << 8)>(w4, F16_EXP));
            } else {
              return pl == 0 ? and_or<M>(w, F16_EXP) : pl == 1 ? and_or<(M << 2)>(w, F16_EXP)
                   : pl == 2 ? and_or<(M << 4)>(w, F16_EXP) : and_or<(M << 6)>(w, F16_EXP);
            }
          };
          const uint32_t a0 = op(wp[sl][bi][0][0], R ? yp[sl][bi][0][0] : 0u);
          const uint32_t a1 = op(wp[sl][bi][1][0], R ? yp[sl][bi][1][0] : 0u);
          const uint32_t a2 = op(wp[sl][bi][0][1], R ? yp[sl][bi][0][1] : 0u);
          const uint32_t a3 = op(wp[sl][bi][1][1], R ? yp[sl][bi][1][1] : 0u);
          mma_v(acc[mt], a0, a1, a2, a3, pb0[gi], pb1[gi]);
        }
      };
      if (rv_on) vdots(Tag<ROTKV_REFINE != 0>{});
      else vdots(Tag<false>{});
#else
#pragma unroll
      for (int mt = 0; mt < NMT; ++mt) {
        const int gi = VM::dim_base(mt) / G;
        const int sl = VM::slot(mt);
        const uint32_t sel = VM::bp(mt, g) ? 0x7362u : 0x5140u;
        const uint32_t x0 = prmt(vw[ti][0][sl], vw[ti][1][sl], sel);
        const uint32_t x1 = prmt(vw[ti][2][sl], vw[ti][3][sl], sel);
        // planes 0-2 stay in place: the bf16 is then 128 + 4^i c (exact: <= 176), rescaled at the
        // end; plane 3 (bits 6-7 would reach the exponent) is shifted down
        const int pl = VM::plane(mt);
        const uint32_t mask = pl < 3 ? 0x03030303u << (2 * pl) : 0x03030303u;
        const uint32_t m0 = (pl < 3 ? x0 : x0 >> 6) & mask, m1 = (pl < 3 ? x1 : x1 >> 6) & mask;
        const uint32_t a0 = prmt(m0, MAGIC, 0x4140u), a1 = prmt(m0, MAGIC, 0x4342u);
        const uint32_t a2 = prmt(m1, MAGIC, 0x4140u), a3 = prmt(m1, MAGIC, 0x4342u);
        mma_bf16(acc[mt], a0, a1, a2, a3, pb0[gi], pb1[gi]);
      }
#endif
    }
  };
  // drop the value accumulators' offset (ROTKV_VFLUSH: called between steps, at the loop's back edge)
  auto flush = [&]() {
#pragma unroll
    for (int mt = 0; mt < NMT; ++mt) {
      const int gi = VM::dim_base(mt) / G;
      acc[mt][0] -= V_OFFSET * psum[gi][0], acc[mt][1] -= V_OFFSET * psum[gi][1];
      acc[mt][2] -= V_OFFSET * psum[gi][0], acc[mt][3] -= V_OFFSET * psum[gi][1];
    }
#pragma unroll
    for (int k = 0; k < NG; ++k) psum[k][0] = psum[k][1] = psum[k][2] = psum[k][3] = 0.f;
  };
  // whether the step at blk ends a flush period (a multiple of `every` steps from tok_lo)
  auto period_end = [&](const int blk, const int every) {
    return (((blk - tok_lo) / (16 * TILES)) & (every - 1)) == every - 1;
  };
  (void)flush;
  (void)period_end;
#if ROTKV_PREFETCH
  // two register buffers: the next step's loads are in flight while this step computes
  Step sa, sb;
  int blk = tok_lo;
  if (blk < tok_hi) load(sa, blk);
  while (blk < tok_hi) {
    const int nb = blk + 16 * TILES;
    if (nb < tok_hi) load(sb, nb);
    compute(sa, blk);
    if (nb >= tok_hi) break;
    const int nb2 = nb + 16 * TILES;
    if (nb2 < tok_hi) load(sa, nb2);
    compute(sb, nb);
    // two steps per iteration: every ROTKV_VFLUSH steps (>= 2) is every ROTKV_VFLUSH / 2 iterations
    if (ROTKV_VFLUSH && period_end(nb, ROTKV_VFLUSH > 1 ? ROTKV_VFLUSH : 2)) flush();
    blk = nb2;
  }
#else
  for (int blk = tok_lo; blk < tok_hi; blk += 16 * TILES) {
    Step st;
    load(st, blk);
    compute(st, blk);
    if (ROTKV_VFLUSH && period_end(blk, ROTKV_VFLUSH > 0 ? ROTKV_VFLUSH : 1)) flush();
  }
#endif
  // ---- reduce the per-thread partial sums over the 8 lanes sharing t
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    l_run[j] += __shfl_xor_sync(0xffffffffu, l_run[j], 4);
    l_run[j] += __shfl_xor_sync(0xffffffffu, l_run[j], 8);
    l_run[j] += __shfl_xor_sync(0xffffffffu, l_run[j], 16);
#pragma unroll
    for (int k = 0; k < NG; ++k) {
      crl[k][j] += __shfl_xor_sync(0xffffffffu, crl[k][j], 4);
      crl[k][j] += __shfl_xor_sync(0xffffffffu, crl[k][j], 8);
      crl[k][j] += __shfl_xor_sync(0xffffffffu, crl[k][j], 16);
    }
  }
  // ---- partials: heads 2t, 2t+1 (if < rep); dims of rows g, g+8 of every m-tile
  float fo[NMT][2][2];  // final values: [m-tile][head j][row g / g+8]
#pragma unroll
  for (int mt = 0; mt < NMT; ++mt) {
    const int gi = VM::dim_base(mt) / G;
    const int pl = VM::plane(mt);
    // undo 4^i (exact); the bf16 path shifted plane 3 down
    const float inv = pl == 0 ? 1.f : pl == 1 ? 0.25f : pl == 2 ? 0.0625f : (ROTKV_VF16 ? 0.015625f : 1.f);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float off = V_OFFSET * psum[gi][j];
      fo[mt][j][0] = (acc[mt][j] - off) * inv + crl[gi][j];
      fo[mt][j][1] = (acc[mt][2 + j] - off) * inv + crl[gi][j];
    }
  }
  if (!p.fuse) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int head = 2 * t + j;
      if (head >= p.rep) continue;
      const int64_t prow = ((int64_t)b * p.HQ + (int64_t)h * p.rep + head) * p.NS + s;
      if (g == 0) {
        p.m[prow] = m_run[j];
        p.l[prow] = l_run[j];
      }
      float* op = p.o + prow * D;
#pragma unroll
      for (int mt = 0; mt < NMT; ++mt) {
        const int d0 = VM::dim(mt, g);
        op[d0] = fo[mt][j][0];
        op[d0 + 1] = fo[mt][j][1];
      }
    }
    return;
  }
  // ---- fused: the block's 4 splits (one (request, KV head)) merged into slot s / 4
  __shared__ MergeSmem<D> sm;
  const int wid = threadIdx.x >> 5, tid = threadIdx.x;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int head = 2 * t + j;
    if (head >= p.rep) continue;
    if (g == 0) sm.m[wid][head] = m_run[j], sm.l[wid][head] = l_run[j];
#pragma unroll
    for (int mt = 0; mt < NMT; ++mt) {
      const int d0 = VM::dim(mt, g);
      sm.o[wid][head][d0] = fo[mt][j][0];
      sm.o[wid][head][d0 + 1] = fo[mt][j][1];
    }
  }
  __syncthreads();
  const int64_t row0 = (int64_t)b * p.HQ + (int64_t)h * p.rep;  // first query row of this KV head
  const int slot = s >> 2;
  for (int idx = tid; idx < p.rep * D; idx += 128) {
    const int head = idx / D, d = idx % D;
    float mx = sm.m[0][head];
#pragma unroll
    for (int w = 1; w < 4; ++w) mx = fmaxf(mx, sm.m[w][head]);
    const float mu = mx == -INFINITY ? 0.f : mx;
    float num = 0.f, den = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float wt = exp2f(sm.m[w][head] - mu);
      num += wt * sm.o[w][head][d];
      den += wt * sm.l[w][head];
    }
    const int64_t prow = (row0 + head) * p.NS + slot;
    p.o[prow * D + d] = num;
    if (d == 0) p.m[prow] = mx, p.l[prow] = den;
  }
  if (p.counters == nullptr) return;
  // ---- the last block of this (request, KV head) merges every slot into out
  __threadfence();  // this block's slot is visible before its arrival is counted
  __syncthreads();
  if (tid == 0) sm.last = atomicAdd(p.counters + bh, 1) == p.n_splits / 4 - 1;
  __syncthreads();
  if (!sm.last) return;
  __threadfence();
  // per head: max over slots, weights into shared memory (reusing sm.o), denominator
  for (int head = wid; head < p.rep; head += 4) {
    const int64_t base = (row0 + head) * p.NS;
    float mx = -INFINITY;
    for (int k = lane; k < p.NS; k += 32) mx = fmaxf(mx, __ldcg(p.m + base + k));
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, x));
    const float mu = mx == -INFINITY ? 0.f : mx;
    float den = 0.f;
    for (int k = lane; k < p.NS; k += 32) {
      const float wt = exp2f(__ldcg(p.m + base + k) - mu);
      sm.w[head][k] = wt;
      den += wt * __ldcg(p.l + base + k);
    }
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) den += __shfl_xor_sync(0xffffffffu, den, x);
    if (lane == 0) sm.den[head] = den > 0.f ? den : 1.f;
  }
  __syncthreads();
  for (int idx = tid; idx < p.rep * D; idx += 128) {
    const int head = idx / D, d = idx % D;
    const float* op = p.o + (row0 + head) * p.NS * D + d;
    float num = 0.f;
    int k = 0;
    for (; k + 4 <= p.NS; k += 4) {  // four independent loads in flight
      const float a0 = __ldcg(op + (int64_t)k * D), a1 = __ldcg(op + (int64_t)(k + 1) * D);
      const float a2 = __ldcg(op + (int64_t)(k + 2) * D), a3 = __ldcg(op + (int64_t)(k + 3) * D);
      num += sm.w[head][k] * a0 + sm.w[head][k + 1] * a1 + sm.w[head][k + 2] * a2 + sm.w[head][k + 3] * a3;
    }
    for (; k < p.NS; ++k) num += sm.w[head][k] * __ldcg(op + (int64_t)k * D);
    store_out(p.out, p.out_kind, (row0 + head) * D + d, num / sm.den[head]);
  }
  if (tid == 0) p.counters[bh] = 0;  // ready for the next call (CUDA-graph replays included)
}

}  // namespace

#ifndef ROTKV_D  // the Python loader builds one library per variant (rotkv.kernels.cuda_decode.VARIANT_MACROS)
#define ROTKV_D 128
#define ROTKV_NG 2
#define ROTKV_TILES 2
#define ROTKV_MINB 4
#endif

extern "C" int rotkv_int2_decode(int d, int ng, int tiles, int minb, int kbits, const void* q, const void* kc,
                                 const void* ks, const void* kl, const void* vc, const void* vs, const void* vl,
                                 const void* indptr, const void* indices, const void* last, void* o, void* m, void* l,
                                 int n_batch, int H,
                                 int HQ, int P, int NS, int n_splits, int tokens_per_split, float qk_scale,
                                 int fuse, void* counters, void* out, int out_kind, const void* rk,
                                 const void* rv, int RK, int RE, void* stream) {
  if (HQ % H) return -1;
  Params p;
  p.q = (const __nv_bfloat16*)q;
  p.kc = (const uint8_t*)kc;
  p.ks = (const __half*)ks;
  p.kl = (const __half*)kl;
  p.vc = (const uint8_t*)vc;
  p.vs = (const __half*)vs;
  p.vl = (const __half*)vl;
  p.indptr = (const int*)indptr;
  p.indices = (const int*)indices;
  p.last = (const int*)last;
  p.o = (float*)o;
  p.m = (float*)m;
  p.l = (float*)l;
  p.H = H;
  p.HQ = HQ;
  p.rep = HQ / H;
  p.P = P;
  p.NS = NS;
  p.n_splits = n_splits;
  p.tokens_per_split = tokens_per_split;
  p.n_work = n_batch * H * n_splits;
  p.qk_scale = qk_scale;
  p.fuse = fuse;
  p.counters = (int*)counters;
  p.out = out;
  p.out_kind = out_kind;
  p.rk = (const uint8_t*)rk;
  p.rv = (const uint8_t*)rv;
  p.RK = RK;
  p.RE = RE;
  if ((rk || rv) && (!ROTKV_REFINE || RK < 1 || RE < 1)) return -4;
  if (rk && ROTKV_K4) return -4;  // 4-bit keys have no refine ring
  if (fuse && (n_splits % 4 || (counters && (NS > MERGE_MAX_SLOTS || !out || out_kind < 0 || out_kind > 2)))) return -2;
  if (d != ROTKV_D || ng != ROTKV_NG || tiles != ROTKV_TILES || minb != ROTKV_MINB || kbits != (ROTKV_K4 ? 4 : 2))
    return -3;
  if (p.rep > 8 || P % 16 || tokens_per_split % (16 * tiles)) return -1;
  if (p.n_work == 0) return 0;
  int2_decode_kernel<ROTKV_D, ROTKV_NG, ROTKV_TILES, ROTKV_MINB><<<(p.n_work + 3) / 4, 128, 0, (cudaStream_t)stream>>>(p);
  return (int)cudaGetLastError();
}

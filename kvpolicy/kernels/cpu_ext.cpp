// Fused decode attention over the packed KV cache (kvpolicy.kernels.cpu_ext builds and
// loads it through ctypes; see that module for what it covers). Specialised per library
// by -D: KVP_KB/KVP_VB (bits), KVP_GK/KVP_GV (group sizes), KVP_DK/KVP_DV (head dims),
// KVP_HALF (rotary_dim / 2), KVP_SDT (storage type of scales, zeros and fp tokens),
// KVP_KLUT/KVP_VLUT (1: a code's value is table[code], Params.klut/vlut; 0: the code itself)
// and KVP_KM8/KVP_VM8 (1: the keys' / values' scale is a uint8 index into Params.stab and
// their zero an int8 point p, zero = -p * scale / 4; 0: both in the storage type KVP_SDT),
// and KVP_VVQ (d > 0: vector-quantized values, one byte per d channels indexing Params.vcb,
// a scale per group and no zero; 0: values coded per element).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <memory>
#include <mutex>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <type_traits>
#include <vector>

extern "C" {
struct Params {
  int64_t B, Hkv, rep, Tq, Dk, Dv, Tk, Gk, Gv, chunk, nthreads;
  const float* q;                            // [B, Hkv*rep, Tq, Dk] contiguous, pre-scaled
  // packed segment (Tk tokens, may be 0)
  const uint8_t* kc; int64_t kc_sb, kc_sh;   // [.., Tk/Gk, Gk*kb/8, Dk]
  const void* ks; int64_t ks_sb, ks_sh;      // [.., Tk/Gk, Dk] KVP_SDT, or uint8 (KVP_KM8)
  const void* kz; int64_t kz_sb, kz_sh;      // KVP_SDT, or int8 (KVP_KM8)
  const uint8_t* vc; int64_t vc_sb, vc_sh;   // [.., Tk, Dv*vb/8]
  const void* vs; int64_t vs_sb, vs_sh;      // [.., Tk, Dv/Gv] KVP_SDT, or uint8 (KVP_VM8)
  const void* vz; int64_t vz_sb, vz_sh;      // KVP_SDT, or int8 (KVP_VM8)
  const float* mask; int64_t m0, m1, m2, m3; // additive over Tk, broadcast strides; or null
  const int64_t* kpos; int64_t kpos_sb;      // [B, Tk]; null when no rope
  // full-precision segment (Tf tokens, may be 0): sinks + residual window
  int64_t Tf;
  const void* fk; int64_t fk_sb, fk_sh;      // [.., Tf, Dk] storage type
  const void* fv; int64_t fv_sb, fv_sh;      // [.., Tf, Dv] storage type
  const float* fmask; int64_t f0, f1, f2, f3;
  const int64_t* fpos; int64_t fpos_sb;      // [B, Tf]
  // rotary tables
  const float* cosc; const float* sinc;      // [P, >= half], rows rope_rs floats apart
  int64_t half, rope_style;                  // 0 none, 1 rotate_half, 2 interleaved
  int64_t rope_rs;
  int64_t sdt;                               // storage type, must equal KVP_SDT
  float* out;                                // [B, Hq, Tq, Dv]
  float* lse;                                // [B, Hq, Tq]
  float softcap;                             // > 0: s = softcap * tanh(s / softcap); 0: none
  // level tables, 2**bits fp32 each: non-null exactly when built with KVP_KLUT / KVP_VLUT
  const float* klut;
  const float* vlut;
  // 8-bit metadata: the 256 fp32 scales an index stands for (layout.scale_table), non-null
  // exactly when built with KVP_KM8 or KVP_VM8
  const float* stab;
  // per-channel key widths (layout.QuantSpec.widths): [Hkv, Dk, 2] int32, each channel's
  // width and the bit its first code starts at in a group's stream; null: KVP_KB for all
  const int32_t* kwid;
  // paged packed segment: null, or [B, btab_sb] block ids; then the packed fields above are
  // pages [num_blocks, Hkv, ...] (their *_sb strides step one page) of bsz tokens each, and
  // token t of row b is token t % bsz of page btab[b * btab_sb + t / bsz] (chunk divides bsz)
  const int64_t* btab; int64_t btab_sb, bsz;
  // vector-quantized values (layout.QuantSpec.levels "vq"): [Hkv, 256, KVP_VVQ] fp32
  // centroids, non-null exactly when built with KVP_VVQ > 0; then vc is [.., Tk, Dv / KVP_VVQ]
  // byte indices, vs one scale per group of Gv channels and vz unused (a VQ group has no zero)
  const float* vcb;
  // implicit bounds (the fused step, kvp_paged_step): null, or [B] each; then token t of row
  // b's packed segment is visible iff plo[b] <= t < phi[b], its position is t (kpos unused),
  // and a work item reads only the key groups that hold visible tokens
  const int64_t* plo; const int64_t* phi;
  // with plo/phi: the position of packed token t is t + ppos0 (0 for the paged step, whose
  // token indices are positions; a transformers layer's first packed token is at ppos0)
  int64_t ppos0;
  // row 0 of the rotary table is position rope_off (a table that starts at the least
  // position a sliding-window layer holds); 0 elsewhere
  int64_t rope_off;
};

// One decode step of one layer over paged packed pages (kvp_paged_step): every sequence
// adds one token. Fixed per layer: pages and where a page's fields lie; per step: the
// sequences, their block tables and the engine's q/k/v/out rows.
struct Step {
  uint8_t* pages; int64_t page_bytes, num_blocks;
  int64_t bs, C, sinks, window;              // block size, chunk, sinks, window (0: none)
  int64_t stage_k, stage_v, sink_k, sink_v;  // byte offsets of those fields in a page
  int64_t rope_rows;                         // rows of the rotary table (0: keys as given)
  const float* rot;                          // [Dv, Dv] value rotation, or null
  float scale;
  int64_t edt;                               // engine dtype of q/k/v/out: 0 fp32 1 bf16 2 fp16
  int64_t B;                                 // sequences
  const int64_t* seq_len;                    // [B] tokens after this step
  const int64_t* btab; int64_t btab_sb, btab_n;  // [B, btab_n] block ids, rows btab_sb apart
  const void* q; int64_t q_rs, q_hs;         // [N, Hq, Dk]: sequence b's row is row b
  const void* k; int64_t k_rs, k_hs;         // [N, Hkv, Dk], rotated as the engine gives it
  const void* v; int64_t v_rs, v_hs;         // [N, Hkv, Dv]
  void* out; int64_t o_rs, o_hs;             // [N, Hq, Dv]
  int64_t nthreads, threads_from;            // threads when the step holds >= threads_from
  // Packing a chunk the step completes (pack_chunk): 0 leaves it to the caller; else
  // kfit / vfit are the coarser scale-table steps fit "mse" tries (0: min-max grid)
  int64_t pack, kfit, vfit;
};

// One decode step of one transformers layer (kvp_layer_step): every batch row adds one token
// to a rectangular cache held as [full-precision sinks | packed body | full-precision
// residual]. The sinks and the residual lie in one writable buffer (Params::fk/fv, Tf = at
// tokens before the step); the new token goes to its index `at`. Fixed per layer state is
// in Params (the packed body's fields, Tk, ppos0, the rotary table, tables, soft-cap).
struct LStep {
  const void* q; int64_t q_bs, q_hs;         // [B, Hq, 1, Dk] in edt, head dim contiguous
  const void* k; int64_t k_bs, k_hs;         // [B, Hkv, 1, Dk] pre-RoPE
  const void* v; int64_t v_bs, v_hs;         // [B, Hkv, 1, Dv]
  void* out; int64_t o_bs, o_hs;             // [B, Hq, 1, Dv]
  int64_t edt;                               // 0 fp32, 1 bf16, 2 fp16
  float scale;
  const float* rot;                          // [Dv, Dv] value rotation, or null
  int64_t at;                                // fp-segment index of the new token
  int64_t* fpos;                             // [>= at + 1] positions of the fp segment
                                             // (every row alike), or null: no rotary table
  int64_t newpos;                            // the new token's position
  int64_t ns;                                // fp tokens held before the packed body (sinks)
  int64_t plo;                               // packed tokens before it are out of the window
  const uint8_t* mask; int64_t mask_bs, mask_n, mask_inv;  // bool [B|1, 1, 1, mask_n] over
                                             // the last mask_n held tokens (rows mask_bs
                                             // apart; inv: True hides), or null
  int64_t nthreads, threads_from;
};
}

namespace {

constexpr int gcd_(int a, int b) { return b == 0 ? a : gcd_(b, a % b); }
template <int BITS> struct Unit {
  static constexpr int bytes = BITS * 8 / gcd_(BITS, 8) / 8;  // bytes per unit
  static constexpr int per = BITS * 8 / gcd_(BITS, 8) / BITS; // codes per unit
  static constexpr uint32_t mask = (1u << BITS) - 1u;
  static_assert(bytes <= 4, "unit must fit a 32-bit word");
};

const float NEG_INF = -std::numeric_limits<float>::infinity();

// bf16 / fp16 bits widened to fp32 (exact).
inline float bf16_to_f32(uint16_t x) {
  const uint32_t u = (uint32_t)x << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  uint32_t u;
  if (e == 31) {
    u = sign | 0x7f800000u | (m << 13);
  } else if (e != 0) {
    u = sign | ((e + 112) << 23) | (m << 13);
  } else {
    const float f = std::ldexp((float)m, -24);
    std::memcpy(&u, &f, 4);
    u |= sign;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// Storage type of scales, zeros and full-precision tokens (-DKVP_SDT): 0 fp32, 1 bf16,
// 2 fp16. Read as-is and widened in registers, so a half-precision cache needs no fp32
// copy per call.
#if KVP_SDT == 0
typedef float SType;
inline float to_f32(float x) { return x; }
#elif KVP_SDT == 1
typedef uint16_t SType;
inline float to_f32(uint16_t x) { return bf16_to_f32(x); }
#else
typedef uint16_t SType;
inline float to_f32(uint16_t h) { return f16_to_f32(h); }
#endif
constexpr int64_t Dk = KVP_DK, Dv = KVP_DV, Gk = KVP_GK, Gv = KVP_GV;
constexpr bool KLUT = KVP_KLUT != 0, VLUT = KVP_VLUT != 0;
constexpr bool KM8 = KVP_KM8 != 0, VM8 = KVP_VM8 != 0;
constexpr int VVQ = KVP_VVQ;  // channels per vector-quantized value byte; 0: none
static_assert(VVQ == 0 || (VVQ * KVP_VB == 8 && Gv % VVQ == 0 && !VLUT),
              "VQ values: d = 8 / bits channels per byte, whole sub-vectors per group, no "
              "level table");

// n groups' fp32 scale and zero from 8-bit metadata: s = stab[index], zero = -point * s / 4
// (layout.ZERO_STEPS: quarters of the step; dividing by 4 is exact, like the reference's).
// NOTE: the empty asm (a compiler barrier, no instruction) keeps gcc from seeing through the
// arrays: with -fassociative-math it folded code * s + (-point * s) into (code - point) * s,
// which rounds unlike the reference and converted two integers per code (2-bit keys: 34
// vsubps against 2 in the 16-bit-metadata build).
inline void meta8(const float* stab, const uint8_t* idx, const int8_t* pt, int64_t n, float* s,
                  float* z) {
  for (int64_t i = 0; i < n; ++i) {
    const float sv = stab[idx[i]];
    s[i] = sv;
    z[i] = -(float)pt[i] * sv * 0.25f;
  }
  asm volatile("" ::: "memory");
}

// The fp32 scales and zeros of n groups, the metadata starting `so` / `zo` elements into
// `s` / `z`: 8-bit (meta8) or in the storage type, widened.
template <bool M8>
inline void group_meta(const float* stab, const void* s, int64_t so, const void* z,
                       int64_t zo, int64_t n, float* sc, float* zc) {
  if constexpr (M8) {
    meta8(stab, (const uint8_t*)s + so, (const int8_t*)z + zo, n, sc, zc);
  } else {
    const SType* ss = (const SType*)s + so;
    const SType* zs = (const SType*)z + zo;
    for (int64_t i = 0; i < n; ++i) { sc[i] = to_f32(ss[i]); zc[i] = to_f32(zs[i]); }
  }
}

// The fp32 scales of n vector-quantized value groups, `so` elements into `s`: 8-bit indices
// into stab or the storage type, widened. No zero is read: a VQ group has none (its stored
// zero is an empty tensor).
template <bool M8>
inline void group_scales(const float* stab, const void* s, int64_t so, int64_t n, float* sc) {
  if constexpr (M8) {
    const uint8_t* idx = (const uint8_t*)s + so;
    for (int64_t i = 0; i < n; ++i) sc[i] = stab[idx[i]];
  } else {
    const SType* ss = (const SType*)s + so;
    for (int64_t i = 0; i < n; ++i) sc[i] = to_f32(ss[i]);
  }
}

// One vector-quantized value row: vrow[u*VVQ + i] = cb[row[u]*VVQ + i] * sc[group], the
// plain fp32 product of vq_codes.vq_decode (no FMA, nothing to fold: there is no zero).
// NOTE: gcc's vectorisation of this loop, no intrinsics. bench/cpu_attention.py --threads 1
// --tokens 8192 --levels uniform vq (whole step, medians, load ~2.7): 2 bits 1.26-1.30 ms
// against 1.50-1.54 ms for uniform values; 1 bit 1.06 against 1.45 ms.
inline void vq_row(const float* cb, const uint8_t* row, const float* sc, float* vrow) {
  if constexpr (VVQ > 0) {
    for (int64_t u = 0; u < Dv / VVQ; ++u) {
      const float* c = cb + (int64_t)row[u] * VVQ;
      const float s = sc[u * VVQ / Gv];
      for (int i = 0; i < VVQ; ++i) vrow[u * VVQ + i] = c[i] * s;
    }
  }
}

// A level table padded to 16 entries (the most 4-bit codes need), so that vector loads of
// it never read past the caller's 2**bits floats.
struct Levels {
  alignas(32) float v[16];
  Levels(const float* t, int bits) {
    std::fill(v, v + 16, 0.f);
    std::copy(t, t + std::min(1 << bits, 16), v);
  }
};
// What a uniform build holds instead: nothing, so that its stack frame and code stay what
// they were before level tables existed.
struct NoLevels {
  NoLevels(const float*, int) {}
};
template <bool LUT, int BITS>  // BITS only makes the choice depend on run_item's parameters
using LevelsOf = std::conditional_t<LUT && (BITS > 0), Levels, NoLevels>;

#if defined(__AVX2__)
// table[idx] for 8 codes of <= 4 bits: one in-register permute per 8 entries (vpermps
// reads only the low 3 bits of each index), bit 3 of the index picking the upper half.
template <int BITS>
inline __m256 lookup8(const Levels& t, __m256i idx) {
  static_assert(BITS <= 4, "level tables have at most 16 entries");
  const __m256 lo = _mm256_permutevar8x32_ps(_mm256_load_ps(t.v), idx);
  if constexpr (BITS <= 3) {
    return lo;
  } else {
    const __m256 hi = _mm256_permutevar8x32_ps(_mm256_load_ps(t.v + 8), idx);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
  }
}
#endif

// exp(x) for x <= 0 (and -inf), relative error ~2e-7, written so that gcc vectorises it.
inline float exp_neg(float x) {
  const bool under = x < -87.f;  // also -inf: hidden keys get exactly zero weight
  x = under ? -87.f : x;
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  int32_t e = ((int32_t)n + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof(float));
  return under ? 0.f : p * scale;
}

// tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|), through exp_neg so that gcc
// vectorises it; absolute error ~2e-7 (saturates at +-1).
// NOTE: 8K-token step, 2-bit, 9 query heads on 3 kv heads, D=64, 1 thread (min of 50):
// 0.80-0.82 ms without a cap; soft-capped 1.66 ms with std::tanh, 0.86-0.88 ms with this.
inline float tanh_vec(float x) {
  const float e = exp_neg(-2.f * std::fabs(x));
  const float t = (1.f - e) / (1.f + e);
  return x < 0.f ? -t : t;
}

struct Acc { float m, l; };

// max(x[0..n)), -inf for n = 0; NaN entries are skipped, as std::max(m, x) skips them
// (maxps returns its second operand, the running max, where the first is NaN).
// NOTE: gcc keeps the std::max loop scalar (vmaxss) without -ffinite-math-only: 7 % of
// run_item's samples at 7,680 tokens (perf, bench/paged_decode.py shapes, 1 thread).
inline float row_max(const float* x, int64_t n) {
  float m = NEG_INF;
  int64_t t = 0;
#if defined(__AVX2__)
  if (n >= 8) {
    __m256 mv = _mm256_set1_ps(NEG_INF);
    for (; t + 8 <= n; t += 8) mv = _mm256_max_ps(_mm256_loadu_ps(x + t), mv);
    alignas(32) float b[8];
    _mm256_store_ps(b, mv);
    for (float v : b) m = std::max(m, v);
  }
#endif
  for (; t < n; ++t) m = std::max(m, x[t]);
  return m;
}

// Rotate nt key rows [nt][Dk] in place at positions pos[0..nt).
inline void rope_rows(const Params& P, float* K, int64_t nt, const int64_t* pos) {
  constexpr int64_t half = KVP_HALF;  // rotary_dim / 2, compile-time like the head dims
  for (int64_t j = 0; j < nt; ++j) {
    const float* cs = P.cosc + (pos[j] - P.rope_off) * P.rope_rs;
    const float* sn = P.sinc + (pos[j] - P.rope_off) * P.rope_rs;
    float* kr = K + j * Dk;
    if (P.rope_style == 1) {
      for (int64_t i = 0; i < half; ++i) {
        const float x0 = kr[i], x1 = kr[i + half];
        kr[i] = x0 * cs[i] - x1 * sn[i];
        kr[i + half] = x1 * cs[i] + x0 * sn[i];
      }
    } else {
      for (int64_t i = 0; i < half; ++i) {
        const float x0 = kr[2 * i], x1 = kr[2 * i + 1];
        kr[2 * i] = x0 * cs[i] - x1 * sn[i];
        kr[2 * i + 1] = x1 * cs[i] + x0 * sn[i];
      }
    }
  }
}

// One key row of a level-table spec: kr[d] = table[code of channel d] * sc[d] + zc[d], the
// codes at bit `shift` of each channel's unit word.
template <int KB>
inline void key_levels(const Levels& t, const uint32_t* wrow, int shift, const float* sc,
                       const float* zc, float* kr) {
  constexpr uint32_t mask = Unit<KB>::mask;
  int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (KB <= 4) {
    const __m256i maskv = _mm256_set1_epi32((int)mask);
    for (; d + 8 <= Dk; d += 8) {
      const __m256i w = _mm256_loadu_si256((const __m256i*)(wrow + d));
      const __m256i idx = _mm256_and_si256(_mm256_srli_epi32(w, shift), maskv);
      _mm256_storeu_ps(kr + d, _mm256_fmadd_ps(lookup8<KB>(t, idx), _mm256_loadu_ps(sc + d),
                                               _mm256_loadu_ps(zc + d)));
    }
  }
#endif
  for (; d < Dk; ++d) kr[d] = t.v[((wrow[d] >> shift) & mask) & 15u] * sc[d] + zc[d];
}

// One work item: tokens [t0, tn) of one segment (packed or full precision) of one batch
// row, for every kv head (so the rotary rows of the chunk are reused across heads from L1/L2).
// Writes per kv head and query row the chunk's softmax max/sum and unnormalised output.
template <int KB, int VB, bool FP>
void run_item(const Params& P, int64_t b, int64_t t0, int64_t tn, Acc* stats, float* accs) {
  using KU = Unit<KB>;
  using VU = Unit<VB>;
  const int64_t R = P.rep * P.Tq;
  // Implicit bounds: the item shrinks to the key groups holding visible tokens (an item of
  // a row with fewer blocks, or below a sliding window, reads nothing, not even its block id)
  const bool bounded = !FP && P.phi != nullptr;
  const int64_t vlo = bounded ? P.plo[b] : 0;
  if (bounded) {
    t0 = std::max(t0, vlo / Gk * Gk);
    tn = std::min(tn, P.phi[b]);
    if (t0 >= tn) {
      for (int64_t e = 0; e < P.Hkv * R; ++e) stats[e] = Acc{NEG_INF, 0.f};
      return;
    }
  }
  const int64_t n = tn - t0;
  const int64_t Hq = P.Hkv * P.rep;
  constexpr int64_t kbytes = Gk * KB / 8;
  constexpr int64_t vbytes = Dv * VB / 8, ngv = Dv / Gv;
  constexpr int64_t nvu = Dv / VU::per;  // units per value row
  std::vector<float> S(R * n), accp(R * Dv);
  const LevelsOf<KLUT, KB> klt(P.klut, KB);
  const LevelsOf<VLUT, VB> vlt(P.vlut, VB);
  alignas(64) float K[Gk * Dk];
  alignas(64) uint32_t wrow[Dk];
  const int64_t* pos = FP ? (P.fpos ? P.fpos + b * P.fpos_sb : nullptr)
                          : (P.kpos ? P.kpos + b * P.kpos_sb : nullptr);
  // Where the packed fields of this item's tokens live: row pb's slab, token t at t - toff
  // (a page of a paged segment: the item lies inside one page).
  int64_t pb = b, toff = 0;
  if (!FP && P.btab) {
    toff = t0 / P.bsz * P.bsz;
    pb = P.btab[b * P.btab_sb + t0 / P.bsz];
  }
  const float* mask = FP ? P.fmask : P.mask;
  const int64_t ms0 = FP ? P.f0 : P.m0, ms1 = FP ? P.f1 : P.m1;
  const int64_t ms2 = FP ? P.f2 : P.m2, ms3 = FP ? P.f3 : P.m3;
  for (int64_t h = 0; h < P.Hkv; ++h) {
    const float* q0 = P.q + (b * Hq + h * P.rep) * P.Tq * Dk;  // rows of this GQA group
    // ---- keys, Gk tokens at a time: a [nt][Dk] fp32 tile (unpacked from the codes, vectorised
    // over channels, or copied), rotated at each token's position, scored against every row.
    for (int64_t g0 = t0; g0 < tn; g0 += Gk) {
      const int64_t nt = std::min(Gk, tn - g0);
      // The tokens' positions (token indices where bounded), and whether the packed
      // dequantization below rotates the rows itself (rotate_half, one width, no level
      // table); else rope_rows rotates the tile after it is filled.
      alignas(64) int64_t tpos[Gk];
      const int64_t* gp = pos ? pos + g0 : nullptr;
      if (bounded) {
        for (int64_t j = 0; j < nt; ++j) tpos[j] = g0 + j + P.ppos0;
        gp = tpos;
      }
      const bool rotated = !FP && !KLUT && KVP_HALF > 0 && P.rope_style == 1 && !P.kwid;
      if (FP) {
        const SType* src = (const SType*)P.fk + b * P.fk_sb + h * P.fk_sh + g0 * Dk;
        for (int64_t e = 0; e < nt * Dk; ++e) K[e] = to_f32(src[e]);
      } else {
        const int64_t grp = (g0 - toff) / Gk;
        const uint8_t* codes = P.kc + pb * P.kc_sb + h * P.kc_sh + grp * kbytes * Dk;
        alignas(64) float sc[Dk], zc[Dk];
        group_meta<KM8>(P.stab, P.ks, pb * P.ks_sb + h * P.ks_sh + grp * Dk, P.kz,
                        pb * P.kz_sb + h * P.kz_sh + grp * Dk, Dk, sc, zc);
        if (P.kwid) {
          // Per-channel widths: channel d's Gk codes follow each other in the group's byte
          // stream from bit wt[2d + 1], wt[2d] bits each (uniform levels only). Where a
          // channel's codes fit one 64-bit word after its first byte (Gk * 4 <= 56, so
          // for every width), one unaligned load per channel, then row by row one shift
          // per channel (vectorised over channels); else a byte pair per code. The group is
          // copied into a zero-padded buffer so that neither reads past it.
          // NOTE: 8K-token step, 1 thread, SmolLM2 shapes, keys in groups of 12, medians of
          // bench/cpu_attention.py --levels default widths (load ~2.3, one run each): a
          // byte pair per code 2.36 ms against 1.31 ms for one width; a word per channel
          // written column by column 1.81 against 1.26; this, row by row, 1.64 against 1.50.
          const int32_t* wt = P.kwid + h * Dk * 2;
          alignas(8) uint8_t buf[kbytes * Dk + 8];
          std::memcpy(buf, codes, kbytes * Dk);
          std::memset(buf + kbytes * Dk, 0, 8);
          if constexpr (Gk * 4 <= 56) {
            alignas(64) uint64_t word[Dk], wmask[Dk], wshift[Dk];
            for (int64_t d = 0; d < Dk; ++d) {
              const int64_t first = wt[2 * d + 1];
              std::memcpy(&word[d], buf + (first >> 3), 8);
              word[d] >>= (first & 7);
              wshift[d] = (uint64_t)wt[2 * d];
              wmask[d] = (1ull << wshift[d]) - 1ull;
            }
            for (int64_t t = 0; t < Gk; ++t) {
              float* kr = K + t * Dk;
              for (int64_t d = 0; d < Dk; ++d) {
                kr[d] = (float)(int32_t)(word[d] & wmask[d]) * sc[d] + zc[d];
                word[d] >>= wshift[d];
              }
            }
          } else {
            for (int64_t d = 0; d < Dk; ++d) {
              const int w = wt[2 * d];
              const uint32_t m = (1u << w) - 1u;
              int64_t bit = wt[2 * d + 1];
              for (int64_t t = 0; t < Gk; ++t, bit += w) {
                const uint32_t pair = buf[bit >> 3] | ((uint32_t)buf[(bit >> 3) + 1] << 8);
                K[t * Dk + d] = (float)((pair >> (bit & 7)) & m) * sc[d] + zc[d];
              }
            }
          }
        }
        for (int u = 0; u < (P.kwid ? 0 : Gk / KU::per); ++u) {
          const uint8_t* row = codes + (int64_t)u * KU::bytes * Dk;
          for (int64_t d = 0; d < Dk; ++d) {
            uint32_t w = row[d];
            for (int j = 1; j < KU::bytes; ++j) w |= (uint32_t)row[j * Dk + d] << (8 * j);
            wrow[d] = w;
          }
          for (int k = 0; k < KU::per; ++k) {
            const int64_t j = u * KU::per + k;
            float* kr = K + j * Dk;
            const int sh = k * KB;
            if constexpr (KLUT) {
              key_levels<KB>(klt, wrow, sh, sc, zc, kr);
            } else if (rotated && j < nt) {
              // Dequantize and rotate (rotate_half) in one pass, each product as rope_rows
              // computes it on the stored row.
              // NOTE: 7,680 tokens, 1 thread, bench/paged_decode.py shapes: rope_rows was
              // 14 % of run_item's samples (perf); this pass
              const float* cs = P.cosc + (gp[j] - P.rope_off) * P.rope_rs;
              const float* sn = P.sinc + (gp[j] - P.rope_off) * P.rope_rs;
              constexpr int64_t half = KVP_HALF;
              for (int64_t i = 0; i < half; ++i) {
                const float x0 = (float)((wrow[i] >> sh) & KU::mask) * sc[i] + zc[i];
                const float x1 =
                    (float)((wrow[i + half] >> sh) & KU::mask) * sc[i + half] + zc[i + half];
                kr[i] = x0 * cs[i] - x1 * sn[i];
                kr[i + half] = x1 * cs[i] + x0 * sn[i];
              }
              for (int64_t d = 2 * half; d < Dk; ++d)
                kr[d] = (float)((wrow[d] >> sh) & KU::mask) * sc[d] + zc[d];
            } else {
              for (int64_t d = 0; d < Dk; ++d)
                kr[d] = (float)((wrow[d] >> sh) & KU::mask) * sc[d] + zc[d];
            }
          }
        }
      }
      if (P.rope_style != 0 && !rotated) rope_rows(P, K, nt, gp);
      for (int64_t r = 0; r < R; ++r) {
        const float* qr = q0 + r * Dk;
        float* sr = S.data() + r * n + (g0 - t0);
        int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
        if constexpr (Dk % 8 == 0) {
          // NOTE: 8 tokens at a time with one transposing hadd reduction for all 8 dot
          // products. 8K step, 1 thread (min of 60): 1.04 ms with gcc's per-token
          // reductions, 0.73 ms with this.
          for (; j + 8 <= nt; j += 8) {
            __m256 a[8];
            for (int jj = 0; jj < 8; ++jj) a[jj] = _mm256_setzero_ps();
            for (int64_t d = 0; d < Dk; d += 8) {
              const __m256 qv = _mm256_loadu_ps(qr + d);
              for (int jj = 0; jj < 8; ++jj)
                a[jj] = _mm256_fmadd_ps(qv, _mm256_load_ps(K + (j + jj) * Dk + d), a[jj]);
            }
            const __m256 h0 =
                _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
            const __m256 h1 =
                _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
            const __m256 lo = _mm256_permute2f128_ps(h0, h1, 0x20);
            const __m256 hi = _mm256_permute2f128_ps(h0, h1, 0x31);
            _mm256_storeu_ps(sr + j, _mm256_add_ps(lo, hi));
          }
          // NOTE: the rest of a key group in fours the same way (groups of 12 tokens: a
          // third of the tokens took gcc's per-token horizontal sums)
          for (; j + 4 <= nt; j += 4) {
            __m256 a[4];
            for (int jj = 0; jj < 4; ++jj) a[jj] = _mm256_setzero_ps();
            for (int64_t d = 0; d < Dk; d += 8) {
              const __m256 qv = _mm256_loadu_ps(qr + d);
              for (int jj = 0; jj < 4; ++jj)
                a[jj] = _mm256_fmadd_ps(qv, _mm256_load_ps(K + (j + jj) * Dk + d), a[jj]);
            }
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]),
                                            _mm256_hadd_ps(a[2], a[3]));
            _mm_storeu_ps(sr + j, _mm_add_ps(_mm256_castps256_ps128(h),
                                             _mm256_extractf128_ps(h, 1)));
          }
        }
#endif
        for (; j < nt; ++j) {
          const float* kr = K + j * Dk;
          float acc = 0.f;
          for (int64_t d = 0; d < Dk; ++d) acc += qr[d] * kr[d];
          sr[j] = acc;
        }
      }
    }
    // ---- soft-capping (before the mask, as the model does), mask and softmax statistics
    Acc* st = stats + h * R;
    const float cap = P.softcap;
    for (int64_t r = 0; r < R; ++r) {
      float* sr = S.data() + r * n;
      if (cap > 0.f) {
        const float inv = 1.f / cap;
        for (int64_t t = 0; t < n; ++t) sr[t] = cap * tanh_vec(sr[t] * inv);
      }
      if (bounded)
        for (int64_t t = 0; t < std::min(n, vlo - t0); ++t) sr[t] = NEG_INF;
      if (mask) {
        const int64_t hq = h * P.rep + r / P.Tq, i = r % P.Tq;
        const float* mr = mask + b * ms0 + hq * ms1 + i * ms2;
        for (int64_t t = 0; t < n; ++t) sr[t] += mr[(t0 + t) * ms3];
      }
      const float m = row_max(sr, n);
      st[r].m = m;
      st[r].l = 0.f;
      if (m == NEG_INF) {
        for (int64_t t = 0; t < n; ++t) sr[t] = 0.f;
        continue;
      }
      float l = 0.f;
      for (int64_t t = 0; t < n; ++t) { const float p = exp_neg(sr[t] - m); sr[t] = p; l += p; }
      st[r].l = l;
    }
    // ---- values: dequantize TB token rows (L1) and add p * row to every query row.
    // NOTE: whole 8K-token step, 1 thread, SmolLM2 shapes, 2 bits (min of 30): folding
    // p_t s_t into the codes (docs/design.md §6) with unit-major accumulators 2.1-3.8 ms;
    // dequantize-then-axpy one token at a time 1.31 ms; the same with a 256-entry byte
    // lookup table 1.32 ms; blocks of TB=8 tokens (accumulators stay in registers) 0.96 ms.
    // With 3 query rows per kv head the fold saves ~1 FMA in 4 and cost vectorisation.
    std::fill(accp.begin(), accp.end(), 0.f);
    constexpr int64_t TB = 8;
    alignas(64) float vblk[TB][Dv];
    float pblk[TB];
    for (int64_t tb = t0; tb < tn; tb += TB) {
      const int64_t nb = std::min<int64_t>(TB, tn - tb);
      // The block's value scales and zeros in one call (a token's ngv groups follow the
      // previous token's): per token, the 8-bit lookups' dependency chain and the barrier
      // in meta8 cost 5 % of run_item (perf, 7,680 tokens, 1 thread).
      alignas(32) float bst[TB * ngv], bzt[TB * ngv];
      if constexpr (!FP && VVQ == 0) {
        const int64_t tp0 = tb - toff;
        group_meta<VM8>(P.stab, P.vs, pb * P.vs_sb + h * P.vs_sh + tp0 * ngv, P.vz,
                        pb * P.vz_sb + h * P.vz_sh + tp0 * ngv, nb * ngv, bst, bzt);
      }
      for (int64_t tt = 0; tt < TB; ++tt) {
        float* vrow = vblk[tt];
        if (tt >= nb) { std::fill(vrow, vrow + Dv, 0.f); continue; }
        const int64_t t = tb + tt;
        if (FP) {
          const SType* src = (const SType*)P.fv + b * P.fv_sb + h * P.fv_sh + t * Dv;
          for (int64_t e = 0; e < Dv; ++e) vrow[e] = to_f32(src[e]);
          continue;
        }
        const int64_t tp = t - toff;
        const uint8_t* row = P.vc + pb * P.vc_sb + h * P.vc_sh + tp * vbytes;
        if constexpr (VVQ > 0) {  // vbytes = Dv / VVQ: one byte per sub-vector
          float stv[ngv];
          group_scales<VM8>(P.stab, P.vs, pb * P.vs_sb + h * P.vs_sh + tp * ngv, ngv, stv);
          vq_row(P.vcb + h * 256 * VVQ, row, stv, vrow);
          continue;
        }
        const float* stt = bst + tt * ngv;
        const float* ztt = bzt + tt * ngv;
#if defined(__AVX2__) && defined(__FMA__)
        if constexpr (Gv % 8 == 0 && VB <= 4) {
          // NOTE: 8 codes per step: broadcast their bits, per-lane shift (vpsrlvd), mask,
          // convert, one FMA with the group's scale/zero. 8K step, 1 thread: value pass
          // 0.58 -> 0.27 ms (timers in the loop), whole step 1.19 -> 0.87 ms, against gcc's
          // vectorisation of the portable loop below (or of a 32-bit-word variant).
          const __m256i shifts = _mm256_setr_epi32(0, VB, 2 * VB, 3 * VB, 4 * VB, 5 * VB,
                                                   6 * VB, 7 * VB);
          const __m256i maskv = _mm256_set1_epi32((int)VU::mask);
          for (int64_t c0 = 0; c0 < Dv; c0 += 8) {
            uint32_t w = 0;
            if constexpr (VB == 3) {
              // NOTE: a 3-byte memcpy is not one load: bench/cpu_attention.py --bits 3,
              // 1 thread, 8K step 2.27 ms with it, 1.06 ms with a 4-byte load (2 bits:
              // 1.05 ms); byte by byte where the 4th byte would lie past the row.
              const uint8_t* s3 = row + c0 * 3 / 8;
              if (c0 + 8 < Dv) {
                std::memcpy(&w, s3, 4);
              } else {
                w = (uint32_t)s3[0] | ((uint32_t)s3[1] << 8) | ((uint32_t)s3[2] << 16);
              }
            } else {
              std::memcpy(&w, row + c0 * VB / 8, VB);  // 8 codes = VB bytes, byte aligned
            }
            const __m256i bits = _mm256_and_si256(
                _mm256_srlv_epi32(_mm256_set1_epi32((int)w), shifts), maskv);
            const int64_t g = c0 / Gv;
            if constexpr (VLUT) {
              _mm256_store_ps(vrow + c0, _mm256_fmadd_ps(lookup8<VB>(vlt, bits),
                                                         _mm256_set1_ps(stt[g]),
                                                         _mm256_set1_ps(ztt[g])));
            } else {
              _mm256_store_ps(vrow + c0, _mm256_fmadd_ps(_mm256_cvtepi32_ps(bits),
                                                         _mm256_set1_ps(stt[g]),
                                                         _mm256_set1_ps(ztt[g])));
            }
          }
          continue;
        }
#endif
        for (int64_t u = 0; u < nvu; ++u) {
          uint32_t w = row[u * VU::bytes];
          for (int j = 1; j < VU::bytes; ++j) w |= (uint32_t)row[u * VU::bytes + j] << (8 * j);
          if constexpr (VLUT) {
            for (int k = 0; k < VU::per; ++k)
              vrow[u * VU::per + k] = vlt.v[(w >> (k * VB)) & VU::mask & 15u];
          } else {
            for (int k = 0; k < VU::per; ++k)
              vrow[u * VU::per + k] = (float)((w >> (k * VB)) & VU::mask);
          }
        }
        for (int64_t g = 0; g < ngv; ++g)
          for (int64_t e = 0; e < Gv; ++e) vrow[g * Gv + e] = vrow[g * Gv + e] * stt[g] + ztt[g];
      }
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t tt = 0; tt < TB; ++tt) pblk[tt] = tt < nb ? S[r * n + (tb - t0) + tt] : 0.f;
        float* ar = accp.data() + r * Dv;
        for (int64_t c = 0; c < Dv; ++c) {
          float a = ar[c];
          for (int64_t tt = 0; tt < TB; ++tt) a += pblk[tt] * vblk[tt][c];
          ar[c] = a;
        }
      }
    }
    std::copy(accp.begin(), accp.end(), accs + h * R * Dv);
  }
}

// Work shared between the calling thread and helpers. Held by shared_ptr: a helper the OS
// starts late finds no work left and exits on its own; the caller never waits for it.
struct Work {
  Params P;
  int64_t items, per_b, npk, R;
  std::vector<Acc> stats;   // [items][Hkv][R]
  std::vector<float> accs;  // [items][Hkv][R][Dv]
  std::atomic<int64_t> next{0}, done{0};
  std::mutex mu;
  std::condition_variable cv;
};

template <int KB, int VB>
void work_loop(Work& w) {
  const Params& P = w.P;
  for (int64_t it = w.next++; it < w.items; it = w.next++) {
    const int64_t b = it / w.per_b, c = it % w.per_b;
    Acc* st = w.stats.data() + it * P.Hkv * w.R;
    float* ac = w.accs.data() + it * P.Hkv * w.R * Dv;
    if (c < w.npk) {
      run_item<KB, VB, false>(P, b, c * P.chunk, std::min(P.Tk, (c + 1) * P.chunk), st, ac);
    } else {
      const int64_t f = c - w.npk;
      run_item<KB, VB, true>(P, b, f * P.chunk, std::min(P.Tf, (f + 1) * P.chunk), st, ac);
    }
    if (++w.done == w.items) {
      std::lock_guard<std::mutex> lock(w.mu);
      w.cv.notify_all();
    }
  }
}

// Helper threads started once and kept (sleeping on a condition variable between calls).
// Never destroyed: a static pool with joinable threads would terminate the process at exit.
class Pool {
 public:
  void post(int64_t helpers, const std::shared_ptr<Work>& w, void (*fn)(Work&)) {
    std::lock_guard<std::mutex> lock(mu_);
    while ((int64_t)count_ < helpers) {
      try {
        std::thread([this] { loop(); }).detach();
        ++count_;
      } catch (...) {  // no thread to be had: the caller does the work
        break;
      }
    }
    job_ = w;
    fn_ = fn;
    ++gen_;
    cv_.notify_all();
  }

 private:
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      std::shared_ptr<Work> w;
      void (*fn)(Work&) = nullptr;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return gen_ != seen; });
        seen = gen_;
        w = job_;
        fn = fn_;
      }
      if (w) fn(*w);
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::shared_ptr<Work> job_;
  void (*fn_)(Work&) = nullptr;
  uint64_t gen_ = 0;
  size_t count_ = 0;
};

Pool& pool() {
  static Pool* p = new Pool();  // intentionally leaked, see above
  return *p;
}

template <int KB, int VB>
void run(const Params& P) {
  auto wp = std::make_shared<Work>();
  Work& w = *wp;
  w.P = P;
  w.npk = (P.Tk + P.chunk - 1) / P.chunk;                // packed chunks per batch row
  w.per_b = w.npk + (P.Tf + P.chunk - 1) / P.chunk;      // + full-precision chunks
  w.items = P.B * w.per_b;
  w.R = P.rep * P.Tq;
  const int64_t items = w.items, per_b = w.per_b, R = w.R, Hq = P.Hkv * P.rep;
  w.stats.resize(items * P.Hkv * R);
  w.accs.resize(items * P.Hkv * R * Dv);
  // NOTE: items come from a shared counter and the caller waits only for items actually
  // taken, never for a helper thread to be scheduled: on this shared 2-core machine (load
  // ~3) a static split plus join() measured a 3.1-3.6 ms median for an 8K step that takes
  // 1.3 ms on one thread. Helpers come from a kept pool (no thread start per call).
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(P.nthreads, items));
#if defined(_OPENMP)
  // NOTE: OpenMP's threads are torch's (one libgomp in the process: the library names
  // libgomp.so.1, which torch has loaded), so a step runs on the threads and cores the engine
  // gave torch. vLLM binds its main thread to one core and each OpenMP thread to its own: a
  // helper thread started by the main thread inherits the main thread's core, so the kept
  // pool below ran a 2-thread step on one core (7.7K-token step in vLLM: 1.71 ms a layer,
  // against 1.2 ms on one thread outside it).
  if (nt > 1 && !omp_in_parallel()) {
#pragma omp parallel num_threads((int)nt)
    work_loop<KB, VB>(w);
  } else {
    work_loop<KB, VB>(w);
  }
#else
  if (nt > 1) pool().post(nt - 1, wp, &work_loop<KB, VB>);
  work_loop<KB, VB>(w);
#endif
  {
    std::unique_lock<std::mutex> lock(w.mu);
    w.cv.wait(lock, [&] { return w.done.load() == items; });
  }
  const std::vector<Acc>& stats = w.stats;
  const std::vector<float>& accs = w.accs;
  // ---- log-sum-exp merge of every chunk of both segments
  for (int64_t b = 0; b < P.B; ++b)
    for (int64_t h = 0; h < P.Hkv; ++h)
      for (int64_t r = 0; r < R; ++r) {
        float M = NEG_INF;
        for (int64_t c = 0; c < per_b; ++c)
          M = std::max(M, stats[((b * per_b + c) * P.Hkv + h) * R + r].m);
        const int64_t hq = h * P.rep + r / P.Tq, i = r % P.Tq;
        float* o = P.out + ((b * Hq + hq) * P.Tq + i) * Dv;
        float* lse = P.lse + (b * Hq + hq) * P.Tq + i;
        std::memset(o, 0, sizeof(float) * Dv);
        if (M == NEG_INF) { *lse = NEG_INF; continue; }
        float L = 0.f;
        for (int64_t c = 0; c < per_b; ++c) {
          const int64_t idx = ((b * per_b + c) * P.Hkv + h) * R + r;
          if (stats[idx].m == NEG_INF) continue;
          const float w = std::exp(stats[idx].m - M);
          L += w * stats[idx].l;
          const float* a = accs.data() + idx * Dv;
          for (int64_t e = 0; e < Dv; ++e) o[e] += w * a[e];
        }
        const float inv = 1.f / L;
        for (int64_t e = 0; e < Dv; ++e) o[e] *= inv;
        *lse = M + std::log(L);
      }
}


// ---- the fused decode step (kvp_paged_step)

// Engine tensors (q, k, v, out) in their dtype, chosen per call (Step::edt). Narrowing
// rounds to nearest even, as torch's .to(bfloat16) / .to(float16).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
inline uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);                 // NaN
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);                // overflow: inf
  if (a < 0x38800000u) {                                                  // subnormal or 0
    float af;
    std::memcpy(&af, &a, 4);
    // af * 2**24 rounded to nearest even is the subnormal's mantissa (0x400: the least normal)
    return (uint16_t)(sign | (uint32_t)std::nearbyint(af * 16777216.f));
  }
  const uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - (112u << 23);
  return (uint16_t)(sign | (r >> 13));
}
inline float load_e(const void* p, int64_t i, int64_t edt) {
  if (edt == 0) return ((const float*)p)[i];
  const uint16_t x = ((const uint16_t*)p)[i];
  return edt == 1 ? bf16_to_f32(x) : f16_to_f32(x);
}
inline void store_e(void* p, int64_t i, int64_t edt, float x) {
  if (edt == 0) {
    ((float*)p)[i] = x;
  } else {
    ((uint16_t*)p)[i] = edt == 1 ? f32_to_bf16(x) : f32_to_f16(x);
  }
}
// The storage type KVP_SDT from fp32.
inline SType to_store(float x) {
#if KVP_SDT == 0
  return x;
#elif KVP_SDT == 1
  return f32_to_bf16(x);
#else
  return f32_to_f16(x);
#endif
}

// The inverse rotation of one key row at one position (cos/sin rows cs/sn): what
// runtime.paged's torch path computes with rope_rotate and -sin, product by product, so
// that the stored pre-RoPE key is bit-identical to it (no fused multiply-add here).
__attribute__((optimize("fp-contract=off"))) inline void unrope(float* kr, const float* cs,
                                                                 const float* sn, int64_t style) {
  constexpr int64_t half = KVP_HALF;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t i0 = style == 1 ? i : 2 * i;
    const int64_t i1 = style == 1 ? i + half : 2 * i + 1;
    const float x0 = kr[i0], x1 = kr[i1];
    const float a = x0 * cs[i], b = x1 * sn[i], c = x1 * cs[i], d = x0 * sn[i];
    kr[i0] = a + b;
    kr[i1] = c - d;
  }
}

// ---- packing a chunk the step completed (Step::pack)
//
// kernels.reference.encode_groups operation by operation (uniform levels: the min-max
// grid; 8-bit metadata with its zero point in quarter steps and fit "mse"'s coarser
// candidates, or 16-bit metadata in the storage type), with no fused multiply-add and no
// reassociation, so codes, scales and zeros are bit-identical to the torch quantizer.
// Fit "mse" sums a candidate's squared error in token order, as torch sums a channel's
// group of up to 16 tokens; in another order (longer groups, per-token groups) two
// candidates whose errors agree to fp32 rounding may swap, as kernels.triton_quant says.
// NOTE: fp-contract=off alone keeps the loops vectorised; no-associative-math as well took
// the packing of a bits=2 chunk (12 tokens, 3 kv heads, D=64) from 25 to 106 us, so only
// the one order-sensitive sum (grid_error, over a group's elements) has it. The channel
// groups' error sums run in lanes across channels, each lane in token order.
#define KVP_EXACT __attribute__((optimize("fp-contract=off")))
#define KVP_ORDERED __attribute__((optimize("no-associative-math", "fp-contract=off")))

// The smallest index whose scale is >= need (torch.searchsorted), 255 at most; NaN: 255.
inline int64_t scale_index(const float* stab, float need) {
  if (!(need == need)) return 255;
  int64_t lo = 0, hi = 256;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (stab[mid] < need) lo = mid + 1; else hi = mid;
  }
  return std::min<int64_t>(lo, 255);
}

// The grid of step s whose zero point is nearest `low` (reference._grid): codes of x[0..n).
KVP_EXACT inline void grid8(const float* x, int64_t n, float s, float low, float top,
                            uint8_t* c, float* point, float* zero) {
  float p = std::nearbyint(-low / s * 4.f);
  p = std::min(std::max(p, -128.f), 127.f);
  const float z = -p * s / 4.f;
  for (int64_t i = 0; i < n; ++i) {
    const float q = std::nearbyint((x[i] - z) / s);
    c[i] = (uint8_t)std::min(std::max(q, 0.f), top);
  }
  *point = p;
  *zero = z;
}

KVP_ORDERED float grid_error(const float* x, const uint8_t* c, int64_t n, float s,
                                  float z) {
  float e = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float back = (float)c[i] * s + z;
    const float d = back - x[i];
    e += d * d;
  }
  return e;
}

// One group x[0..n) of uniform levels up to `top` (a float: 2**bits - 1): codes c and the
// metadata, 8-bit (M8: a scale index and a zero point; fit coarser steps tried) or in the
// storage type.
template <bool M8>
KVP_EXACT void encode_group(const float* stab, const float* x, int64_t n, float top, int64_t fit,
                            uint8_t* c, void* scale, void* zero, int64_t at) {
  float lo = x[0], hi = x[0];
  for (int64_t i = 1; i < n; ++i) { lo = std::min(lo, x[i]); hi = std::max(hi, x[i]); }
  if constexpr (M8) {
    const float need = std::max((hi - lo) / top, std::fabs(lo) / 31.75f);  // 127 / ZERO_STEPS
    int64_t idx = scale_index(stab, need);
    float p, z;
    grid8(x, n, stab[idx], lo, top, c, &p, &z);
    if (fit > 0) {
      float err = grid_error(x, c, n, stab[idx], z);
      const float mid = (lo + hi) / 2.f;
      const int64_t base = idx;
      alignas(64) uint8_t cc[256];
      for (int64_t k = 1; k <= fit; ++k) {
        const int64_t j = std::max<int64_t>(base - k, 0);
        const float s = stab[j];
        float p2, z2;
        grid8(x, n, s, mid - top * s / 2.f, top, cc, &p2, &z2);
        const float e = grid_error(x, cc, n, s, z2);
        if (e < err) {
          err = e;
          std::memcpy(c, cc, n);
          idx = j;
          p = p2;
        }
      }
    }
    ((uint8_t*)scale)[at] = (uint8_t)idx;
    ((int8_t*)zero)[at] = (int8_t)p;
  } else {
    const SType zs = to_store(lo), ss = to_store((hi - lo) / top);
    const float z = to_f32(zs), s = to_f32(ss), safe = s > 0.f ? s : 1.f;
    for (int64_t i = 0; i < n; ++i) {
      const float q = std::min(std::max(std::nearbyint((x[i] - z) / safe), 0.f), top);
      c[i] = s > 0.f ? (uint8_t)q : 0;
    }
    ((SType*)scale)[at] = ss;
    ((SType*)zero)[at] = zs;
  }
}

// encode_group for the Dk channel groups of one key group at once: X [Gk][Dk] (token-major,
// as the stage holds it), each channel its own group of Gk tokens; the same operations
// per channel, in lanes across channels (so gcc vectorises them; the error still sums in
// token order per channel). Codes to Cf [Gk][Dk] as floats, metadata to scale/zero [Dk].
template <bool M8>
KVP_EXACT void encode_channels(const float* stab, const float (*X)[Dk], const float* top,
                               int64_t fit, float (*Cf)[Dk], void* scale, void* zero) {
  alignas(64) float lo[Dk], hi[Dk];
  for (int64_t d = 0; d < Dk; ++d) lo[d] = hi[d] = X[0][d];
  for (int64_t t = 1; t < Gk; ++t)
    for (int64_t d = 0; d < Dk; ++d) {
      lo[d] = std::min(lo[d], X[t][d]);
      hi[d] = std::max(hi[d], X[t][d]);
    }
  if constexpr (M8) {
    alignas(64) float s[Dk], p[Dk], z[Dk];
    int64_t idx[Dk];
    for (int64_t d = 0; d < Dk; ++d) {
      idx[d] = scale_index(stab, std::max((hi[d] - lo[d]) / top[d], std::fabs(lo[d]) / 31.75f));
      s[d] = stab[idx[d]];
    }
    // the grid of steps s whose zero points are nearest `low` (reference._grid)
    auto grid = [&](const float* sg, const float* low, float (*c)[Dk], float* pg, float* zg) {
      for (int64_t d = 0; d < Dk; ++d) {
        pg[d] = std::min(std::max(std::nearbyint(-low[d] / sg[d] * 4.f), -128.f), 127.f);
        zg[d] = -pg[d] * sg[d] / 4.f;
      }
      for (int64_t t = 0; t < Gk; ++t)
        for (int64_t d = 0; d < Dk; ++d)
          c[t][d] = std::min(std::max(std::nearbyint((X[t][d] - zg[d]) / sg[d]), 0.f), top[d]);
    };
    auto error = [&](float (*c)[Dk], const float* sg, const float* zg, float* e) {
      for (int64_t d = 0; d < Dk; ++d) e[d] = 0.f;
      for (int64_t t = 0; t < Gk; ++t)
        for (int64_t d = 0; d < Dk; ++d) {
          const float back = c[t][d] * sg[d] + zg[d];
          const float df = back - X[t][d];
          e[d] += df * df;
        }
    };
    grid(s, lo, Cf, p, z);
    if (fit > 0) {
      alignas(64) float err[Dk], mid[Dk], s2[Dk], low[Dk], p2[Dk], z2[Dk], e2[Dk];
      alignas(64) float cc[Gk][Dk];
      int64_t base[Dk];
      error(Cf, s, z, err);
      for (int64_t d = 0; d < Dk; ++d) {
        mid[d] = (lo[d] + hi[d]) / 2.f;
        base[d] = idx[d];
      }
      for (int64_t k = 1; k <= fit; ++k) {
        int64_t j[Dk];
        for (int64_t d = 0; d < Dk; ++d) {
          j[d] = std::max<int64_t>(base[d] - k, 0);
          s2[d] = stab[j[d]];
          low[d] = mid[d] - top[d] * s2[d] / 2.f;
        }
        grid(s2, low, cc, p2, z2);
        error(cc, s2, z2, e2);
        for (int64_t d = 0; d < Dk; ++d) {
          if (!(e2[d] < err[d])) continue;
          err[d] = e2[d];
          for (int64_t t = 0; t < Gk; ++t) Cf[t][d] = cc[t][d];
          idx[d] = j[d];
          p[d] = p2[d];
        }
      }
    }
    for (int64_t d = 0; d < Dk; ++d) {
      ((uint8_t*)scale)[d] = (uint8_t)idx[d];
      ((int8_t*)zero)[d] = (int8_t)p[d];
    }
  } else {
    alignas(64) float s[Dk], z[Dk], safe[Dk];
    for (int64_t d = 0; d < Dk; ++d) {
      const SType zs = to_store(lo[d]), ss = to_store((hi[d] - lo[d]) / top[d]);
      ((SType*)scale)[d] = ss;
      ((SType*)zero)[d] = zs;
      z[d] = to_f32(zs);
      s[d] = to_f32(ss);
      safe[d] = s[d] > 0.f ? s[d] : 1.f;
    }
    for (int64_t t = 0; t < Gk; ++t)
      for (int64_t d = 0; d < Dk; ++d) {
        const float q = std::min(std::max(std::nearbyint((X[t][d] - z[d]) / safe[d]), 0.f),
                                 top[d]);
        Cf[t][d] = s[d] > 0.f ? q : 0.f;
      }
  }
}

// What both decode steps (kvp_paged_step, kvp_layer_step) do around the attention: the
// engine's query rows, scaled, to fp32 [B, Hq, Dk] (row b at b * rs, head h at h * hs);
// a new value row rotated (x R, R [Dv, Dv] row-major), in place; the fp32 outputs
// [B, Hq, Dv] rotated back (o R^T, where R is given) and stored in the engine's dtype.
inline void load_queries(const void* q, int64_t B, int64_t Hq, int64_t rs, int64_t hs,
                         int64_t edt, float scale, float* qs) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < Hq * Dk; ++i)
      qs[b * Hq * Dk + i] = load_e(q, b * rs + (i / Dk) * hs + i % Dk, edt) * scale;
}
inline void rotate_value(float* x, const float* R) {
  alignas(64) float y[Dv];
  for (int64_t j = 0; j < Dv; ++j) y[j] = 0.f;
  for (int64_t i = 0; i < Dv; ++i)
    for (int64_t j = 0; j < Dv; ++j) y[j] += x[i] * R[i * Dv + j];
  std::memcpy(x, y, sizeof(y));
}
inline void store_outputs(const float* o32, int64_t B, int64_t Hq, const float* R, void* out,
                          int64_t rs, int64_t hs, int64_t edt) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hq = 0; hq < Hq; ++hq) {
      const float* o = o32 + (b * Hq + hq) * Dv;
      const int64_t at = b * rs + hq * hs;
      if (R) {
        for (int64_t i = 0; i < Dv; ++i) {
          float a = 0.f;
          for (int64_t j = 0; j < Dv; ++j) a += o[j] * R[i * Dv + j];
          store_e(out, at + i, edt, a);
        }
      } else {
        for (int64_t i = 0; i < Dv; ++i) store_e(out, at + i, edt, o[i]);
      }
    }
}

// ORs code c into a little-endian bit stream at `bit` (stream byte j at buf[j * stride]).
inline void put_code(uint8_t* buf, int64_t stride, int64_t bit, uint32_t c) {
  const uint32_t w = c << (bit & 7);
  buf[(bit >> 3) * stride] |= (uint8_t)(w & 0xffu);
  if (w >> 8) buf[((bit >> 3) + 1) * stride] |= (uint8_t)(w >> 8);
}

// Pack one chunk of C tokens into block pb at token offset `off` (a multiple of C): keys
// and values from sk / sv, head h's token r at (h * sh + r * sr) elements (the head dim
// contiguous), its rows r < nsink (sinks) replaced by row nsink, as runtime.paged does.
// `P` holds the packed fields' pointers and strides.
template <int KB, int VB>
void pack_chunk(const Step& S, const Params& P, const SType* stk, const SType* stv,
                int64_t ksh, int64_t ksr, int64_t vsh, int64_t vsr, int64_t nsink,
                int64_t pb, int64_t off) {
  const int64_t C = S.C;
  auto src = [&](int64_t r) { return r < nsink ? nsink : r; };
  constexpr int64_t kbytes = Gk * KB / 8, vbytes = Dv * VB / 8, ngv = Dv / Gv;
  constexpr int64_t kms = KM8 ? 1 : sizeof(SType), vms = VM8 ? 1 : sizeof(SType);
  for (int64_t h = 0; h < P.Hkv; ++h) {
    const int32_t* wt = P.kwid ? P.kwid + h * Dk * 2 : nullptr;
    alignas(64) float top[Dk];
    for (int64_t d = 0; d < Dk; ++d) top[d] = (float)((1 << (wt ? wt[2 * d] : KB)) - 1);
    for (int64_t g = 0; g < C / Gk; ++g) {  // keys: per channel, Gk tokens a group
      const int64_t grp = off / Gk + g;
      alignas(64) float X[Gk][Dk], Cf[Gk][Dk];
      for (int64_t t = 0; t < Gk; ++t) {
        const SType* row = stk + h * ksh + src(g * Gk + t) * ksr;
        for (int64_t d = 0; d < Dk; ++d) X[t][d] = to_f32(row[d]);
      }
      encode_channels<KM8>(P.stab, X, top, S.kfit, Cf,
                           (uint8_t*)P.ks + (pb * P.ks_sb + h * P.ks_sh + grp * Dk) * kms,
                           (uint8_t*)P.kz + (pb * P.kz_sb + h * P.kz_sh + grp * Dk) * kms);
      uint8_t* codes = (uint8_t*)P.kc + pb * P.kc_sb + h * P.kc_sh + grp * kbytes * Dk;
      std::memset(codes, 0, kbytes * Dk);
      for (int64_t t = 0; t < Gk; ++t)
        for (int64_t d = 0; d < Dk; ++d) {
          if (wt) put_code(codes, 1, wt[2 * d + 1] + t * wt[2 * d], (uint32_t)Cf[t][d]);
          else put_code(codes + d, Dk, t * KB, (uint32_t)Cf[t][d]);
        }
    }
    void* vs = (uint8_t*)P.vs + (pb * P.vs_sb + h * P.vs_sh) * vms;
    void* vz = (uint8_t*)P.vz + (pb * P.vz_sb + h * P.vz_sh) * vms;
    for (int64_t r = 0; r < C; ++r) {  // values: per token, Gv channels a group
      const int64_t tp = off + r;
      uint8_t* codes = (uint8_t*)P.vc + pb * P.vc_sb + h * P.vc_sh + tp * vbytes;
      std::memset(codes, 0, vbytes);
      const SType* row = stv + h * vsh + src(r) * vsr;
      for (int64_t g = 0; g < ngv; ++g) {
        alignas(64) float x[Gv];
        alignas(64) uint8_t c[Gv];
        for (int64_t e = 0; e < Gv; ++e) x[e] = to_f32(row[g * Gv + e]);
        encode_group<VM8>(P.stab, x, Gv, (float)((1 << VB) - 1), S.vfit, c, vs, vz,
                          tp * ngv + g);
        for (int64_t e = 0; e < Gv; ++e) put_code(codes, 1, (g * Gv + e) * VB, c[e]);
      }
    }
  }
}

// One decode step of one layer: per sequence, its new key (rotated back to pre-RoPE at its
// position, where the layer has a rotary table) and value (rotated by the value rotation,
// where there is one) go to its block's stage (and to the sinks while it is one); its query
// attends over the sinks, the packed blocks (in place, through the block table, cut to the
// visible tokens) and the stage up to and including the new token, in one softmax; the
// output is rotated back and written to the engine's row in its dtype; with Step::pack, a
// chunk the step completes is packed into its block (else that is the caller's). Returns 0, or what was wrong (the caller
// raises): 2 a sequence with no token, 3 a block table too short for a sequence, 4 a
// position past the rotary table, 5 a block id outside the pages, 6 an unknown dtype.
template <int KB, int VB>
int step(const Step& S, const Params& base) {
  const int64_t B = S.B, Hkv = base.Hkv, rep = base.rep, Hq = Hkv * rep;
  const int64_t C = S.C, SN = S.sinks, bs = S.bs, Tf = SN + C;
  if (S.edt < 0 || S.edt > 2) return 6;
  std::vector<int64_t> plo(B), phi(B);
  int64_t nbmax = 0, total = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t L = S.seq_len[b], pos = L - 1;
    if (L < 1) return 2;
    if (pos / bs >= S.btab_n) return 3;
    if (S.rope_rows > 0 && L > S.rope_rows) return 4;
    const int64_t np = pos / C * C;  // tokens of complete chunks, before this step's
    plo[b] = std::max(SN, S.window > 0 ? pos - S.window + 1 : (int64_t)0);
    phi[b] = np;
    const int64_t* row = S.btab + b * S.btab_sb;
    const int64_t nb = (np + bs - 1) / bs;
    for (int64_t j = std::min(plo[b] / bs, nb); j < nb; ++j)
      if (row[j] < 0 || row[j] >= S.num_blocks) return 5;
    if (row[pos / bs] < 0 || row[pos / bs] >= S.num_blocks) return 5;
    if (SN && (row[0] < 0 || row[0] >= S.num_blocks)) return 5;
    nbmax = std::max(nbmax, nb);
    total += L;
  }
  std::vector<float> qs(B * Hq * Dk), out32(B * Hq * Dv), lse(B * Hq), fmask(B * Tf);
  std::vector<SType> fk(B * Hkv * Tf * Dk), fv(B * Hkv * Tf * Dv);
  std::vector<int64_t> fpos(B * Tf, 0);
  load_queries(S.q, B, Hq, S.q_rs, S.q_hs, S.edt, S.scale, qs.data());
  for (int64_t b = 0; b < B; ++b) {
    const int64_t L = S.seq_len[b], pos = L - 1, np = pos / C * C;
    const int64_t* row = S.btab + b * S.btab_sb;
    uint8_t* page = S.pages + row[pos / bs] * S.page_bytes;
    uint8_t* first = S.pages + row[0] * S.page_bytes;
    // ---- append: the new key and value to the stage (and the sinks)
    for (int64_t h = 0; h < Hkv; ++h) {
      alignas(64) float kr[Dk], vr[Dv];
      for (int64_t d = 0; d < Dk; ++d) kr[d] = load_e(S.k, b * S.k_rs + h * S.k_hs + d, S.edt);
      if (S.rope_rows > 0)
        unrope(kr, base.cosc + pos * base.rope_rs, base.sinc + pos * base.rope_rs,
               base.rope_style);
      for (int64_t d = 0; d < Dv; ++d) vr[d] = load_e(S.v, b * S.v_rs + h * S.v_hs + d, S.edt);
      if (S.rot) rotate_value(vr, S.rot);  // v R
      SType* sk = (SType*)(page + S.stage_k) + (h * C + pos % C) * Dk;
      SType* sv = (SType*)(page + S.stage_v) + (h * C + pos % C) * Dv;
      for (int64_t d = 0; d < Dk; ++d) sk[d] = to_store(kr[d]);
      for (int64_t d = 0; d < Dv; ++d) sv[d] = to_store(vr[d]);
      if (pos < SN) {
        std::memcpy((SType*)(first + S.sink_k) + (h * SN + pos) * Dk, sk, Dk * sizeof(SType));
        std::memcpy((SType*)(first + S.sink_v) + (h * SN + pos) * Dv, sv, Dv * sizeof(SType));
      }
    }
    // ---- the full-precision tokens: sinks, then the stage from the chunk's first non-sink
    int64_t nf = 0;
    auto take = [&](const uint8_t* pg, int64_t ko, int64_t vo, int64_t rows, int64_t r, int64_t p) {
      for (int64_t h = 0; h < Hkv; ++h) {
        std::memcpy(fk.data() + ((b * Hkv + h) * Tf + nf) * Dk,
                    (const SType*)(pg + ko) + (h * rows + r) * Dk, Dk * sizeof(SType));
        std::memcpy(fv.data() + ((b * Hkv + h) * Tf + nf) * Dv,
                    (const SType*)(pg + vo) + (h * rows + r) * Dv, Dv * sizeof(SType));
      }
      fpos[b * Tf + nf] = p;
      fmask[b * Tf + nf] = S.window > 0 && p <= pos - S.window ? NEG_INF : 0.f;
      ++nf;
    };
    for (int64_t j = 0; j < std::min(SN, L); ++j) take(first, S.sink_k, S.sink_v, SN, j, j);
    for (int64_t j = std::max(np, SN); j < L; ++j) take(page, S.stage_k, S.stage_v, C, j % C, j);
    for (int64_t j = nf; j < Tf; ++j) fmask[b * Tf + j] = NEG_INF;
  }
  Params P = base;
  P.B = B;
  P.Tq = 1;
  P.Tk = nbmax * bs;
  P.chunk = bs;
  P.nthreads = total >= S.threads_from ? S.nthreads : 1;
  P.q = qs.data();
  P.mask = nullptr;
  P.kpos = nullptr;
  P.plo = plo.data();
  P.phi = phi.data();
  P.btab = S.btab;
  P.btab_sb = S.btab_sb;
  P.bsz = bs;
  P.Tf = Tf;
  P.fk = fk.data(); P.fk_sb = Hkv * Tf * Dk; P.fk_sh = Tf * Dk;
  P.fv = fv.data(); P.fv_sb = Hkv * Tf * Dv; P.fv_sh = Tf * Dv;
  P.fmask = fmask.data(); P.f0 = Tf; P.f1 = 0; P.f2 = 0; P.f3 = 1;
  P.fpos = S.rope_rows > 0 ? fpos.data() : nullptr;
  P.fpos_sb = Tf;
  P.out = out32.data();
  P.lse = lse.data();
  run<KB, VB>(P);
  // ---- the chunks this step completed, packed from the stage (after attending: the step
  // read them from the stage, as the torch path does)
  if (S.pack) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t L = S.seq_len[b];
      if (L % C) continue;
      const int64_t* row = S.btab + b * S.btab_sb;
      const int64_t pb = row[(L - 1) / bs], cs = L - C;
      const uint8_t* page = S.pages + pb * S.page_bytes;
      const int64_t first_ok = std::max<int64_t>(SN - cs, 0);  // the chunk's first non-sink
      pack_chunk<KB, VB>(S, base, (const SType*)(page + S.stage_k),
                         (const SType*)(page + S.stage_v), C * Dk, Dk, C * Dv, Dv,
                         first_ok < C ? first_ok : 0, pb, cs % bs);
    }
  }
  // ---- the output: rotated back (o R^T) and written to the engine's rows
  store_outputs(out32.data(), B, Hq, S.rot, S.out, S.o_rs, S.o_hs, S.edt);
  return 0;
}

// The transformers layer's decode step (LStep above). Returns 0, or: 8 a new key or value
// that is NaN or Inf (nothing is written), 6 an unknown dtype.
template <int KB, int VB>
int layer_step(const LStep& S, const Params& base) {
  const int64_t B = base.B, Hkv = base.Hkv, rep = base.rep, Hq = Hkv * rep;
  const int64_t Tk = base.Tk, Tf = S.at + 1, ns = S.ns, total = Tk + Tf;
  if (S.edt < 0 || S.edt > 2) return 6;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int64_t d = 0; d < Dk; ++d)
        if (!std::isfinite(load_e(S.k, b * S.k_bs + h * S.k_hs + d, S.edt))) return 8;
      for (int64_t d = 0; d < Dv; ++d)
        if (!std::isfinite(load_e(S.v, b * S.v_bs + h * S.v_hs + d, S.edt))) return 8;
    }
  // ---- append: the key as given (pre-RoPE), the value rotated (v R), to index `at`
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hkv; ++h) {
      SType* fk = (SType*)base.fk + b * base.fk_sb + h * base.fk_sh + S.at * Dk;
      SType* fv = (SType*)base.fv + b * base.fv_sb + h * base.fv_sh + S.at * Dv;
      for (int64_t d = 0; d < Dk; ++d)
        fk[d] = to_store(load_e(S.k, b * S.k_bs + h * S.k_hs + d, S.edt));
      alignas(64) float vr[Dv];
      for (int64_t d = 0; d < Dv; ++d) vr[d] = load_e(S.v, b * S.v_bs + h * S.v_hs + d, S.edt);
      if (S.rot) rotate_value(vr, S.rot);
      for (int64_t d = 0; d < Dv; ++d) fv[d] = to_store(vr[d]);
    }
  if (S.fpos) S.fpos[S.at] = S.newpos;
  // ---- visibility: held token j is fp token j (< ns), packed token j - ns, or fp token
  // j - Tk; the mask covers the last mask_n held tokens (earlier ones hidden)
  std::vector<int64_t> plo(B, S.plo), phi(B, Tk);
  std::vector<float> fmask, pmask;
  Params P = base;
  if (S.mask) {
    const int64_t off = total - S.mask_n;
    auto seen = [&](int64_t b, int64_t j) {
      const int64_t c = j - off;
      return c >= 0 && c < S.mask_n && ((S.mask[b * S.mask_bs + c] != 0) != (S.mask_inv != 0));
    };
    fmask.assign(B * Tf, 0.f);
    bool runs = true;  // every row's visible packed tokens one run up to the body's end
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < Tf; ++i)
        if (!seen(b, i < ns ? i : Tk + i)) fmask[b * Tf + i] = NEG_INF;
      int64_t lo = Tk;
      while (lo > plo[b] && seen(b, ns + lo - 1)) --lo;
      for (int64_t t = plo[b]; t < lo && runs; ++t) runs = !seen(b, ns + t);
      plo[b] = lo;
    }
    if (!runs) {  // a mask with holes in the body: read as an additive mask
      pmask.assign(B * Tk, 0.f);
      for (int64_t b = 0; b < B; ++b) {
        plo[b] = S.plo;
        for (int64_t t = 0; t < Tk; ++t)
          if (!seen(b, ns + t)) pmask[b * Tk + t] = NEG_INF;
      }
      P.mask = pmask.data(); P.m0 = Tk; P.m1 = 0; P.m2 = 0; P.m3 = 1;
    }
    P.fmask = fmask.data(); P.f0 = Tf; P.f1 = 0; P.f2 = 0; P.f3 = 1;
  }
  std::vector<float> qs(B * Hq * Dk), out32(B * Hq * Dv), lse(B * Hq);
  load_queries(S.q, B, Hq, S.q_bs, S.q_hs, S.edt, S.scale, qs.data());
  P.Tq = 1;
  P.Tf = Tf;
  P.fpos = S.fpos;
  P.fpos_sb = 0;
  P.kpos = nullptr;
  P.plo = plo.data();
  P.phi = phi.data();
  P.nthreads = B * total >= S.threads_from ? S.nthreads : 1;
  P.q = qs.data();
  P.out = out32.data();
  P.lse = lse.data();
  run<KB, VB>(P);
  // ---- the output: rotated back (o R^T), in the engine's dtype
  store_outputs(out32.data(), B, Hq, S.rot, S.out, S.o_bs, S.o_hs, S.edt);
  return 0;
}

}  // namespace

// One instance per library, specialised by -D: bits, group sizes and head dims, so that every
// inner loop has a compile-time trip count. Returns 1 (nothing run) for a Params this library
// was not built for: a null stab says "no 8-bit metadata", but which of keys and values has
// it is the caller's to match (cpu_ext.load with km8/vm8); a null vcb says "no VQ values".
static bool built_for(const Params* P, int kbits, int vbits) {
  return kbits == KVP_KB && vbits == KVP_VB && P->Dk == KVP_DK && P->Dv == KVP_DV &&
         P->sdt == KVP_SDT && (P->klut != nullptr) == KLUT && (P->vlut != nullptr) == VLUT &&
         (P->stab != nullptr) == (KM8 || VM8) && (P->vcb != nullptr) == (VVQ > 0) &&
         P->Gk == KVP_GK && P->Gv == KVP_GV && (P->rope_style == 0 || P->half == KVP_HALF);
}

extern "C" int kvp_packed_attention(const Params* P, int kbits, int vbits) {
  if (!built_for(P, kbits, vbits)) return 1;
  run<KVP_KB, KVP_VB>(*P);
  return 0;
}

// Pack n chunks (Step::C tokens each, every row in the storage type, the head dim
// contiguous) into blocks blk[i] at token offsets off[i]: chunk i's head h, token r at
// k + i * k_sn + h * k_sh + r * k_sr elements (v likewise). Uniform levels only (the caller
// checks, as for Step::pack). Returns 0, 5 a block outside the pages, 7 an offset that is
// not a whole chunk inside a block; nothing is written unless every chunk is valid.
extern "C" int kvp_pack_chunks(const Step* S, const Params* P, int kbits, int vbits,
                               const void* k, int64_t k_sn, int64_t k_sh, int64_t k_sr,
                               const void* v, int64_t v_sn, int64_t v_sh, int64_t v_sr,
                               int64_t n, const int64_t* blk, const int64_t* off) {
  if (!built_for(P, kbits, vbits)) return 1;
  for (int64_t i = 0; i < n; ++i) {
    if (blk[i] < 0 || blk[i] >= S->num_blocks) return 5;
    if (off[i] < 0 || off[i] % S->C || off[i] + S->C > S->bs) return 7;
  }
  for (int64_t i = 0; i < n; ++i)
    pack_chunk<KVP_KB, KVP_VB>(*S, *P, (const SType*)k + i * k_sn, (const SType*)v + i * v_sn,
                               k_sh, k_sr, v_sh, v_sr, 0, blk[i], off[i]);
  return 0;
}

// The fused decode step (Step above): `P` holds the layer's fixed fields (the packed fields
// as pages, specs' tables, rotary table, soft-cap); the step's fill the rest.
extern "C" int kvp_paged_step(const Step* S, const Params* P, int kbits, int vbits) {
  if (!built_for(P, kbits, vbits) || (S->rope_rows > 0) != (P->rope_style != 0)) return 1;
  return step<KVP_KB, KVP_VB>(*S, *P);
}

// The transformers layer's decode step (LStep above): `P` holds the layer's fields.
extern "C" int kvp_layer_step(const LStep* S, const Params* P, int kbits, int vbits) {
  if (!built_for(P, kbits, vbits) || (S->fpos != nullptr) != (P->rope_style != 0)) return 1;
  return layer_step<KVP_KB, KVP_VB>(*S, *P);
}

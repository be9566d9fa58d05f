// moet W2 MoE kernels: route -> w13 (gate/up, SiLU * up, re-quantization) -> w2 (down) -> combine.
//
// The portable int8 mma.sync path (design.md, Kernels): weights are 2-bit codes {-4,-1,+1,+4} with
// a UE8M0 scale per 32 along K, decoded to int8 by one PRMT per 4 weights; activations are int8
// with a float32 scale per token and chunk of 128 along K.
//
// Promotion once per 128 ("fold"): lane group t of the mma owns the 32-block t of each chunk, and
// where a row's four block exponents b_j lie within 4 of their minimum b_min, its level table is
// (-4v, -v, v, 4v) with v = 2^(b_t - b_min) <= 16: exact int8 levels, so the chunk's four k-tiles
// accumulate in the mma's int32 C operand and one FADD + FFMA per accumulator promotes the chunk
// with 2^(b_min - 127) * activation scale. Row tiles where some row spreads wider (or holds a zero
// scale) are flagged by the packer and take the exact slow path: one promotion per 32-block.
//
// Weights are read in the kernel-native layout of moet_kernels.layout (NativeRowLayout, v2): for
// each group of 64 rows and each chunk of 128 along K, 4 row tiles x 32 lanes x 16 bytes, so a
// warp's 16-byte loads stream one contiguous 2 KiB piece; lane L's 32-bit word for k-tile tt holds
// the 16 codes of its mma A fragment. Activations are int8 rows in natural order: lane t's 32
// bytes of a chunk are exactly its 32-block's B fragments.
//
// The FP4 recovery tiers have their own GEMMs (fp4r / MXFP4: e2m1 with the same fold; NVFP4: a
// promotion per 16-block), sharing route, requant and combine. A job is 8 pairs (one mma n-tile)
// or, for prefill, 16 (two n-tiles per decoded fragment: the _t16 GEMMs).
//
// Everything is graph-capturable: fixed buffers sized for the worst case, the job count read on
// the device, persistent grids that stride over (job, row group) work items. Results do not
// depend on the grid size: every sum has a fixed order (split-K partials reduced warp 0..3, the
// top-k sum in slot order).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

constexpr int TOK = 8;       // pairs per mma n-tile (the mma's N); a job holds 1 or 2 tiles
constexpr int KCHUNK = 128;  // K per chunk: 4 k-tiles of 32, one 16-byte load per lane
constexpr int WARPS = 4;     // split-K warps per CTA
constexpr int THREADS = WARPS * 32;
constexpr int CODE_CHUNK = 2048;  // W2 code bytes per (64-row group, K chunk); FP4: twice
constexpr int SCALE_CHUNK = 264;  // scale bytes per (64-row group, K chunk): words, then flags
constexpr int SLOW_FLAGS = 256;   // byte rt of the 4 after the words: row tile rt is slow
constexpr uint32_t LEVELS = 0x0401FFFCu;  // int8 levels by code: -4, -1, +1, +4
// FP4 (e2m1: sign bit 3, magnitude index 0..7): int8 levels 2 * e2m1 by magnitude index
constexpr uint32_t FP4_LO = 0x03020100u;  // 0, 1, 2, 3
constexpr uint32_t FP4_HI = 0x0C080604u;  // 4, 6, 8, 12
constexpr int ROUTE_THREADS = 256;
// CTAs per SM the register budget of the GEMM kernels is sized for: W2 3 (up to 170 registers,
// no spills on any target; on the H200, 4 CTAs with single-buffered chunks, and 4 with chunks
// staged in shared memory by cp.async, were both slower: docs/kernels.md); FP4 (and NVFP4) 2
// (twice the code registers per chunk: at 3 its ping-pong spills). Each can be set at build time
// (-D) for an A/B run (bench/probes/chain_probe.py with MOET_NVCC_FLAGS; w2 alone at 4, which
// takes batch 1's work items in one round instead of two, was no faster: docs/kernels-design.md).
#ifndef GEMM_BLOCKS
#define GEMM_BLOCKS 3
#endif
#ifndef GEMM_BLOCKS_FP4
#define GEMM_BLOCKS_FP4 2
#endif
// Warps that share one work item's K (chunks part, part + SPLIT, ...); a CTA takes WARPS / SPLIT
// items at a time. Build knobs for an A/B run (chain_probe.py --variant).
#ifndef W13_SPLIT
#define W13_SPLIT 4
#endif
#ifndef W2_SPLIT
#define W2_SPLIT 2
#endif
constexpr int MAX_EXPERTS = 1024;

__device__ __forceinline__ uint4 ld_stream16(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t ld_stream4(const uint8_t* p) {
  uint32_t v;
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ uint2 ld_stream8(const uint8_t* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];"
               : "=r"(v.x), "=r"(v.y)
               : "l"(p));
  return v;
}

// Programmatic dependent launch (sm_90+; the loader launches every kernel with it): a kernel may
// be scheduled while its predecessor in the stream drains, so its launch and CTA set-up overlap
// that tail. It waits for the predecessor's completion (and memory) before touching any global
// memory, then lets its own successor be scheduled. Launched without PDL, both are no-ops.
__device__ __forceinline__ void pdl_enter() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// UE8M0 byte i of a word -> 2^(b-127) as float32. b = 0 (2^-127) reads as 0; the packer refuses
// b = 255 (NaN), so neither special case costs an instruction here.
__device__ __forceinline__ float ue8m0(uint32_t w, int i) {
  // byte 0: one shift, the next byte's low bit lands in the sign and fabsf (free on the FMUL) drops
  // it
  if (i == 0) return fabsf(__uint_as_float(w << 23));
  return __uint_as_float(((w >> (8 * i)) & 0xFFu) << 23);
}

// The int32 sums start from the bits of 1.5 * 2^23 (MAGIC): a chunk's |sum| <= 128 * 64 * 127
// < 2^22, so the result's bits read as a float are exactly 1.5 * 2^23 + sum, and one FADD
// recovers the sum. That keeps the int -> float conversion off the slow conversion pipe (I2F).
constexpr uint32_t MAGIC_BITS = 0x4B400000u;
constexpr float MAGIC = 12582912.f;

// c += A (16 x 32 int8) * B (32 x 8 int8), int32.
__device__ __forceinline__ void mma_s8(uint32_t (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                       uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// A work item's activation columns, per n-tile n of its job: the int8 row of column g (token of
// pair 8n + g), the activation scales of columns 2tig and 2tig + 1 and their pairs (where the
// epilogue writes). An empty slot reads the rows of the job's first pair (never empty), so the
// loads need no predicate and no zeroed registers: its column's sums are computed and never
// written (an mma's column n depends on column n of B alone).
template <int NT>
struct Cols {
  const int8_t* act_g[NT];
  const float* as0[NT];
  const float* as1[NT];
  int p0[NT], p1[NT];  // the pairs of columns 2tig and 2tig + 1 (-1: empty)
};

// One K chunk's operands for one warp: codes and scale words of the 4 row tiles (rows g, g+8),
// the slow-tile flags, and per n-tile the activation fragments of column g (its 32-block tig)
// and the chunk's activation scales of columns 2*tig and 2*tig+1.
// CW: 16-byte code pieces per lane (W2: 1 per row tile; FP4: 2, the lane's 32 bytes).
// NT: n-tiles per job (1; 2 for prefill jobs of 16 pairs, where one decode feeds two mmas).
template <int CW, int NT>
struct ChunkT {
  static constexpr int kTiles = NT;
  static constexpr int kCodeBytes = CODE_CHUNK * CW / 4;  // per (64-row group, K chunk)
  static constexpr int kScaleHead = 0;                    // scale bytes per group before chunk 0
  static constexpr int kScaleBytes = SCALE_CHUNK;         // per (64-row group, K chunk)
  static constexpr int kPieces = CW / 4;                  // 16-byte code pieces per row tile
  // a lane's first scale word (row g of row tile 0) and activation byte (its 32-block tig)
  __device__ static int scale_lane(int g, int) { return g * 8; }
  __device__ static int act_lane(int tig) { return tig * 32; }
  uint4 cw[CW];
  uint2 sw[4];
  uint32_t slow;
  uint4 b_lo[NT], b_hi[NT];
  float x0[NT], x1[NT];
};
template <int NT>
using Chunk = ChunkT<4, NT>;
template <int NT>
using ChunkFp4 = ChunkT<8, NT>;

// A warp's read positions in a work item: its lane's addresses at its current chunk, stepped by
// a constant once per loop iteration, the chunks ahead read at immediate offsets from them. The
// loop then computes no 64-bit address from the chunk index (about 24 instructions a chunk
// before: docs/kernels-design.md).
template <class K>
struct Cursor {
  static constexpr int NT = K::kTiles;
  const uint8_t* code;   // the lane's first code piece
  const uint8_t* scale;  // the lane's first scale word
  const uint8_t* chunk;  // the chunk's scale record (the slow-tile flags)
  const int8_t* act[NT];
  const float* as0[NT];
  const float* as1[NT];
  __device__ __forceinline__ Cursor(const uint8_t* codes, const uint8_t* scales,
                                    const Cols<NT>& cols, int c, int lane) {
    const int g = lane >> 2, tig = lane & 3;
    code = codes + (size_t)c * K::kCodeBytes + lane * K::kPieces * 16;
    chunk = scales + (size_t)c * K::kScaleBytes;
    scale = chunk + K::scale_lane(g, tig);
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      act[n] = cols.act_g[n] + c * KCHUNK + K::act_lane(tig);
      as0[n] = cols.as0[n] + c;
      as1[n] = cols.as1[n] + c;
    }
  }
  template <int C>
  __device__ __forceinline__ void step() {
    code += C * K::kCodeBytes;
    scale += C * K::kScaleBytes;
    chunk += C * K::kScaleBytes;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      act[n] += C * KCHUNK;
      as0[n] += C;
      as1[n] += C;
    }
  }
};

// Loads the chunk D chunks past the cursor's.
template <int D, int CW, int NT>
__device__ __forceinline__ void load_chunk(ChunkT<CW, NT>& k, const Cursor<ChunkT<CW, NT>>& at) {
  using K = ChunkT<CW, NT>;
  constexpr int PER = K::kPieces;
  const uint8_t* cc = at.code + D * K::kCodeBytes;
#pragma unroll
  for (int q = 0; q < CW; ++q) k.cw[q] = ld_stream16(cc + (q / PER) * 512 * PER + (q % PER) * 16);
  const uint8_t* sc = at.scale + D * K::kScaleBytes;
#pragma unroll
  for (int rt = 0; rt < 4; ++rt) k.sw[rt] = ld_stream8(sc + rt * 64);
  k.slow = ld_stream4(at.chunk + D * K::kScaleBytes + SLOW_FLAGS);
  // FP4 levels are 2 * e2m1: their half scale goes with the activation scale (exact)
  constexpr float HALF = CW == 8 ? 0.5f : 1.f;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const uint4* p = reinterpret_cast<const uint4*>(at.act[n] + D * KCHUNK);
    k.b_lo[n] = p[0];
    k.b_hi[n] = p[1];
    k.x0[n] = HALF * at.as0[n][D];
    k.x1[n] = HALF * at.as1[n][D];
  }
}

// The B fragment (b0, b1) of n-tile n for k-tile tt: column g's activations of its 32-block.
template <int CW, int NT>
__device__ __forceinline__ uint2 b_frag(const ChunkT<CW, NT>& k, int n, int tt) {
  const uint4& v = tt < 2 ? k.b_lo[n] : k.b_hi[n];
  return make_uint2(word_of(v, (tt & 1) * 2), word_of(v, (tt & 1) * 2 + 1));
}

__device__ __forceinline__ uint32_t prmt(uint32_t lo, uint32_t hi, uint32_t sel) {
  uint32_t d;  // selector nibble bit 3 set: the selected byte's sign, replicated
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(lo), "r"(hi), "r"(sel));
  return d;
}

// Decodes the A fragment of row tile rt, k-tile tt with the level tables tab (row g) and tab8
// (row g+8), once, and accumulates its mma with every n-tile's activations into acc[n]. A PRMT
// selector nibble's bit 2 picks the second source (the same table: don't care), bit 3 must be
// clear. prmt.b32 ignores the selector's upper half, so `lo >> 16` needs no mask (through
// __byte_perm the compiler adds one per selector: two more integer ops per 16 codes).
template <int NT>
__device__ __forceinline__ void tile_mma(uint32_t (&acc)[NT][4], const Chunk<NT>& k, int rt, int tt,
                                         uint32_t tab, uint32_t tab8) {
  const uint32_t w = word_of(k.cw[rt], tt);
  const uint32_t lo = w & 0x77777777u, hi = (w >> 2) & 0x77777777u;
  const uint32_t a0 = prmt(tab, tab, lo), a1 = prmt(tab8, tab8, hi);
  const uint32_t a2 = prmt(tab, tab, lo >> 16), a3 = prmt(tab8, tab8, hi >> 16);
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const uint2 b = b_frag(k, n, tt);
    mma_s8(acc[n], a0, a1, a2, a3, b.x, b.y);
  }
}

// f[n][rt][0..3] += d[n] x the scales of rows g / g+8 (s, s8) and of columns 2tig / 2tig+1, where
// d[n] holds the chunk's sums of rows g (0, 1) and g+8 (2, 3) for n-tile n's two columns.
template <class K>
__device__ __forceinline__ void promote(float (&f)[K::kTiles][4][4], int rt,
                                        const float (&d)[K::kTiles][4], float s, float s8,
                                        const K& k) {
#pragma unroll
  for (int n = 0; n < K::kTiles; ++n) {
    f[n][rt][0] = fmaf(d[n][0], s * k.x0[n], f[n][rt][0]);
    f[n][rt][1] = fmaf(d[n][1], s * k.x1[n], f[n][rt][1]);
    f[n][rt][2] = fmaf(d[n][2], s8 * k.x0[n], f[n][rt][2]);
    f[n][rt][3] = fmaf(d[n][3], s8 * k.x1[n], f[n][rt][3]);
  }
}

// The int32 sums (biased by MAGIC) as floats: one FADD each.
template <int NT>
__device__ __forceinline__ void unbias(float (&d)[NT][4], const uint32_t (&acc)[NT][4]) {
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) d[n][i] = __uint_as_float(acc[n][i]) - MAGIC;
}

template <int NT>
__device__ __forceinline__ void set_bias(uint32_t (&acc)[NT][4]) {
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[n][i] = MAGIC_BITS;
}

// The level table (-4v, -v, v, 4v) of this lane's 32-block from a fast tile's word, whose bits
// 5j..5j+4 hold v_j = 2^(b_j - b_min) (1 <= v <= 16 keeps every level an int8).
__device__ __forceinline__ uint32_t fast_table(uint32_t word, int tig) {
  return ((word >> (5 * tig)) & 31u) * 0x0400FEFCu + 0x10100u;
}

// f[n][rt][0..3] += rows g / g+8 of row tile rt x columns 2tig / 2tig+1 of n-tile n, over one
// chunk. Fast tiles: the chunk's 4 k-tiles accumulate in int32 and one promotion applies
// 2^(b_min - 127) (a fast word's bits 23..30 hold b_min, so masking them gives the float) times
// the activation scale. When no tile of the chunk is slow (the common case) the 4 row tiles' mma
// chains run interleaved. A slow tile's words are the 4 raw scale bytes: one pass per 32-block j,
// where only lane group j's table is non-zero, promoted with that block's scales (a byte of 0
// reads as 0).
template <int NT>
__device__ __forceinline__ void mma_chunk(float (&f)[NT][4][4], const Chunk<NT>& k, int tig) {
  float d[NT][4];
  if (k.slow == 0) {
    uint32_t acc[4][NT][4];
#pragma unroll
    for (int rt = 0; rt < 4; ++rt) set_bias(acc[rt]);
#pragma unroll
    for (int tt = 0; tt < 4; ++tt)
#pragma unroll
      for (int rt = 0; rt < 4; ++rt)
        tile_mma(acc[rt], k, rt, tt, fast_table(k.sw[rt].x, tig), fast_table(k.sw[rt].y, tig));
#pragma unroll
    for (int rt = 0; rt < 4; ++rt) {
      unbias(d, acc[rt]);
      promote(f, rt, d, __uint_as_float(k.sw[rt].x & 0x7F800000u),
              __uint_as_float(k.sw[rt].y & 0x7F800000u), k);
    }
    return;
  }
#pragma unroll
  for (int rt = 0; rt < 4; ++rt) {
    const uint32_t wg = k.sw[rt].x, wg8 = k.sw[rt].y;
    uint32_t acc[NT][4];
    if (!((k.slow >> (8 * rt)) & 1u)) {
      set_bias(acc);
#pragma unroll
      for (int tt = 0; tt < 4; ++tt)
        tile_mma(acc, k, rt, tt, fast_table(wg, tig), fast_table(wg8, tig));
      unbias(d, acc);
      promote(f, rt, d, __uint_as_float(wg & 0x7F800000u), __uint_as_float(wg8 & 0x7F800000u), k);
      continue;
    }
#pragma unroll 1
    for (int j = 0; j < 4; ++j) {
      const uint32_t tab = tig == j ? LEVELS : 0u;
      set_bias(acc);
#pragma unroll
      for (int tt = 0; tt < 4; ++tt) tile_mma(acc, k, rt, tt, tab, tab);
      unbias(d, acc);
      promote(f, rt, d, ue8m0(wg, j), ue8m0(wg8, j), k);
    }
  }
}

// FP4 level tables of rows g and g+8: (lo, hi) bytes by magnitude index, all below 0x80.
struct Fp4Tables {
  uint32_t lo, hi, lo8, hi8;
};

// FP4 row tile rt, k-tile tt: the lane's words 2tt (row g) and 2tt+1 (row g+8) hold, per 16-bit
// half, one A register's four e2m1 codes. The positive weights are PRMT(table, code): a code with
// the sign bit set selects its magnitude in sign-replicate mode, which gives 0 (every table byte
// is below 0x80); the negative ones are the same with the sign bits flipped. So W x = P x - N x,
// two mma chains (pos, neg) per n-tile, and no per-byte negation.
template <int NT>
__device__ __forceinline__ void fp4_tile_mma(uint32_t (&pos)[NT][4], uint32_t (&neg)[NT][4],
                                             const ChunkFp4<NT>& k, int rt, int tt,
                                             const Fp4Tables& t) {
  const uint4& q = k.cw[2 * rt + (tt >> 1)];
  const uint32_t w = word_of(q, (tt & 1) * 2), w8 = word_of(q, (tt & 1) * 2 + 1);
  const uint32_t n = w ^ 0x88888888u, n8 = w8 ^ 0x88888888u;
  const uint32_t p0 = prmt(t.lo, t.hi, w), p1 = prmt(t.lo8, t.hi8, w8);
  const uint32_t p2 = prmt(t.lo, t.hi, w >> 16), p3 = prmt(t.lo8, t.hi8, w8 >> 16);
  const uint32_t n0 = prmt(t.lo, t.hi, n), n1 = prmt(t.lo8, t.hi8, n8);
  const uint32_t n2 = prmt(t.lo, t.hi, n >> 16), n3 = prmt(t.lo8, t.hi8, n8 >> 16);
#pragma unroll
  for (int c = 0; c < NT; ++c) {
    const uint2 b = b_frag(k, c, tt);
    mma_s8(pos[c], p0, p1, p2, p3, b.x, b.y);
    mma_s8(neg[c], n0, n1, n2, n3, b.x, b.y);
  }
}

// P - N as floats: both sums are biased by MAGIC, so one FADD each.
template <int NT>
__device__ __forceinline__ void difference(float (&d)[NT][4], const uint32_t (&pos)[NT][4],
                                           const uint32_t (&neg)[NT][4]) {
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) d[n][i] = __uint_as_float(pos[n][i]) - __uint_as_float(neg[n][i]);
}

// The FP4 tiers' chunk: as for W2 (same scale words; the packer keeps fast tiles within a spread
// of 3, so v <= 8 and 12 v <= 96 fits an int8), with P/N mma chains per row tile.
template <int NT>
__device__ __forceinline__ void mma_chunk(float (&f)[NT][4][4], const ChunkFp4<NT>& k, int tig) {
  float d[NT][4];
#pragma unroll
  for (int rt = 0; rt < 4; ++rt) {
    const uint32_t wg = k.sw[rt].x, wg8 = k.sw[rt].y;
    uint32_t pos[NT][4], neg[NT][4];
    if (!((k.slow >> (8 * rt)) & 1u)) {
      const uint32_t v = (wg >> (5 * tig)) & 31u, v8 = (wg8 >> (5 * tig)) & 31u;
      const Fp4Tables t = {v * FP4_LO, v * FP4_HI, v8 * FP4_LO, v8 * FP4_HI};
      set_bias(pos);
      set_bias(neg);
#pragma unroll
      for (int tt = 0; tt < 4; ++tt) fp4_tile_mma(pos, neg, k, rt, tt, t);
      difference(d, pos, neg);
      promote(f, rt, d, __uint_as_float(wg & 0x7F800000u), __uint_as_float(wg8 & 0x7F800000u), k);
      continue;
    }
#pragma unroll 1
    for (int j = 0; j < 4; ++j) {
      const uint32_t lo = tig == j ? FP4_LO : 0u, hi = tig == j ? FP4_HI : 0u;
      const Fp4Tables t = {lo, hi, lo, hi};
      set_bias(pos);
      set_bias(neg);
#pragma unroll
      for (int tt = 0; tt < 4; ++tt) fp4_tile_mma(pos, neg, k, rt, tt, t);
      difference(d, pos, neg);
      promote(f, rt, d, ue8m0(wg, j), ue8m0(wg8, j), k);
    }
  }
}

// NVFP4 (fp4x-nvfp4): e2m1 codes, an e4m3 scale per 16 along K, a float32 scale_2 per row. The
// e4m3 scales do not fold into int8 levels (2 e2m1 times a 4-bit mantissa reaches 180), so each
// k16 tile of the native layout is one 16-block of every row: its sum (one mma, mma_chunk) is
// promoted with that block's scales of rows g and g+8 into float32 per chunk, the chunk's
// activation scale follows, and scale_2 once per row at the end of the work item (scale_rows).
struct Nvfp4Chunk {
  static constexpr int kTiles = 1;  // one n-tile: two would spill (no prefill variant)
  static constexpr int kCodeBytes = 2 * CODE_CHUNK;
  static constexpr int kScaleHead = 256;   // the group's 64 float32 scale_2, before its chunks
  static constexpr int kScaleBytes = 512;  // 4 row tiles x 8 lane groups x 8 blocks x 2 rows
  static constexpr int kPieces = 2;        // 16-byte code pieces per row tile
  __device__ static int scale_lane(int g, int tig) { return tig * 128 + g * 16; }
  __device__ static int act_lane(int tig) { return 4 * tig; }
  uint4 cw[8];    // row tile rt, k16 tile kt: cw[2rt + kt / 4], word kt % 4
  uint4 sw;       // row tile tig (the quad shares them): byte 2kt + j: row g + 8j, block kt
  uint32_t b[8];  // k16 tile kt: k 16kt + 4tig .. + 3 of column g
  float x0, x1;
};

template <int D>
__device__ __forceinline__ void load_chunk(Nvfp4Chunk& k, const Cursor<Nvfp4Chunk>& at) {
  const uint8_t* cc = at.code + D * Nvfp4Chunk::kCodeBytes;
#pragma unroll
  for (int q = 0; q < 8; ++q) k.cw[q] = ld_stream16(cc + (q / 2) * 1024 + (q % 2) * 16);
  k.sw = ld_stream16(at.scale + D * Nvfp4Chunk::kScaleBytes);
  const int8_t* act = at.act[0] + D * KCHUNK;
#pragma unroll
  for (int kt = 0; kt < 8; ++kt) k.b[kt] = *reinterpret_cast<const uint32_t*>(act + 16 * kt);
  k.x0 = 0.5f * at.as0[0][D];  // levels are 2 * e2m1
  k.x1 = 0.5f * at.as1[0][D];
}

// Byte j of a scale half-word as float32: the e4m3's 7 magnitude bits (the packer refuses a
// sign) shifted into a float32's top exponent and mantissa bits, times 2^(127 - 7), is exact for
// normals and subnormals (a subnormal e4m3 lands on a float32 subnormal).
__device__ __forceinline__ float e4m3(uint32_t half_word, int j) {
  return __uint_as_float(((half_word >> (8 * j)) & 0x7Fu) << 20) * 0x1p120f;
}

// Four int8 lanes negated (|v| <= 127: no lane is -128): the low 7 bits of ~v plus 1 carry at
// most into bit 7, whose sum bit is then ~v's bit 7 xor that carry.
__device__ __forceinline__ uint32_t neg_s8x4(uint32_t v) {
  return ((~v & 0x7F7F7F7Fu) + 0x01010101u) ^ (~v & 0x80808080u);
}

// One mma.m16n8k32 per (row tile, block): k 0..15 are the block's positive weights P against the
// activations, k 16..31 its negative ones N (sign bits flipped, as in fp4_tile_mma) against the
// negated activations, so the int32 sum is P x - N x, biased by MAGIC for the FADD.
__device__ __forceinline__ void mma_chunk(float (&f)[1][4][4], const Nvfp4Chunk& k, int) {
  const int quad = (threadIdx.x & 31) & ~3;
  uint32_t nb[8];
#pragma unroll
  for (int kt = 0; kt < 8; ++kt) nb[kt] = neg_s8x4(k.b[kt]);
#pragma unroll
  for (int rt = 0; rt < 4; ++rt) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    uint32_t sw = 0;  // row tile rt's scales of blocks kt and kt + 1, from lane tig = rt
#pragma unroll
    for (int kt = 0; kt < 8; ++kt) {
      if (!(kt & 1)) sw = __shfl_sync(0xffffffffu, word_of(k.sw, kt >> 1), quad | rt);
      const uint32_t w = word_of(k.cw[2 * rt + (kt >> 2)], kt & 3), n = w ^ 0x88888888u;
      uint32_t d[4] = {MAGIC_BITS, MAGIC_BITS, MAGIC_BITS, MAGIC_BITS};
      mma_s8(d, prmt(FP4_LO, FP4_HI, w), prmt(FP4_LO, FP4_HI, w >> 16), prmt(FP4_LO, FP4_HI, n),
             prmt(FP4_LO, FP4_HI, n >> 16), k.b[kt], nb[kt]);
      const uint32_t half_word = sw >> (16 * (kt & 1));
      const float s = e4m3(half_word, 0), s8 = e4m3(half_word, 1);
#pragma unroll
      for (int i = 0; i < 4; ++i)
        acc[i] = fmaf(__uint_as_float(d[i]) - MAGIC, i < 2 ? s : s8, acc[i]);
    }
    f[0][rt][0] = fmaf(acc[0], k.x0, f[0][rt][0]);
    f[0][rt][1] = fmaf(acc[1], k.x1, f[0][rt][1]);
    f[0][rt][2] = fmaf(acc[2], k.x0, f[0][rt][2]);
    f[0][rt][3] = fmaf(acc[3], k.x1, f[0][rt][3]);
  }
}

// NVFP4's per-row scale_2 (the group's scale head: 64 float32 in group row order) on a reduced
// item: f[n][rt][j] is row 16rt + g + 8(j / 2). Other chunk types have no head and no row scale.
template <class K>
__device__ __forceinline__ void scale_rows(float (&f)[K::kTiles][4][4], const uint8_t* group_scales,
                                           int g) {
  if constexpr (K::kScaleHead > 0) {
    const float* s2 = reinterpret_cast<const float*>(group_scales);
#pragma unroll
    for (int rt = 0; rt < 4; ++rt)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float v = s2[16 * rt + g + 8 * (j >> 1)];
#pragma unroll
        for (int n = 0; n < K::kTiles; ++n) f[n][rt][j] *= v;
      }
  }
}

// One warp's share (chunks warp, warp + 4, ...) of a 64-row x K tile product against the job's
// activation columns. f[n][rt][0..3]: rows rt*16 + g (0, 1) and + 8 (2, 3), columns 2*tig and
// 2*tig+1 of n-tile n. The next chunk's loads are issued before the current chunk's math (two
// chunks in flight).
template <class K, int S>
__device__ __forceinline__ void gemm64(float (&f)[K::kTiles][4][4], const uint8_t* codes,
                                       const uint8_t* scales, int nchunks,
                                       const Cols<K::kTiles>& cols, int part, int lane) {
#pragma unroll
  for (int n = 0; n < K::kTiles; ++n)
#pragma unroll
    for (int rt = 0; rt < 4; ++rt)
#pragma unroll
      for (int j = 0; j < 4; ++j) f[n][rt][j] = 0.f;
  if (part >= nchunks) return;
  K a, b;  // ping-pong: no register copies between iterations
  Cursor<K> at(codes, scales, cols, part, lane);
  load_chunk<0>(a, at);
#pragma unroll 1
  for (int c = part; c < nchunks; c += 2 * S) {
    if (c + S < nchunks) load_chunk<S>(b, at);
    mma_chunk(f, a, lane & 3);
    if (c + S >= nchunks) break;
    if (c + 2 * S < nchunks) load_chunk<2 * S>(a, at);
    mma_chunk(f, b, lane & 3);
    at.template step<2 * S>();
  }
}

// The S warps of a CTA that share one work item (S = 1, 2 or 4): team `slot` of the CTA's
// WARPS / S, this warp its part `part`; a barrier of the team alone (named barrier 1 + slot; the
// CTA's for S = WARPS), so teams run through their items independently.
template <int S>
struct Team {
  static_assert(S == 1 || S == 2 || S == WARPS, "a team is 1, 2 or all 4 warps");
  static constexpr int kSlots = WARPS / S;
  int slot, part;
  __device__ explicit Team(int warp) : slot(warp / S), part(warp % S) {}
  __device__ __forceinline__ void sync() const {
    if (S == WARPS)
      __syncthreads();
    else if (S == 2 && slot == 0)  // immediate barrier ids: ptxas reserves all 16 for a register
      asm volatile("bar.sync 1, 64;" ::: "memory");
    else if (S == 2)
      asm volatile("bar.sync 2, 64;" ::: "memory");
  }
};

// Sums the team's partials in part order into part 0's f (deterministic), which then scales and
// writes the item's outputs; `red` is the CTA's.
template <int S, int NT>
__device__ __forceinline__ void reduce_team(float (&f)[NT][4][4], float (*red)[16 * NT][32],
                                            const Team<S>& team, int lane) {
  if (S == 1) return;
  const int w0 = team.slot * S;
#pragma unroll
  for (int i = 0; i < 16 * NT; ++i) red[w0 + team.part][i][lane] = f[i >> 4][(i >> 2) & 3][i & 3];
  team.sync();
  if (team.part != 0) return;
#pragma unroll
  for (int i = 0; i < 16 * NT; ++i) {
    float v = red[w0][i][lane];
#pragma unroll
    for (int w = 1; w < S; ++w) v = __fadd_rn(v, red[w0 + w][i][lane]);
    f[i >> 4][(i >> 2) & 3][i & 3] = v;
  }
}

// Quantizes 32 values to int8 with one float32 scale, as reference.quantize_activations does:
// s = amax / 127, q = round-half-even(v / s), q = 0 when s = 0.
__device__ __forceinline__ int quant_one(float v, float s) {
  return s > 0.f ? __float2int_rn(__fdiv_rn(v, s)) : 0;
}

// One warp quantizes one chunk of 128 (lane: k = 4 lane .. 4 lane + 3) with one float32 scale, as
// reference.quantize_activations does; a chunk holding NaN gets s = NaN (fmaxf would drop it).
__device__ __forceinline__ void quantize_chunk(const float (&v)[4], int lane, int8_t* q_chunk,
                                               float* s_out) {
  float amax = 0.f;
  bool nan = false;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    amax = fmaxf(amax, fabsf(v[i]));
    nan |= v[i] != v[i];
  }
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    nan |= __shfl_xor_sync(0xffffffffu, (int)nan, o);
  }
  const float s = nan ? __int_as_float(0x7fc00000) : __fdiv_rn(amax, 127.f);
  uint32_t word = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) word |= (uint32_t)(uint8_t)(int8_t)quant_one(v[i], s) << (8 * i);
  reinterpret_cast<uint32_t*>(q_chunk)[lane] = word;
  if (lane == 0) *s_out = s;
}

// bf16/fp16/fp32 <-> float32; the narrowing conversions round to nearest even.
template <typename T>
__device__ __forceinline__ float to_f32(T v) {
  return static_cast<float>(v);
}
template <typename T>
__device__ __forceinline__ T from_f32(float v) {
  return T(v);
}

// Block-wide exclusive scan of one int per thread (ROUTE_THREADS threads); returns the total too.
__device__ int block_exclusive_scan(int v, int* total, int* warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    int n = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += n;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (threadIdx.x == 0) {
    int run = 0;
    for (int w = 0; w < ROUTE_THREADS / 32; ++w) {
      int s = warp_sums[w];
      warp_sums[w] = run;
      run += s;
    }
    *total = run;
  }
  __syncthreads();
  return warp_sums[warp] + incl - v;
}

// Block 0 for one token (a decode step of one sequence) whose top_k <= 32 picks are distinct
// experts: each resident pick is its own job, so warp 0 writes route's lists with shuffles and
// ballots, without the counting sort's block-wide passes and scans (same lists: jobs by tier,
// then by expert; the same flags, mask and miss count). Every warp of block 0 reads the picks and
// decides alike, so the block takes one path without a barrier; false: the general path runs.
__device__ __forceinline__ bool route_one_token(const int* ids, int top_k, const int* slot_table,
                                                const int* fp4_slot_table,
                                                const int* host_slot_table, int n_experts,
                                                const int* n_real, int* miss_count, uint8_t* routed,
                                                int job_shift, int* n_jobs, int* job_slot,
                                                int* job_pairs, uint8_t* pair_ok) {
  const unsigned all = 0xffffffffu;
  const int lane = threadIdx.x & 31, p = lane;
  const int raw = p < top_k ? ids[p] : -1;
  const int e = raw >= 0 && raw < n_experts ? raw : -1;
  const unsigned same = __match_any_sync(all, e);  // every lane: the mask names all 32
  if (!__all_sync(all, e < 0 || __popc(same) == 1)) return false;
  if (threadIdx.x >= 32) return true;
  int tier = 3, slot = -1;  // tier 3: no tier holds it (a miss)
  if (e >= 0) {
    const int s4 = fp4_slot_table ? fp4_slot_table[e] : -1, s2 = slot_table[e];
    const int sh = host_slot_table ? host_slot_table[e] : -1;
    tier = s4 >= 0 ? 0 : s2 >= 0 ? 1 : sh >= 0 ? 2 : 3;
    slot = s4 >= 0 ? s4 : s2 >= 0 ? s2 : sh;
  }
  const bool ok = tier < 3;
  const int key = ok ? tier * MAX_EXPERTS + e : 3 * MAX_EXPERTS;  // (tier, expert) order
  int job = 0;  // the resident picks before this one in that order
  for (int q = 0; q < top_k; ++q) job += __shfl_sync(all, key, q) < key;
  if (ok) {
    const int job_tok = 1 << job_shift;
    job_slot[job] = slot;
    job_pairs[job << job_shift] = p;
    for (int i = 1; i < job_tok; ++i) job_pairs[(job << job_shift) + i] = -1;
  }
  if (p < top_k) pair_ok[p] = ok;
  const bool real = p < min(*n_real, 1) * top_k && e >= 0;
  if (real) routed[e] = 1;
  const int misses = __popc(__ballot_sync(all, real && !ok));
  const int t0 = __popc(__ballot_sync(all, tier == 0)), t1 = __popc(__ballot_sync(all, tier == 1));
  const int t2 = __popc(__ballot_sync(all, tier == 2));
  if (lane == 0) {
    n_jobs[0] = 0;
    n_jobs[1] = t0;
    n_jobs[2] = t0 + t1;
    n_jobs[3] = t0 + t1 + t2;
    if (misses > 0) atomicAdd(miss_count, misses);
  }
  return true;
}

// Block 0: per-expert job lists (pairs of one resident expert in increasing pair order, 2^job_shift
// per job: 8, or 16 for prefill), pair flags, the miss counter and the routed mask. Blocks 1..:
// activation quantization. Up to three tiers, by preference: the FP4 pool (fp4_slot_table
// non-null), the device pool (slot_table), and rows of pinned host memory read in place
// (host_slot_table non-null: rows the GPU reads over the bus, no fetch, no replay); an expert no
// tier holds is a miss (design.md, Residency). Jobs are grouped by tier in that order: n_jobs =
// {0, FP4 jobs, + device jobs, + host jobs}, so tier t's jobs are [n_jobs[t], n_jobs[t + 1]) (the
// device and host tiers' W2 rows in one GEMM launch: JobRows); job_slot holds the slot (row) in
// that tier's pool. The job lists are a stable counting sort: counts with shared-memory atomics
// (their order does not matter), then tiles of 256 pairs placed by rank: a pair's place is the
// expert's pairs in earlier tiles + in earlier warps of this tile + in lower lanes of its warp
// (match_any).
template <typename T>
__device__ void route(const T* x, int n_tok, int hidden, int hidden_p, const int* ids, int top_k,
                      const int* slot_table, const int* fp4_slot_table, const int* host_slot_table,
                      int n_experts, const int* n_real, int* miss_count, uint8_t* routed,
                      int8_t* xq, float* xs, int job_shift, int* n_jobs, int* job_slot,
                      int* job_pairs, uint8_t* pair_ok) {
  const int job_tok = 1 << job_shift;
  pdl_enter();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  constexpr int WARPS_R = ROUTE_THREADS / 32;
  if (blockIdx.x == 0) {
    if (n_tok == 1 && top_k <= 32 &&
        route_one_token(ids, top_k, slot_table, fp4_slot_table, host_slot_table, n_experts, n_real,
                        miss_count, routed, job_shift, n_jobs, job_slot, job_pairs, pair_ok))
      return;
    constexpr int TIERS = 3;                 // FP4, device, host
    __shared__ int s_slot[MAX_EXPERTS];      // the chosen tier's slot, -1: not resident
    __shared__ uint8_t s_tier[MAX_EXPERTS];  // the chosen tier
    __shared__ int s_cnt[MAX_EXPERTS];       // pass 1: pairs per expert; pass 2: pairs placed
    __shared__ int s_base[MAX_EXPERTS];      // first job of each expert
    __shared__ uint8_t s_wcnt[WARPS_R][MAX_EXPERTS];  // this tile's pairs per (warp, expert)
    __shared__ int warp_sums[WARPS_R];
    __shared__ int s_total;
    constexpr int PER = MAX_EXPERTS / ROUTE_THREADS;  // experts owned by each thread
    const int n_pairs = n_tok * top_k;
    for (int e = tid; e < n_experts; e += ROUTE_THREADS) {
      const int s4 = fp4_slot_table ? fp4_slot_table[e] : -1, s2 = slot_table[e];
      const int sh = host_slot_table ? host_slot_table[e] : -1;
      s_tier[e] = s4 >= 0 ? 0 : s2 >= 0 ? 1 : 2;
      s_slot[e] = s4 >= 0 ? s4 : s2 >= 0 ? s2 : sh;
      s_cnt[e] = 0;
#pragma unroll
      for (int w = 0; w < WARPS_R; ++w) s_wcnt[w][e] = 0;
    }
    __syncthreads();
    for (int p = tid; p < n_pairs; p += ROUTE_THREADS) {  // pass 1: count
      const int e = ids[p];
      if (e >= 0 && e < n_experts) atomicAdd(&s_cnt[e], 1);
    }
    __syncthreads();
    const int e0 = tid * PER;
    int mine[TIERS] = {0, 0, 0};  // this thread's experts' jobs, by tier
#pragma unroll
    for (int q = 0; q < PER; ++q) {
      const int e = e0 + q;
      if (e >= n_experts || s_slot[e] < 0) continue;
      mine[s_tier[e]] += (s_cnt[e] + job_tok - 1) >> job_shift;
    }
    int next[TIERS];  // this thread's first job, by tier
    int first = 0;    // the tier's first job
#pragma unroll
    for (int t = 0; t < TIERS; ++t) {
      next[t] = first + block_exclusive_scan(mine[t], &s_total, warp_sums);
      first += s_total;
      if (tid == 0) n_jobs[t + 1] = first;
      __syncthreads();  // warp_sums and s_total are reused
    }
    if (tid == 0) n_jobs[0] = 0;
#pragma unroll
    for (int q = 0; q < PER; ++q) {
      const int e = e0 + q;
      if (e >= n_experts) break;
      const int base = next[s_tier[e]];
      const int nj = s_slot[e] >= 0 ? (s_cnt[e] + job_tok - 1) >> job_shift : 0;
      s_base[e] = base;
      for (int j = base; j < base + nj; ++j) {
        job_slot[j] = s_slot[e];
        for (int i = 0; i < job_tok; ++i) job_pairs[(j << job_shift) + i] = -1;
      }
      next[s_tier[e]] += nj;
    }
    __syncthreads();  // every expert's count is read before it is reset
    for (int e = tid; e < n_experts; e += ROUTE_THREADS) s_cnt[e] = 0;
    __syncthreads();
    for (int base = 0; base < n_pairs; base += ROUTE_THREADS) {  // pass 2: stable placement
      const int p = base + tid;
      const int raw = p < n_pairs ? ids[p] : -1;
      const int e = raw >= 0 && raw < n_experts ? raw : -1;
      const unsigned same = __match_any_sync(0xffffffffu, e);
      const int rank = __popc(same & ((1u << lane) - 1));
      if (e >= 0 && rank == 0) s_wcnt[warp][e] = (uint8_t)__popc(same);
      __syncthreads();
      if (e >= 0 && s_slot[e] >= 0) {
        int j = s_cnt[e] + rank;
        for (int w = 0; w < warp; ++w) j += s_wcnt[w][e];
        job_pairs[((s_base[e] + (j >> job_shift)) << job_shift) + (j & (job_tok - 1))] = p;
      }
      __syncthreads();
      if (e >= 0 && rank == 0) {
        atomicAdd(&s_cnt[e], __popc(same));
        s_wcnt[warp][e] = 0;
      }
      __syncthreads();
    }
    const int real = min(*n_real, n_tok) * top_k;
    int misses = 0;
    for (int p = tid; p < n_pairs; p += ROUTE_THREADS) {
      const int e = ids[p];
      const bool valid = e >= 0 && e < n_experts;
      const bool ok = valid && s_slot[e] >= 0;
      pair_ok[p] = ok;
      if (p < real && valid) {
        routed[e] = 1;
        misses += !ok;
      }
    }
    __syncthreads();  // warp_sums and s_total are reused
    block_exclusive_scan(misses, &s_total, warp_sums);
    if (tid == 0 && s_total > 0) atomicAdd(miss_count, s_total);
    return;
  }
  // Activation quantization: one warp per (token, chunk of 128); padding (k >= hidden) is zero.
  const int nchunk = hidden_p / KCHUNK;
  const int warps = (gridDim.x - 1) * (blockDim.x / 32);
  for (int item = (blockIdx.x - 1) * (blockDim.x / 32) + warp; item < n_tok * nchunk;
       item += warps) {
    const int t = item / nchunk, c = item % nchunk;
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int k = c * KCHUNK + 4 * lane + i;
      v[i] = k < hidden ? to_f32<T>(x[(size_t)t * hidden + k]) : 0.f;
    }
    quantize_chunk(v, lane, xq + (size_t)t * hidden_p + c * KCHUNK, xs + (size_t)t * nchunk + c);
  }
}

__device__ __forceinline__ float silu(float v) { return __fdiv_rn(v, 1.f + expf(-v)); }

}  // namespace

#define MOET_ROUTE(NAME, T)                                                                        \
  extern "C" __global__ void __launch_bounds__(ROUTE_THREADS) NAME(                                \
      const T* x, int n_tok, int hidden, int hidden_p, const int* ids, int top_k,                  \
      const int* slot_table, const int* fp4_slot_table, const int* host_slot_table, int n_experts, \
      const int* n_real, int* miss_count, uint8_t* routed, int8_t* xq, float* xs, int job_shift,   \
      int* n_jobs, int* job_slot, int* job_pairs, uint8_t* pair_ok) {                              \
    route<T>(x, n_tok, hidden, hidden_p, ids, top_k, slot_table, fp4_slot_table, host_slot_table,  \
             n_experts, n_real, miss_count, routed, xq, xs, job_shift, n_jobs, job_slot,           \
             job_pairs, pair_ok);                                                                  \
  }
MOET_ROUTE(moet_route_bf16, __nv_bfloat16)
MOET_ROUTE(moet_route_f16, __half)
MOET_ROUTE(moet_route_f32, float)

// Expert selection (moet_kernels.reference.route_reference's rules, one kernel instead of a
// dozen small torch ops): one warp per token. Scores in float32: sigmoid as torch computes it
// (1 / (1 + exp(-z)), IEEE division and expf: bit for bit), softmax with the max subtracted (its
// sum in another order than torch's: ulps apart); the correction bias steers selection only;
// with n_group > 1 (at most 32: a group per lane) only the topk_group best groups compete (a
// group's score: its best biased score, or its two best summed when there is a bias). The top_k
// picks go highest first, ties to the lower expert id, as the reference's stable sort; their
// weights are summed in pick order when renormalized, then scaled. A picked expert's selection
// score becomes NaN, which no comparison prefers.
namespace {

constexpr int TOPK_WARPS = 4;
constexpr int RANK_EXPERTS =
    256;  // pick_by_rank's bound: each thread compares its experts with all

// (a, ia) before (b, ib): the higher value, then the lower index; NaN (picked, or no candidate yet)
// last.
__device__ __forceinline__ bool prefer(float a, int ia, float b, int ib) {
  return a > b || (a == b && ia < ib) || (b != b && a == a);
}

// The warp's preferred (value, index) of its lanes' ones; every lane ends with the same pair.
__device__ __forceinline__ void warp_best(float& v, int& idx) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
    if (prefer(ov, oi, v, idx)) {
      v = ov;
      idx = oi;
    }
  }
}

// One token's picks by rank, the block's warps together (a decode step of one sequence): an
// expert's rank is the number of experts `prefer` puts before it, so the expert of rank i is the
// rounds' pick i (prefer is a strict order on the scores that are not NaN), without the rounds'
// chain of warp-wide arg-max reductions. Ids, weights and their sum in pick order are the rounds'
// bit for bit. False, with nothing written, where fewer than top_k scores are not NaN (the
// rounds then pick as they do).
__device__ __forceinline__ bool pick_by_rank(const float* score, const float* sel, int n_experts,
                                             int top_k, int renormalize, float scaling, int* ids,
                                             float* weights) {
  __shared__ int s_id[32];
  __shared__ float s_w[32];
  __shared__ int s_ranked;
  if (threadIdx.x == 0) s_ranked = 0;
  __syncthreads();
  for (int e = threadIdx.x; e < n_experts; e += blockDim.x) {
    const float v = sel[e];
    if (v != v) continue;
    int r = 0;  // prefer(sel[j], j, v, e), v not NaN
#pragma unroll 8
    for (int j = 0; j < n_experts; ++j) r += sel[j] > v || (sel[j] == v && j < e);
    if (r < top_k) {
      s_id[r] = e;
      s_w[r] = score[e];
      atomicAdd(&s_ranked, 1);
    }
  }
  __syncthreads();
  if (s_ranked < top_k) return false;
  const int lane = threadIdx.x;
  if (lane >= top_k) return true;
  float sum = 0.f;
  for (int i = 0; i < top_k; ++i) sum = __fadd_rn(sum, s_w[i]);
  float w = s_w[lane];
  if (renormalize || scaling != 1.f) w = __fmul_rn(renormalize ? __fdiv_rn(w, sum) : w, scaling);
  ids[lane] = s_id[lane];
  weights[lane] = w;
  return true;
}

// One token's selection scores (warp-wide): score[e] the routing weight's source, sel[e] what
// selects (score plus the correction bias; -inf outside the kept groups).
template <typename T>
__device__ void score_token(const T* z, const float* bias, int n_experts, int softmax, int n_group,
                            int topk_group, float* score, float* sel) {
  const int lane = threadIdx.x & 31;
  float m = -INFINITY;
  for (int e = lane; e < n_experts; e += 32) {
    const float v = to_f32<T>(z[e]);
    score[e] = v;
    m = fmaxf(m, v);
  }
  if (softmax) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float sum = 0.f;
    for (int e = lane; e < n_experts; e += 32) {
      score[e] = expf(score[e] - m);
      sum += score[e];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    for (int e = lane; e < n_experts; e += 32) score[e] = __fdiv_rn(score[e], sum);
  } else {
    for (int e = lane; e < n_experts; e += 32) score[e] = __fdiv_rn(1.f, 1.f + expf(-score[e]));
  }
  for (int e = lane; e < n_experts; e += 32)
    sel[e] = bias ? __fadd_rn(score[e], bias[e]) : score[e];
  __syncwarp();
  if (n_group > 1) {
    const int size = n_experts / n_group;
    float g_score = -INFINITY;
    if (lane < n_group) {
      float b1 = -INFINITY, b2 = -INFINITY;  // the group's best and second best
      for (int e = lane * size; e < (lane + 1) * size; ++e) {
        const float v = sel[e];
        if (v > b1) {
          b2 = b1;
          b1 = v;
        } else if (v > b2) {
          b2 = v;
        }
      }
      g_score = bias ? __fadd_rn(b1, b2) : b1;
    }
    bool kept = false;
    for (int i = 0; i < topk_group; ++i) {
      float v = lane < n_group && !kept ? g_score : NAN;
      int g = lane;
      warp_best(v, g);
      kept |= lane == g;
    }
    const unsigned keep = __ballot_sync(0xffffffffu, kept);
    for (int e = lane; e < n_experts; e += 32)
      if (!((keep >> (e / size)) & 1u)) sel[e] = -INFINITY;
    __syncwarp();
  }
}

// The top_k picks of one token, highest first, in rounds of a warp-wide arg-max; ids and weights
// point at the token's row.
__device__ void pick_in_rounds(float* score, float* sel, int n_experts, int top_k, int renormalize,
                               float scaling, int* ids, float* weights) {
  const int lane = threadIdx.x & 31;
  float picked = 0.f, sum = 0.f;  // lane i keeps pick i's weight
  for (int i = 0; i < top_k; ++i) {
    float v = NAN;
    int best = n_experts;
    for (int e = lane; e < n_experts; e += 32) {
      if (prefer(sel[e], e, v, best)) {
        v = sel[e];
        best = e;
      }
    }
    warp_best(v, best);
    const float w = score[best];
    __syncwarp();
    if (lane == 0) sel[best] = NAN;
    __syncwarp();
    sum = __fadd_rn(sum, w);
    if (lane == (i & 31)) picked = w;
    if (lane == 0) ids[i] = best;
    if (((i + 1) & 31) == 0 || i + 1 == top_k) {  // lanes 0..31 hold picks of this round
      const int first = i & ~31;
      if (lane <= i - first) weights[first + lane] = picked;
    }
  }
  __syncwarp();
  if (renormalize || scaling != 1.f) {
    for (int i = lane; i < top_k; i += 32) {
      const float w = renormalize ? __fdiv_rn(weights[i], sum) : weights[i];
      weights[i] = __fmul_rn(w, scaling);
    }
  }
}

template <typename T>
__device__ void select_experts(const T* logits, const float* bias, int n_tok, int n_experts,
                               int top_k, int softmax, int renormalize, int n_group, int topk_group,
                               float scaling, int* ids, float* weights) {
  __shared__ float s_score[TOPK_WARPS][MAX_EXPERTS];
  __shared__ float s_sel[TOPK_WARPS][MAX_EXPERTS];
  pdl_enter();
  const int warp = threadIdx.x >> 5;
  const int t = blockIdx.x * TOPK_WARPS + warp;
  float* score = s_score[warp];
  float* sel = s_sel[warp];
  // one token without groups: the block ranks its experts (pick_by_rank), each warp scoring them
  // (no warp waits for another's scores, and no shuffle sits in a branch)
  const bool by_rank = n_tok == 1 && n_group <= 1 && top_k <= 32 && n_experts <= RANK_EXPERTS;
  if (!by_rank && t >= n_tok) return;
  const int row = by_rank ? 0 : t;
  score_token(logits + (size_t)row * n_experts, bias, n_experts, softmax, n_group, topk_group,
              score, sel);
  if (by_rank) {
    __syncthreads();
    if (pick_by_rank(score, sel, n_experts, top_k, renormalize, scaling, ids, weights)) return;
    if (warp > 0) return;
  }
  pick_in_rounds(score, sel, n_experts, top_k, renormalize, scaling, ids + (size_t)t * top_k,
                 weights + (size_t)t * top_k);
}

}  // namespace

#define MOET_SELECT(NAME, T)                                                                   \
  extern "C" __global__ void __launch_bounds__(TOPK_WARPS * 32) NAME(                          \
      const T* logits, const float* bias, int n_tok, int n_experts, int top_k, int softmax,    \
      int renormalize, int n_group, int topk_group, float scaling, int* ids, float* weights) { \
    select_experts<T>(logits, bias, n_tok, n_experts, top_k, softmax, renormalize, n_group,    \
                      topk_group, scaling, ids, weights);                                      \
  }
MOET_SELECT(moet_select_bf16, __nv_bfloat16)
MOET_SELECT(moet_select_f16, __half)
MOET_SELECT(moet_select_f32, float)

// The work item's activation columns (Cols) for the job's pairs (8 per n-tile; -1: empty slot):
// rows of act at row_of(pair) and scale rows of scale at the same row, `chunks` per row.
template <int NT, class RowOf>
__device__ __forceinline__ Cols<NT> job_cols(const int* pairs, const int8_t* act,
                                             const float* scale, int act_row, int chunks, int g,
                                             int tig, RowOf row_of) {
  Cols<NT> c;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const int pg = pairs[TOK * n + g], p0 = pairs[TOK * n + 2 * tig],
              p1 = pairs[TOK * n + 2 * tig + 1];
    const auto at = [&](int p) { return row_of(p >= 0 ? p : pairs[0]); };
    c.act_g[n] = act + (size_t)at(pg) * act_row;
    c.as0[n] = scale + (size_t)at(p0) * chunks;
    c.as1[n] = scale + (size_t)at(p1) * chunks;
    c.p0[n] = p0;
    c.p1[n] = p1;
  }
  return c;
}

// A GEMM launch's jobs and where their rows are: jobs [range[0], range[1]) in `pool`, then, where
// `pool2` is non-null, jobs [range[1], range[2]) in `pool2`, rows of the same format (the host rows
// read in place, whose jobs route places right after the device pool's), so that both run in one
// launch. Read after pdl_enter: route writes the ranges.
struct JobRows {
  const uint8_t* pool;
  long long slot_bytes;
  const uint8_t* pool2;
  long long slot_bytes2;
  int first, split, end;
  __device__ JobRows(const uint8_t* pool, long long slot_bytes, const uint8_t* pool2,
                     long long slot_bytes2, const int* range)
      : pool(pool),
        slot_bytes(slot_bytes),
        pool2(pool2),
        slot_bytes2(slot_bytes2),
        first(range[0]),
        split(range[1]),
        end(pool2 ? range[2] : range[1]) {}
  __device__ __forceinline__ const uint8_t* row(int job, const int* job_slot) const {
    const size_t slot = (size_t)job_slot[job];
    return job < split ? pool + slot * slot_bytes : pool2 + slot * slot_bytes2;
  }
};

// Gate/up for (job, unit of 32 intermediate rows): rows [gate 32u.., up 32u..] of the expert,
// SiLU(gate) * up in float32 (h [pair, inter_p]); moet_requant quantizes it per 128.
template <class K, int S>
__device__ __forceinline__ void w13(const uint8_t* pool, long long slot_bytes, const uint8_t* pool2,
                                    long long slot_bytes2, long long off_codes,
                                    long long off_scales, int n_units, int nchunks,
                                    const int8_t* xq, const float* xs, int hidden_p, int top_k,
                                    const int* job_range, const int* job_slot, const int* job_pairs,
                                    float* h, int inter_p) {
  pdl_enter();
  constexpr int NT = K::kTiles;
  __shared__ float red[WARPS][16 * NT][32];
  const int lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
  const Team<S> team(threadIdx.x >> 5);
  const JobRows jobs(pool, slot_bytes, pool2, slot_bytes2, job_range);
  const int work = (jobs.end - jobs.first) * n_units;
  for (int item = blockIdx.x * team.kSlots + team.slot; item < work;
       item += gridDim.x * team.kSlots) {
    const int job = jobs.first + item / n_units, u = item % n_units;
    const uint8_t* row = jobs.row(job, job_slot);
    const int* pairs = job_pairs + job * TOK * NT;
    const Cols<NT> cols = job_cols<NT>(pairs, xq, xs, hidden_p, hidden_p / KCHUNK, g, tig,
                                       [top_k](int p) { return p / top_k; });
    const uint8_t* gs =  // the group's scales (its head, then its chunks)
        row + off_scales + (size_t)u * nchunks * K::kScaleBytes + (size_t)u * K::kScaleHead;
    float f[NT][4][4];
    gemm64<K, S>(f, row + off_codes + (size_t)u * nchunks * K::kCodeBytes, gs + K::kScaleHead,
                 nchunks, cols, team.part, lane);
    reduce_team(f, red, team, lane);
    if (team.part == 0) {
      scale_rows<K>(f, gs, g);
      // f[n][rt][j]: gate rows rt = 0, 1 and up rows rt = 2, 3; q -> intermediate row g, g+8,
      // 16+g, 24+g of this unit; columns 2tig (j even) and 2tig+1 of n-tile n
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int col = 0; col < 2; ++col) {
          const int pair = col ? cols.p1[n] : cols.p0[n];
          if (pair < 0) continue;
          float* dst = h + (size_t)pair * inter_p + u * 32;
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const int rt = q >> 1, j = (q & 1) * 2 + col;
            dst[(q & 1) * 8 + (q >> 1) * 16 + g] = __fmul_rn(silu(f[n][rt][j]), f[n][rt + 2][j]);
          }
        }
    }
    team.sync();  // red is reused by the next item
  }
}

// The down projection's input: h quantized per pair and chunk of 128 (one warp each) to int8 aq
// and float32 as; columns past inter are zero. Pairs whose expert is not resident are skipped.
extern "C" __global__ void moet_requant(const float* h, const uint8_t* pair_ok, int n_pairs,
                                        int inter, int inter_p, int8_t* aq, float* as) {
  pdl_enter();
  const int lane = threadIdx.x & 31, nchunk = inter_p / KCHUNK;
  const int warps = gridDim.x * (blockDim.x / 32);
  for (int item = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5); item < n_pairs * nchunk;
       item += warps) {
    const int p = item / nchunk, c = item % nchunk;
    if (!pair_ok[p]) continue;
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int k = c * KCHUNK + 4 * lane + i;
      v[i] = k < inter ? h[(size_t)p * inter_p + k] : 0.f;
    }
    quantize_chunk(v, lane, aq + (size_t)p * inter_p + c * KCHUNK, as + (size_t)p * nchunk + c);
  }
}

// Down projection for (job, group of 64 output rows): y[pair][row] in float32.
template <class K, int S>
__device__ __forceinline__ void w2(const uint8_t* pool, long long slot_bytes, const uint8_t* pool2,
                                   long long slot_bytes2, long long off_codes, long long off_scales,
                                   int n_groups, int nchunks, const int8_t* aq, const float* as,
                                   int inter_p, const int* job_range, const int* job_slot,
                                   const int* job_pairs, float* y, int hidden) {
  pdl_enter();
  constexpr int NT = K::kTiles;
  __shared__ float red[WARPS][16 * NT][32];
  const int lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
  const Team<S> team(threadIdx.x >> 5);
  const JobRows jobs(pool, slot_bytes, pool2, slot_bytes2, job_range);
  const int work = (jobs.end - jobs.first) * n_groups;
  for (int item = blockIdx.x * team.kSlots + team.slot; item < work;
       item += gridDim.x * team.kSlots) {
    const int job = jobs.first + item / n_groups, rg = item % n_groups;
    const uint8_t* row = jobs.row(job, job_slot);
    const int* pairs = job_pairs + job * TOK * NT;
    const Cols<NT> cols =
        job_cols<NT>(pairs, aq, as, inter_p, inter_p / KCHUNK, g, tig, [](int p) { return p; });
    const uint8_t* gs =
        row + off_scales + (size_t)rg * nchunks * K::kScaleBytes + (size_t)rg * K::kScaleHead;
    float f[NT][4][4];
    gemm64<K, S>(f, row + off_codes + (size_t)rg * nchunks * K::kCodeBytes, gs + K::kScaleHead,
                 nchunks, cols, team.part, lane);
    reduce_team(f, red, team, lane);
    if (team.part == 0) {
      scale_rows<K>(f, gs, g);
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int rt = 0; rt < 4; ++rt)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int r = rg * 64 + rt * 16 + g + (j >> 1) * 8;
            const int pair = (j & 1) ? cols.p1[n] : cols.p0[n];
            if (pair >= 0 && r < hidden) y[(size_t)pair * hidden + r] = f[n][rt][j];
          }
    }
    team.sync();  // red is reused by the next item
  }
}

// Entry points: W2 rows, FP4 rows (fp4r, fp4x-mxfp4) and NVFP4 rows (fp4x-nvfp4) share everything
// but the chunk type. W2 and FP4 also come for prefill jobs of 16 pairs (suffix _t16: two n-tiles
// share each decoded fragment); NVFP4 has no such variant (two tiles would spill).
#define MOET_GEMMS(SUFFIX, K, BLOCKS)                                                         \
  extern "C" __global__ void __launch_bounds__(THREADS, BLOCKS) moet_w13##SUFFIX(             \
      const uint8_t* pool, long long slot_bytes, const uint8_t* pool2, long long slot_bytes2, \
      long long off_codes, long long off_scales, int n_units, int nchunks, const int8_t* xq,  \
      const float* xs, int hidden_p, int top_k, const int* job_range, const int* job_slot,    \
      const int* job_pairs, float* h, int inter_p) {                                          \
    w13<K, W13_SPLIT>(pool, slot_bytes, pool2, slot_bytes2, off_codes, off_scales, n_units,   \
                      nchunks, xq, xs, hidden_p, top_k, job_range, job_slot, job_pairs, h,    \
                      inter_p);                                                               \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(THREADS, BLOCKS) moet_w2##SUFFIX(              \
      const uint8_t* pool, long long slot_bytes, const uint8_t* pool2, long long slot_bytes2, \
      long long off_codes, long long off_scales, int n_groups, int nchunks, const int8_t* aq, \
      const float* as, int inter_p, const int* job_range, const int* job_slot,                \
      const int* job_pairs, float* y, int hidden) {                                           \
    w2<K, W2_SPLIT>(pool, slot_bytes, pool2, slot_bytes2, off_codes, off_scales, n_groups,    \
                    nchunks, aq, as, inter_p, job_range, job_slot, job_pairs, y, hidden);     \
  }
MOET_GEMMS(, Chunk<1>, GEMM_BLOCKS)
MOET_GEMMS(_fp4, ChunkFp4<1>, GEMM_BLOCKS_FP4)
MOET_GEMMS(_nvfp4, Nvfp4Chunk, GEMM_BLOCKS_FP4)
MOET_GEMMS(_t16, Chunk<2>, GEMM_BLOCKS_FP4)
MOET_GEMMS(_fp4_t16, ChunkFp4<2>, GEMM_BLOCKS_FP4)

// out[t][h] = sum over slots j = 0..k-1, in that order, of weight[t][j] * y[t*k+j][h], skipping
// pairs whose expert was not resident (they contribute zero, as in the reference).
template <typename T>
__device__ void combine(const float* y, const float* weights, const uint8_t* pair_ok, int n_tok,
                        int top_k, int hidden, T* out) {
  pdl_enter();
  const size_t n = (size_t)n_tok * hidden;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const int t = (int)(i / hidden), h = (int)(i % hidden);
    float acc = 0.f;
    for (int j = 0; j < top_k; ++j) {
      const int p = t * top_k + j;
      if (pair_ok[p]) acc = __fadd_rn(acc, __fmul_rn(weights[p], y[(size_t)p * hidden + h]));
    }
    out[i] = from_f32<T>(acc);
  }
}

#define MOET_COMBINE(NAME, T)                                                                   \
  extern "C" __global__ void NAME(const float* y, const float* weights, const uint8_t* pair_ok, \
                                  int n_tok, int top_k, int hidden, T* out) {                   \
    combine<T>(y, weights, pair_ok, n_tok, top_k, hidden, out);                                 \
  }
MOET_COMBINE(moet_combine_bf16, __nv_bfloat16)
MOET_COMBINE(moet_combine_f16, __half)
MOET_COMBINE(moet_combine_f32, float)

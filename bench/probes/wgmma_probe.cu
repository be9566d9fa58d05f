// A probe, not a shipped kernel: how fast would w13's W2 decode run on sm_90a's e4m3 wgmma
// (docs/kernels-design.md, "What should close the gap", item 1)? Same code bytes as the native v2 layout
// (a warp's 16-byte piece per row tile and chunk, PRMT decode), but:
//
// - levels are e4m3 bytes: code {-4,-1,+1,+4} times 2^(f - 6), f = 0..12 one 5-bit field per
//   (row, chunk, 32-block) in the scale words' place, so a row's block exponents fold into the
//   levels over the whole K and the fp32 accumulator needs no promotion at all;
// - activations are e4m3, one job's 8 tokens staged in shared memory in wgmma's K-major layout
//   (pre-permuted so that the B tile of k-tile tt holds the k the A fragments stand for);
// - the CTA's 4 warps are one warpgroup: warp w decodes row tile w over all of K (no split-K), and
//   the decode of chunk c + 1 runs while chunk c's wgmmas are in flight.
//
// probe_w13 writes acc * xscale[n] (f32, out[job][n][unit * 64 + row]); bench/probes/wgmma_probe.py
// checks it against float64 and times it against moet_w13 in the same run. The shipped source is
// included for its streaming loads and chunk sizes (ld_stream16, ld_stream8, CODE_CHUNK,
// SCALE_CHUNK), so the probe reads the bytes exactly as moet_w13 does.

#include "../../packages/moet-kernels/csrc/w2_moe.cu"

namespace {

constexpr int SUPER = 4;  // chunks loaded at once

__device__ __forceinline__ uint64_t desc(const void* smem) {  // K-major, no swizzle
  const uint64_t a = (uint64_t)__cvta_generic_to_shared(smem);
  return ((a & 0x3FFFF) >> 4) | ((uint64_t)(128 >> 4) << 16) | ((uint64_t)(256 >> 4) << 32);
}

__device__ __forceinline__ void wgmma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                      uint32_t a3, uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, "
      "p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b));
}

__device__ __forceinline__ uint32_t e4m3_table(uint32_t word, int t) {
  // bytes by code: -4, -1, +1, +4 (0xC8, 0xB8, 0x38, 0x48) with the exponent
  // moved by f - 6
  return ((word >> (5 * t)) & 31u) * 0x08080808u + 0x18088898u;
}

struct Super {
  uint4 cw[SUPER];
  uint2 sw[SUPER];
};

__device__ __forceinline__ void load_super(Super& s, const uint8_t* cbase, const uint8_t* sbase,
                                           int c0) {
#pragma unroll
  for (int i = 0; i < SUPER; ++i) {
    s.cw[i] = ld_stream16(cbase + (size_t)(c0 + i) * CODE_CHUNK);
    s.sw[i] = ld_stream8(sbase + (size_t)(c0 + i) * SCALE_CHUNK);
  }
}

// Decodes one chunk's 4 k-tiles into a[tt][0..3] (the mma.m16n8k32 A fragment
// of row tile w).
__device__ __forceinline__ void decode(uint32_t (&a)[4][4], uint4 cw, uint2 sw, int t) {
  const uint32_t tab = e4m3_table(sw.x, t), tab8 = e4m3_table(sw.y, t);
  const uint32_t w[4] = {cw.x, cw.y, cw.z, cw.w};
#pragma unroll
  for (int tt = 0; tt < 4; ++tt) {
    const uint32_t lo = w[tt] & 0x77777777u, hi = (w[tt] >> 2) & 0x77777777u;
    a[tt][0] = __byte_perm(tab, tab, lo);
    a[tt][1] = __byte_perm(tab8, tab8, hi);
    a[tt][2] = __byte_perm(tab, tab, lo >> 16);
    a[tt][3] = __byte_perm(tab8, tab8, hi >> 16);
  }
}

// Chunk c's 4 wgmmas; xd is the descriptor of the staged activations (k-tile i
// at 256 i bytes: its start address field, in 16-byte units, moves by 16 per
// k-tile).
__device__ __forceinline__ void issue(float (&acc)[4], const uint32_t (&a)[4][4], uint64_t xd,
                                      int c) {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
  for (int tt = 0; tt < 4; ++tt)
    wgmma(acc, a[tt][0], a[tt][1], a[tt][2], a[tt][3],
          xd + (uint64_t)(uint32_t)((c * 4 + tt) * 16));
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

__device__ __forceinline__ void wait1() {
  asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
}

}  // namespace

extern "C" __global__ void __launch_bounds__(128, 3)
    probe_w13(const uint8_t* codes, const uint8_t* scales, const uint8_t* xperm,
              const float* xscale, int n_jobs, int units, int nchunks, float* out) {
  extern __shared__ __align__(128) uint8_t xs[];  // nchunks * 1024 bytes: one job's 8 tokens
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int work = n_jobs * units, per = (work + gridDim.x - 1) / gridDim.x;
  const int first = blockIdx.x * per, last = min(work, first + per);
  int staged = -1;
  const uint64_t xd = desc(xs);
  for (int item = first; item < last; ++item) {
    const int job = item / units, u = item % units;
    if (job != staged) {  // contiguous items: a CTA stages a job's activations once
      __syncthreads();
      const uint4* src = reinterpret_cast<const uint4*>(xperm + (size_t)job * nchunks * 1024);
      for (int i = threadIdx.x; i < nchunks * 64; i += blockDim.x)
        reinterpret_cast<uint4*>(xs)[i] = src[i];
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      __syncthreads();
      staged = job;
    }
    const size_t unit = (size_t)item * nchunks;
    const uint8_t* cbase = codes + unit * CODE_CHUNK + warp * 512 + lane * 16;
    const uint8_t* sbase = scales + unit * SCALE_CHUNK + warp * 64 + g * 8;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    uint32_t a0[4][4], a1[4][4];
    Super p, q;
    load_super(p, cbase, sbase, 0);
    for (int c0 = 0; c0 < nchunks; c0 += 2 * SUPER) {
      if (c0 + SUPER < nchunks) load_super(q, cbase, sbase, c0 + SUPER);
#pragma unroll
      for (int i = 0; i < SUPER; i += 2) {
        decode(a0, p.cw[i], p.sw[i], t);
        issue(acc, a0, xd, c0 + i);
        wait1();
        decode(a1, p.cw[i + 1], p.sw[i + 1], t);
        issue(acc, a1, xd, c0 + i + 1);
        wait1();
      }
      if (c0 + SUPER >= nchunks) break;
      if (c0 + 2 * SUPER < nchunks) load_super(p, cbase, sbase, c0 + 2 * SUPER);
#pragma unroll
      for (int i = 0; i < SUPER; i += 2) {
        decode(a0, q.cw[i], q.sw[i], t);
        issue(acc, a0, xd, c0 + SUPER + i);
        wait1();
        decode(a1, q.cw[i + 1], q.sw[i + 1], t);
        issue(acc, a1, xd, c0 + SUPER + i + 1);
        wait1();
      }
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    const int row = u * 64 + warp * 16 + g, rows = units * 64;
    float* o = out + (size_t)job * 8 * rows;
    const float s0 = xscale[job * 8 + 2 * t], s1 = xscale[job * 8 + 2 * t + 1];
    o[(2 * t) * rows + row] = acc[0] * s0;
    o[(2 * t + 1) * rows + row] = acc[1] * s1;
    o[(2 * t) * rows + row + 8] = acc[2] * s0;
    o[(2 * t + 1) * rows + row + 8] = acc[3] * s1;
  }
}

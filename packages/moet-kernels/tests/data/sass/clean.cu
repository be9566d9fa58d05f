// SASS audit test kernel: nothing to report. An int8 mma.sync (IMMA) and a bf16 mma.sync whose
// results are packed with F2FP.BF16.F32.PACK_AB: F2FP without an FP8 unpack is not emulation.
#include <cuda_bf16.h>
#include <stdint.h>

extern "C" __global__ void clean_axpy(float a, const float* __restrict__ x, float* __restrict__ y,
                                      int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}

extern "C" __global__ void clean_mma_bf16(const uint32_t* a, const uint32_t* b, __nv_bfloat162* d) {
  const uint32_t* pa = a + threadIdx.x * 4;
  const uint32_t* pb = b + threadIdx.x * 2;
  float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f;
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
      : "r"(pa[0]), "r"(pa[1]), "r"(pa[2]), "r"(pa[3]), "r"(pb[0]), "r"(pb[1]));
  d[threadIdx.x * 2] = __floats2bfloat162_rn(c0, c1);
  d[threadIdx.x * 2 + 1] = __floats2bfloat162_rn(c2, c3);
}

extern "C" __global__ void clean_mma_s8(const uint32_t* a, const uint32_t* b, int* d) {
  const uint32_t* pa = a + threadIdx.x * 4;
  const uint32_t* pb = b + threadIdx.x * 2;
  int c0 = 0, c1 = 0, c2 = 0, c3 = 0;
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+r"(c0), "+r"(c1), "+r"(c2), "+r"(c3)
      : "r"(pa[0]), "r"(pa[1]), "r"(pa[2]), "r"(pa[3]), "r"(pb[0]), "r"(pb[1]));
  int4* out = reinterpret_cast<int4*>(d) + threadIdx.x;
  *out = make_int4(c0, c1, c2, c3);
}

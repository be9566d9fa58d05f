// SASS audit test kernel: mma.sync with e4m3 operands. Native on sm_120a; on sm_90a ptxas
// emulates it (F2FP.F16.E4M3.UNPACK_B feeding HMMA), which the audit must report.
#include <stdint.h>

extern "C" __global__ void fp8_mma_sync(const uint32_t* a, const uint32_t* b, float* d) {
  const uint32_t* pa = a + threadIdx.x * 4;
  const uint32_t* pb = b + threadIdx.x * 2;
  float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f;
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
      : "r"(pa[0]), "r"(pa[1]), "r"(pa[2]), "r"(pa[3]), "r"(pb[0]), "r"(pb[1]));
  float4* out = reinterpret_cast<float4*>(d) + threadIdx.x;
  *out = make_float4(c0, c1, c2, c3);
}

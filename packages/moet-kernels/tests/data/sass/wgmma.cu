// SASS audit test kernel: wgmma.mma_async that ptxas must serialize. The accumulators are set by
// ordinary instructions inside the pipeline stage (zero-initialized, then a loop of wgmmas
// without a fence per iteration), so ptxas reports "(C7515) Potential Performance Loss:
// wgmma.mma_async instructions are serialized ...", which the audit must fail on.
#include <stdint.h>

extern "C" __global__ void wgmma_loop(float* out, uint64_t desc_a, uint64_t desc_b, int n) {
  float d[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  asm volatile("wgmma.fence.sync.aligned;");
  for (int i = 0; i < n; ++i) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, "
        "1, 1, 1, 0, 0;"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7])
        : "l"(desc_a + i), "l"(desc_b + i));
  }
  asm volatile("wgmma.commit_group.sync.aligned;");
  asm volatile("wgmma.wait_group.sync.aligned 0;");
  for (int j = 0; j < 8; ++j) out[threadIdx.x * 8 + j] = d[j];
}

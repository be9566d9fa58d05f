// SASS audit test kernel: spills registers. 64 accumulators live across a loop, built with
// -maxrregcount=32 (tests/data/sass/CMakeLists.txt): ptxas must spill to local memory.
extern "C" __global__ void spill_many_live(const float* __restrict__ x, float* __restrict__ y,
                                           int n) {
  float acc[64];
#pragma unroll
  for (int j = 0; j < 64; ++j) acc[j] = x[j * blockDim.x + threadIdx.x];
  for (int i = 0; i < n; ++i) {
    float xi = x[i];
#pragma unroll
    for (int j = 0; j < 64; ++j) acc[j] = acc[j] * acc[(j + 7) % 64] + xi;
  }
#pragma unroll
  for (int j = 0; j < 64; ++j) y[j * blockDim.x + threadIdx.x] = acc[j];
}

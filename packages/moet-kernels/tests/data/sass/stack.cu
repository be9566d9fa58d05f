// SASS audit test kernel: a stack frame without spills. A per-thread array larger than the
// register file, read at indexes known only at run time, lives in local memory (the stack).
extern "C" __global__ void stack_local_array(const int* __restrict__ idx,
                                             const float* __restrict__ x, float* __restrict__ y,
                                             int n) {
  float buf[256];
  for (int j = 0; j < 256; ++j) buf[j] = x[j * blockDim.x + threadIdx.x];
  float s = 0.f;
  for (int i = 0; i < n; ++i) s += buf[idx[i] & 255];
  y[threadIdx.x] = s;
}

#include "crc32c.hpp"

#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace moet {
namespace {

struct Table {
  uint32_t t[8][256];
  Table() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
  }
};

const Table& table() {
  static const Table tab;
  return tab;
}

uint32_t crc_sw(const uint8_t* p, size_t n, uint32_t c) {
  const Table& T = table();
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    v ^= c;
    c = T.t[7][v & 0xff] ^ T.t[6][(v >> 8) & 0xff] ^ T.t[5][(v >> 16) & 0xff] ^
        T.t[4][(v >> 24) & 0xff] ^ T.t[3][(v >> 32) & 0xff] ^ T.t[2][(v >> 40) & 0xff] ^
        T.t[1][(v >> 48) & 0xff] ^ T.t[0][v >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ T.t[0][(c ^ *p++) & 0xff];
  return c;
}

// x * y modulo the (bit-reflected) CRC-32C polynomial: the CRC register is linear in GF(2), so
// the register after A||B equals shift(register after A, |B|) ^ register of B from zero.
uint32_t mul_mod_p(uint32_t x, uint32_t y) {
  uint32_t prod = 0;
  for (uint32_t m = 1u << 31; m; m >>= 1) {
    if (x & m) prod ^= y;
    y = (y & 1) ? (y >> 1) ^ 0x82F63B78u : y >> 1;
  }
  return prod;
}

// x^(8 n) mod P: the operator that advances a register over n zero bytes.
uint32_t x8n_mod_p(uint64_t n) {
  uint32_t result = 1u << 31;  // x^0
  uint32_t sq = 1u << 23;      // x^8
  for (; n; n >>= 1) {
    if (n & 1) result = mul_mod_p(sq, result);
    sq = mul_mod_p(sq, sq);
  }
  return result;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint64_t crc_hw_run(const uint8_t* p, size_t n, uint64_t c) {
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
  }
  return c;
}

// The crc32 instruction has a latency of 3 cycles and a throughput of 1 per cycle: three
// independent streams over thirds of the buffer keep it busy, then the registers are combined.
__attribute__((target("sse4.2"))) uint32_t crc_hw(const uint8_t* p, size_t n, uint32_t c) {
  uint64_t c64 = c;
  constexpr size_t kMin = 3 * 1024;
  if (n >= kMin) {
    const size_t third = n / 24 * 8;
    const uint8_t *p1 = p + third, *p2 = p + 2 * third;
    uint64_t c1 = 0, c2 = 0;
    for (size_t i = 0; i < third; i += 8) {
      uint64_t v0, v1, v2;
      std::memcpy(&v0, p + i, 8);
      std::memcpy(&v1, p1 + i, 8);
      std::memcpy(&v2, p2 + i, 8);
      c64 = _mm_crc32_u64(c64, v0);
      c1 = _mm_crc32_u64(c1, v1);
      c2 = _mm_crc32_u64(c2, v2);
    }
    const uint32_t shift = x8n_mod_p(third);
    c64 = mul_mod_p(shift, uint32_t(c64)) ^ uint32_t(c1);
    c64 = mul_mod_p(shift, uint32_t(c64)) ^ uint32_t(c2);
    p += 3 * third;
    n -= 3 * third;
  }
  c64 = crc_hw_run(p, n, c64);
  uint32_t c32 = static_cast<uint32_t>(c64);
  p += n / 8 * 8;
  for (n %= 8; n--;) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}
#endif

}  // namespace

bool crc32c_hw() {
#if defined(__x86_64__)
  static const bool hw = __builtin_cpu_supports("sse4.2");
  return hw;
#else
  return false;
#endif
}

uint32_t crc32c(const void* data, size_t len, uint32_t crc) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
#if defined(__x86_64__)
  if (crc32c_hw()) return ~crc_hw(p, len, c);
#endif
  return ~crc_sw(p, len, c);
}

}  // namespace moet

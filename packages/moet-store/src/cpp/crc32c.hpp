// CRC-32C (Castagnoli): SSE4.2 instruction when the CPU has it, table otherwise.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moet {

uint32_t crc32c(const void* data, size_t len, uint32_t crc = 0);
bool crc32c_hw();

}  // namespace moet

// I/O engines behind one interface: io_uring, a pread thread pool, and a fault injector.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common.hpp"

namespace moet {

struct ReadOp {
  int fd = -1;
  int file_index = -1;  // index among registered files, -1 when not registered
  bool direct = false;  // the fd was opened with O_DIRECT (alignment rules apply)
  uint64_t offset = 0;
  uint32_t len = 0;
  uint8_t* dst = nullptr;
  int64_t result = 0;    // bytes read (== len on success) or -errno
  uint32_t crc_len = 0;  // > 0: the reading thread computes CRC-32C of the first crc_len bytes
  uint32_t crc = 0;      // valid when crc_done
  bool crc_done = false;
};

struct Region {
  void* base;
  size_t len;
};

// Faults injected by FaultEngine (reads) and by write_rows (writes). Counters are shared by copies.
struct FaultConfig {
  int short_read_every = 0;         // every k-th read op returns about half its bytes
  int eio_every = 0;                // every k-th read op fails with EIO
  int64_t eio_after = -1;           // read ops numbered >= n fail with EIO
  uint32_t stall_us = 0;            // sleep before each submission
  bool odirect_refused = false;     // O_DIRECT open/reads fail with EINVAL
  int64_t enospc_after_bytes = -1;  // writes fail with ENOSPC once this many bytes were written
  bool any() const {
    return short_read_every || eio_every || eio_after >= 0 || stall_us || odirect_refused;
  }
};

// Throws std::invalid_argument with a clear message when op does not meet O_DIRECT alignment.
void check_direct_alignment(const ReadOp& op);

class Engine {
 public:
  virtual ~Engine() = default;
  virtual std::string name() const = 0;
  // Runs every op once; an op may come back short. Never throws for per-op I/O errors.
  virtual void submit(ReadOp* ops, size_t n) = 0;
  // Runs every op to completion: retries short reads, maps an unexpected EOF to -EIO.
  // Misaligned O_DIRECT ops throw std::invalid_argument before anything is submitted.
  void read_all(ReadOp* ops, size_t n);
  virtual void register_files(const std::vector<int>&) {}
  virtual void register_buffers(const std::vector<Region>&) {}
  virtual bool buffers_registered() const { return false; }
  virtual bool files_registered() const { return false; }
  virtual std::string register_note() const { return ""; }
  virtual int readers() const { return 1; }
};

class PreadPool : public Engine {
 public:
  explicit PreadPool(int threads);
  ~PreadPool() override;
  std::string name() const override { return "pread"; }
  void submit(ReadOp* ops, size_t n) override;
  int readers() const override { return threads_; }

 private:
  void worker();
  void run_ops();
  int threads_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  ReadOp* ops_ = nullptr;
  size_t n_ = 0;
  std::atomic<size_t> next_{0};
  std::atomic<size_t> remaining_{0};
  uint64_t gen_ = 0;
  int active_ = 0;
  bool stop_ = false;
};

class FaultEngine : public Engine {
 public:
  FaultEngine(std::unique_ptr<Engine> inner, FaultConfig cfg);
  std::string name() const override { return inner_->name(); }
  void submit(ReadOp* ops, size_t n) override;
  void register_files(const std::vector<int>& f) override { inner_->register_files(f); }
  void register_buffers(const std::vector<Region>& r) override { inner_->register_buffers(r); }
  bool buffers_registered() const override { return inner_->buffers_registered(); }
  bool files_registered() const override { return inner_->files_registered(); }
  std::string register_note() const override { return inner_->register_note(); }
  int readers() const override { return inner_->readers(); }

 private:
  std::unique_ptr<Engine> inner_;
  FaultConfig cfg_;
  int64_t count_ = 0;
};

// io_uring: defined only when built with liburing.
struct UringProbe {
  bool ok = false;
  int err = 0;         // errno of io_uring_setup when not ok
  std::string state;   // "available" | "blocked" | "absent" | "disabled" | "not built" | "error"
  std::string reason;  // one line for logs and doctor
};

UringProbe probe_uring();
bool uring_built();
std::unique_ptr<Engine> make_uring_engine(unsigned depth, int readers);  // throws IoError

struct EngineChoice {
  std::unique_ptr<Engine> engine;
  std::string reason;
};

// kind: "auto" | "io_uring" | "pread". "io_uring" throws IoError when unavailable.
// buffered_only: the store will never read with O_DIRECT; "auto" then takes the pread pool, whose
// threads copy out of the page cache in parallel (io_uring's buffered reads did not scale on the
// H200: 0.18-0.29 of memcpy with 8-16 readers vs 0.81-0.96 for the pool).
EngineChoice choose_engine(const std::string& kind, int readers, const FaultConfig& faults,
                           unsigned queue_depth = 64, bool buffered_only = false);

// Writes n rows of row_bytes (packed in src) at offset + i*stride, zero padding each row to stride.
// Returns per-row CRC-32C of the row_bytes. Throws IoError (errno) on failure; honours
// faults.enospc_after_bytes, counting against *written (bytes written so far by this writer).
std::vector<uint32_t> write_rows(int fd, const uint8_t* src, size_t n, uint64_t row_bytes,
                                 uint64_t stride, uint64_t offset, const FaultConfig& faults,
                                 int64_t* written);

}  // namespace moet

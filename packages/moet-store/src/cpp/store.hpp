// The store: a pinned (page-aligned, mlock-able) MRU arena of row slots over one pack file, a stage
// for overflow and for the pagecache backend, and an engine that reads missing rows.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine.hpp"

namespace moet {

// Anonymous, page-aligned memory (mmap). Shared so views can outlive the store that made them.
struct Mapping {
  uint8_t* base = nullptr;
  size_t len = 0;
  explicit Mapping(size_t bytes, bool populate = false);
  ~Mapping();
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
};

struct StoreConfig {
  std::string path;
  uint32_t n_layers = 0;
  uint32_t n_experts = 0;
  uint64_t row_bytes = 0;
  uint64_t stride = 0;
  uint64_t arena_slots = 0;
  uint64_t stage_slots = 0;
  std::string engine = "auto";  // auto | io_uring | pread
  int direct = -1;              // -1 auto, 0 buffered, 1 O_DIRECT required
  int readers = 4;
  unsigned queue_depth = 64;  // io_uring reads in flight
  bool verify = true;         // check each row read from the pack against its CRC-32C
  bool populate = false;
  bool register_buffers = true;
  FaultConfig faults;
};

struct Stats {
  uint64_t fetches = 0, rows = 0, hits = 0, misses = 0, overflow_rows = 0, temp_rows = 0;
  uint64_t evictions = 0, reads = 0, bytes = 0, read_errors = 0, checksum_errors = 0;
  uint64_t scan_rows = 0;
};

// One leased batch: the rows' addresses stay valid (never evicted) until release().
struct BatchState {
  std::vector<uint8_t*> ptrs;
  std::vector<int64_t> slots;        // arena slot pinned for row i, or -1
  std::vector<uint8_t> src;          // 0 arena, 1 stage, 2 temp buffer
  std::vector<uint64_t> off;         // byte offset in the arena or stage
  std::vector<int64_t> temp_index;   // index into temps for src 2
  std::vector<int64_t> owned_stage;  // stage slots leased by this batch
  std::vector<std::shared_ptr<Mapping>> temps;
  std::vector<uint8_t> hit;
  bool released = false;
};

class Store {
 public:
  // layer_written[l] != 0 marks layer l as present; crcs holds n_layers*n_experts CRC-32C values.
  Store(const StoreConfig& cfg, std::vector<uint8_t> layer_written, std::vector<uint32_t> crcs);
  ~Store();

  // keys: n (layer, expert) pairs. Throws IoError / std::out_of_range; on error nothing is leased.
  std::shared_ptr<BatchState> fetch(const int64_t* keys, size_t n, bool scan);
  void release(BatchState& b);

  // Rows of the arena from most to least recently used (at most limit).
  std::vector<int64_t> hot_rows(size_t limit) const;
  // Reads rows into free arena slots (scan discipline, least-recent end in order: first = hottest).
  size_t preheat(const std::vector<int64_t>& rows);
  void close();

  Stats stats() const;
  std::vector<double> latency_us(bool miss_only) const;  // recent fetch latencies
  std::vector<std::string> take_events();                // demotions/warnings to log

  const StoreConfig& config() const { return cfg_; }
  std::shared_ptr<Mapping> arena() const { return arena_; }
  std::shared_ptr<Mapping> stage() const { return stage_; }
  std::string engine_name() const { return engine_->name(); }
  std::string engine_reason() const { return engine_reason_; }
  bool direct() const { return direct_; }
  std::string direct_reason() const { return direct_reason_; }
  bool buffers_registered() const { return engine_->buffers_registered(); }
  bool files_registered() const { return engine_->files_registered(); }
  std::string register_note() const { return engine_->register_note(); }
  int readers() const { return engine_->readers(); }
  size_t leased_batches() const;
  bool row_present(int64_t row) const { return layer_written_[row / cfg_.n_experts] != 0; }
  int64_t row_slot(int64_t row) const;

 private:
  void lru_unlink(int64_t s);
  void lru_push_front(int64_t s);
  void lru_push_back(int64_t s);
  int64_t take_free_slot();
  int64_t take_victim();
  int64_t take_stage_slot();
  void unlease_locked(BatchState& b);
  void demote_direct(const std::string& why);
  void record_latency(uint64_t ns, bool miss);

  StoreConfig cfg_;
  std::vector<uint8_t> layer_written_;
  std::vector<uint32_t> crcs_;
  int fd_buf_ = -1, fd_direct_ = -1;
  bool direct_ = false;
  std::string direct_reason_;
  std::unique_ptr<Engine> engine_;
  std::string engine_reason_;
  std::shared_ptr<Mapping> arena_, stage_;

  mutable std::mutex mu_;
  std::vector<int64_t> row_slot_;     // row -> arena slot (published), -1
  std::vector<int64_t> slot_row_;     // slot -> row, -1 when free or loading
  std::vector<int32_t> pins_;         // leases per slot
  std::vector<int64_t> prev_, next_;  // recency list of published slots (head = MRU)
  int64_t head_ = -1, tail_ = -1;
  std::vector<int64_t> free_;  // free arena slots
  std::vector<int64_t> stage_free_;
  size_t leased_ = 0;
  bool closed_ = false;
  Stats st_;
  std::vector<uint32_t> lat_, lat_miss_;
  size_t lat_pos_ = 0, lat_miss_pos_ = 0;
  std::vector<std::string> events_;
  uint64_t overflow_events_ = 0;
};

}  // namespace moet

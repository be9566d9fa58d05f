#include "store.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "crc32c.hpp"

namespace moet {

Mapping::Mapping(size_t bytes, bool populate) : len(bytes) {
  if (bytes == 0) return;
  int flags = MAP_PRIVATE | MAP_ANONYMOUS | (populate ? MAP_POPULATE : 0);
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, flags, -1, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    throw IoError(e, "cannot map " + std::to_string(bytes) +
                         " bytes of arena memory: " + errstr(e) + "; lower arena_bytes");
  }
  base = static_cast<uint8_t*>(p);
}

Mapping::~Mapping() {
  if (base) ::munmap(base, len);
}

namespace {

uint64_t now_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

std::string key_str(int64_t row, uint32_t E) {
  return "(" + std::to_string(row / E) + ", " + std::to_string(row % E) + ")";
}

}  // namespace

Store::Store(const StoreConfig& cfg, std::vector<uint8_t> layer_written, std::vector<uint32_t> crcs)
    : cfg_(cfg), layer_written_(std::move(layer_written)), crcs_(std::move(crcs)) {
  const uint64_t n_rows = uint64_t(cfg_.n_layers) * cfg_.n_experts;
  if (n_rows == 0 || cfg_.row_bytes == 0 || cfg_.stride % kPage || cfg_.stride < cfg_.row_bytes ||
      cfg_.row_bytes > (1u << 31)) {
    throw std::invalid_argument(
        "invalid store geometry: n_layers " + std::to_string(cfg_.n_layers) + ", n_experts " +
        std::to_string(cfg_.n_experts) + ", row_bytes " + std::to_string(cfg_.row_bytes) +
        ", stride " + std::to_string(cfg_.stride));
  }
  if (layer_written_.size() != cfg_.n_layers || crcs_.size() != n_rows) {
    throw std::invalid_argument("layer_written / crcs do not match the geometry");
  }
  fd_buf_ = ::open(cfg_.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_buf_ < 0) {
    int e = errno;
    throw IoError(e, "cannot open pack " + cfg_.path + ": " + errstr(e));
  }
  struct stat sb;
  const bool any_written =
      std::any_of(layer_written_.begin(), layer_written_.end(), [](uint8_t w) { return w != 0; });
  if (any_written && ::fstat(fd_buf_, &sb) == 0 && uint64_t(sb.st_size) < n_rows * cfg_.stride) {
    ::close(fd_buf_);
    throw IoError(EIO, "pack " + cfg_.path + " holds " + std::to_string(sb.st_size) +
                           " bytes, expected " + std::to_string(n_rows * cfg_.stride) +
                           " (n_layers*n_experts*stride); delete it to rebuild");
  }
  try {
    arena_ = std::make_shared<Mapping>(cfg_.arena_slots * cfg_.stride, cfg_.populate);
    stage_ = std::make_shared<Mapping>(cfg_.stage_slots * cfg_.stride, cfg_.populate);
    EngineChoice ch =
        choose_engine(cfg_.engine, cfg_.readers, cfg_.faults, cfg_.queue_depth, cfg_.direct == 0);
    engine_ = std::move(ch.engine);
    engine_reason_ = ch.reason;
  } catch (...) {
    ::close(fd_buf_);
    throw;
  }

  // O_DIRECT: open, then one aligned probe read through the engine (a filesystem may accept the
  // open and refuse the reads).
  if (cfg_.direct != 0) {
    int fd = ::open(cfg_.path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
    int err = fd < 0 ? errno : 0;
    if (fd >= 0) {
      Mapping probe(kPage);
      ReadOp op;
      op.fd = fd;
      op.direct = true;
      op.len = kPage;
      op.dst = probe.base;
      engine_->read_all(&op, 1);
      if (op.result != int64_t(kPage)) {
        err = op.result < 0 ? int(-op.result) : EIO;
        ::close(fd);
        fd = -1;
      }
    }
    if (fd >= 0) {
      fd_direct_ = fd;
      direct_ = true;
      direct_reason_ = cfg_.direct == 1 ? "O_DIRECT requested" : "O_DIRECT accepted (probe read)";
    } else if (cfg_.direct == 1) {
      ::close(fd_buf_);
      throw IoError(err, "O_DIRECT requested but refused for " + cfg_.path + ": " + errstr(err) +
                             "; open with direct='auto' or direct=False");
    } else {
      direct_reason_ = "O_DIRECT refused (" + errstr(err) + "); buffered reads";
      events_.push_back("moet-store: O_DIRECT refused for " + cfg_.path + " (" + errstr(err) +
                        "); using buffered reads");
    }
  } else {
    direct_reason_ = "buffered reads requested (direct=False)";
  }
  std::vector<int> fds{fd_buf_};
  if (fd_direct_ >= 0) fds.push_back(fd_direct_);
  engine_->register_files(fds);
  if (cfg_.register_buffers) {
    std::vector<Region> regions;
    if (arena_->len) regions.push_back({arena_->base, arena_->len});
    if (stage_->len) regions.push_back({stage_->base, stage_->len});
    engine_->register_buffers(regions);
  }

  row_slot_.assign(n_rows, -1);
  slot_row_.assign(cfg_.arena_slots, -1);
  pins_.assign(cfg_.arena_slots, 0);
  prev_.assign(cfg_.arena_slots, -1);
  next_.assign(cfg_.arena_slots, -1);
  for (int64_t s = int64_t(cfg_.arena_slots) - 1; s >= 0; --s) free_.push_back(s);
  for (int64_t s = int64_t(cfg_.stage_slots) - 1; s >= 0; --s) stage_free_.push_back(s);
  lat_.reserve(8192);
  lat_miss_.reserve(8192);
}

Store::~Store() { close(); }

void Store::close() {
  std::lock_guard<std::mutex> g(mu_);
  if (closed_) return;
  closed_ = true;
  engine_.reset();
  if (fd_direct_ >= 0) ::close(fd_direct_);
  if (fd_buf_ >= 0) ::close(fd_buf_);
  fd_direct_ = fd_buf_ = -1;
}

void Store::lru_unlink(int64_t s) {
  if (prev_[s] >= 0) next_[prev_[s]] = next_[s];
  if (next_[s] >= 0) prev_[next_[s]] = prev_[s];
  if (head_ == s) head_ = next_[s];
  if (tail_ == s) tail_ = prev_[s];
  prev_[s] = next_[s] = -1;
}

void Store::lru_push_front(int64_t s) {
  prev_[s] = -1;
  next_[s] = head_;
  if (head_ >= 0) prev_[head_] = s;
  head_ = s;
  if (tail_ < 0) tail_ = s;
}

void Store::lru_push_back(int64_t s) {
  next_[s] = -1;
  prev_[s] = tail_;
  if (tail_ >= 0) next_[tail_] = s;
  tail_ = s;
  if (head_ < 0) head_ = s;
}

int64_t Store::take_free_slot() {
  if (free_.empty()) return -1;
  int64_t s = free_.back();
  free_.pop_back();
  return s;
}

int64_t Store::take_victim() {
  for (int64_t s = tail_; s >= 0; s = prev_[s]) {
    if (pins_[s] == 0) {
      lru_unlink(s);
      row_slot_[slot_row_[s]] = -1;
      slot_row_[s] = -1;
      ++st_.evictions;
      return s;
    }
  }
  return -1;
}

int64_t Store::take_stage_slot() {
  if (stage_free_.empty()) return -1;
  int64_t s = stage_free_.back();
  stage_free_.pop_back();
  return s;
}

void Store::demote_direct(const std::string& why) {
  direct_ = false;
  direct_reason_ = "demoted to buffered reads: " + why;
  events_.push_back("moet-store: O_DIRECT reads of " + cfg_.path + " failed (" + why +
                    "); demoted to buffered reads for the rest of this store's life");
}

void Store::record_latency(uint64_t ns, bool miss) {
  uint32_t v = uint32_t(std::min<uint64_t>(ns, 0xffffffffu));
  auto push = [v](std::vector<uint32_t>& ring, size_t& pos) {
    if (ring.size() < 8192) {
      ring.push_back(v);
    } else {
      ring[pos] = v;
      pos = (pos + 1) % 8192;
    }
  };
  push(lat_, lat_pos_);
  if (miss) push(lat_miss_, lat_miss_pos_);
}

std::shared_ptr<BatchState> Store::fetch(const int64_t* keys, size_t n, bool scan) {
  const uint64_t t0 = now_ns();
  std::lock_guard<std::mutex> g(mu_);
  if (closed_) throw IoError(EBADF, "store for " + cfg_.path + " is closed");
  const uint32_t E = cfg_.n_experts;
  std::vector<int64_t> rows(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t l = keys[2 * i], e = keys[2 * i + 1];
    if (l < 0 || l >= int64_t(cfg_.n_layers) || e < 0 || e >= int64_t(E)) {
      throw std::out_of_range("key #" + std::to_string(i) + " (" + std::to_string(l) + ", " +
                              std::to_string(e) + ") is out of range: expected 0 <= layer < " +
                              std::to_string(cfg_.n_layers) + " and 0 <= expert < " +
                              std::to_string(E));
    }
    if (!layer_written_[l]) {
      throw IoError(ENODATA, "row (" + std::to_string(l) + ", " + std::to_string(e) +
                                 ") is not in pack " + cfg_.path + ": layer " + std::to_string(l) +
                                 " was never written (or the pack was stale); write it with "
                                 "open_pack_for_write(...).write_layer() and reopen the store");
    }
    rows[i] = l * E + e;
  }
  auto b = std::make_shared<BatchState>();
  b->ptrs.assign(n, nullptr);
  b->slots.assign(n, -1);
  b->src.assign(n, 0);
  b->off.assign(n, 0);
  b->hit.assign(n, 0);
  const uint64_t stride = cfg_.stride;

  // Hits first: pinning them keeps this batch's slots out of the victim search below.
  std::vector<std::pair<int64_t, size_t>> miss;  // (row, index)
  for (size_t i = 0; i < n; ++i) {
    int64_t s = row_slot_[rows[i]];
    if (s >= 0) {
      ++pins_[s];
      b->slots[i] = s;
      b->off[i] = uint64_t(s) * stride;
      b->ptrs[i] = arena_->base + b->off[i];
      b->hit[i] = 1;
      if (!scan && head_ != s) {
        lru_unlink(s);
        lru_push_front(s);
      }
    } else {
      miss.emplace_back(rows[i], i);
    }
  }
  st_.fetches++;
  st_.rows += n;
  st_.hits += n - miss.size();
  st_.misses += miss.size();
  if (scan) st_.scan_rows += n;
  if (miss.empty()) {
    ++leased_;
    record_latency(now_ns() - t0, false);
    return b;
  }
  std::sort(miss.begin(), miss.end());

  struct Dest {
    int64_t row;
    int src;  // 0 arena, 1 stage, 2 temp
    int64_t slot;
    uint64_t off;
    uint8_t* ptr;
    std::shared_ptr<Mapping> temp;
  };
  std::vector<Dest> dests;
  bool overflow = false;
  for (size_t k = 0; k < miss.size(); ++k) {
    if (k > 0 && miss[k].first == miss[k - 1].first) continue;
    Dest d{miss[k].first, 0, -1, 0, nullptr, nullptr};
    int64_t s = take_free_slot();
    if (s < 0 && !scan) s = take_victim();
    if (s >= 0) {
      ++pins_[s];
      d.slot = s;
      d.off = uint64_t(s) * stride;
      d.ptr = arena_->base + d.off;
    } else {
      int64_t ss = take_stage_slot();
      if (ss >= 0) {
        d.src = 1;
        d.slot = ss;
        d.off = uint64_t(ss) * stride;
        d.ptr = stage_->base + d.off;
      } else {
        d.src = 2;
        d.temp = std::make_shared<Mapping>(stride);
        d.ptr = d.temp->base;
        ++st_.temp_rows;
        overflow = true;
      }
      if (cfg_.arena_slots > 0 && !scan) {
        ++st_.overflow_rows;
        overflow = true;
      }
    }
    dests.push_back(std::move(d));
  }

  auto build_ops = [&](std::vector<ReadOp>& ops, const std::vector<size_t>& which) {
    ops.clear();
    for (size_t k : which) {
      ReadOp op;
      op.direct = direct_;
      op.fd = direct_ ? fd_direct_ : fd_buf_;
      op.file_index = direct_ ? 1 : 0;
      op.offset = uint64_t(dests[k].row) * stride;
      op.len = uint32_t(direct_ ? stride : cfg_.row_bytes);
      op.dst = dests[k].ptr;
      op.crc_len = cfg_.verify ? uint32_t(cfg_.row_bytes) : 0;
      ops.push_back(op);
    }
  };
  std::vector<size_t> all(dests.size());
  for (size_t k = 0; k < all.size(); ++k) all[k] = k;
  std::vector<ReadOp> ops;
  std::vector<int64_t> result(dests.size(), 0);
  std::vector<int64_t> crc_of(dests.size(), -1);  // computed by the reading thread, or -1
  auto rollback = [&]() {
    for (auto& d : dests) {
      if (d.src == 0) {
        --pins_[d.slot];
        free_.push_back(d.slot);
      } else if (d.src == 1) {
        stage_free_.push_back(d.slot);
      }
    }
    for (size_t i = 0; i < n; ++i)
      if (b->hit[i]) --pins_[b->slots[i]];
  };
  try {
    build_ops(ops, all);
    engine_->read_all(ops.data(), ops.size());
    for (size_t k = 0; k < ops.size(); ++k) {
      result[k] = ops[k].result;
      if (ops[k].crc_done) crc_of[k] = ops[k].crc;
    }
    if (direct_) {
      std::vector<size_t> redo;
      for (size_t k = 0; k < ops.size(); ++k)
        if (result[k] == -EINVAL) redo.push_back(k);
      if (!redo.empty()) {
        demote_direct("EINVAL on a read at offset " + std::to_string(ops[redo[0]].offset));
        build_ops(ops, redo);
        engine_->read_all(ops.data(), ops.size());
        for (size_t j = 0; j < redo.size(); ++j) {
          result[redo[j]] = ops[j].result;
          crc_of[redo[j]] = ops[j].crc_done ? int64_t(ops[j].crc) : -1;
        }
      }
    }
  } catch (...) {
    rollback();
    throw;
  }
  st_.reads += dests.size();
  std::string err;
  int err_no = 0;
  for (size_t k = 0; k < dests.size(); ++k) {
    const Dest& d = dests[k];
    if (result[k] < 0) {
      ++st_.read_errors;
      if (!err_no) {
        err_no = int(-result[k]);
        err = "reading row " + key_str(d.row, E) + " of " + cfg_.path + " at offset " +
              std::to_string(uint64_t(d.row) * stride) + " failed: " + errstr(err_no) +
              "; nothing from this batch was published (the arena is unchanged); retry, or "
              "check the disk";
      }
      continue;
    }
    st_.bytes += uint64_t(result[k]);
    if (cfg_.verify) {
      uint32_t c = crc_of[k] >= 0 ? uint32_t(crc_of[k]) : crc32c(d.ptr, cfg_.row_bytes);
      if (c != crcs_[d.row]) {
        ++st_.checksum_errors;
        if (!err_no) {
          err_no = EBADMSG;
          char b2[64];
          std::snprintf(b2, sizeof b2, "expected CRC-32C %08x, found %08x", crcs_[d.row], c);
          err = "row " + key_str(d.row, E) + " of " + cfg_.path + " failed its checksum (" + b2 +
                "): the pack was modified or is corrupt; delete it (and its .json sidecar) "
                "to rebuild";
        }
      }
    }
  }
  if (err_no) {
    rollback();
    throw IoError(err_no, err);
  }
  // Publish (transactional: only now do the new rows become visible).
  std::vector<int64_t> dest_of_row;  // parallel to dests for lookup by sorted row
  for (auto& d : dests) {
    if (d.src == 0) {
      slot_row_[d.slot] = d.row;
      row_slot_[d.row] = d.slot;
      if (scan) {
        lru_push_back(d.slot);
      } else {
        lru_push_front(d.slot);
      }
    } else if (d.src == 1) {
      b->owned_stage.push_back(d.slot);
    } else {
      b->temps.push_back(d.temp);
    }
  }
  size_t di = 0;
  for (size_t k = 0; k < miss.size(); ++k) {
    if (k > 0 && miss[k].first != miss[k - 1].first) ++di;
    const Dest& d = dests[di];
    size_t i = miss[k].second;
    b->ptrs[i] = d.ptr;
    b->off[i] = d.off;
    if (d.src == 0) {
      b->slots[i] = d.slot;
      if (k > 0 && miss[k].first == miss[k - 1].first) ++pins_[d.slot];
    } else if (d.src == 1) {
      b->src[i] = 1;
    } else {
      b->src[i] = 2;
      b->temp_index.resize(n, -1);
      b->temp_index[i] = int64_t(b->temps.size()) - 1;
      for (size_t t = 0; t < b->temps.size(); ++t)
        if (b->temps[t] == d.temp) b->temp_index[i] = int64_t(t);
    }
  }
  if (overflow) ++overflow_events_;
  if (overflow && (overflow_events_ & (overflow_events_ - 1)) == 0) {  // log the 1st, 2nd, 4th...
    events_.push_back("moet-store: batch of " + std::to_string(n) + " rows overflowed the arena (" +
                      std::to_string(cfg_.arena_slots) + " slots) of " + cfg_.path +
                      "; served from the stage buffer (raise arena_bytes or stage_bytes); "
                      "overflowed batches so far: " +
                      std::to_string(overflow_events_));
  }
  ++leased_;
  record_latency(now_ns() - t0, true);
  return b;
}

void Store::unlease_locked(BatchState& b) {
  if (b.released) return;
  b.released = true;
  for (int64_t s : b.slots)
    if (s >= 0) --pins_[s];
  for (int64_t s : b.owned_stage) stage_free_.push_back(s);
  b.owned_stage.clear();
  --leased_;
}

void Store::release(BatchState& b) {
  std::lock_guard<std::mutex> g(mu_);
  unlease_locked(b);
}

size_t Store::leased_batches() const {
  std::lock_guard<std::mutex> g(mu_);
  return leased_;
}

int64_t Store::row_slot(int64_t row) const {
  std::lock_guard<std::mutex> g(mu_);
  if (row < 0 || size_t(row) >= row_slot_.size()) return -1;
  return row_slot_[row];
}

std::vector<int64_t> Store::hot_rows(size_t limit) const {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<int64_t> out;
  for (int64_t s = head_; s >= 0 && out.size() < limit; s = next_[s]) out.push_back(slot_row_[s]);
  return out;
}

size_t Store::preheat(const std::vector<int64_t>& rows) {
  std::vector<int64_t> keys;
  {
    std::lock_guard<std::mutex> g(mu_);
    size_t room = free_.size();
    for (int64_t r : rows) {
      if (keys.size() / 2 >= room) break;
      if (r < 0 || size_t(r) >= row_slot_.size() || row_slot_[r] >= 0 || !row_present(r)) continue;
      keys.push_back(r / cfg_.n_experts);
      keys.push_back(r % cfg_.n_experts);
    }
  }
  if (keys.empty()) return 0;
  auto b = fetch(keys.data(), keys.size() / 2, true);
  release(*b);
  return keys.size() / 2;
}

Stats Store::stats() const {
  std::lock_guard<std::mutex> g(mu_);
  return st_;
}

std::vector<double> Store::latency_us(bool miss_only) const {
  std::lock_guard<std::mutex> g(mu_);
  const auto& src = miss_only ? lat_miss_ : lat_;
  std::vector<double> out(src.size());
  for (size_t i = 0; i < src.size(); ++i) out[i] = src[i] / 1000.0;
  return out;
}

std::vector<std::string> Store::take_events() {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<std::string> out;
  out.swap(events_);
  return out;
}

}  // namespace moet

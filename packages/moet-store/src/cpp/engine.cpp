#include "engine.hpp"

#include <fcntl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "crc32c.hpp"

namespace moet {

void check_direct_alignment(const ReadOp& op) {
  if (!op.direct) return;
  auto addr = reinterpret_cast<uintptr_t>(op.dst);
  if (op.offset % kPage || op.len % kPage || addr % kPage) {
    throw std::invalid_argument(
        "misaligned O_DIRECT read: offset " + std::to_string(op.offset) + ", length " +
        std::to_string(op.len) + ", buffer address 0x" +
        [&] {
          char b[32];
          std::snprintf(b, sizeof b, "%llx", static_cast<unsigned long long>(addr));
          return std::string(b);
        }() +
        "; expected all three to be multiples of 4096 (use a page-aligned buffer and "
        "stride-aligned offsets, or open without direct)");
  }
}

void Engine::read_all(ReadOp* ops, size_t n) {
  for (size_t i = 0; i < n; ++i) check_direct_alignment(ops[i]);
  std::vector<size_t> pending;
  std::vector<uint32_t> done(n, 0);
  pending.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (ops[i].len == 0) {
      ops[i].result = 0;
    } else {
      pending.push_back(i);
    }
  }
  std::vector<ReadOp> sub;
  for (int round = 0; !pending.empty(); ++round) {
    sub.clear();
    for (size_t i : pending) {
      ReadOp s = ops[i];
      s.offset += done[i];
      s.len -= done[i];
      s.dst += done[i];
      s.result = 0;
      s.crc_done = false;
      if (done[i] != 0) s.crc_len = 0;
      sub.push_back(s);
    }
    submit(sub.data(), sub.size());
    std::vector<size_t> next;
    for (size_t k = 0; k < sub.size(); ++k) {
      size_t i = pending[k];
      int64_t r = sub[k].result;
      if (r < 0) {
        ops[i].result = r;
      } else if (r == 0) {
        ops[i].result = -EIO;  // unexpected end of file: the pack is shorter than its sidecar says
      } else {
        if (done[i] == 0 && r == int64_t(ops[i].len) && sub[k].crc_done) {
          ops[i].crc = sub[k].crc;
          ops[i].crc_done = true;
        }
        done[i] += static_cast<uint32_t>(r);
        if (done[i] >= ops[i].len) {
          ops[i].result = ops[i].len;
        } else if (round >= 64) {
          ops[i].result = -EIO;
        } else {
          next.push_back(i);
        }
      }
    }
    pending.swap(next);
  }
}

// ---------------------------------------------------------------- pread pool

static int64_t do_pread(const ReadOp& op) {
  for (;;) {
    ssize_t r = ::pread(op.fd, op.dst, op.len, static_cast<off_t>(op.offset));
    if (r >= 0) return r;
    if (errno == EINTR) continue;
    return -static_cast<int64_t>(errno);
  }
}

// Reads a row in cache-sized chunks and folds each chunk into the CRC right after it lands, so the
// checksum reads from this core's cache instead of re-reading a multi-MiB row from DRAM. A short
// read ends the op early (the caller completes it; the CRC is then left to it).
static void pread_crc(ReadOp& op) {
  constexpr uint32_t kChunk = 256u << 10;  // a multiple of 4096: O_DIRECT-safe
  uint32_t crc = 0;
  uint32_t done = 0;
  while (done < op.len) {
    ReadOp part = op;
    part.offset += done;
    part.dst += done;
    part.len = std::min(kChunk, op.len - done);
    int64_t r = do_pread(part);
    if (r < 0) {
      op.result = r;
      return;
    }
    if (done < op.crc_len) {
      crc = crc32c(part.dst, std::min<uint64_t>(uint64_t(r), op.crc_len - done), crc);
    }
    done += uint32_t(r);
    if (r < int64_t(part.len)) break;
  }
  op.result = done;
  op.crc = crc;
  op.crc_done = done == op.len;
}

PreadPool::PreadPool(int threads) : threads_(threads < 1 ? 1 : threads) {
  for (int i = 1; i < threads_; ++i) workers_.emplace_back([this] { worker(); });
}

PreadPool::~PreadPool() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  for (auto& t : workers_) t.join();
}

void PreadPool::run_ops() {
  for (;;) {
    size_t i = next_.fetch_add(1);
    if (i >= n_) return;
    ReadOp& op = ops_[i];
    if (op.crc_len && op.crc_len <= op.len) {
      pread_crc(op);
    } else {
      op.result = do_pread(op);
    }
    if (remaining_.fetch_sub(1) == 1) {
      std::lock_guard<std::mutex> g(mu_);
      cv_done_.notify_all();
    }
  }
}

void PreadPool::worker() {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_work_.wait(lk, [&] { return stop_ || gen_ != seen; });
    if (stop_) return;
    seen = gen_;
    ++active_;
    lk.unlock();
    run_ops();
    lk.lock();
    if (--active_ == 0) cv_done_.notify_all();
  }
}

void PreadPool::submit(ReadOp* ops, size_t n) {
  if (n == 0) return;
  if (n == 1 || workers_.empty()) {
    ops_ = ops;
    n_ = n;
    next_.store(0);
    remaining_.store(n);
    run_ops();
    ops_ = nullptr;
    n_ = 0;
    return;
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    ops_ = ops;
    n_ = n;
    next_.store(0);
    remaining_.store(n);
    ++gen_;
  }
  cv_work_.notify_all();
  run_ops();  // the caller reads too
  std::unique_lock<std::mutex> lk(mu_);
  cv_done_.wait(lk, [&] { return remaining_.load() == 0 && active_ == 0; });
  ops_ = nullptr;
  n_ = 0;
}

// ---------------------------------------------------------------- faults

FaultEngine::FaultEngine(std::unique_ptr<Engine> inner, FaultConfig cfg)
    : inner_(std::move(inner)), cfg_(cfg) {}

void FaultEngine::submit(ReadOp* ops, size_t n) {
  if (cfg_.stall_us) std::this_thread::sleep_for(std::chrono::microseconds(cfg_.stall_us));
  std::vector<ReadOp> pass;
  std::vector<size_t> where;
  for (size_t i = 0; i < n; ++i) {
    int64_t k = ++count_;
    ReadOp& op = ops[i];
    if (cfg_.odirect_refused && op.direct) {
      op.result = -EINVAL;
      continue;
    }
    if ((cfg_.eio_every && k % cfg_.eio_every == 0) ||
        (cfg_.eio_after >= 0 && k > cfg_.eio_after)) {
      op.result = -EIO;
      continue;
    }
    ReadOp p = op;
    if (cfg_.short_read_every && k % cfg_.short_read_every == 0) {
      uint32_t half = p.len / 2;
      if (p.direct) half = static_cast<uint32_t>(half / kPage * kPage);
      if (half > 0) p.len = half;
    }
    pass.push_back(p);
    where.push_back(i);
  }
  if (!pass.empty()) inner_->submit(pass.data(), pass.size());
  for (size_t k = 0; k < pass.size(); ++k) {
    ReadOp& op = ops[where[k]];
    op.result = pass[k].result;
    op.crc_done = pass[k].crc_done && pass[k].len == op.len;
    op.crc = pass[k].crc;
  }
}

// ---------------------------------------------------------------- choice

EngineChoice choose_engine(const std::string& kind, int readers, const FaultConfig& faults,
                           unsigned queue_depth, bool buffered_only) {
  EngineChoice c;
  if (kind != "auto" && kind != "io_uring" && kind != "pread") {
    throw std::invalid_argument("engine must be 'auto', 'io_uring' or 'pread', got '" + kind + "'");
  }
  if (kind == "pread") {
    c.engine = std::make_unique<PreadPool>(readers);
    c.reason = "pread requested";
  } else if (kind == "auto" && buffered_only) {
    c.engine = std::make_unique<PreadPool>(readers);
    c.reason =
        "buffered reads only: the pread pool (it scales with readers; io_uring is kept "
        "for O_DIRECT)";
  } else {
    UringProbe p = probe_uring();
    if (p.ok) {
      c.engine = make_uring_engine(queue_depth < 1 ? 1 : queue_depth, readers);
      c.reason = kind == "auto" ? "io_uring available (probe: io_uring_setup succeeded)"
                                : "io_uring requested";
    } else if (kind == "io_uring") {
      throw IoError(p.err ? p.err : ENOSYS, "io_uring requested but " + p.reason);
    } else {
      c.engine = std::make_unique<PreadPool>(readers);
      c.reason = "io_uring " + p.state + ": " + p.reason + "; using the pread pool";
    }
  }
  if (faults.any()) {
    c.engine = std::make_unique<FaultEngine>(std::move(c.engine), faults);
    c.reason += " (+fault injection)";
  }
  return c;
}

// ---------------------------------------------------------------- writes

std::vector<uint32_t> write_rows(int fd, const uint8_t* src, size_t n, uint64_t row_bytes,
                                 uint64_t stride, uint64_t offset, const FaultConfig& faults,
                                 int64_t* written) {
  std::vector<uint32_t> crcs(n);
  const uint64_t chunk_rows = std::max<uint64_t>(1, (8u << 20) / stride);
  std::vector<uint8_t> buf(chunk_rows * stride);
  for (size_t r0 = 0; r0 < n; r0 += chunk_rows) {
    size_t cnt = std::min<size_t>(chunk_rows, n - r0);
    for (size_t k = 0; k < cnt; ++k) {
      const uint8_t* row = src + (r0 + k) * row_bytes;
      crcs[r0 + k] = crc32c(row, row_bytes);
      std::memcpy(buf.data() + k * stride, row, row_bytes);
      std::memset(buf.data() + k * stride + row_bytes, 0, stride - row_bytes);
    }
    uint64_t len = cnt * stride, off = offset + r0 * stride, done = 0;
    while (done < len) {
      uint64_t want = len - done;
      bool inject = false;
      if (faults.enospc_after_bytes >= 0) {
        int64_t budget = faults.enospc_after_bytes - *written;
        if (budget <= 0) {
          inject = true;
        } else if (static_cast<uint64_t>(budget) < want) {
          want = static_cast<uint64_t>(budget);
        }
      }
      if (inject) throw IoError(ENOSPC, "No space left on device (injected)");
      ssize_t w = ::pwrite(fd, buf.data() + done, want, static_cast<off_t>(off + done));
      if (w < 0) {
        if (errno == EINTR) continue;
        int e = errno;
        throw IoError(e, errstr(e));
      }
      done += static_cast<uint64_t>(w);
      *written += w;
    }
  }
  return crcs;
}

}  // namespace moet

// The io_uring engine (liburing, linked statically with hidden symbols) and its probe.
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>

#include "engine.hpp"

#if MOET_HAVE_LIBURING
#include <liburing.h>
#endif

namespace moet {

bool uring_built() { return MOET_HAVE_LIBURING != 0; }

#if !MOET_HAVE_LIBURING

UringProbe probe_uring() {
  UringProbe p;
  p.state = "not built";
  p.err = ENOSYS;
  p.reason = "this build has no io_uring (built without liburing / MOET_WITH_LIBURING=OFF)";
  return p;
}

std::unique_ptr<Engine> make_uring_engine(unsigned, int) {
  throw IoError(ENOSYS, "io_uring engine not built (MOET_WITH_LIBURING=OFF or liburing absent)");
}

#else

UringProbe probe_uring() {
  UringProbe p;
  {
    std::ifstream f("/proc/sys/kernel/io_uring_disabled");
    int v = 0;
    if (f && (f >> v) && v == 2) {
      p.state = "disabled";
      p.err = EPERM;
      p.reason = "io_uring disabled by sysctl kernel.io_uring_disabled=2";
      return p;
    }
  }
  struct io_uring ring;
  int r = io_uring_queue_init(4, &ring, 0);
  if (r == 0) {
    io_uring_queue_exit(&ring);
    p.ok = true;
    p.state = "available";
    p.reason = "io_uring_setup succeeded";
    return p;
  }
  p.err = -r;
  if (r == -EPERM || r == -EACCES) {
    p.state = "blocked";
    p.reason = "io_uring_setup returned " + errstr(r) +
               " (blocked: seccomp filter, e.g. Docker's default profile, or a sysctl)";
  } else if (r == -ENOSYS) {
    p.state = "absent";
    p.reason = "io_uring_setup returned ENOSYS (kernel without io_uring)";
  } else if (r == -ENOMEM) {
    p.state = "error";
    p.reason = "io_uring_setup returned ENOMEM (memlock limit too small for the ring)";
  } else {
    p.state = "error";
    p.reason = "io_uring_setup returned " + errstr(r);
  }
  return p;
}

namespace {

class UringEngine : public Engine {
 public:
  UringEngine(unsigned depth, int readers) : depth_(depth), readers_(readers) {
    int r = io_uring_queue_init(depth, &ring_, 0);
    if (r < 0) throw IoError(-r, "io_uring_queue_init failed: " + errstr(r));
  }
  ~UringEngine() override { io_uring_queue_exit(&ring_); }
  std::string name() const override { return "io_uring"; }
  int readers() const override { return readers_; }
  bool buffers_registered() const override { return !bufs_.empty(); }
  bool files_registered() const override { return files_; }
  std::string register_note() const override { return note_; }

  void register_files(const std::vector<int>& fds) override {
    if (files_) {
      io_uring_unregister_files(&ring_);
      files_ = false;
    }
    if (fds.empty()) return;
    int r = io_uring_register_files(&ring_, fds.data(), static_cast<unsigned>(fds.size()));
    files_ = r == 0;
    fds_ = fds;
    if (r < 0) note_ += "files not registered (" + errstr(r) + "); ";
  }

  void register_buffers(const std::vector<Region>& regions) override {
    if (!bufs_.empty()) {
      io_uring_unregister_buffers(&ring_);
      bufs_.clear();
    }
    // The kernel caps one registered buffer at 1 GiB: split regions into page-aligned chunks.
    const size_t cap = size_t(1) << 30;
    std::vector<struct iovec> iov;
    for (const Region& rg : regions) {
      size_t off = 0;
      while (off < rg.len) {
        size_t len = std::min(cap, rg.len - off);
        iov.push_back({static_cast<uint8_t*>(rg.base) + off, len});
        off += len;
      }
    }
    if (iov.empty()) return;
    int r = io_uring_register_buffers(&ring_, iov.data(), static_cast<unsigned>(iov.size()));
    if (r == 0) {
      bufs_ = iov;
      note_ += "buffers registered; ";
    } else {
      struct rlimit rl;
      getrlimit(RLIMIT_MEMLOCK, &rl);
      size_t total = 0;
      for (auto& v : iov) total += v.iov_len;
      char b[256];
      std::snprintf(b, sizeof b,
                    "buffers not registered: %s (RLIMIT_MEMLOCK %llu bytes < %zu bytes needed, "
                    "or no CAP_IPC_LOCK); unregistered reads",
                    errstr(r).c_str(), static_cast<unsigned long long>(rl.rlim_cur), total);
      note_ += b;
      note_ += "; ";
    }
  }

  void submit(ReadOp* ops, size_t n) override {
    size_t next = 0, inflight = 0;
    while (next < n || inflight > 0) {
      size_t queued = 0;
      while (next < n && inflight + queued < depth_) {
        struct io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
        if (!sqe) break;
        ReadOp& op = ops[next];
        int buf = find_buf(op.dst, op.len);
        int fd = op.fd;
        bool fixed_file = files_ && op.file_index >= 0;
        if (fixed_file) fd = op.file_index;
        if (buf >= 0) {
          io_uring_prep_read_fixed(sqe, fd, op.dst, op.len, op.offset, buf);
        } else {
          io_uring_prep_read(sqe, fd, op.dst, op.len, op.offset);
        }
        if (fixed_file) sqe->flags |= IOSQE_FIXED_FILE;
        // Buffered reads of a batch: punt to io-wq so page-cache copies run on several threads.
        if (!op.direct && n > 1 && readers_ > 1) sqe->flags |= IOSQE_ASYNC;
        io_uring_sqe_set_data64(sqe, next);
        ++next;
        ++queued;
      }
      int r = io_uring_submit_and_wait(&ring_, 1);
      if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY) {
        // The ring itself failed: fail everything not yet completed.
        for (size_t i = 0; i < n; ++i)
          if (ops[i].result == 0) ops[i].result = r;
        drain(inflight + queued);
        return;
      }
      inflight += queued;
      struct io_uring_cqe* cqe;
      unsigned head, seen = 0;
      io_uring_for_each_cqe(&ring_, head, cqe) {
        ops[io_uring_cqe_get_data64(cqe)].result = cqe->res;
        ++seen;
      }
      io_uring_cq_advance(&ring_, seen);
      inflight -= seen;
    }
  }

 private:
  void drain(size_t count) {
    while (count > 0) {
      struct io_uring_cqe* cqe;
      if (io_uring_wait_cqe(&ring_, &cqe) < 0) return;
      io_uring_cqe_seen(&ring_, cqe);
      --count;
    }
  }
  int find_buf(const uint8_t* p, uint32_t len) const {
    for (size_t i = 0; i < bufs_.size(); ++i) {
      auto* b = static_cast<const uint8_t*>(bufs_[i].iov_base);
      if (p >= b && p + len <= b + bufs_[i].iov_len) return static_cast<int>(i);
    }
    return -1;
  }

  struct io_uring ring_;
  unsigned depth_;
  int readers_;
  bool files_ = false;
  std::vector<int> fds_;
  std::vector<struct iovec> bufs_;
  std::string note_;
};

}  // namespace

std::unique_ptr<Engine> make_uring_engine(unsigned depth, int readers) {
  return std::make_unique<UringEngine>(depth, readers);
}

#endif

}  // namespace moet

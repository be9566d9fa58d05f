// C++ unit suite of the moet-store core (ctest). A tiny assert framework, no dependencies.
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "crc32c.hpp"
#include "engine.hpp"
#include "store.hpp"

using namespace moet;

namespace {

int g_failed = 0, g_checks = 0;
std::vector<std::pair<std::string, std::function<void()>>>& registry() {
  static std::vector<std::pair<std::string, std::function<void()>>> r;
  return r;
}
struct Reg {
  Reg(const char* n, std::function<void()> f) { registry().emplace_back(n, std::move(f)); }
};

#define TEST(name)                    \
  static void name();                 \
  static Reg reg_##name(#name, name); \
  static void name()
#define CHECK(c)                                                          \
  do {                                                                    \
    ++g_checks;                                                           \
    if (!(c)) {                                                           \
      ++g_failed;                                                         \
      std::fprintf(stderr, "  FAIL %s:%d: %s\n", __FILE__, __LINE__, #c); \
    }                                                                     \
  } while (0)
#define CHECK_THROWS(expr, T) \
  do {                        \
    bool thrown = false;      \
    try {                     \
      expr;                   \
    } catch (const T&) {      \
      thrown = true;          \
    }                         \
    CHECK(thrown);            \
  } while (0)

struct TmpPack {
  std::string dir, path;
  uint32_t L, E;
  uint64_t row_bytes, stride;
  std::vector<uint8_t> data;  // L*E*row_bytes, the expected rows
  std::vector<uint32_t> crcs;
  TmpPack(uint32_t L_, uint32_t E_, uint64_t rb) : L(L_), E(E_), row_bytes(rb) {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : P_tmpdir) + "/moet-store-cxx-XXXXXX";
    dir = mkdtemp(tmpl.data());
    path = dir + "/p.pack";
    stride = round_up(rb, kPage);
    data.resize(size_t(L) * E * rb);
    std::mt19937 g(1234);
    for (auto& b : data) b = uint8_t(g());
    int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0644);
    if (ftruncate(fd, off_t(uint64_t(L) * E * stride)) != 0) std::abort();
    int64_t written = 0;
    crcs = write_rows(fd, data.data(), size_t(L) * E, rb, stride, 0, FaultConfig{}, &written);
    ::close(fd);
  }
  ~TmpPack() {
    ::unlink(path.c_str());
    ::rmdir(dir.c_str());
  }
  const uint8_t* row(int64_t r) const { return data.data() + r * row_bytes; }
  StoreConfig cfg(uint64_t arena_slots, const std::string& engine, int direct) const {
    StoreConfig c;
    c.path = path;
    c.n_layers = L;
    c.n_experts = E;
    c.row_bytes = row_bytes;
    c.stride = stride;
    c.arena_slots = arena_slots;
    c.stage_slots = 4;
    c.engine = engine;
    c.direct = direct;
    c.readers = 2;
    return c;
  }
  std::unique_ptr<Store> open(uint64_t arena_slots, const std::string& engine = "pread",
                              int direct = 0, FaultConfig f = {}) const {
    StoreConfig c = cfg(arena_slots, engine, direct);
    c.faults = f;
    return std::make_unique<Store>(c, std::vector<uint8_t>(L, 1), crcs);
  }
};

std::vector<std::string> engines() {
  std::vector<std::string> e{"pread"};
  if (probe_uring().ok) e.push_back("io_uring");
  return e;
}

bool rows_equal(const TmpPack& p, const BatchState& b, const std::vector<int64_t>& keys) {
  for (size_t i = 0; i < b.ptrs.size(); ++i) {
    int64_t r = keys[2 * i] * p.E + keys[2 * i + 1];
    if (std::memcmp(b.ptrs[i], p.row(r), p.row_bytes) != 0) return false;
  }
  return true;
}

TEST(crc32c_known_vector) {
  const char* s = "123456789";
  CHECK(crc32c(s, 9) == 0xE3069283u);
  CHECK(crc32c(s + 4, 5, crc32c(s, 4)) == 0xE3069283u);
  CHECK(crc32c("", 0) == 0);
  // long buffers take the three-stream path: it must equal byte-wise chaining (one stream)
  std::vector<uint8_t> buf(70000);
  uint32_t x = 12345;
  for (auto& b : buf) b = uint8_t((x = x * 1103515245u + 12345u) >> 24);
  for (size_t n : {3071u, 3072u, 3080u, 4099u, 65536u, 70000u}) {
    uint32_t chained = 0;
    for (size_t i = 0; i < n; i += 1000)
      chained = crc32c(buf.data() + i, std::min<size_t>(1000, n - i), chained);
    CHECK(crc32c(buf.data(), n) == chained);
  }
}

TEST(engine_probe_and_choice) {
  UringProbe p = probe_uring();
  CHECK(!p.state.empty());
  CHECK(!p.reason.empty());
  if (!uring_built()) {
    CHECK(!p.ok);
    CHECK(p.state == "not built");
    CHECK_THROWS(choose_engine("io_uring", 2, {}), IoError);
    EngineChoice c = choose_engine("auto", 2, {});
    CHECK(c.engine->name() == "pread");
    CHECK(c.reason.find("not built") != std::string::npos);
  }
  CHECK_THROWS(choose_engine("bogus", 1, {}), std::invalid_argument);
  // buffered-only stores take the pread pool in auto, whatever io_uring's state
  EngineChoice b = choose_engine("auto", 2, {}, 64, true);
  CHECK(b.engine->name() == "pread");
  CHECK(b.reason.find("buffered reads only") != std::string::npos);
  CHECK(choose_engine("pread", 2, {}, 64, true).engine->name() == "pread");
}

TEST(engines_read_exact_bytes) {
  TmpPack p(3, 5, 5000);
  for (const auto& e : engines()) {
    for (int direct : {0, 1}) {
      EngineChoice c = choose_engine(e, 3, {});
      int fd = ::open(p.path.c_str(), O_RDONLY | (direct ? O_DIRECT : 0));
      CHECK(fd >= 0);
      Mapping buf(15 * p.stride);
      std::vector<ReadOp> ops;
      for (int r = 0; r < 15; ++r) {
        ReadOp op;
        op.fd = fd;
        op.direct = direct;
        op.offset = uint64_t(r) * p.stride;
        op.len = uint32_t(direct ? p.stride : p.row_bytes);
        op.dst = buf.base + r * p.stride;
        ops.push_back(op);
      }
      c.engine->read_all(ops.data(), ops.size());
      for (int r = 0; r < 15; ++r) {
        CHECK(ops[r].result == int64_t(ops[r].len));
        CHECK(std::memcmp(buf.base + r * p.stride, p.row(r), p.row_bytes) == 0);
      }
      ::close(fd);
    }
  }
}

TEST(short_reads_are_completed_and_eio_reported) {
  TmpPack p(2, 4, 9000);
  for (const auto& e : engines()) {
    FaultConfig f;
    f.short_read_every = 2;
    auto st = p.open(8, e, 0, f);
    std::vector<int64_t> keys{0, 0, 0, 1, 1, 2, 1, 3};
    auto b = st->fetch(keys.data(), 4, false);
    CHECK(rows_equal(p, *b, keys));
    st->release(*b);
    FaultConfig f2;
    f2.eio_every = 3;
    auto st2 = p.open(8, e, 0, f2);
    bool thrown = false;
    try {
      st2->fetch(keys.data(), 4, false);
    } catch (const IoError& err) {
      thrown = true;
      CHECK(err.err == EIO);
      CHECK(std::string(err.what()).find(p.path) != std::string::npos);
    }
    CHECK(thrown);
    for (int64_t r = 0; r < 8; ++r) CHECK(st2->row_slot(r) == -1);  // nothing published
    CHECK(st2->leased_batches() == 0);
  }
}

TEST(misaligned_direct_rejected) {
  TmpPack p(1, 2, 4096);
  EngineChoice c = choose_engine("pread", 1, {});
  Mapping buf(2 * kPage);
  ReadOp op;
  op.fd = ::open(p.path.c_str(), O_RDONLY | O_DIRECT);
  op.direct = true;
  op.offset = 100;
  op.len = kPage;
  op.dst = buf.base;
  CHECK_THROWS(c.engine->read_all(&op, 1), std::invalid_argument);
  op.offset = 0;
  op.dst = buf.base + 8;
  CHECK_THROWS(c.engine->read_all(&op, 1), std::invalid_argument);
  op.dst = buf.base;
  op.len = 100;
  CHECK_THROWS(c.engine->read_all(&op, 1), std::invalid_argument);
  ::close(op.fd);
}

TEST(lru_eviction_pins_and_scan) {
  TmpPack p(4, 4, 3000);
  auto st = p.open(4);
  auto fetch1 = [&](int64_t l, int64_t e, bool scan) {
    std::vector<int64_t> k{l, e};
    auto b = st->fetch(k.data(), 1, scan);
    CHECK(rows_equal(p, *b, k));
    st->release(*b);
    return b->hit[0] != 0;
  };
  for (int e = 0; e < 4; ++e) CHECK(!fetch1(0, e, false));  // fill: MRU order 3,2,1,0
  CHECK(fetch1(0, 0, false));                               // 0 becomes MRU
  CHECK(!fetch1(1, 0, false));                              // evicts LRU = (0,1)
  CHECK(st->row_slot(1) == -1);
  CHECK(st->row_slot(0) >= 0);
  // scan never evicts: the arena is full, so a scan miss is served from the stage
  Stats s0 = st->stats();
  CHECK(!fetch1(3, 3, true));
  CHECK(st->row_slot(3 * 4 + 3) == -1);
  CHECK(st->stats().evictions == s0.evictions);
  // pinned slots are never victims: lease all 4 resident rows, then a miss overflows
  std::vector<int64_t> hot;
  for (int64_t r : st->hot_rows(8)) {
    hot.push_back(r / 4);
    hot.push_back(r % 4);
  }
  CHECK(hot.size() == 8);
  auto held = st->fetch(hot.data(), 4, false);
  std::vector<int64_t> k{2, 2};
  auto b = st->fetch(k.data(), 1, false);
  CHECK(rows_equal(p, *b, k));
  CHECK(b->src[0] != 0);  // overflow (stage)
  CHECK(rows_equal(p, *held, hot));
  st->release(*b);
  st->release(*held);
  CHECK(st->stats().overflow_rows == 1);
  CHECK(st->leased_batches() == 0);
}

TEST(batch_larger_than_arena_and_duplicates) {
  TmpPack p(4, 8, 4096);
  auto st = p.open(5);
  std::vector<int64_t> keys;
  for (int i = 0; i < 20; ++i) {
    keys.push_back(i % 4);
    keys.push_back((i * 3) % 8);
  }
  keys.push_back(0);  // duplicate of the first key
  keys.push_back(0);
  auto b = st->fetch(keys.data(), keys.size() / 2, false);
  CHECK(rows_equal(p, *b, keys));
  CHECK(b->ptrs[0] == b->ptrs[20]);
  st->release(*b);
  auto b2 = st->fetch(keys.data(), keys.size() / 2, false);
  CHECK(rows_equal(p, *b2, keys));
  st->release(*b2);
}

TEST(checksum_mismatch_never_served) {
  TmpPack p(2, 2, 4096);
  std::vector<uint32_t> bad = p.crcs;
  bad[3] ^= 1;
  StoreConfig c = p.cfg(4, "pread", 0);
  Store st(c, std::vector<uint8_t>(2, 1), bad);
  std::vector<int64_t> k{1, 1};
  CHECK_THROWS(st.fetch(k.data(), 1, false), IoError);
  CHECK(st.row_slot(3) == -1);
  std::vector<int64_t> k2{0, 1};
  auto b = st.fetch(k2.data(), 1, false);
  CHECK(rows_equal(p, *b, k2));
  st.release(*b);
}

TEST(unwritten_layer_and_range_errors) {
  TmpPack p(2, 2, 4096);
  StoreConfig c = p.cfg(4, "pread", 0);
  Store st(c, std::vector<uint8_t>{1, 0}, p.crcs);
  std::vector<int64_t> k{1, 0};
  CHECK_THROWS(st.fetch(k.data(), 1, false), IoError);
  std::vector<int64_t> k2{2, 0};
  CHECK_THROWS(st.fetch(k2.data(), 1, false), std::out_of_range);
  std::vector<int64_t> k3{0, -1};
  CHECK_THROWS(st.fetch(k3.data(), 1, false), std::out_of_range);
}

TEST(direct_refused_falls_back_buffered) {
  TmpPack p(2, 2, 5000);
  FaultConfig f;
  f.odirect_refused = true;
  auto st = p.open(4, "pread", -1, f);
  CHECK(!st->direct());
  CHECK(st->direct_reason().find("refused") != std::string::npos);
  std::vector<int64_t> k{1, 1};
  auto b = st->fetch(k.data(), 1, false);
  CHECK(rows_equal(p, *b, k));
  st->release(*b);
  StoreConfig c = p.cfg(4, "pread", 1);
  c.faults = f;
  CHECK_THROWS(Store(c, std::vector<uint8_t>(2, 1), p.crcs), IoError);
  for (const auto& e : engines()) {
    auto sd = p.open(4, e, 1);
    CHECK(sd->direct());
    auto bd = sd->fetch(k.data(), 1, false);
    CHECK(rows_equal(p, *bd, k));
    sd->release(*bd);
  }
}

TEST(preheat_and_hot_rows) {
  TmpPack p(3, 4, 4096);
  auto st = p.open(4);
  size_t n = st->preheat({5, 5, 1, 99, -3, 7, 2, 3, 4});
  CHECK(n == 4);  // deduplicated, in-range, truncated to the free slots
  CHECK(st->row_slot(5) >= 0 && st->row_slot(1) >= 0 && st->row_slot(7) >= 0);
  CHECK(st->row_slot(3) == -1);
  std::vector<int64_t> k{1, 1};
  auto b = st->fetch(k.data(), 1, false);
  CHECK(b->hit[0]);
  st->release(*b);
  CHECK(st->hot_rows(1).at(0) == 5);
}

TEST(write_rows_enospc_injected) {
  TmpPack p(1, 2, 4096);
  int fd = ::open(p.path.c_str(), O_RDWR);
  FaultConfig f;
  f.enospc_after_bytes = 4096;
  int64_t written = 0;
  std::vector<uint8_t> rows(2 * 4096, 7);
  bool thrown = false;
  try {
    write_rows(fd, rows.data(), 2, 4096, 4096, 0, f, &written);
  } catch (const IoError& e) {
    thrown = e.err == ENOSPC;
  }
  CHECK(thrown);
  CHECK(written == 4096);
  ::close(fd);
}

}  // namespace

int main() {
  std::printf("moet-store C++ unit suite (liburing built: %s, io_uring: %s)\n",
              uring_built() ? "yes" : "no", probe_uring().state.c_str());
  for (auto& t : registry()) {
    int before = g_failed;
    try {
      t.second();
    } catch (const std::exception& e) {
      ++g_failed;
      std::fprintf(stderr, "  FAIL %s: unexpected exception: %s\n", t.first.c_str(), e.what());
    }
    std::printf("%s %s\n", g_failed == before ? "ok  " : "FAIL", t.first.c_str());
  }
  std::printf("%d checks, %d failed\n", g_checks, g_failed);
  return g_failed ? 1 : 0;
}

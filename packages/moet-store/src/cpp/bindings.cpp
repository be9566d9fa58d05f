// pybind11 bindings of the moet-store core: the module moet_store._core.
#include <fcntl.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstring>
#include <thread>

#include "crc32c.hpp"
#include "engine.hpp"
#include "store.hpp"

namespace py = pybind11;
using namespace moet;

namespace {

PyObject* g_store_error = nullptr;

// A buffer-protocol exporter over a Mapping; memoryviews of it keep the memory alive.
struct Memory {
  std::shared_ptr<Mapping> map;
  bool readonly = true;
};

py::object memview(const std::shared_ptr<Mapping>& m, bool readonly) {
  if (!m || m->len == 0) return py::none();
  py::object holder = py::cast(Memory{m, readonly});
  PyObject* mv = PyMemoryView_FromObject(holder.ptr());
  if (!mv) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(mv);
}

FaultConfig parse_faults(const py::object& o) {
  FaultConfig f;
  if (o.is_none()) return f;
  py::dict d = o.cast<py::dict>();
  for (auto kv : d) {
    std::string k = kv.first.cast<std::string>();
    py::handle v = kv.second;
    if (k == "short_read_every") {
      f.short_read_every = v.cast<int>();
    } else if (k == "eio_every") {
      f.eio_every = v.cast<int>();
    } else if (k == "eio_after") {
      f.eio_after = v.cast<int64_t>();
    } else if (k == "stall_us") {
      f.stall_us = v.cast<uint32_t>();
    } else if (k == "odirect_refused") {
      f.odirect_refused = v.cast<bool>();
    } else if (k == "enospc_after_bytes") {
      f.enospc_after_bytes = v.cast<int64_t>();
    } else {
      throw std::invalid_argument(
          "unknown fault '" + k +
          "': expected short_read_every, eio_every, eio_after, stall_us, odirect_refused or "
          "enospc_after_bytes");
    }
  }
  return f;
}

template <typename T>
void copy_keys(const void* p, size_t count, std::vector<int64_t>& out) {
  const T* t = static_cast<const T*>(p);
  out.resize(count);
  for (size_t i = 0; i < count; ++i) out[i] = static_cast<int64_t>(t[i]);
}

// keys: a list/tuple of (layer, expert) pairs, or a C-contiguous integer array [n, 2].
void parse_keys(py::handle keys, std::vector<int64_t>& out) {
  PyObject* o = keys.ptr();
  if (PyList_Check(o) || PyTuple_Check(o)) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
    PyObject** items = PySequence_Fast_ITEMS(o);
    out.resize(size_t(n) * 2);
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* it = items[i];
      if (!(PyTuple_Check(it) || PyList_Check(it)) || PySequence_Fast_GET_SIZE(it) != 2) {
        throw py::type_error("keys[" + std::to_string(i) +
                             "] must be a (layer, expert) pair of ints");
      }
      PyObject** pr = PySequence_Fast_ITEMS(it);
      for (int j = 0; j < 2; ++j) {
        if (!PyLong_Check(pr[j]) && !PyIndex_Check(pr[j]))
          throw py::type_error("keys[" + std::to_string(i) + "] must hold ints");
        long long v = PyLong_AsLongLong(pr[j]);
        if (v == -1 && PyErr_Occurred()) {
          PyErr_Clear();
          v = -1;  // overflow: reported as out of range below
        }
        out[size_t(i) * 2 + j] = v;
      }
    }
    return;
  }
  Py_buffer view;
  if (PyObject_GetBuffer(o, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
    PyErr_Clear();
    throw py::type_error(
        "keys must be a list of (layer, expert) pairs or a C-contiguous integer array [n, 2]");
  }
  struct Release {
    Py_buffer* v;
    ~Release() { PyBuffer_Release(v); }
  } rel{&view};
  if (!((view.ndim == 2 && view.shape[1] == 2) || (view.ndim == 1 && view.shape[0] == 0))) {
    throw py::value_error("keys array must have shape [n, 2]");
  }
  size_t count = size_t(view.len / view.itemsize);
  std::string fmt = view.format ? view.format : "B";
  if (!fmt.empty() && (fmt[0] == '<' || fmt[0] == '=' || fmt[0] == '@')) fmt = fmt.substr(1);
  char c = fmt.empty() ? 'B' : fmt[0];
  switch (c) {
    case 'q':
    case 'l':
      if (view.itemsize == 8) {
        copy_keys<int64_t>(view.buf, count, out);
      } else {
        copy_keys<int32_t>(view.buf, count, out);
      }
      break;
    case 'Q':
    case 'L':
      if (view.itemsize == 8) {
        copy_keys<uint64_t>(view.buf, count, out);  // huge values wrap negative: rejected later
      } else {
        copy_keys<uint32_t>(view.buf, count, out);
      }
      break;
    case 'i':
      copy_keys<int32_t>(view.buf, count, out);
      break;
    case 'I':
      copy_keys<uint32_t>(view.buf, count, out);
      break;
    case 'h':
      copy_keys<int16_t>(view.buf, count, out);
      break;
    case 'H':
      copy_keys<uint16_t>(view.buf, count, out);
      break;
    case 'b':
      copy_keys<int8_t>(view.buf, count, out);
      break;
    case 'B':
      copy_keys<uint8_t>(view.buf, count, out);
      break;
    default:
      throw py::type_error("keys array must hold integers, got format '" + fmt + "'");
  }
}

struct PyStore;

struct PyBatch {
  std::shared_ptr<BatchState> b;
  std::shared_ptr<PyStore> owner;
  py::object views_cache;
};

struct PyStore {
  std::shared_ptr<Store> s;
  bool writable_views = false;
  py::object arena_mv, stage_mv;

  py::object views(PyBatch& pb) {
    if (pb.b->released) throw std::runtime_error("batch was released; its views are gone");
    if (!pb.views_cache.is_none()) return pb.views_cache;
    if (arena_mv.is_none()) arena_mv = memview(s->arena(), !writable_views);
    if (stage_mv.is_none()) stage_mv = memview(s->stage(), !writable_views);
    const BatchState& b = *pb.b;
    const Py_ssize_t rb = Py_ssize_t(s->config().row_bytes);
    size_t n = b.ptrs.size();
    py::list out(n);
    for (size_t i = 0; i < n; ++i) {
      PyObject* v;
      if (b.src[i] == 2) {
        py::object whole = memview(b.temps[size_t(b.temp_index[i])], !writable_views);
        PyObject* sl = PySlice_New(py::int_(0).ptr(), py::int_(rb).ptr(), nullptr);
        v = PyObject_GetItem(whole.ptr(), sl);
        Py_DECREF(sl);
      } else {
        PyObject* base = b.src[i] == 0 ? arena_mv.ptr() : stage_mv.ptr();
        Py_ssize_t off = Py_ssize_t(b.off[i]);
        PyObject* lo = PyLong_FromSsize_t(off);
        PyObject* hi = PyLong_FromSsize_t(off + rb);
        PyObject* sl = PySlice_New(lo, hi, nullptr);
        Py_DECREF(lo);
        Py_DECREF(hi);
        v = PyObject_GetItem(base, sl);
        Py_DECREF(sl);
      }
      if (!v) throw py::error_already_set();
      PyList_SET_ITEM(out.ptr(), Py_ssize_t(i), v);
    }
    pb.views_cache = out;
    return out;
  }
};

void log_events(Store& s) {
  auto ev = s.take_events();
  if (ev.empty()) return;
  py::object log = py::module_::import("logging").attr("getLogger")("moet_store");
  for (auto& e : ev) log.attr("warning")(e);
}

py::dict stats_dict(const Store& s) {
  Stats st = s.stats();
  py::dict d;
  d["fetches"] = st.fetches;
  d["rows"] = st.rows;
  d["hit_rows"] = st.hits;
  d["miss_rows"] = st.misses;
  d["overflow_rows"] = st.overflow_rows;
  d["temp_rows"] = st.temp_rows;
  d["scan_rows"] = st.scan_rows;
  d["evictions"] = st.evictions;
  d["reads"] = st.reads;
  d["bytes"] = st.bytes;
  d["read_errors"] = st.read_errors;
  d["checksum_errors"] = st.checksum_errors;
  return d;
}

// Installs a seccomp filter making io_uring_setup fail with err (tests: "blocked" / "absent").
void block_io_uring(int err) {
#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425
#endif
  struct sock_filter filt[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (uint32_t(err) & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  struct sock_fprog prog = {static_cast<unsigned short>(sizeof(filt) / sizeof(filt[0])), filt};
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
      prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) {
    int e = errno;
    throw IoError(e, "cannot install the seccomp filter: " + errstr(e));
  }
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "moet-store C++ core: pack I/O engines, pinned arena, CRC-32C";
  g_store_error = PyErr_NewExceptionWithDoc(
      "moet_store.StoreError",
      "A pack store error: OSError with errno and one message naming the file, what was "
      "expected, what was found and what to do.",
      PyExc_OSError, nullptr);
  m.attr("StoreError") = py::handle(g_store_error);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const IoError& e) {
      PyObject* args = Py_BuildValue("(is)", e.err, e.what());
      PyErr_SetObject(g_store_error, args);
      Py_XDECREF(args);
    }
  });

  py::class_<Memory>(m, "Memory", py::buffer_protocol())
      .def_buffer([](Memory& mem) {
        return py::buffer_info(mem.map->base, 1, "B", 1, {py::ssize_t(mem.map->len)}, {1},
                               mem.readonly);
      })
      .def_property_readonly("address", [](const Memory& mem) { return uintptr_t(mem.map->base); })
      .def("__len__", [](const Memory& mem) { return mem.map->len; });

  m.def(
      "aligned_buffer",
      [](size_t nbytes) {
        if (nbytes == 0) throw std::invalid_argument("aligned_buffer needs nbytes > 0");
        return py::memoryview(memview(std::make_shared<Mapping>(nbytes), false));
      },
      py::arg("nbytes"), "Page-aligned writable memory (anonymous mmap) as a memoryview.");

  m.def("liburing_built", &uring_built);
  m.def("crc32c_hw", &crc32c_hw);
  m.def(
      "crc32c",
      [](py::buffer b, uint32_t crc) {
        py::buffer_info bi = b.request();
        size_t len = size_t(bi.size * bi.itemsize);
        py::gil_scoped_release nogil;
        return crc32c(bi.ptr, len, crc);
      },
      py::arg("data"), py::arg("crc") = 0);
  m.def(
      "crc32c_rows",
      [](py::buffer b, size_t row_bytes) {
        py::buffer_info bi = b.request();
        size_t len = size_t(bi.size * bi.itemsize);
        if (row_bytes == 0 || len % row_bytes) throw std::invalid_argument("bad row_bytes");
        std::vector<uint32_t> out(len / row_bytes);
        {
          py::gil_scoped_release nogil;
          for (size_t i = 0; i < out.size(); ++i)
            out[i] = crc32c(static_cast<uint8_t*>(bi.ptr) + i * row_bytes, row_bytes);
        }
        return out;
      },
      py::arg("data"), py::arg("row_bytes"));

  m.def(
      "write_rows",
      [](int fd, py::buffer rows, size_t n, uint64_t row_bytes, uint64_t stride, uint64_t offset,
         py::object faults, int64_t written) {
        py::buffer_info bi = rows.request();
        if (uint64_t(bi.size * bi.itemsize) != n * row_bytes)
          throw std::invalid_argument(
              "rows buffer holds " + std::to_string(bi.size * bi.itemsize) +
              " bytes, expected n * row_bytes = " + std::to_string(n * row_bytes));
        FaultConfig f = parse_faults(faults);
        std::vector<uint32_t> crcs;
        {
          py::gil_scoped_release nogil;
          crcs = write_rows(fd, static_cast<const uint8_t*>(bi.ptr), n, row_bytes, stride, offset,
                            f, &written);
        }
        return py::make_tuple(crcs, written);
      },
      py::arg("fd"), py::arg("rows"), py::arg("n"), py::arg("row_bytes"), py::arg("stride"),
      py::arg("offset"), py::arg("faults") = py::none(), py::arg("written") = 0);

  m.def("probe_uring", []() {
    UringProbe p = probe_uring();
    py::dict d;
    d["ok"] = p.ok;
    d["state"] = p.state;
    d["reason"] = p.reason;
    d["errno"] = p.err;
    d["built"] = uring_built();
    return d;
  });
  m.def(
      "probe_register",
      [](size_t nbytes) -> py::dict {
        py::dict d;
        UringProbe p = probe_uring();
        if (!p.ok) {
          d["registered"] = false;
          d["note"] = "io_uring unavailable: " + p.reason;
          return d;
        }
        auto eng = make_uring_engine(4, 1);
        Mapping mem(nbytes);
        eng->register_buffers({{mem.base, mem.len}});
        d["registered"] = eng->buffers_registered();
        d["note"] = eng->register_note();
        return d;
      },
      py::arg("nbytes"));
  m.def("block_io_uring", &block_io_uring, py::arg("errno"),
        "Tests only: seccomp-filter io_uring_setup in this process to fail with errno.");
  m.def(
      "raw_read",
      [](const std::string& path, uint64_t offset, py::buffer out, const std::string& engine,
         bool direct, py::object faults) {
        py::buffer_info bi = out.request(true);
        FaultConfig f = parse_faults(faults);
        int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
        if (fd < 0) {
          int e = errno;
          throw IoError(e, "cannot open " + path + ": " + errstr(e));
        }
        ReadOp op;
        op.fd = fd;
        op.direct = direct;
        op.offset = offset;
        op.len = uint32_t(bi.size * bi.itemsize);
        op.dst = static_cast<uint8_t*>(bi.ptr);
        try {
          EngineChoice ch = choose_engine(engine, 1, f);
          py::gil_scoped_release nogil;
          ch.engine->read_all(&op, 1);
        } catch (...) {
          ::close(fd);
          throw;
        }
        ::close(fd);
        if (op.result < 0)
          throw IoError(int(-op.result), "reading " + std::to_string(op.len) + " bytes of " + path +
                                             " at offset " + std::to_string(offset) +
                                             " failed: " + errstr(int(op.result)));
        return op.result;
      },
      py::arg("path"), py::arg("offset"), py::arg("out"), py::arg("engine") = "pread",
      py::arg("direct") = false, py::arg("faults") = py::none(),
      "Read len(out) bytes at offset into out (tests, doctor).");
  m.def(
      "memcpy_mt",
      [](py::buffer dst, py::buffer src, int threads, int iters) {
        py::buffer_info d = dst.request(true), s = src.request();
        size_t len = size_t(std::min(d.size * d.itemsize, s.size * s.itemsize));
        auto* dp = static_cast<uint8_t*>(d.ptr);
        auto* sp = static_cast<const uint8_t*>(s.ptr);
        py::gil_scoped_release nogil;
        auto t0 = std::chrono::steady_clock::now();
        for (int it = 0; it < iters; ++it) {
          std::vector<std::thread> ts;
          size_t chunk = (len + threads - 1) / threads;
          for (int t = 0; t < threads; ++t) {
            size_t a = std::min(len, t * chunk), b = std::min(len, a + chunk);
            ts.emplace_back([=] { std::memcpy(dp + a, sp + a, b - a); });
          }
          for (auto& t : ts) t.join();
        }
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      },
      py::arg("dst"), py::arg("src"), py::arg("threads"), py::arg("iters") = 1,
      "Bench baseline: multi-threaded memcpy, returns seconds for iters copies.");
  m.def("memlock_limit", []() {
    struct rlimit rl;
    getrlimit(RLIMIT_MEMLOCK, &rl);
    return py::make_tuple(rl.rlim_cur == RLIM_INFINITY ? -1 : int64_t(rl.rlim_cur),
                          rl.rlim_max == RLIM_INFINITY ? -1 : int64_t(rl.rlim_max));
  });

  py::class_<PyBatch, std::shared_ptr<PyBatch>>(m, "Batch")
      .def_property_readonly(
          "views", [](PyBatch& b) { return b.owner->views(b); },
          "Row buffers (memoryviews over arena/stage memory, no copy), valid until release().")
      .def_property_readonly("ptrs",
                             [](PyBatch& b) {
                               py::list out;
                               for (auto* p : b.b->ptrs) out.append(uintptr_t(p));
                               return out;
                             })
      .def_property_readonly("hits",
                             [](PyBatch& b) {
                               py::list out;
                               for (auto h : b.b->hit) out.append(bool(h));
                               return out;
                             })
      .def_property_readonly("in_arena",
                             [](PyBatch& b) {
                               py::list out;
                               for (auto s : b.b->src) out.append(s == 0);
                               return out;
                             })
      .def_property_readonly("released", [](PyBatch& b) { return b.b->released; })
      .def_property_readonly("row_bytes", [](PyBatch& b) { return b.owner->s->config().row_bytes; })
      .def("__len__", [](PyBatch& b) { return b.b->ptrs.size(); })
      .def("release",
           [](PyBatch& b) {
             b.views_cache = py::none();
             b.owner->s->release(*b.b);
           })
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyBatch& b, py::args) {
        b.views_cache = py::none();
        b.owner->s->release(*b.b);
        return false;
      });

  py::class_<PyStore, std::shared_ptr<PyStore>>(m, "CoreStore")
      .def(py::init([](const std::string& path, uint32_t n_layers, uint32_t n_experts,
                       uint64_t row_bytes, uint64_t stride, uint64_t arena_slots,
                       uint64_t stage_slots, const std::string& engine, int direct, int readers,
                       bool verify, bool populate, bool register_buffers, py::object faults,
                       std::vector<uint8_t> layer_written, std::vector<uint32_t> crcs,
                       bool writable_views, unsigned queue_depth) {
             StoreConfig c;
             c.path = path;
             c.n_layers = n_layers;
             c.n_experts = n_experts;
             c.row_bytes = row_bytes;
             c.stride = stride;
             c.arena_slots = arena_slots;
             c.stage_slots = stage_slots;
             c.engine = engine;
             c.direct = direct;
             c.readers = readers;
             c.queue_depth = queue_depth;
             c.verify = verify;
             c.populate = populate;
             c.register_buffers = register_buffers;
             c.faults = parse_faults(faults);
             auto ps = std::make_shared<PyStore>();
             {
               py::gil_scoped_release nogil;
               ps->s = std::make_shared<Store>(c, std::move(layer_written), std::move(crcs));
             }
             ps->writable_views = writable_views;
             ps->arena_mv = py::none();
             ps->stage_mv = py::none();
             log_events(*ps->s);
             return ps;
           }),
           py::arg("path"), py::arg("n_layers"), py::arg("n_experts"), py::arg("row_bytes"),
           py::arg("stride"), py::arg("arena_slots"), py::arg("stage_slots"), py::arg("engine"),
           py::arg("direct"), py::arg("readers"), py::arg("verify"), py::arg("populate"),
           py::arg("register_buffers"), py::arg("faults"), py::arg("layer_written"),
           py::arg("crcs"), py::arg("writable_views") = false, py::arg("queue_depth") = 64)
      .def(
          "fetch",
          [](std::shared_ptr<PyStore> self, py::handle keys, bool scan) {
            std::vector<int64_t> k;
            parse_keys(keys, k);
            auto pb = std::make_shared<PyBatch>();
            pb->owner = self;
            pb->views_cache = py::none();
            {
              py::gil_scoped_release nogil;
              pb->b = self->s->fetch(k.data(), k.size() / 2, scan);
            }
            log_events(*self->s);
            return pb;
          },
          py::arg("keys"), py::arg("scan") = false)
      .def("hot_rows", [](PyStore& s, size_t limit) { return s.s->hot_rows(limit); })
      .def("preheat",
           [](PyStore& s, const std::vector<int64_t>& rows) {
             size_t r;
             {
               py::gil_scoped_release nogil;
               r = s.s->preheat(rows);
             }
             log_events(*s.s);
             return r;
           })
      .def("row_slot", [](PyStore& s, int64_t row) { return s.s->row_slot(row); })
      .def("stats", [](PyStore& s) { return stats_dict(*s.s); })
      .def("latency_us", [](PyStore& s, bool miss) { return s.s->latency_us(miss); })
      .def("leased_batches", [](PyStore& s) { return s.s->leased_batches(); })
      .def("close",
           [](PyStore& s) {
             py::gil_scoped_release nogil;
             s.s->close();
           })
      .def_property_readonly("arena_address",
                             [](PyStore& s) { return uintptr_t(s.s->arena()->base); })
      .def_property_readonly("arena_bytes", [](PyStore& s) { return s.s->arena()->len; })
      .def_property_readonly("stage_address",
                             [](PyStore& s) { return uintptr_t(s.s->stage()->base); })
      .def_property_readonly("stage_bytes", [](PyStore& s) { return s.s->stage()->len; })
      .def("info", [](PyStore& s) {
        py::dict d;
        d["engine"] = s.s->engine_name();
        d["engine_reason"] = s.s->engine_reason();
        d["direct"] = s.s->direct();
        d["direct_reason"] = s.s->direct_reason();
        d["registered_buffers"] = s.s->buffers_registered();
        d["registered_files"] = s.s->files_registered();
        d["register_note"] = s.s->register_note();
        d["readers"] = s.s->readers();
        d["liburing_built"] = uring_built();
        return d;
      });
}

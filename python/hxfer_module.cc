// Python bindings of hxfer's public API (include/hxfer/hxfer.h), nothing else. This is the
// extension hxfer._hxfer; the package python/hxfer/ re-exports all of it as `hxfer`.
//
//   hxfer.Layout        Layout::engine(...) with keyword options; pools(), describe(), ...
//   hxfer.Memory        Memory::wrap() over Python buffers, taken without a copy: anything with
//                       the writable buffer protocol (numpy, bytearray, memoryview), a CPU torch
//                       tensor (data_ptr()), a hxfer.SharedBuffer (shareable over shm). CUDA
//                       memory (a torch cuda tensor, __cuda_array_interface__, DLPack) becomes a
//                       kCuda Buffer, which Memory::wrap checks against the CUDA runtime.
//                       mark_ready(ready_event=) and start(pages_free=) take a torch.cuda.Event
//                       (or a cudaEvent_t as an int) for such pools.
//   hxfer.SharedBuffer  SharedBuffer::allocate(); exports a writable 1-D uint8 buffer.
//   hxfer.Sender        the context rank; a context manager.
//   hxfer.Receiver      the generation rank; a context manager. wait()/poll() give Result.
//   hxfer.plan_transfer planTransfer(): a request's fragments as a numpy array.
//   hxfer.Error         every non-ok Status: .code ("InvalidArgument", ...) and .message.
//
// Ownership: a Memory keeps every buffer object it was given, and holds their buffer views,
// until it dies; a Sender or Receiver keeps its Layout and Memory. So pages outlive every
// registration that can touch them, whatever order Python drops the objects in.
//
// The GIL: released around every call into a Sender or Receiver (each may block or take
// hxfer's locks) and around their destruction, which joins hxfer threads that may be waiting
// to run a Python callback. Callbacks (on_released, on_request) run on an hxfer thread: they
// take the GIL, and an exception they raise is reported with sys.unraisablehook, never passed
// into hxfer. A callback may call back in, even shutdown(), and may drop the last reference
// to its endpoint: what would join the callback's own thread runs on a thread of its own.
// At interpreter exit every live Sender and Receiver is shut down (atexit) while Python can
// still run their callbacks. A callback that refers to its own endpoint makes a cycle Python's
// collector does not see (the endpoint then lives until shutdown() or exit): prefer `with`.
#include <pybind11/eval.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <Python.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "hxfer/hxfer.h"
#include "hxfer/status.h"

namespace py = pybind11;

namespace {

// ---- Errors ----

// A non-ok Status on its way out of a binding; translated into hxfer.Error. Carries no Python
// object, so it may be thrown while the GIL is released.
struct StatusError {
  hxfer::Status status;
};

PyObject* g_error_type = nullptr;  // hxfer.Error; one reference, never dropped

void throwIfError(const hxfer::Status& s) {
  if (!s.isOk()) throw StatusError{s};
}

template <typename T>
T valueOrThrow(hxfer::StatusOr<T>&& s) {
  if (!s.isOk()) throw StatusError{s.status()};
  return std::move(s).value();
}

[[noreturn]] void throwInvalid(std::string message) {
  throw StatusError{hxfer::InvalidArgument(std::move(message))};
}

void setPythonError(const hxfer::Status& s) {
  py::object type = py::reinterpret_borrow<py::object>(g_error_type);
  py::object err = type(std::string(hxfer::statusCodeName(s.code())), s.message());
  PyErr_SetObject(g_error_type, err.ptr());
}

std::string typeName(py::handle obj) {
  return py::str(py::type::handle_of(obj).attr("__qualname__"));
}

// Whether the interpreter is shutting down (Python 3.13 renamed the call).
bool pyFinalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// Runs `step(slice)` with the GIL released, in slices of at most 100 ms until it returns true
// or `total` passed, checking for signals between slices: a long wait never holds off the
// program's own handlers (Ctrl-C raises KeyboardInterrupt within a slice).
template <typename Step>
void waitInterruptibly(std::chrono::milliseconds total, Step&& step) {
  const auto deadline = std::chrono::steady_clock::now() + total;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    const auto slice =
        std::clamp(left, std::chrono::milliseconds(0), std::chrono::milliseconds(100));
    bool done;
    {
      py::gil_scoped_release nogil;
      done = step(slice);
    }
    if (done || std::chrono::steady_clock::now() >= deadline) return;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

// ---- Conversions ----

// Float seconds to milliseconds, rounded up so a small positive timeout never becomes zero.
std::chrono::milliseconds toMillis(double seconds, const char* what) {
  if (std::isnan(seconds) || seconds < 0) {
    throwInvalid(std::string(what) + "=" + std::to_string(seconds) +
                 " is not a non-negative number of seconds");
  }
  constexpr double kMaxMs = 1e15;  // ~31000 years: "forever" without overflowing
  double ms = std::ceil(seconds * 1000.0);
  return std::chrono::milliseconds(static_cast<int64_t>(ms > kMaxMs ? kMaxMs : ms));
}

// Any iterable of ints (a list, a range, a numpy integer array) as page indices.
std::vector<uint32_t> toPages(py::handle obj, const char* what) {
  std::vector<uint32_t> out;
  if (py::isinstance<py::str>(obj) || py::isinstance<py::bytes>(obj)) {
    throw py::type_error(std::string(what) + " must be a sequence of ints, got " + typeName(obj));
  }
  if (!py::isinstance<py::iterable>(obj)) {
    throw py::type_error(std::string(what) + " must be a sequence of ints, got " + typeName(obj));
  }
  size_t i = 0;
  for (py::handle item : py::reinterpret_borrow<py::iterable>(obj)) {
    py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(item.ptr()));
    if (!index) {
      PyErr_Clear();
      throw py::type_error(std::string(what) + "[" + std::to_string(i) + "] must be an int, got " +
                           typeName(item));
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
    if (overflow != 0 || v < 0 || v > static_cast<long long>(UINT32_MAX)) {
      throwInvalid(std::string(what) + "[" + std::to_string(i) +
                   "]=" + std::string(py::str(index)) + " is not a page index (0 .. 2^32-1)");
    }
    out.push_back(static_cast<uint32_t>(v));
    ++i;
  }
  return out;
}

// bytes, bytearray, memoryview or any other bytes-like object, copied.
std::string toBytes(py::handle obj, const char* what) {
  if (obj.is_none()) return {};
  if (PyBytes_Check(obj.ptr())) return std::string(py::reinterpret_borrow<py::bytes>(obj));
  if (PyObject_CheckBuffer(obj.ptr()) && !PyUnicode_Check(obj.ptr())) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_C_CONTIGUOUS) == 0) {
      std::string out(static_cast<const char*>(view.buf), static_cast<size_t>(view.len));
      PyBuffer_Release(&view);
      return out;
    }
    PyErr_Clear();
  }
  throw py::type_error(std::string(what) + " must be bytes-like, got " + typeName(obj));
}

std::vector<std::pair<std::string, std::string>> toUcxOptions(const py::object& obj) {
  std::vector<std::pair<std::string, std::string>> out;
  if (obj.is_none()) return out;
  py::dict d(obj);
  for (auto [k, v] : d) out.emplace_back(py::str(k), py::str(v));
  return out;
}

std::optional<uint32_t> toSlot(const py::object& obj) {
  if (obj.is_none()) return std::nullopt;
  std::vector<uint32_t> one = toPages(py::make_tuple(obj), "slot");
  return one[0];
}

// A CUDA event the engine recorded: a torch.cuda.Event (its cuda_event, 0 until recorded) or
// the cudaEvent_t as an int; nullopt for None. TypeError naming `what` for anything else.
std::optional<hxfer::DeviceEvent> toDeviceEvent(const py::object& obj, const std::string& what) {
  if (obj.is_none()) return std::nullopt;
  py::object handle = obj;
  if (!py::isinstance<py::int_>(obj)) {
    if (!py::hasattr(obj, "cuda_event")) {
      throw py::type_error(what + " must be a torch.cuda.Event or a cudaEvent_t as an int, got " +
                           typeName(obj));
    }
    handle = obj.attr("cuda_event");
  }
  uintptr_t p = 0;
  try {
    p = handle.cast<uintptr_t>();
  } catch (const py::cast_error&) {
    throw py::type_error(what + ": the event handle is not an address, got " + typeName(handle));
  }
  return hxfer::DeviceEvent{reinterpret_cast<const void*>(p)};
}

// (blocks, slot) or (blocks, slot, group_slots) as RankPages; slot None where the rank holds no
// recurrent state.
hxfer::RankPages toRankPages(py::handle obj, const std::string& what) {
  py::tuple t;
  if (py::isinstance<py::tuple>(obj) || py::isinstance<py::list>(obj)) {
    t = py::reinterpret_borrow<py::sequence>(obj).cast<py::tuple>();
  }
  if (t.size() != 2 && t.size() != 3) {
    throw py::type_error(what + " must be (blocks, slot) or (blocks, slot, group_slots), got " +
                         typeName(obj));
  }
  hxfer::RankPages pages;
  pages.blocks = toPages(t[0], (what + " blocks").c_str());
  pages.slot = toSlot(py::reinterpret_borrow<py::object>(t[1]));
  if (t.size() == 3) pages.group_slots = toPages(t[2], (what + " group_slots").c_str());
  return pages;
}

py::dict planDict(const hxfer::TransferPlan& plan) {
  py::array_t<uint64_t> fragments(
      {static_cast<py::ssize_t>(plan.fragments.size()), static_cast<py::ssize_t>(6)});
  auto f = fragments.mutable_unchecked<2>();
  for (size_t i = 0; i < plan.fragments.size(); ++i) {
    const hxfer::Fragment& x = plan.fragments[i];
    const auto r = static_cast<py::ssize_t>(i);
    f(r, 0) = x.source;
    f(r, 1) = x.src_pool;
    f(r, 2) = x.src_offset;
    f(r, 3) = x.dst_pool;
    f(r, 4) = x.dst_offset;
    f(r, 5) = x.bytes;
  }
  py::dict out;
  out["bytes"] = plan.bytes;
  out["fragments"] = fragments;
  return out;
}

py::dict metricsDict(const hxfer::Metrics& m) {
  py::dict out;
  if (!m.json.empty()) {
    py::object parsed = py::module_::import("json").attr("loads")(m.json);
    if (py::isinstance<py::dict>(parsed)) out = py::dict(parsed);
  }
  out["requests_started"] = m.requests_started;
  out["requests_ok"] = m.requests_ok;
  out["requests_failed"] = m.requests_failed;
  out["requests_cancelled"] = m.requests_cancelled;
  out["bytes"] = m.bytes;
  out["ops"] = m.ops;
  out["leases_expired"] = m.leases_expired;
  out["quarantined_requests"] = m.quarantined_requests;
  out["peers_lost"] = m.peers_lost;
  out["handshakes_ok"] = m.handshakes_ok;
  out["handshakes_refused"] = m.handshakes_refused;
  out["accounting_errors"] = m.accounting_errors;
  out["requests_held"] = m.requests_held;
  out["latency_p50_us"] = m.latency_p50_us;
  out["latency_p99_us"] = m.latency_p99_us;
  return out;
}

// ---- Layout ----

py::dict poolDict(const hxfer::PoolInfo& p) {
  py::dict d;
  d["name"] = p.name;
  d["bytes"] = p.bytes;
  d["shape"] = py::tuple(py::cast(p.shape));
  d["strides"] = py::tuple(py::cast(p.strides));
  return d;
}

py::dict recordDict(const hxfer::RecordPart& r) {
  py::dict d;
  d["pool"] = r.pool;
  d["offset"] = r.offset;
  d["index_stride"] = r.index_stride;
  d["num_indices"] = r.num_indices;
  d["state_group"] = r.state_group;
  d["dtype"] = r.dtype;
  d["element_bytes"] = r.element_bytes;
  py::list dims;
  for (const hxfer::RecordDim& dim : r.dims) {
    py::dict x;
    x["name"] = dim.name;
    x["size"] = dim.size;
    x["stride"] = dim.stride;
    dims.append(x);
  }
  d["dims"] = dims;
  py::list sections;
  for (const hxfer::RecordSection& sec : r.sections) {
    py::dict x;
    x["name"] = sec.name;
    x["first_unit"] = sec.first_unit;
    x["units"] = sec.units;
    x["unit_len"] = sec.unit_len;
    x["base"] = sec.base;
    x["unit_stride"] = sec.unit_stride;
    x["within_stride"] = sec.within_stride;
    sections.append(x);
  }
  d["sections"] = sections;
  return d;
}

hxfer::Layout makeLayout(const hxfer::LayoutOptions& o) {
  hxfer::StatusOr<hxfer::Layout> l = hxfer::Layout::engine(o);
  return valueOrThrow(std::move(l));
}

// ---- SharedBuffer ----

struct PySharedBuffer {
  std::shared_ptr<hxfer::SharedBuffer> buffer;
  std::string name;
};

// ---- Memory ----

// One pool's buffer as the Memory holds it: the object, the buffer view taken from it (released
// when the Memory dies) or, for a tensor, its storage: the memory stays allocated while hxfer
// may touch it, even when the tensor is given another storage (set_) or dropped. What holding
// cannot stop (numpy's resize(refcheck=False), a tensor's resize_ reallocate in place) is found
// by moved(): the Sender and Receiver check it before they hand hxfer any page.
class HeldBuffer {
 public:
  HeldBuffer(py::object obj) : obj_(std::move(obj)) {}
  ~HeldBuffer() {
    if (view_) PyBuffer_Release(view_.get());
  }
  HeldBuffer(const HeldBuffer&) = delete;
  HeldBuffer& operator=(const HeldBuffer&) = delete;

  // REQUIRES: the GIL. Fills `out` from obj_ or throws hxfer.Error(InvalidArgument) naming the
  // pool.
  void acquire(const std::string& pool, hxfer::Buffer* out) {
    const std::string where = "pool " + pool + ": ";
    py::handle obj = obj_;
    if (py::isinstance<PySharedBuffer>(obj)) {
      const PySharedBuffer& sb = obj.cast<const PySharedBuffer&>();
      *out = sb.buffer->buffer();
      return;
    }
    if (acquireDevice(where, out)) return;
    if (PyObject_CheckBuffer(obj.ptr())) {
      if (PyBytes_Check(obj.ptr())) throwInvalid(where + "buffer is read-only (bytes)");
      view_ = std::make_unique<Py_buffer>();
      if (PyObject_GetBuffer(obj.ptr(), view_.get(), PyBUF_STRIDES) != 0) {
        view_.reset();
        py::error_already_set e;
        throwInvalid(where + "cannot take a buffer from " + typeName(obj) + ": " + e.what());
      }
      if (view_->readonly) {
        PyBuffer_Release(view_.get());
        view_.reset();
        throwInvalid(where + "buffer is read-only (" + typeName(obj) + ")");
      }
      if (!PyBuffer_IsContiguous(view_.get(), 'A')) {
        PyBuffer_Release(view_.get());
        view_.reset();
        throwInvalid(where + "buffer is not contiguous (" + typeName(obj) +
                     "); pass a contiguous copy, e.g. numpy.ascontiguousarray");
      }
      *out = hxfer::Buffer{view_->buf, static_cast<uint64_t>(view_->len), hxfer::MemoryKind::kHost,
                           -1};
      where_ = {reinterpret_cast<uintptr_t>(view_->buf), static_cast<uint64_t>(view_->len)};
      return;
    }
    if (py::hasattr(obj, "data_ptr") && py::hasattr(obj, "is_contiguous") &&
        py::hasattr(obj, "device")) {  // a torch tensor (or anything shaped like one)
      py::object device = obj.attr("device");
      std::string device_type = py::hasattr(device, "type")
                                    ? std::string(py::str(device.attr("type")))
                                    : std::string(py::str(device));
      if (device_type != "cpu") {
        throwInvalid(where + "tensor on " + std::string(py::str(device)) +
                     ": hxfer takes host memory and CUDA device memory, not " + device_type);
      }
      if (!obj.attr("is_contiguous")().cast<bool>()) {
        throwInvalid(where + "tensor is not contiguous; pass tensor.contiguous()");
      }
      uint64_t nbytes = 0;
      if (py::hasattr(obj, "nbytes")) {
        nbytes = obj.attr("nbytes").cast<uint64_t>();
      } else {
        nbytes = obj.attr("numel")().cast<uint64_t>() * obj.attr("element_size")().cast<uint64_t>();
      }
      uintptr_t ptr = obj.attr("data_ptr")().cast<uintptr_t>();
      if (ptr == 0 && nbytes > 0) throwInvalid(where + "tensor has no storage (data_ptr() is 0)");
      // The storage, held: a set_ or the tensor's death does not free what hxfer writes.
      for (const char* name : {"untyped_storage", "storage"}) {
        if (py::hasattr(obj, name)) {
          storage_ = obj.attr(name)();
          break;
        }
      }
      *out = hxfer::Buffer{reinterpret_cast<void*>(ptr), nbytes, hxfer::MemoryKind::kHost, -1};
      where_ = {ptr, nbytes};
      tensor_ = true;
      return;
    }
    throwInvalid(where +
                 "expected a writable buffer (numpy array, bytearray, memoryview), a "
                 "torch tensor or a hxfer.SharedBuffer, got " +
                 typeName(obj));
  }

  // REQUIRES: the GIL. Why the object's memory is no longer where it was registered (its
  // address or size changed), or nullopt. Buffers other than numpy arrays and tensors cannot
  // move while their view is held (CPython refuses to resize an exported bytearray).
  std::optional<std::string> moved() const {
    uintptr_t ptr = 0;
    uint64_t bytes = 0;
    try {
      if (tensor_) {
        ptr = obj_.attr("data_ptr")().cast<uintptr_t>();
        bytes =
            obj_.attr("numel")().cast<uint64_t>() * obj_.attr("element_size")().cast<uint64_t>();
      } else if (view_ && py::hasattr(obj_, "__array_interface__")) {
        py::dict ai = obj_.attr("__array_interface__");
        ptr = py::tuple(ai["data"])[0].cast<uintptr_t>();
        bytes = obj_.attr("nbytes").cast<uint64_t>();
      } else {
        return std::nullopt;
      }
    } catch (const py::error_already_set& e) {
      return std::string("its address cannot be read any more: ") + e.what();
    }
    if (ptr == where_.first && bytes == where_.second) return std::nullopt;
    return "it was registered at 0x" + hex(where_.first) + " (" + std::to_string(where_.second) +
           " bytes) and is now at 0x" + hex(ptr) + " (" + std::to_string(bytes) + " bytes)";
  }

 private:
  // DLPack's device types hxfer knows (dlpack.h's DLDeviceType) and its C structs, as the
  // DLPack ABI fixes them (a capsule named "dltensor" holds a DLManagedTensor*).
  static constexpr int kDLCPU = 1;
  static constexpr int kDLCUDA = 2;
  static constexpr int kDLCUDAHost = 3;
  static constexpr int kDLCUDAManaged = 13;
  struct DLDevice {
    int32_t device_type;
    int32_t device_id;
  };
  struct DLDataType {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
  };
  struct DLTensor {
    void* data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t* shape;
    int64_t* strides;
    uint64_t byte_offset;
  };

  // REQUIRES: the GIL. Where obj_ is device memory (a torch tensor on cuda, an object with
  // __cuda_array_interface__, or one whose __dlpack_device__ is not the CPU), fills `out` with a
  // kCuda buffer, or throws naming the pool and what is wrong, and returns true; false for
  // host memory. Memory::wrap decides what device memory can do.
  bool acquireDevice(const std::string& where, hxfer::Buffer* out) {
    py::handle obj = obj_;
    const bool torch_like = py::hasattr(obj, "data_ptr") && py::hasattr(obj, "is_contiguous") &&
                            py::hasattr(obj, "device") && py::hasattr(obj.attr("device"), "type");
    const bool torch_cuda =
        torch_like && std::string(py::str(obj.attr("device").attr("type"))) == "cuda";
    if (torch_like && !torch_cuda) return false;  // the tensor path takes or names it
    std::optional<std::pair<int, int>> dl;        // __dlpack_device__(): (device type, id)
    if (!torch_like && py::hasattr(obj, "__dlpack_device__")) {
      try {
        py::tuple t = obj.attr("__dlpack_device__")();
        dl = {t[0].cast<int>(), t[1].cast<int>()};
      } catch (const py::error_already_set& e) {
        throwInvalid(where + typeName(obj) + ".__dlpack_device__() failed: " + pyError(e));
      } catch (const py::cast_error& e) {
        throwInvalid(where + typeName(obj) + ".__dlpack_device__() is not (type, id): " + e.what());
      }
    }
    const bool cai = !torch_like && py::hasattr(obj, "__cuda_array_interface__");
    if (!cai && !torch_cuda && (!dl || dl->first == kDLCPU)) return false;
    if (dl && dl->first != kDLCUDA && dl->first != kDLCUDAManaged) {
      throwInvalid(where + typeName(obj) + " is on DLPack device type " +
                   std::to_string(dl->first) +
                   (dl->first == kDLCUDAHost ? " (CUDA pinned host memory: pass it as a CPU "
                                               "tensor or numpy array)"
                                             : "") +
                   "; hxfer takes host memory and CUDA device memory (type 2)");
    }
    int device = -1;
    uintptr_t ptr = 0;
    uint64_t bytes = 0;
    if (torch_cuda) {
      py::object index = obj.attr("device").attr("index");
      device = index.is_none() ? -1 : index.cast<int>();
      if (!obj.attr("is_contiguous")().cast<bool>()) {
        throwInvalid(where + "tensor is not contiguous; pass tensor.contiguous()");
      }
      ptr = obj.attr("data_ptr")().cast<uintptr_t>();
      bytes = obj.attr("numel")().cast<uint64_t>() * obj.attr("element_size")().cast<uint64_t>();
      if (py::hasattr(obj, "untyped_storage")) storage_ = obj.attr("untyped_storage")();
      tensor_ = true;
    } else if (cai) {
      if (dl) device = dl->second;
      readCudaArrayInterface(where, &ptr, &bytes);
    } else {
      device = dl->second;
      readDlpack(where, &ptr, &bytes);
    }
    if (device < 0) {
      throwInvalid(where + typeName(obj) +
                   " is CUDA memory of no known device: hxfer needs the device ordinal (give "
                   "the object a __dlpack_device__(), or pass a torch tensor)");
    }
    if (ptr == 0 && bytes > 0) throwInvalid(where + "CUDA buffer at address 0");
    *out = hxfer::Buffer{reinterpret_cast<void*>(ptr), bytes, hxfer::MemoryKind::kCuda, -1};
    out->device = device;
    where_ = {ptr, bytes};
    return true;
  }

  // Bytes of `shape` elements of `itemsize` when `strides` (element strides in bytes, or none)
  // are C-contiguous; throws naming the pool otherwise.
  static uint64_t contiguousBytes(const std::string& where, const std::vector<int64_t>& shape,
                                  const std::vector<int64_t>* strides, uint64_t itemsize) {
    uint64_t n = itemsize;
    for (int64_t d : shape) {
      if (d < 0) throwInvalid(where + "negative extent " + std::to_string(d) + " in the shape");
      n *= static_cast<uint64_t>(d);
    }
    if (strides != nullptr && n > 0) {
      if (strides->size() != shape.size()) throwInvalid(where + "strides and shape differ in rank");
      int64_t expect = static_cast<int64_t>(itemsize);
      for (size_t i = shape.size(); i-- > 0;) {
        if (shape[i] != 1 && (*strides)[i] != expect) {
          throwInvalid(where + "device buffer is not contiguous (stride " +
                       std::to_string((*strides)[i]) + " where " + std::to_string(expect) +
                       " would be); pass a contiguous copy");
        }
        expect *= shape[i];
      }
    }
    return n;
  }

  void readCudaArrayInterface(const std::string& where, uintptr_t* ptr, uint64_t* bytes) {
    try {
      py::dict cai = obj_.attr("__cuda_array_interface__");
      py::tuple data = cai["data"];
      if (data[1].cast<bool>()) throwInvalid(where + "device buffer is read-only");
      *ptr = data[0].cast<uintptr_t>();
      const std::string typestr = cai["typestr"].cast<std::string>();
      if (typestr.size() < 3) throwInvalid(where + "typestr '" + typestr + "' has no size");
      const uint64_t itemsize = std::stoull(typestr.substr(2));
      const auto shape = cai["shape"].cast<std::vector<int64_t>>();
      std::optional<std::vector<int64_t>> strides;
      if (cai.contains("strides") && !cai["strides"].is_none()) {
        strides = cai["strides"].cast<std::vector<int64_t>>();
      }
      *bytes = contiguousBytes(where, shape, strides ? &*strides : nullptr, itemsize);
    } catch (const py::error_already_set& e) {
      throwInvalid(where + "malformed __cuda_array_interface__: " + pyError(e));
    } catch (const py::cast_error& e) {
      throwInvalid(where + "malformed __cuda_array_interface__: " + e.what());
    } catch (const std::logic_error& e) {  // stoull
      throwInvalid(where + "malformed __cuda_array_interface__ typestr: " + e.what());
    }
  }

  // Reads the DLTensor of obj_.__dlpack__() without consuming it: the capsule is held (its
  // destructor hands the tensor back to its producer when hxfer lets go of it).
  void readDlpack(const std::string& where, uintptr_t* ptr, uint64_t* bytes) {
    py::object capsule;
    try {
      capsule = obj_.attr("__dlpack__")();
    } catch (const py::error_already_set& e) {
      throwInvalid(where + typeName(obj_) + ".__dlpack__() failed: " + pyError(e));
    }
    if (!PyCapsule_IsValid(capsule.ptr(), "dltensor")) {
      throwInvalid(where + typeName(obj_) +
                   ".__dlpack__() gave no unconsumed capsule named 'dltensor'");
    }
    // A DLManagedTensor begins with its DLTensor. DLPack 1.0's versioned capsule
    // ("dltensor_versioned") is another struct: __dlpack__() without max_version gives this one.
    const auto* t = static_cast<const DLTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
    if (t == nullptr || t->ndim < 0 || (t->ndim > 0 && t->shape == nullptr)) {
      throwInvalid(where + "malformed DLPack tensor");
    }
    if ((t->dtype.bits * uint32_t{t->dtype.lanes}) % 8 != 0) {
      throwInvalid(where + "DLPack elements of " + std::to_string(t->dtype.bits) +
                   " bits are not whole bytes");
    }
    std::vector<int64_t> shape(t->shape, t->shape + t->ndim);
    const uint64_t itemsize = t->dtype.bits * uint64_t{t->dtype.lanes} / 8;
    std::optional<std::vector<int64_t>> strides;
    if (t->strides != nullptr) {
      strides.emplace();
      for (int i = 0; i < t->ndim; ++i) {
        strides->push_back(t->strides[i] * static_cast<int64_t>(itemsize));  // elements -> bytes
      }
    }
    *bytes = contiguousBytes(where, shape, strides ? &*strides : nullptr, itemsize);
    *ptr = reinterpret_cast<uintptr_t>(t->data) + t->byte_offset;
    storage_ = capsule;
  }

  // "TypeError: message", without the traceback pybind11 appends to what().
  static std::string pyError(const py::error_already_set& e) {
    return std::string(py::str(e.type().attr("__name__"))) + ": " + std::string(py::str(e.value()));
  }

  static std::string hex(uintptr_t v) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%llx", static_cast<unsigned long long>(v));
    return buf;
  }

  py::object obj_;
  std::unique_ptr<Py_buffer> view_;
  py::object storage_;  // a tensor's storage
  bool tensor_ = false;
  std::pair<uintptr_t, uint64_t> where_;  // address and bytes when registered
};

struct PyMemory {
  std::optional<hxfer::Memory> memory;
  py::object layout;                              // the Python Layout it was made for
  py::dict buffers;                               // name -> the object given
  std::vector<std::unique_ptr<HeldBuffer>> held;  // the views taken from them
  std::vector<std::string> names;                 // of held, in order
  std::optional<std::string> broken;              // why it may not be used any more

  // REQUIRES: the GIL. Throws hxfer.Error(InvalidArgument) once any pool's memory moved since
  // it was registered (and from then on): hxfer must not be handed pages of memory that is gone.
  void checkIntact() {
    for (size_t i = 0; !broken && i < held.size(); ++i) {
      if (auto why = held[i]->moved()) {
        broken = "pool " + names[i] + ": its memory moved after it was registered (" + *why +
                 "; a tensor's resize_ or set_, or numpy's resize, under a registered buffer): "
                 "this Memory is unusable, make a new one over the engine's current buffers";
      }
    }
    if (broken) throwInvalid(*broken);
  }
};

std::unique_ptr<PyMemory> makeMemory(py::object layout_obj, py::object buffers_obj) {
  const hxfer::Layout& layout = layout_obj.cast<const hxfer::Layout&>();
  if (!py::isinstance<py::dict>(buffers_obj) && !py::hasattr(buffers_obj, "items")) {
    throw py::type_error("buffers must be a dict of pool name -> buffer, got " +
                         typeName(buffers_obj));
  }
  auto out = std::make_unique<PyMemory>();
  out->layout = layout_obj;
  // A copy: the caller may change its dict; the Memory keeps what it registered.
  for (auto [key, value] : py::dict(buffers_obj)) out->buffers[key] = value;
  std::map<std::string, hxfer::Buffer> wrapped;
  for (auto [key, value] : out->buffers) {
    if (!py::isinstance<py::str>(key)) {
      throw py::type_error("buffers keys must be pool names (str), got " + typeName(key));
    }
    std::string name = py::str(key);
    auto held = std::make_unique<HeldBuffer>(py::reinterpret_borrow<py::object>(value));
    hxfer::Buffer b;
    held->acquire(name, &b);
    out->held.push_back(std::move(held));
    out->names.push_back(name);
    wrapped.emplace(std::move(name), b);
  }
  out->memory = valueOrThrow(hxfer::Memory::wrap(layout, wrapped));
  return out;
}

// ---- Callbacks ----

// A Python callable called from hxfer threads. Its destructor takes the GIL, so whoever drops
// the last copy of the std::function holding it (hxfer, maybe without the GIL) may.
// >0 while this thread runs a Python callback for hxfer (an hxfer thread).
thread_local int t_callback_depth = 0;

class PyCallback {
 public:
  explicit PyCallback(py::object fn) : fn_(std::move(fn)) {}
  ~PyCallback() {
    if (!Py_IsInitialized() || pyFinalizing()) {
      fn_.release();  // leaked: Python is gone or going
      return;
    }
    py::gil_scoped_acquire gil;
    fn_ = py::object();
  }
  PyCallback(const PyCallback&) = delete;
  PyCallback& operator=(const PyCallback&) = delete;

  template <typename... Args>
  void operator()(Args&&... args) const {
    if (!Py_IsInitialized() || pyFinalizing()) return;
    py::gil_scoped_acquire gil;
    ++t_callback_depth;
    try {
      fn_(std::forward<Args>(args)...);
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable(fn_);
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
      PyErr_WriteUnraisable(fn_.ptr());
    }
    --t_callback_depth;
  }

 private:
  py::object fn_;
};

std::shared_ptr<PyCallback> toCallback(const py::object& fn, const char* what) {
  if (fn.is_none()) return nullptr;
  if (!PyCallable_Check(fn.ptr())) {
    throw py::type_error(std::string(what) + " must be callable, got " + typeName(fn));
  }
  return std::make_shared<PyCallback>(fn);
}

std::function<void(uint64_t)> releasedFn(const std::shared_ptr<PyCallback>& cb) {
  if (!cb) return {};
  return [cb](uint64_t id) { (*cb)(id); };
}

void fillTransport(hxfer::TransportOptions& o, const std::string& backend, const std::string& token,
                   const std::string& instance, bool checksum, const py::object& ucx_options) {
  o.backend = backend;
  o.token = token;
  o.instance = instance;
  o.checksum = checksum;
  o.ucx_options = toUcxOptions(ucx_options);
}

// ---- Sender / Receiver ----

// Runs `work` on a thread of its own, then drops `keep` with the GIL held. For what a thread
// of hxfer's cannot do itself: join itself.
template <typename F>
void runDetached(F work, std::vector<py::object> keep) {
  auto held = std::make_shared<std::vector<py::object>>(std::move(keep));
  std::thread([work = std::move(work), held]() mutable {
    work();
    if (!Py_IsInitialized() || pyFinalizing()) {
      for (py::object& o : *held) o.release();  // leaked: Python is gone or going
      return;
    }
    py::gil_scoped_acquire gil;
    held->clear();
  }).detach();
}

// Live endpoints, shut down at interpreter exit. Touched only with the GIL held.
class Endpoint;
std::set<Endpoint*>& liveEndpoints() {
  static auto* live = new std::set<Endpoint*>();
  return *live;
}

class Endpoint {
 public:
  Endpoint() { liveEndpoints().insert(this); }
  virtual ~Endpoint() { liveEndpoints().erase(this); }
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;
  // REQUIRES: the GIL.
  virtual void shutdownNow() = 0;

  py::object layout, memory;  // kept alive while the endpoint may touch the pages
};

// A Sender or Receiver as Python holds it. shutdown() and destruction join hxfer's threads,
// which may be waiting for the GIL to run a callback: both release it first. Called from
// inside a callback (an hxfer thread), they cannot wait for the thread they run on: they do
// the work on a thread of their own, keeping the Python objects it needs alive until done.
template <typename T>
struct PyEndpoint : Endpoint {
  std::shared_ptr<T> impl;

  ~PyEndpoint() override { destroy(); }

  void shutdownNow() override {
    if (!impl) return;
    // A reference of its own, taken with the GIL: a callback that drops this endpoint while
    // the GIL is released (at exit) cannot free it under the shutdown.
    std::shared_ptr<T> s = impl;
    py::gil_scoped_release nogil;
    s->shutdown();
    s.reset();  // without the GIL: if it was the last, ~T joins threads that may want it
  }
  // REQUIRES: the GIL; `self` is the Python object of this endpoint.
  void shutdown(py::object self) {
    if (!impl) return;
    if (t_callback_depth > 0) {
      // Drops its reference before `self` goes: the object dies, if it does, on the normal
      // path, with its buffers held until the endpoint is gone.
      runDetached(
          [s = impl]() mutable {
            s->shutdown();
            s.reset();
          },
          {std::move(self)});
      return;
    }
    shutdownNow();
  }
  void destroy() {
    if (!impl) return;
    std::shared_ptr<T> s = std::move(impl);
    if (t_callback_depth > 0) {
      runDetached([s = std::move(s)]() mutable { s.reset(); }, {layout, memory});
      return;
    }
    py::gil_scoped_release nogil;
    s.reset();
  }
};

struct PySender : PyEndpoint<hxfer::Sender> {
  std::shared_ptr<PyCallback> on_released, on_request;
  std::string address, backend, routing;  // cached: fixed at creation
};

struct PyReceiver : PyEndpoint<hxfer::Receiver> {
  std::shared_ptr<PyCallback> on_released;
  std::string backend, routing;
};

// A shutdown runs callbacks, which may drop the last reference to another endpoint: the live
// set is looked at afresh before each one, never through a copy that may dangle.
void shutdownAll() {
  std::set<Endpoint*> done;
  for (;;) {
    Endpoint* next = nullptr;
    for (Endpoint* e : liveEndpoints()) {
      if (!done.count(e)) {
        next = e;
        break;
      }
    }
    if (next == nullptr) return;
    done.insert(next);
    next->shutdownNow();
  }
}

const hxfer::Memory& memoryOf(const py::object& memory_obj) {
  const PyMemory& m = memory_obj.cast<const PyMemory&>();
  return *m.memory;
}

std::unique_ptr<PySender> makeSender(py::object layout_obj, py::object memory_obj,
                                     const std::string& listen, const std::string& backend,
                                     const std::string& token, const std::string& instance,
                                     bool checksum, double lease_timeout, py::object ucx_options,
                                     py::object on_released, py::object on_request,
                                     uint64_t stream_min_tokens, double stall_timeout) {
  const hxfer::Layout& layout = layout_obj.cast<const hxfer::Layout&>();
  memory_obj.cast<PyMemory&>().checkIntact();
  const hxfer::Memory& memory = memoryOf(memory_obj);
  auto out = std::make_unique<PySender>();
  out->layout = layout_obj;
  out->memory = memory_obj;
  out->on_released = toCallback(on_released, "on_released");
  out->on_request = toCallback(on_request, "on_request");

  hxfer::SenderOptions o;
  fillTransport(o, backend, token, instance, checksum, ucx_options);
  o.listen = listen;
  o.lease_timeout = toMillis(lease_timeout, "lease_timeout");
  o.stall_timeout = toMillis(stall_timeout, "stall_timeout");
  o.stream_min_tokens = stream_min_tokens;
  o.on_released = releasedFn(out->on_released);
  if (out->on_request) {
    std::shared_ptr<PyCallback> cb = out->on_request;
    o.on_request = [cb](uint64_t id, uint64_t num_tokens, const std::string& aux) {
      if (!Py_IsInitialized() || pyFinalizing()) return;
      py::gil_scoped_acquire gil;
      (*cb)(id, num_tokens, py::bytes(aux));
    };
  }
  hxfer::StatusOr<std::unique_ptr<hxfer::Sender>> created = hxfer::Status();
  {
    py::gil_scoped_release nogil;
    created = hxfer::Sender::create(layout, memory, std::move(o));
  }
  out->impl = valueOrThrow(std::move(created));
  out->address = out->impl->address();
  out->backend = out->impl->backend();
  out->routing = out->impl->routing();
  return out;
}

std::unique_ptr<PyReceiver> makeReceiver(py::object layout_obj, py::object memory_obj,
                                         std::vector<std::string> peers, uint32_t peer_tp,
                                         uint32_t peer_pp, const std::string& backend,
                                         const std::string& token, const std::string& instance,
                                         bool checksum, double request_timeout,
                                         double handshake_timeout, py::object ucx_options,
                                         py::object on_released, uint64_t staging_bytes) {
  const hxfer::Layout& layout = layout_obj.cast<const hxfer::Layout&>();
  memory_obj.cast<PyMemory&>().checkIntact();
  const hxfer::Memory& memory = memoryOf(memory_obj);
  auto out = std::make_unique<PyReceiver>();
  out->layout = layout_obj;
  out->memory = memory_obj;
  out->on_released = toCallback(on_released, "on_released");

  hxfer::ReceiverOptions o;
  fillTransport(o, backend, token, instance, checksum, ucx_options);
  o.peers = std::move(peers);
  o.peer_tp = peer_tp;
  o.peer_pp = peer_pp;
  o.request_timeout = toMillis(request_timeout, "request_timeout");
  o.handshake_timeout = toMillis(handshake_timeout, "handshake_timeout");
  o.staging_bytes = staging_bytes;
  o.on_released = releasedFn(out->on_released);
  hxfer::StatusOr<std::unique_ptr<hxfer::Receiver>> created = hxfer::Status();
  {
    py::gil_scoped_release nogil;
    created = hxfer::Receiver::create(layout, memory, std::move(o));
  }
  out->impl = valueOrThrow(std::move(created));
  out->backend = out->impl->backend();
  out->routing = out->impl->routing();
  return out;
}

// ---- Result ----

const char* stateName(hxfer::Result::State s) {
  switch (s) {
    case hxfer::Result::State::kInProgress:
      return "in_progress";
    case hxfer::Result::State::kDone:
      return "done";
    case hxfer::Result::State::kFailed:
      return "failed";
  }
  return "unknown";
}

std::string resultRepr(const hxfer::Result& r) {
  std::string out = "hxfer.Result(state=";
  out += stateName(r.state);
  if (r.state == hxfer::Result::State::kFailed) {
    out += ", error=" + std::string(py::repr(py::str(r.status.toString())));
  } else {
    out += ", bytes=" + std::to_string(r.bytes);
  }
  return out + ")";
}

const char* kErrorSource = R"PY(
class Error(Exception):
    """A non-ok hxfer Status.

    code:    the status code's name: "InvalidArgument", "Corruption", "Incompatible",
             "Unavailable", "Timeout", "Cancelled", "ResourceExhausted", "NotFound",
             "Internal", "PermissionDenied" or "Expired".
    message: what happened, naming the field and the values.
    str(e) is "<code>: <message>", as Status::toString().
    """

    def __init__(self, code, message=""):
        super().__init__(code, message)
        self.code = code
        self.message = message

    def __str__(self):
        return f"{self.code}: {self.message}" if self.message else str(self.code)
)PY";

}  // namespace

// HXFER_VERSION is the CMake project's version (python/CMakeLists.txt): the one source of
// hxfer.__version__ and of the wheel's version (pyproject.toml reads it from CMakeLists.txt).
#ifndef HXFER_VERSION
#error "HXFER_VERSION must be defined by the build (python/CMakeLists.txt)"
#endif

// ---- Described layouts ----

// dims: [(name, size, stride)] or [{"name", "size", "stride"}].
std::vector<hxfer::RecordDim> toDims(const py::handle& obj, const std::string& where) {
  std::vector<hxfer::RecordDim> out;
  for (py::handle d : obj) {
    hxfer::RecordDim dim;
    if (py::isinstance<py::dict>(d)) {
      py::dict m = py::reinterpret_borrow<py::dict>(d);
      dim = {m["name"].cast<std::string>(), m["size"].cast<uint32_t>(),
             m["stride"].cast<uint64_t>()};
    } else {
      py::tuple t = py::reinterpret_borrow<py::object>(d).cast<py::tuple>();
      if (t.size() != 3) {
        throw py::value_error(where + ": a dim is (name, size, stride), got " +
                              std::string(py::repr(d)));
      }
      dim = {t[0].cast<std::string>(), t[1].cast<uint32_t>(), t[2].cast<uint64_t>()};
    }
    out.push_back(std::move(dim));
  }
  return out;
}

hxfer::LayoutDescription toDescription(const hxfer::LayoutOptions& o, const py::object& pools,
                                       const py::object& records, uint32_t state_groups,
                                       bool joint_ids) {
  hxfer::LayoutDescription d;
  d.options = o;
  d.state_groups = state_groups;
  d.joint_ids = joint_ids;
  if (py::isinstance<py::dict>(pools)) {
    for (auto [k, v] : py::reinterpret_borrow<py::dict>(pools)) {
      d.pools.push_back({k.cast<std::string>(), v.cast<uint64_t>()});
    }
  } else {
    for (py::handle p : pools) {
      py::tuple t = py::reinterpret_borrow<py::object>(p).cast<py::tuple>();
      d.pools.push_back({t[0].cast<std::string>(), t[1].cast<uint64_t>()});
    }
  }
  size_t i = 0;
  for (py::handle h : records) {
    const std::string where = "records[" + std::to_string(i++) + "]";
    if (!py::isinstance<py::dict>(h)) throw py::type_error(where + " must be a dict");
    py::dict r = py::reinterpret_borrow<py::dict>(h);
    for (const char* key : {"layer", "role", "pool", "offset", "index_stride", "dims"}) {
      if (!r.contains(key)) throw py::value_error(where + " has no '" + key + "'");
    }
    hxfer::RecordSpec spec;
    spec.layer = r["layer"].cast<uint32_t>();
    spec.role = r["role"].cast<std::string>();
    spec.pool = r["pool"].cast<std::string>();
    spec.offset = r["offset"].cast<uint64_t>();
    spec.index_stride = r["index_stride"].cast<uint64_t>();
    if (r.contains("state_group")) spec.state_group = r["state_group"].cast<uint32_t>();
    if (r.contains("section") && !r["section"].is_none()) {
      spec.section = r["section"].cast<std::string>();
    }
    spec.dims = toDims(r["dims"], where);
    d.records.push_back(std::move(spec));
  }
  return d;
}

py::dict descriptionDict(const hxfer::LayoutDescription& d) {
  py::dict out;
  py::list pools, records;
  for (const hxfer::PoolSpec& p : d.pools) pools.append(py::make_tuple(p.name, p.bytes));
  for (const hxfer::RecordSpec& r : d.records) {
    py::dict x;
    x["layer"] = r.layer;
    x["role"] = r.role;
    x["pool"] = r.pool;
    x["offset"] = r.offset;
    x["index_stride"] = r.index_stride;
    x["state_group"] = r.state_group;
    x["section"] = r.section.empty() ? py::object(py::none()) : py::object(py::str(r.section));
    py::list dims;
    for (const hxfer::RecordDim& dim : r.dims) {
      dims.append(py::make_tuple(dim.name, dim.size, dim.stride));
    }
    x["dims"] = dims;
    records.append(x);
  }
  out["pools"] = pools;
  out["records"] = records;
  out["state_groups"] = d.state_groups;
  out["joint_ids"] = d.joint_ids;
  return out;
}

PYBIND11_MODULE(_hxfer, m) {
  m.doc() =
      "hxfer: move the cache state of hybrid LLMs between serving instances.\n\n"
      "Layout describes one rank's cache as an engine lays it out; Memory registers the "
      "engine's buffers for it without a copy; Sender (context rank) marks a request's pages "
      "ready; Receiver (generation rank) pulls them into its own pages. Every error is "
      "hxfer.Error with a .code. See include/hxfer/hxfer.h for the page lifetime contract.";
  m.attr("__version__") = HXFER_VERSION;
  m.attr("API_VERSION") = hxfer::kApiVersion;

  {
    py::dict scope;
    scope["__builtins__"] = py::module_::import("builtins");
    scope["__name__"] = "hxfer";
    py::exec(kErrorSource, scope);
    py::object error = scope["Error"];
    error.attr("__module__") = "hxfer";
    g_error_type = error.inc_ref().ptr();
    m.attr("Error") = error;
  }
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      setPythonError(e.status);
    }
  });

  // ---- Layout ----
  py::class_<hxfer::Layout>(m, "Layout",
                            "One rank's cache as a serving engine lays it out (a value).")
      .def_static(
          "engine",
          [](const std::string& engine, std::optional<std::string> model, uint32_t tp,
             uint32_t tp_rank, uint32_t pp, uint32_t pp_rank, uint32_t num_blocks,
             uint32_t num_slots, uint32_t tokens_per_block, std::optional<std::string> kv_dtype,
             std::optional<std::string> conv_dtype, std::optional<std::string> ssm_dtype,
             std::optional<std::string> kv_layout, std::optional<std::string> conv_layout,
             std::optional<std::string> state_layout, std::optional<std::string> shared_tensors) {
            hxfer::LayoutOptions o;
            o.engine = engine;
            o.model = model.value_or("");
            o.tp = tp;
            o.tp_rank = tp_rank;
            o.pp = pp;
            o.pp_rank = pp_rank;
            o.num_blocks = num_blocks;
            o.num_slots = num_slots;
            o.tokens_per_block = tokens_per_block;
            o.kv_dtype = kv_dtype.value_or("");
            o.conv_dtype = conv_dtype.value_or("");
            o.ssm_dtype = ssm_dtype.value_or("");
            o.kv_layout = kv_layout.value_or("");
            o.conv_layout = conv_layout.value_or("");
            o.state_layout = state_layout.value_or("");
            o.shared_tensors = shared_tensors.value_or("");
            return makeLayout(o);
          },
          py::arg("engine"), py::kw_only(), py::arg("model") = py::none(), py::arg("tp") = 1,
          py::arg("tp_rank") = 0, py::arg("pp") = 1, py::arg("pp_rank") = 0,
          py::arg("num_blocks") = 0, py::arg("num_slots") = 0, py::arg("tokens_per_block") = 32,
          py::arg("kv_dtype") = py::none(), py::arg("conv_dtype") = py::none(),
          py::arg("ssm_dtype") = py::none(), py::arg("kv_layout") = py::none(),
          py::arg("conv_layout") = py::none(), py::arg("state_layout") = py::none(),
          py::arg("shared_tensors") = py::none(),
          "The layout of rank (tp_rank, pp_rank) of `engine` (\"hxfer\", \"trtllm-v1\", "
          "\"trtllm-v2\", \"vllm\", \"sglang\") for `model` (a preset name or a config.json "
          "path; None: the default preset) with num_blocks kv blocks and num_slots state "
          "slots. dtypes: \"fp32\", \"fp16\", \"bf16\", \"fp8\" (None: the config's). "
          "shared_tensors=\"on\" (vllm): vLLM's hybrid manager, blocks and a state per Mamba "
          "group from one pool of num_blocks ids (num_slots is not used).")
      .def(
          "pools",
          [](const hxfer::Layout& l) {
            py::list out;
            for (const hxfer::PoolInfo& p : l.pools()) out.append(poolDict(p));
            return out;
          },
          "The pools the engine registers: dicts with name, bytes, shape and strides "
          "(bytes; rows of the outermost index: blocks, slots or layers).")
      .def(
          "pool",
          [](const hxfer::Layout& l, const std::string& name) -> py::object {
            const hxfer::PoolInfo* p = l.pool(name);
            if (!p) return py::none();
            return poolDict(*p);
          },
          py::arg("name"), "One pool by name, or None.")
      .def(
          "records",
          [](const hxfer::Layout& l, uint32_t layer, const std::string& role) {
            auto parts = valueOrThrow(l.records(layer, role));
            py::list out;
            for (const hxfer::RecordPart& p : parts) out.append(recordDict(p));
            return out;
          },
          py::arg("layer"), py::arg("role"),
          "Where global layer `layer`'s records of `role` (\"kv\", \"conv\", \"ssm\") lie: "
          "dicts with pool, offset, index_stride, num_indices, state_group, dtype, element_bytes, "
          "dims "
          "[{name, size, stride}] and sections [{name, first_unit, units, unit_len, base, "
          "unit_stride, within_stride}] (docs/api.md).")
      .def_static(
          "from_records",
          [](std::optional<std::string> model, uint32_t tp, uint32_t tp_rank, uint32_t pp,
             uint32_t pp_rank, uint32_t num_blocks, uint32_t num_slots, uint32_t tokens_per_block,
             std::optional<std::string> kv_dtype, std::optional<std::string> conv_dtype,
             std::optional<std::string> ssm_dtype, py::object pools, py::object records,
             uint32_t state_groups, bool joint_ids, const std::string& label) {
            hxfer::LayoutOptions o;
            o.engine = label;
            o.model = model.value_or("");
            o.tp = tp;
            o.tp_rank = tp_rank;
            o.pp = pp;
            o.pp_rank = pp_rank;
            o.num_blocks = num_blocks;
            o.num_slots = num_slots;
            o.tokens_per_block = tokens_per_block;
            o.kv_dtype = kv_dtype.value_or("");
            o.conv_dtype = conv_dtype.value_or("");
            o.ssm_dtype = ssm_dtype.value_or("");
            return valueOrThrow(hxfer::Layout::fromRecords(
                toDescription(o, pools, records, state_groups, joint_ids)));
          },
          py::kw_only(), py::arg("model") = py::none(), py::arg("tp") = 1, py::arg("tp_rank") = 0,
          py::arg("pp") = 1, py::arg("pp_rank") = 0, py::arg("num_blocks") = 0,
          py::arg("num_slots") = 0, py::arg("tokens_per_block") = 32,
          py::arg("kv_dtype") = py::none(), py::arg("conv_dtype") = py::none(),
          py::arg("ssm_dtype") = py::none(), py::arg("pools"), py::arg("records"),
          py::arg("state_groups") = 1, py::arg("joint_ids") = false, py::arg("label") = "described",
          "A layout described record by record, from the tensors an engine registers (docs/"
          "api.md): pools {name: bytes}; records [{layer, role, pool, offset, index_stride, "
          "state_group=0, section=None ('K' or 'V' for a kv part holding one), dims [(name, "
          "size, stride)]}], the inverse of records(). With joint_ids (vLLM's hybrid manager) "
          "state ids come from the num_blocks block ids, state_groups per request.")
      .def_property_readonly(
          "description",
          [](const hxfer::Layout& l) -> py::object {
            const hxfer::LayoutDescription* d = l.description();
            if (d == nullptr) return py::none();
            return descriptionDict(*d);
          },
          "For a layout made by from_records: {pools, records, state_groups, joint_ids}; None "
          "for Layout.engine.")
      .def_property_readonly("reserved_blocks", &hxfer::Layout::reservedBlocks,
                             "Block ids the engine never hands to a request (vllm's null block "
                             "0, sglang's dummy page 0).")
      .def_property_readonly("reserved_slots", &hxfer::Layout::reservedSlots,
                             "State ids the engine never hands to a request (vllm's null block 0, "
                             "sglang's dummy slot 0).")
      .def("layers", &hxfer::Layout::layers, "Global layer ids this rank holds records of.")
      .def_property_readonly(
          "stage_layers",
          [](const hxfer::Layout& l) {
            const hxfer::LayerSpan s = l.stageLayers();
            return py::make_tuple(s.first, s.first + s.count);
          },
          "(begin, end): every global layer of this rank's pp stage, the span that "
          "Sender.mark_ready(..., layers=) ranges cover.")
      .def("describe", &hxfer::Layout::describe)
      .def("blocks_for", &hxfer::Layout::blocksFor, py::arg("num_tokens"),
           "Blocks that num_tokens tokens occupy on this rank (0 without attention layers).")
      .def_property_readonly("has_kv", &hxfer::Layout::hasKv)
      .def_property_readonly("has_state", &hxfer::Layout::hasState)
      .def_property_readonly("state_groups", &hxfer::Layout::stateGroups,
                             "State ids a request has on this rank: slot and group_slots.")
      .def_property_readonly("joint_ids", &hxfer::Layout::jointIds,
                             "Whether block and state ids share one pool (vllm shared tensors).")
      .def_property_readonly("engine_name",
                             [](const hxfer::Layout& l) { return l.options().engine; })
      .def_property_readonly("model", [](const hxfer::Layout& l) { return l.options().model; })
      .def_property_readonly("tp", [](const hxfer::Layout& l) { return l.options().tp; })
      .def_property_readonly("tp_rank", [](const hxfer::Layout& l) { return l.options().tp_rank; })
      .def_property_readonly("pp", [](const hxfer::Layout& l) { return l.options().pp; })
      .def_property_readonly("pp_rank", [](const hxfer::Layout& l) { return l.options().pp_rank; })
      .def_property_readonly("num_blocks",
                             [](const hxfer::Layout& l) { return l.options().num_blocks; })
      .def_property_readonly("num_slots",
                             [](const hxfer::Layout& l) { return l.options().num_slots; })
      .def_property_readonly("tokens_per_block",
                             [](const hxfer::Layout& l) { return l.options().tokens_per_block; })
      .def("__repr__", [](const hxfer::Layout& l) { return "hxfer.Layout(" + l.describe() + ")"; })
      .def("__eq__",
           [](const hxfer::Layout& a, py::object b) {
             if (!py::isinstance<hxfer::Layout>(b)) return false;
             return a == b.cast<const hxfer::Layout&>();
           })
      .def("__ne__",
           [](const hxfer::Layout& a, py::object b) {
             if (!py::isinstance<hxfer::Layout>(b)) return true;
             return !(a == b.cast<const hxfer::Layout&>());
           })
      .def(py::pickle(
          [](const hxfer::Layout& l) {
            const hxfer::LayoutOptions& o = l.options();
            py::dict d;
            d["engine"] = o.engine;
            d["kv_layout"] = o.kv_layout;
            d["conv_layout"] = o.conv_layout;
            d["state_layout"] = o.state_layout;
            d["shared_tensors"] = o.shared_tensors;
            d["model"] = o.model;
            d["tp"] = o.tp;
            d["tp_rank"] = o.tp_rank;
            d["pp"] = o.pp;
            d["pp_rank"] = o.pp_rank;
            d["num_blocks"] = o.num_blocks;
            d["num_slots"] = o.num_slots;
            d["tokens_per_block"] = o.tokens_per_block;
            d["kv_dtype"] = o.kv_dtype;
            d["conv_dtype"] = o.conv_dtype;
            d["ssm_dtype"] = o.ssm_dtype;
            if (const hxfer::LayoutDescription* desc = l.description()) {
              d["description"] = descriptionDict(*desc);
            }
            return d;
          },
          [](const py::dict& d) {
            hxfer::LayoutOptions o;
            o.engine = d["engine"].cast<std::string>();
            o.kv_layout = d["kv_layout"].cast<std::string>();
            o.conv_layout = d["conv_layout"].cast<std::string>();
            o.state_layout = d["state_layout"].cast<std::string>();
            if (d.contains("shared_tensors"))
              o.shared_tensors = d["shared_tensors"].cast<std::string>();
            o.model = d["model"].cast<std::string>();
            o.tp = d["tp"].cast<uint32_t>();
            o.tp_rank = d["tp_rank"].cast<uint32_t>();
            o.pp = d["pp"].cast<uint32_t>();
            o.pp_rank = d["pp_rank"].cast<uint32_t>();
            o.num_blocks = d["num_blocks"].cast<uint32_t>();
            o.num_slots = d["num_slots"].cast<uint32_t>();
            o.tokens_per_block = d["tokens_per_block"].cast<uint32_t>();
            o.kv_dtype = d["kv_dtype"].cast<std::string>();
            o.conv_dtype = d["conv_dtype"].cast<std::string>();
            o.ssm_dtype = d["ssm_dtype"].cast<std::string>();
            if (d.contains("description")) {
              py::dict x = d["description"];
              return valueOrThrow(hxfer::Layout::fromRecords(
                  toDescription(o, x["pools"], x["records"], x["state_groups"].cast<uint32_t>(),
                                x["joint_ids"].cast<bool>())));
            }
            return makeLayout(o);
          }));

  // ---- SharedBuffer ----
  py::class_<PySharedBuffer>(m, "SharedBuffer", py::buffer_protocol(),
                             "Host memory the shm transport can share (a sealed memfd). Exports "
                             "a writable 1-D uint8 buffer: numpy.asarray(sb) is a view.")
      .def(py::init([](uint64_t nbytes, const std::string& name) {
             hxfer::StatusOr<std::shared_ptr<hxfer::SharedBuffer>> sb = hxfer::Status();
             {
               py::gil_scoped_release nogil;  // pre-faulting a large buffer takes a while
               sb = hxfer::SharedBuffer::allocate(nbytes, name);
             }
             return PySharedBuffer{valueOrThrow(std::move(sb)), name};
           }),
           py::arg("nbytes"), py::arg("name") = "pool")
      .def_buffer([](PySharedBuffer& sb) {
        return py::buffer_info(sb.buffer->data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(sb.buffer->bytes())}, {1},
                               /*readonly=*/false);
      })
      .def_property_readonly("nbytes", [](const PySharedBuffer& sb) { return sb.buffer->bytes(); })
      .def_property_readonly("fd", [](const PySharedBuffer& sb) { return sb.buffer->fd(); })
      .def_property_readonly("name", [](const PySharedBuffer& sb) { return sb.name; })
      .def("__len__", [](const PySharedBuffer& sb) { return sb.buffer->bytes(); })
      .def("__repr__", [](const PySharedBuffer& sb) {
        return "hxfer.SharedBuffer(nbytes=" + std::to_string(sb.buffer->bytes()) +
               ", name=" + std::string(py::repr(py::str(sb.name))) +
               ", fd=" + std::to_string(sb.buffer->fd()) + ")";
      });

  // ---- Memory ----
  py::class_<PyMemory>(m, "Memory",
                       "The engine's buffers for one Layout, one per pool by name, registered "
                       "without a copy. Keeps every buffer object alive while it lives.")
      .def(py::init(&makeMemory), py::arg("layout"), py::arg("buffers"))
      .def_property_readonly("layout", [](const PyMemory& mem) { return mem.layout; })
      .def_property_readonly("shareable",
                             [](const PyMemory& mem) { return mem.memory->shareable(); })
      .def_property_readonly("device", [](const PyMemory& mem) { return mem.memory->device(); })
      .def_property_readonly("buffers", [](const PyMemory& mem) { return py::dict(mem.buffers); })
      .def("__repr__", [](const PyMemory& mem) {
        return "hxfer.Memory(" + std::to_string(mem.held.size()) +
               " pools, shareable=" + (mem.memory->shareable() ? "True" : "False") + ")";
      });

  // ---- Result ----
  py::class_<hxfer::Result>(m, "Result", "A receive's state: in_progress, done or failed.")
      .def_property_readonly("ok", &hxfer::Result::ok)
      .def_property_readonly("terminal", &hxfer::Result::terminal)
      .def_property_readonly("state", [](const hxfer::Result& r) { return stateName(r.state); })
      .def_property_readonly("error",
                             [](const hxfer::Result& r) -> py::object {
                               if (r.status.isOk()) return py::none();
                               return py::str(r.status.toString());
                             })
      .def_property_readonly("code",
                             [](const hxfer::Result& r) {
                               return std::string(hxfer::statusCodeName(r.status.code()));
                             })
      .def_property_readonly("message", [](const hxfer::Result& r) { return r.status.message(); })
      .def_property_readonly("bytes", [](const hxfer::Result& r) { return r.bytes; })
      .def_property_readonly("aux", [](const hxfer::Result& r) { return py::bytes(r.aux); })
      .def_property_readonly(
          "latency",
          [](const hxfer::Result& r) { return std::chrono::duration<double>(r.latency).count(); },
          "Seconds from start() to the end.")
      .def_property_readonly(
          "queued",
          [](const hxfer::Result& r) { return std::chrono::duration<double>(r.queued).count(); },
          "Seconds of latency before the request's first ask went to a context rank (all of it "
          "when none went): waiting for a connection, the pages-free event or staging room; "
          "latency - queued is the transfer, from the first ask to the end.")
      .def(
          "raise_for_error", [](const hxfer::Result& r) { throwIfError(r.status); },
          "Raises hxfer.Error when the request failed.")
      .def("__bool__", &hxfer::Result::ok)
      .def("__repr__", &resultRepr);

  // ---- Sender ----
  py::class_<PySender>(m, "Sender",
                       "The context rank. mark_ready(id, blocks, slot, aux) once prefill wrote "
                       "the pages; hxfer fences them until on_released(id). Streaming: "
                       "mark_ready(..., layers=(begin, end)) as prefill finishes layers "
                       "[begin, end). A context manager.")
      .def(py::init(&makeSender), py::arg("layout"), py::arg("memory"), py::kw_only(),
           py::arg("listen") = "", py::arg("backend") = "auto", py::arg("token") = "",
           py::arg("instance") = "", py::arg("checksum") = false, py::arg("lease_timeout") = 30.0,
           py::arg("ucx_options") = py::none(), py::arg("on_released") = py::none(),
           py::arg("on_request") = py::none(), py::arg("stream_min_tokens") = 512,
           py::arg("stall_timeout") = 30.0)
      .def_property_readonly("address", [](const PySender& s) { return s.address; })
      .def_property_readonly("backend", [](const PySender& s) { return s.backend; })
      .def_property_readonly("routing", [](const PySender& s) { return s.routing; })
      .def_property_readonly("layout", [](const PySender& s) { return s.layout; })
      .def_property_readonly("memory", [](const PySender& s) { return s.memory; })
      .def(
          "mark_ready",
          [](PySender& s, uint64_t id, py::object blocks, py::object slot, py::object aux,
             py::object layers, py::object group_slots, py::object ready_event) {
            s.memory.cast<PyMemory&>().checkIntact();
            const std::optional<hxfer::DeviceEvent> ready =
                toDeviceEvent(ready_event, "ready_event");
            hxfer::RankPages pages{toPages(blocks, "blocks"), toSlot(slot)};
            if (!group_slots.is_none()) pages.group_slots = toPages(group_slots, "group_slots");
            std::string aux_bytes = toBytes(aux, "aux");
            std::optional<hxfer::LayerSpan> span;
            if (!layers.is_none()) {
              // (begin, end), a Python range of layers; end below begin is left to the
              // library's check (an empty range).
              auto pair = layers.cast<std::pair<int64_t, int64_t>>();
              if (pair.first < 0 || pair.second < 0 || pair.first > UINT32_MAX ||
                  pair.second > UINT32_MAX) {
                throw py::value_error("layers: (begin, end) must be layer ids >= 0, got (" +
                                      std::to_string(pair.first) + ", " +
                                      std::to_string(pair.second) + ")");
              }
              span = hxfer::LayerSpan{
                  static_cast<uint32_t>(pair.first),
                  static_cast<uint32_t>(std::max<int64_t>(0, pair.second - pair.first))};
            }
            hxfer::Status st;
            {
              py::gil_scoped_release nogil;
              if (ready) {
                st = span ? s.impl->markReady(id, pages, *span, *ready, aux_bytes)
                          : s.impl->markReady(id, pages, *ready, aux_bytes);
              } else {
                st = span ? s.impl->markReady(id, pages, *span, aux_bytes)
                          : s.impl->markReady(id, pages, aux_bytes);
              }
            }
            throwIfError(st);
          },
          py::arg("request_id"), py::arg("blocks"), py::arg("slot") = py::none(),
          py::arg("aux") = py::bytes(""), py::arg("layers") = py::none(),
          py::arg("group_slots") = py::none(), py::arg("ready_event") = py::none())
      .def(
          "cancel",
          [](PySender& s, uint64_t id) {
            hxfer::Status st;
            {
              py::gil_scoped_release nogil;
              st = s.impl->cancel(id);
            }
            throwIfError(st);
          },
          py::arg("request_id"))
      .def(
          "holds",
          [](const PySender& s, uint64_t id) {
            py::gil_scoped_release nogil;
            return s.impl->holds(id);
          },
          py::arg("request_id"))
      .def("connected_peers",
           [](const PySender& s) {
             py::gil_scoped_release nogil;
             return s.impl->connectedPeers();
           })
      .def("metrics",
           [](const PySender& s) {
             hxfer::Metrics m;
             {
               py::gil_scoped_release nogil;
               m = s.impl->metrics();
             }
             return metricsDict(m);
           })
      .def(
          "shutdown", [](py::object self) { self.cast<PySender&>().shutdown(self); },
          "Ends every request (its pages released once its writes stopped) and disconnects. "
          "Idempotent. Called from a callback, it begins the shutdown and returns.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__",
           [](py::object self, py::object, py::object, py::object) {
             self.cast<PySender&>().shutdown(self);
             return false;
           })
      .def("__repr__", [](const PySender& s) {
        return "hxfer.Sender(" + std::string(py::repr(py::str(s.address))) + ")";
      });

  // ---- Receiver ----
  py::class_<PyReceiver>(m, "Receiver",
                         "The generation rank. start(id, num_tokens, blocks, slot), then "
                         "wait()/poll(), then release(id). A context manager.")
      .def(py::init(&makeReceiver), py::arg("layout"), py::arg("memory"), py::kw_only(),
           py::arg("peers"), py::arg("peer_tp") = 0, py::arg("peer_pp") = 1,
           py::arg("backend") = "auto", py::arg("token") = "", py::arg("instance") = "",
           py::arg("checksum") = false, py::arg("request_timeout") = 30.0,
           py::arg("handshake_timeout") = 10.0, py::arg("ucx_options") = py::none(),
           py::arg("on_released") = py::none(), py::arg("staging_bytes") = 64ull << 20)
      .def_property_readonly("backend", [](const PyReceiver& r) { return r.backend; })
      .def_property_readonly("routing", [](const PyReceiver& r) { return r.routing; })
      .def_property_readonly("layout", [](const PyReceiver& r) { return r.layout; })
      .def_property_readonly("memory", [](const PyReceiver& r) { return r.memory; })
      .def(
          "wait_for_peers",
          [](PyReceiver& r, double timeout) {
            std::chrono::milliseconds t = toMillis(timeout, "timeout");
            hxfer::Status st;
            waitInterruptibly(t, [&](std::chrono::milliseconds slice) {
              st = r.impl->waitForPeers(slice);
              return st.code() != hxfer::StatusCode::kTimeout;
            });
            throwIfError(st);
          },
          py::arg("timeout") = 10.0)
      .def(
          "start",
          [](PyReceiver& r, uint64_t id, uint32_t num_tokens, py::object blocks, py::object slot,
             uint32_t prefix_tokens, py::object aux, py::object group_slots,
             py::object pages_free) {
            r.memory.cast<PyMemory&>().checkIntact();
            const std::optional<hxfer::DeviceEvent> free_event =
                toDeviceEvent(pages_free, "pages_free");
            hxfer::RankPages pages{toPages(blocks, "blocks"), toSlot(slot)};
            if (!group_slots.is_none()) pages.group_slots = toPages(group_slots, "group_slots");
            std::string aux_bytes = toBytes(aux, "aux");
            hxfer::Status st;
            {
              py::gil_scoped_release nogil;
              st = free_event
                       ? r.impl->start(id, num_tokens, pages, *free_event, prefix_tokens, aux_bytes)
                       : r.impl->start(id, num_tokens, pages, prefix_tokens, aux_bytes);
            }
            throwIfError(st);
          },
          py::arg("request_id"), py::arg("num_tokens"), py::arg("blocks"),
          py::arg("slot") = py::none(), py::arg("prefix_tokens") = 0,
          py::arg("aux") = py::bytes(""), py::arg("group_slots") = py::none(),
          py::arg("pages_free") = py::none())
      .def(
          "poll",
          [](const PyReceiver& r, uint64_t id) {
            hxfer::StatusOr<hxfer::Result> res = hxfer::Status();
            {
              py::gil_scoped_release nogil;
              res = r.impl->poll(id);
            }
            return valueOrThrow(std::move(res));
          },
          py::arg("request_id"))
      .def(
          "wait",
          [](PyReceiver& r, uint64_t id, double timeout) {
            std::chrono::milliseconds t = toMillis(timeout, "timeout");
            hxfer::StatusOr<hxfer::Result> res = hxfer::Status();
            waitInterruptibly(t, [&](std::chrono::milliseconds slice) {
              res = r.impl->wait(id, slice);
              return !res.isOk() || res->terminal();
            });
            return valueOrThrow(std::move(res));
          },
          py::arg("request_id"), py::arg("timeout") = 30.0,
          "Waits for a terminal state; the in-progress Result when `timeout` passes first.")
      .def(
          "cancel",
          [](PyReceiver& r, uint64_t id) {
            hxfer::Status st;
            {
              py::gil_scoped_release nogil;
              st = r.impl->cancel(id);
            }
            throwIfError(st);
          },
          py::arg("request_id"))
      .def(
          "release",
          [](PyReceiver& r, uint64_t id) {
            hxfer::Status st;
            {
              py::gil_scoped_release nogil;
              st = r.impl->release(id);
            }
            throwIfError(st);
          },
          py::arg("request_id"))
      .def(
          "holds",
          [](const PyReceiver& r, uint64_t id) {
            py::gil_scoped_release nogil;
            return r.impl->holds(id);
          },
          py::arg("request_id"))
      .def("metrics",
           [](const PyReceiver& r) {
             hxfer::Metrics m;
             {
               py::gil_scoped_release nogil;
               m = r.impl->metrics();
             }
             return metricsDict(m);
           })
      .def(
          "shutdown", [](py::object self) { self.cast<PyReceiver&>().shutdown(self); },
          "Fails what is in flight and disconnects. Idempotent. Called from a callback, it "
          "begins the shutdown and returns.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__",
           [](py::object self, py::object, py::object, py::object) {
             self.cast<PyReceiver&>().shutdown(self);
             return false;
           })
      .def("__repr__",
           [](const PyReceiver& r) { return "hxfer.Receiver(backend=" + r.backend + ")"; });

  m.def(
      "plan_transfer",
      [](const std::vector<hxfer::Layout>& sources, const py::sequence& source_pages,
         const hxfer::Layout& destination, const py::object& destination_pages, uint32_t num_tokens,
         uint32_t prefix_tokens) {
        std::vector<hxfer::RankPages> pages;
        for (size_t i = 0; i < source_pages.size(); ++i) {
          pages.push_back(toRankPages(source_pages[i], "source_pages[" + std::to_string(i) + "]"));
        }
        hxfer::RankPages dst = toRankPages(destination_pages, "destination_pages");
        hxfer::StatusOr<hxfer::TransferPlan> plan = hxfer::InvalidArgument("not planned");
        {
          py::gil_scoped_release nogil;
          plan = hxfer::planTransfer(sources, pages, destination, dst, num_tokens, prefix_tokens);
        }
        return planDict(valueOrThrow(std::move(plan)));
      },
      py::arg("sources"), py::arg("source_pages"), py::arg("destination"),
      py::arg("destination_pages"), py::arg("num_tokens"), py::arg("prefix_tokens") = 0,
      "The copies that move one request from every rank of a context instance (`sources`, "
      "with source_pages[i] = (blocks, slot) of sources[i]) into one generation rank "
      "(destination_pages = (blocks, slot)): what a Sender writes. Returns {bytes, fragments}, "
      "fragments a uint64 numpy array of rows (source, src_pool, src_offset, dst_pool, "
      "dst_offset, bytes), pools being indices into Layout.pools(). Every destination byte of "
      "the request is written once. hxfer.Error Incompatible where the plan needs a staging "
      "copy (state elements ordered differently).");

  m.def("_shutdown_all", &shutdownAll,
        "Shuts down every live Sender and Receiver (registered with atexit).");
  py::module_::import("atexit").attr("register")(m.attr("_shutdown_all"));
}

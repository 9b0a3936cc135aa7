// The copy engine in C++: runtime/copies.py's CudaCopies, each copy one call from Python.
//
// Every ordering rule is CudaCopies' (the module docstring of runtime/copies.py): an eviction's copy
// runs on the device-to-host side stream after an event recorded on the compute stream (and on the
// stream that last used the bytes), the block it reads is recorded on that side stream before the
// storage releases it; a fetch's copy runs on the host-to-device side stream after an event
// recorded on the compute stream (the allocation) and the event of the copy that filled the host
// buffer; the compute stream waits on a fetch's event before it reads the bytes. A demand fetch
// (fetch_inline) is copied on the compute stream itself, after the event of the copy that filled the
// host buffer. Nothing here waits on the host except sync() and CopyEvent.synchronize().
//
// Streams and events go through c10's backend-generic DeviceGuardImplInterface, so this file
// compiles against a CPU-only torch and runs against a CUDA one. A second implementation of that
// interface, LogDevice, stands in for the GPU where tests run on the CPU: its streams and events
// only log what was asked of them (the copies run at once), so the tests read the protocol.

#include <torch/extension.h>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/DynamicTypes.h>

#include "bytes.h"
#include "copies_cuda.h"

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace dynn {
namespace {

using c10::impl::DeviceGuardImplInterface;

// What a LogDevice was asked, in order: (what, a, b). "record" (event, stream), "wait" (event,
// stream), "stream" (the current stream set, the one it replaced), "keep" (stream, -1: a block
// recorded on it), "copy" (the current stream, bytes), "sync_event" (event, -1), "sync_stream"
// (stream, -1); and what the engine itself did to a storage's device block: "allocate" (the
// current stream, bytes), "release" (the current stream, bytes given back).
using LogEntry = std::tuple<std::string, int64_t, int64_t>;

// A device whose streams and events are bookkeeping only, on the CPU: stream 0 is the compute
// stream, the pool hands out 1, 2, ...; an event is reached once something waited on it, the host
// synchronized it, or it was queried once before (its first query says "not yet", so the callers'
// late paths run too).
struct LogDevice final : DeviceGuardImplInterface {
  mutable std::vector<LogEntry> log;
  mutable c10::StreamId current = 0;
  mutable c10::StreamId next_stream = 1;
  mutable int64_t next_event = 1;
  // per event id: reached
  mutable std::unordered_map<int64_t, bool> reached;
  // tests: this many of the engine's next block allocations run out of memory (c10::OutOfMemoryError,
  // as the CUDA caching allocator's)
  int64_t failing_allocations = 0;

  static c10::Stream stream(c10::StreamId id) {
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::kCPU, 0), id);
  }
  static int64_t id_of(void* ev) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(ev)); }

  c10::DeviceType type() const override { return c10::kCPU; }
  c10::Device exchangeDevice(c10::Device d) const override { return d; }
  c10::Device getDevice() const override { return c10::Device(c10::kCPU, 0); }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const override { return stream(current); }
  c10::Stream getStreamFromGlobalPool(c10::Device, bool) const override { return stream(next_stream++); }
  c10::Stream exchangeStream(c10::Stream s) const override {
    const c10::StreamId old = current;
    current = s.id();
    log.emplace_back("stream", s.id(), old);
    return stream(old);
  }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void** event, const c10::Stream& s, const c10::DeviceIndex, const c10::EventFlag) const override {
    if (*event == nullptr) *event = reinterpret_cast<void*>(static_cast<intptr_t>(next_event++));
    reached[id_of(*event)] = false;
    log.emplace_back("record", id_of(*event), s.id());
  }
  void block(void* event, const c10::Stream& s) const override {
    reached[id_of(event)] = true;
    log.emplace_back("wait", id_of(event), s.id());
  }
  bool queryEvent(void* event) const override {
    auto it = reached.find(id_of(event));
    if (it == reached.end()) return true;
    const bool was = it->second;
    it->second = true;
    return was;
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override { reached.erase(id_of(event)); }
  void synchronizeEvent(void* event) const override {
    reached[id_of(event)] = true;
    log.emplace_back("sync_event", id_of(event), -1);
  }
  void synchronizeStream(const c10::Stream& s) const override { log.emplace_back("sync_stream", s.id(), -1); }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream& s) const override {
    log.emplace_back("keep", s.id(), -1);
  }
  double elapsedTime(void*, void*, const c10::DeviceIndex) const override { return 0.0; }
};

// A copy's event (or a timing event): query(), synchronize(), elapsed_time(end) in milliseconds,
// as torch.cuda.Event's.
// The implementation behind an engine and its events: the registry's for cuda (it lives as long as the
// process), or the engine's own LogDevice, which every event of that engine keeps alive (an event
// may outlive its engine in Python).
using Impl = std::shared_ptr<const DeviceGuardImplInterface>;

// Events the CopyEvents that held them gave back, for the next copies of their engine: an event per
// copy made and destroyed is two driver calls a copy. A given-back event is recorded again, which
// changes no wait issued before (a wait is on the version recorded before it), and nothing else
// holds it: only a CopyEvent's destruction gives it back. Each CopyEvent of the engine shares the
// pool, so an event outliving its engine still has somewhere to go.
class EventPool {
 public:
  EventPool(Impl impl, c10::DeviceIndex index) : impl_(std::move(impl)), index_(index) {}
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;
  ~EventPool() {
    for (auto& events : free_)
      for (void* e : events) impl_->destroyEvent(e, index_);
  }
  // an event made with `flag` before, or nullptr (record() then makes one)
  void* take(c10::EventFlag flag) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& events = free_[slot(flag)];
    if (events.empty()) return nullptr;
    void* e = events.back();
    events.pop_back();
    return e;
  }
  // false where the pool is full: the caller destroys the event
  bool give(void* event, c10::EventFlag flag) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& events = free_[slot(flag)];
    if (events.size() >= kKeep) return false;
    events.push_back(event);
    return true;
  }

 private:
  static constexpr size_t kKeep = 4096;
  static int slot(c10::EventFlag flag) { return flag == c10::EventFlag::PYTORCH_DEFAULT ? 0 : 1; }
  Impl impl_;
  c10::DeviceIndex index_;
  std::mutex mutex_;  // a CopyEvent may die on any thread that holds the last reference
  std::vector<void*> free_[2];  // per flag: without timing (copies), with (timed waits)
};

class CopyEvent {
 public:
  CopyEvent(Impl impl, c10::DeviceIndex index, c10::EventFlag flag, std::shared_ptr<EventPool> pool = nullptr)
      : impl_(std::move(impl)), index_(index), flag_(flag), pool_(std::move(pool)) {
    if (pool_) event_ = pool_->take(flag_);
  }
  CopyEvent(const CopyEvent&) = delete;
  CopyEvent& operator=(const CopyEvent&) = delete;
  CopyEvent(CopyEvent&& o) noexcept
      : impl_(std::move(o.impl_)), index_(o.index_), flag_(o.flag_), pool_(std::move(o.pool_)), event_(o.event_) {
    o.event_ = nullptr;
  }
  ~CopyEvent() {
    if (event_ != nullptr && !(pool_ && pool_->give(event_, flag_))) impl_->destroyEvent(event_, index_);
  }

  void record(const c10::Stream& s) { impl_->record(&event_, s, index_, flag_); }
  void block(const c10::Stream& s) const {
    if (event_ != nullptr) impl_->block(event_, s);
  }
  bool query() const { return event_ == nullptr || impl_->queryEvent(event_); }
  void synchronize() const {
    if (event_ == nullptr) return;
    py::gil_scoped_release unlocked;
    impl_->synchronizeEvent(event_);
  }
  double elapsed_time(const CopyEvent& end) const {
    TORCH_CHECK(event_ != nullptr && end.event_ != nullptr, "dynn_runtime: elapsed_time of an event never recorded");
    return impl_->elapsedTime(event_, end.event_, index_);
  }

 private:
  Impl impl_;
  c10::DeviceIndex index_;
  c10::EventFlag flag_;
  std::shared_ptr<EventPool> pool_;  // where the event goes when this dies; null: destroyed
  void* event_ = nullptr;
};

class CopyEngine {
 public:
  // device_type "cuda" (the device's own streams and events) or "log" (tests: a LogDevice, CPU tensors)
  // reuse_events: the copies' and timed waits' events come from, and go back to, the engine's pool
  // raw_copies: a non-blocking CUDA copy is one cudaMemcpyAsync (copies_cuda.h) where that is built;
  // else, and on the log device, Tensor::copy_
  CopyEngine(const std::string& device_type, int64_t index, bool non_blocking, bool reuse_events, bool raw_copies)
      : non_blocking_(non_blocking) {
    if (device_type == "log") {
      auto log = std::make_shared<LogDevice>();
      log_ = log.get();
      impl_ = std::move(log);
      device_ = c10::Device(c10::kCPU, 0);
    } else {
      TORCH_CHECK(device_type == "cuda", "dynn_runtime: the native copy engine runs on cuda (or 'log' in tests), not ",
                  device_type);
      // raises where torch has no CUDA; the registry's implementation is never freed
      impl_ = Impl(c10::impl::getDeviceGuardImpl(c10::kCUDA), [](const DeviceGuardImplInterface*) {});
      device_ = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
      raw_ = raw_copies && non_blocking && cuda_copy::built();
    }
    d2h_ = impl_->getStreamFromGlobalPool(device_, false);
    h2d_ = impl_->getStreamFromGlobalPool(device_, false);
    if (reuse_events) pool_ = std::make_shared<EventPool>(impl_, device_.index());
    ready_ = std::make_unique<CopyEvent>(impl_, device_.index(), c10::EventFlag::PYTORCH_DEFAULT);
    also_ = std::make_unique<CopyEvent>(impl_, device_.index(), c10::EventFlag::PYTORCH_DEFAULT);
  }

  // device bytes src into host buffer dst, after the compute stream (and the stream last_stream, where
  // it is another) produced them; the block of src is kept until the copy has read it
  CopyEvent to_host(const at::Tensor& src, at::Tensor& dst, std::optional<int64_t> last_stream) {
    const c10::Stream compute = impl_->getStream(device_);
    ready_->record(compute);  // re-recorded: a wait is on the version recorded before it
    ready_->block(d2h_);
    if (last_stream.has_value() && *last_stream != compute.id()) {
      also_->record(c10::Stream(c10::Stream::UNSAFE, device_, static_cast<c10::StreamId>(*last_stream)));
      also_->block(d2h_);
    }
    copy_on(d2h_, compute, dst, src);
    CopyEvent done(impl_, device_.index(), c10::EventFlag::PYTORCH_DEFAULT, pool_);
    done.record(d2h_);
    impl_->recordDataPtrOnStream(src.storage().data_ptr(), d2h_);
    return done;
  }

  // host bytes src into the freshly allocated device storage under dst, after the allocation (an
  // event on the compute stream) and after (the copy that filled src), where given
  CopyEvent to_device(const at::Tensor& src, at::Tensor& dst, const CopyEvent* after) {
    const c10::Stream compute = impl_->getStream(device_);
    ready_->record(compute);
    ready_->block(h2d_);
    if (after != nullptr) after->block(h2d_);
    copy_on(h2d_, compute, dst, src);
    CopyEvent done(impl_, device_.index(), c10::EventFlag::PYTORCH_DEFAULT, pool_);
    done.record(h2d_);
    impl_->recordDataPtrOnStream(dst.storage().data_ptr(), h2d_);
    return done;
  }

  // to_host and to_device with the device side given as its UntypedStorage (the manager's moves): the
  // byte view over it is made here, so no tensor of it reaches Python. With release, the storage then
  // gives its block back (its size 0, as UntypedStorage.resize_(0)), stream-ordered: to_host recorded
  // the block on the side stream, so the allocator reuses it only once the copy has read it.
  CopyEvent evict(py::handle storage, at::Tensor& dst, std::optional<int64_t> last_stream, bool release) {
    c10::Storage st = torch::createStorage(storage.ptr());
    at::Tensor src = bytes_of(st);
    CopyEvent done = to_host(src, dst, last_stream);
    if (release) {
      src = at::Tensor();  // the view's reference to the block; the storage's goes below
      release_block(st);
    }
    return done;
  }
  CopyEvent fetch(const at::Tensor& src, py::handle storage, const CopyEvent* after) {
    at::Tensor dst = bytes_of(torch::createStorage(storage.ptr()));
    return to_device(src, dst, after);
  }

  // A demand fetch: host bytes src into the whole of the device storage, copied on the compute stream
  // itself after `after` (the copy that filled src), where given. On a side stream the copy would
  // first wait for the compute stream's work so far (the allocation), and the compute stream would
  // wait for the copy before its next kernel: the compute stream copying orders the same work with
  // no event of the copy's own. With `timed`, two timing events bracket the copy (its stall).
  // With nbytes, the storage (given back at its eviction) first gets a block of nbytes (as
  // UntypedStorage.resize_(nbytes)); where the allocator runs out, torch.OutOfMemoryError is raised
  // and nothing changed.
  std::optional<std::pair<CopyEvent, CopyEvent>> fetch_inline(const at::Tensor& src, py::handle storage,
                                                              const CopyEvent* after, bool timed,
                                                              std::optional<int64_t> nbytes) {
    c10::Storage st = torch::createStorage(storage.ptr());
    if (nbytes.has_value()) allocate_block(st, static_cast<size_t>(*nbytes));
    at::Tensor dst = bytes_of(st);
    const c10::Stream compute = impl_->getStream(device_);
    if (after != nullptr) after->block(compute);
    std::optional<std::pair<CopyEvent, CopyEvent>> stall;
    if (timed) {
      stall.emplace(CopyEvent(impl_, device_.index(), c10::EventFlag::BACKEND_DEFAULT, pool_),
                    CopyEvent(impl_, device_.index(), c10::EventFlag::BACKEND_DEFAULT, pool_));
      stall->first.record(compute);
    }
    copy_bytes(dst, src, compute);
    if (timed) stall->second.record(compute);
    return stall;
  }

  void compute_waits(const CopyEvent& event) { event.block(impl_->getStream(device_)); }

  std::pair<CopyEvent, CopyEvent> timed_wait(const CopyEvent& event) {
    const c10::Stream compute = impl_->getStream(device_);
    CopyEvent before(impl_, device_.index(), c10::EventFlag::BACKEND_DEFAULT, pool_);  // timing enabled
    before.record(compute);
    event.block(compute);
    CopyEvent after(impl_, device_.index(), c10::EventFlag::BACKEND_DEFAULT, pool_);
    after.record(compute);
    return {std::move(before), std::move(after)};
  }

  void sync() {
    const c10::Stream compute = impl_->getStream(device_);
    py::gil_scoped_release unlocked;
    impl_->synchronizeStream(compute);
    impl_->synchronizeStream(d2h_);
    impl_->synchronizeStream(h2d_);
  }

  std::vector<LogEntry> take_log() {
    TORCH_CHECK(log_ != nullptr, "dynn_runtime: take_log is for an engine on the 'log' device");
    std::vector<LogEntry> out;
    out.swap(log_->log);
    return out;
  }

  std::pair<int64_t, int64_t> stream_ids() const { return {d2h_.id(), h2d_.id()}; }
  bool raw() const { return raw_; }

  // tests, on the log device: the next n block allocations run out of memory
  void fail_allocations(int64_t n) {
    TORCH_CHECK(log_ != nullptr, "dynn_runtime: fail_allocations is for an engine on the 'log' device");
    log_->failing_allocations = n;
  }

 private:
  // dst.copy_(src) on stream `on`, the current stream (a raw copy names it; copy_ reads it)
  void copy_bytes(at::Tensor& dst, const at::Tensor& src, const c10::Stream& on) {
    if (log_ != nullptr) log_->log.emplace_back("copy", log_->current, static_cast<int64_t>(src.nbytes()));
    py::gil_scoped_release unlocked;  // as torch's own copy_: a copy into pageable memory waits for the GPU
    if (raw_ && same_bytes(dst, src)) {
      cuda_copy::copy_async(dst.mutable_data_ptr(), src.const_data_ptr(), src.nbytes(), on);
    } else {
      dst.copy_(src, non_blocking_);
    }
  }

  // Whether a copy from src into dst is n contiguous bytes from one side of the device to the other,
  // which one cudaMemcpyAsync does as copy_ would. The manager's moves always are (a storage's bytes
  // and a pool buffer of its size); a caller of to_host or to_device with other tensors (another
  // dtype, a strided view, sizes that differ: copy_'s conversions, or its error) gets copy_.
  static bool same_bytes(const at::Tensor& dst, const at::Tensor& src) {
    return dst.nbytes() == src.nbytes() && dst.scalar_type() == src.scalar_type() && dst.is_contiguous() &&
           src.is_contiguous() && dst.is_cuda() != src.is_cuda();
  }

  // A block of nbytes for a storage that holds none, from the storage's own allocator on the engine's
  // device, as UntypedStorage.resize_ gives one (no bytes to keep); the allocator's out-of-memory
  // error becomes torch.OutOfMemoryError, as resize_'s does.
  void allocate_block(c10::Storage& st, size_t nbytes) {
    c10::StorageImpl* impl = st.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "dynn_runtime: a storage that is not resizable cannot get a block back");
    TORCH_CHECK(impl->nbytes() == 0, "dynn_runtime: allocate_block of a storage that holds ", impl->nbytes(), " bytes");
    at::DataPtr block;
    try {
      if (log_ != nullptr) {
        if (log_->failing_allocations > 0) {
          --log_->failing_allocations;
          TORCH_CHECK_WITH(OutOfMemoryError, false, "out of memory (injected by fail_allocations). Tried to allocate ",
                           nbytes, " bytes.");
        }
        log_->log.emplace_back("allocate", log_->current, static_cast<int64_t>(nbytes));
      }
      const c10::Device was = impl_->exchangeDevice(device_);  // the allocator serves the current device
      try {
        block = impl->allocator()->allocate(nbytes);
      } catch (...) {
        impl_->setDevice(was);
        throw;
      }
      impl_->setDevice(was);
    } catch (const c10::OutOfMemoryError& e) {
      PyErr_SetString(out_of_memory().ptr(), e.what_without_backtrace());
      throw py::error_already_set();
    }
    impl->set_data_ptr_noswap(std::move(block));
    impl->set_nbytes(nbytes);
  }

  // The storage's block given back (its size 0, as UntypedStorage.resize_(0)): freed now, reused by
  // the allocator after the streams it was recorded on have passed that point.
  void release_block(c10::Storage& st) {
    c10::StorageImpl* impl = st.unsafeGetStorageImpl();
    if (log_ != nullptr) log_->log.emplace_back("release", log_->current, static_cast<int64_t>(impl->nbytes()));
    impl->set_data_ptr_noswap(at::DataPtr(nullptr, impl->device()));
    impl->set_nbytes(0);
  }

  static py::handle out_of_memory() {
    static py::handle cls = py::object(py::module_::import("torch").attr("OutOfMemoryError")).release();
    return cls;
  }

  // dst.copy_(src) issued on stream side, then compute is current again (also when the copy raises)
  void copy_on(const c10::Stream& side, const c10::Stream& compute, at::Tensor& dst, const at::Tensor& src) {
    impl_->exchangeStream(side);
    try {
      copy_bytes(dst, src, side);
    } catch (...) {
      impl_->exchangeStream(compute);
      throw;
    }
    impl_->exchangeStream(compute);
  }

  LogDevice* log_ = nullptr;  // the 'log' device: impl_, as a LogDevice
  Impl impl_;
  c10::Device device_{c10::kCPU};
  bool non_blocking_;
  bool raw_ = false;  // copies as one cudaMemcpyAsync each (copies_cuda.h)
  c10::Stream d2h_{c10::Stream::UNSAFE, c10::Device(c10::kCPU), 0};
  c10::Stream h2d_{c10::Stream::UNSAFE, c10::Device(c10::kCPU), 0};
  std::shared_ptr<EventPool> pool_;    // null: every copy's event made and destroyed
  std::unique_ptr<CopyEvent> ready_;  // the compute stream's point a copy waits for (re-recorded each copy)
  std::unique_ptr<CopyEvent> also_;   // the last user's stream's point, where it is another
};

}  // namespace

void define_copies(py::module_& m) {
  py::class_<CopyEvent>(m, "CopyEvent")
      .def("query", &CopyEvent::query, "whether the copy (or point) this event marks has been reached")
      .def("synchronize", &CopyEvent::synchronize, "the host waits until this event is reached")
      .def("elapsed_time", &CopyEvent::elapsed_time, py::arg("end"),
           "milliseconds from this timing event to end (both reached)");
  py::class_<CopyEngine>(m, "CopyEngine")
      .def(py::init<const std::string&, int64_t, bool, bool, bool>(), py::arg("device_type"), py::arg("index"),
           py::arg("non_blocking"), py::arg("reuse_events") = true, py::arg("raw_copies") = true)
      .def_property_readonly("raw_copies", [](const CopyEngine& e) { return e.raw(); },
                             "whether each copy is one cudaMemcpyAsync (else Tensor.copy_)")
      .def("to_host", &CopyEngine::to_host, py::arg("src"), py::arg("dst"), py::arg("last_stream") = py::none())
      .def("to_device", &CopyEngine::to_device, py::arg("src"), py::arg("dst"), py::arg("after") = py::none())
      .def("evict", &CopyEngine::evict, py::arg("storage"), py::arg("dst"), py::arg("last_stream") = py::none(),
           py::arg("release") = false,
           "to_host from the whole of a device UntypedStorage; with release, the storage then gives its block "
           "back (size 0), stream-ordered")
      .def("fetch", &CopyEngine::fetch, py::arg("src"), py::arg("storage"), py::arg("after") = py::none(),
           "to_device into the whole of a device UntypedStorage")
      .def("fetch_inline", &CopyEngine::fetch_inline, py::arg("src"), py::arg("storage"), py::arg("after") = py::none(),
           py::arg("timed") = false, py::arg("nbytes") = py::none(),
           "a demand fetch into the whole of a device UntypedStorage, on the compute stream (with nbytes, the "
           "storage first gets a block of that size); with timed, the (before, after) timing events around the "
           "copy, else None")
      .def("fail_allocations", &CopyEngine::fail_allocations, py::arg("n"),
           "tests, on the 'log' device: the next n block allocations raise torch.OutOfMemoryError")
      .def("compute_waits", &CopyEngine::compute_waits, py::arg("event"))
      .def("timed_wait", &CopyEngine::timed_wait, py::arg("event"))
      .def("sync", &CopyEngine::sync)
      .def("take_log", &CopyEngine::take_log, "tests: what the 'log' device was asked since the last call")
      .def_property_readonly("stream_ids", &CopyEngine::stream_ids, "(device-to-host, host-to-device) side streams");
}

}  // namespace dynn

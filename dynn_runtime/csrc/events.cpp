// The live runtime's native event source: what the memory manager must do for every ATen operator,
// done in C++ so that Python runs only at decision points.
//
// An `Observer` puts a dispatch key of its own in the calling thread's included key set (autograd's
// worker threads inherit it) and serves that key with a boxed fallback, and the most frequent
// operators with unboxed kernels of its own that do the same on typed arguments (no boxing of their
// arguments, no unboxing for the kernel below; `register_unboxed`). The key sits above autograd,
// so the fallback sees each operator once as its caller called it; composite-implicit operators fall
// through the key (their decompositions reach it instead), and the fallback excludes the key while
// the kernel runs, so operators a kernel calls internally do not reach it. For each operator it
// registers the storages on the managed device it has not seen and accounts them in `used`; before
// the kernel, hands the ids of storages that are away to the Python fault handler, which brings them
// back; marks written storages' host copies stale; logs the operator (id, phase, autograd node,
// storage ids) for the policies to read in batches, or, while lru's order is kept here, tells that
// order its touches instead (invariant 13); after the kernel, calls the Python decision
// handler when `used` is over the budget or every `decide_every` operators. Operators it does not
// see cost nothing: no callback runs for them.
//
// Invariants:
//   1. A tracked storage's key (its StorageImpl address) cannot be reused while it is tracked: the
//      entry holds a weak reference, which keeps the StorageImpl object (not its data) allocated.
//   2. `used` = bytes of tracked, alive storages that are not away. Python changes "away" only
//      through set_away(), which moves `used` with it.
//   3. A Python handler's exception is kept and re-raised by take_error() at the next Python-side
//      check, never thrown through the operator (a kernel's own exceptions propagate unchanged, but
//      for the one retry of an out-of-memory error, invariant 11); an operator whose input the fault
//      handler left away fails with an error of its own (invariant 12).
//   4. Python handlers, and the manager's own tensor work between suspend() and resume(), run with
//      the key excluded on this thread, so the manager's own copies and resizes are not observed.
//   5. A storage with a copy in flight (`watch`) faults like an away one: the manager cancels the
//      eviction or makes the compute stream wait for the fetch before the kernel reads it.
//   6. After an operator, when `used` is above the budget less `max_made` (the most bytes one
//      operator has allocated so far), the decision handler runs and makes room for `max_made`:
//      an operator no larger than any before it then stays within the budget; a larger one
//      overshoots once, by at most what it exceeds the old maximum.
//   7. Every entry knows the stream of its last access (the current stream of the managed device
//      when an operator touched it, or when it was registered): an eviction orders its copy after
//      that stream's work too, not only after the evicting thread's current stream.
//   8. `away` = bytes of tracked, alive storages that are away; `live_peak` is the most `used` +
//      `away` has been (what PyTorch alone would have held), exact where a sweep follows every
//      operator (a measuring step). A storage that dies while away leaves `away` when it is swept.
//   9. A tracked storage is "covered" when its data's deleter is `covered::release_cb` (covered.h),
//      which tells the observer (drained before each operator's accounting) that the data was
//      released before freeing it with the allocator's own deleter. While every storage counted in
//      `used` is covered (`exposed_` == 0), deaths are known without sweeping the table, so `used`
//      and the peak are exact with no sweep. Covering never changes what is freed or when; only
//      CPU data whose deleter's context is the data pointer itself (the CPU allocator's) is wrapped.
//      CUDA data is never covered (covered.h says why); it is "heard" instead: while `hearing_`,
//      the caching allocator reports every block it frees by address (heard.h), `by_data_` maps the
//      data address of each heard entry back to it, and the drain judges each reported address's
//      entry by its own state, as it judges covered ones. An entry is heard only while its data is
//      the caching allocator's (the probe's deleter) at the address `by_data_` holds; anything
//      else (data the allocator does not own, data replaced or given up while away, two live
//      storages at one address) stays exposed, and its death is swept for. A dead entry whose
//      address a new one takes before its free is drained stays heard (`shadowed_`).
//  10. A wrapped number (a Python scalar an operator's binding made a tensor of) is never tracked: no
//      entry, no log record, no fault. Nothing but that operator's argument holds it, so it can be
//      neither away nor read by a later kernel.
//  11. In a step, an operator whose kernel throws c10::OutOfMemoryError (the caching allocator ran
//      out) is retried once when it writes none of its arguments: its failed attempt changed
//      nothing the program can see, so running it again cannot apply anything twice. A random
//      operator (one taking a Generator, or drawing from the default one: `random_by_name`) may
//      have drawn before it ran out: the state of the generator it draws from (the one it was
//      given, else the managed device's default) is saved before its kernel and restored before
//      the retry, which so draws the numbers the first attempt would have. Between the attempts
//      the OOM handler makes room (it evicts what the operator does not read, waits for the copies
//      and empties the allocator's cache). The operator is seen, faulted and logged once, as if it
//      had run once. The boxed path keeps a copy of the arguments for the retry (unboxing moves
//      lists and optional tensors out of the stack); the unboxed path's arguments are its own and
//      stay intact. A writing operator's OOM, a second OOM, and an OOM whose handler raised
//      propagate unchanged (the handler's error is kept, as in invariant 3).
//  12. No kernel reads a storage that is away. Where the fault handler returns with an input still
//      away (it raised), the operator throws before its kernel, naming the handler's error; the
//      storage's host copy is valid, so nothing is lost, and the kept error is raised as in invariant 3.
//  13. While `recency_live_` (lru's order kept here, recency.h), the order learns every touch at the
//      point of the log where the Python parse would read it: a storage first seen as an input at its
//      kAlloc record, an operator's allocations and then its storages (inputs in argument order, then
//      outputs that are not inputs) at its kOp record, a death at its kFree record. Deaths reach the
//      order whether or not it is live, so it never holds a storage the table has forgotten. While
//      live, operators get no kOp record (unless `op_records_while_live_`): the compact parse, the
//      only reader of a live step's log, would drop them, and reads what it needs of them from the
//      records told_live() keeps instead (the timeline, stale host copies, collectives, the last
//      operator). The log then holds only the kAlloc and kFree records that change the table.
//  14. The log's order is a function of the program's operations only, never of addresses: records
//      come as the operators ran, and deaths in batches where the program's operations put them (a
//      drain before each operator's record and wherever Python reads `used`, a sweep every
//      `sweep_every` operators and wherever Python asks). A drain logs the deaths release_cb reported
//      (covered storages), then those the CUDA allocator reported (heard ones), each in the order
//      their data was freed; a sweep drains, then logs the storages its walk of the table found dead
//      (exposed ones: data given up while away, data the allocator does not own, CUDA data while
//      nothing is heard) in ascending storage id. A heard storage is never drained out of order: a
//      new one whose address a dead one still holds stays exposed rather than draining early.
//      Storage ids count from 1 in the order the observer first saw each storage.
//  15. An operator's node word is the autograd node it belongs to, or -1: in backward, the node the
//      engine is running (-1 for AccumulateGrad, whose sequence number is UINT64_MAX); in forward,
//      the node it made (autograd makes it below the key, while the kernel runs, so the thread's
//      sequence counter has moved past it), judged against the last node this thread had made when
//      the observer started or the step began. A node made before, or by work the key does not see
//      (the manager's own runs under no_grad), is never an operator's, so a step's node words do not
//      depend on what ran before it. trace/recorder.py's AutogradNodes, which the Python event
//      source and the trace recorder use, keeps the same rule.
//  16. An entry's `settled` bit for a label (kLabelGrad, kLabelState) is set once the optimizer
//      hooks' walk found its record's kind as specific as that label; the walk then passes over it
//      without reading the record. kLabelSaved is set once the saved-tensor pack hook found its
//      record saved. A record's kind only ever gets more specific, its saved flag is never
//      cleared, and record and entry die with their storage (sids are never reused), so a set
//      bit stays true.

#include <ATen/ATen.h>
#include <ATen/Operators.h>
#include <ATen/SequenceNumber.h>
#include <ATen/SparseCsrTensorImpl.h>
#include <ATen/SparseTensorImpl.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include "bytes.h"
#include "covered.h"
#include "flat_map.h"
#include "copies_cuda.h"
#include "heard.h"
#include "recency.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace dynn {
namespace {

// The event log's words: appended by the operator's path (extend: one compare, the words left for
// the writer to fill), read and compacted in place between reads, and kept in capacity across reads.
class Words {
 public:
  Words() = default;
  Words(const Words&) = delete;
  Words& operator=(const Words&) = delete;
  // `k` more words at the end, uninitialised (the caller writes each); returns the first.
  int64_t* extend(size_t k) {
    if (size_ + k > cap_) grow(size_ + k);
    int64_t* w = data_.get() + size_;
    size_ += k;
    return w;
  }
  int64_t* data() { return data_.get(); }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  void clear() { size_ = 0; }
  void shrink_to(size_t n) { size_ = n < size_ ? n : size_; }  // the words before n stay
  int64_t& operator[](size_t i) { return data_[i]; }

 private:
  C10_NOINLINE void grow(size_t need) {
    size_t cap = cap_ < 1024 ? 1024 : cap_;
    while (cap < need) cap *= 2;
    std::unique_ptr<int64_t[]> next(new int64_t[cap]);  // (default-initialised: left as they are)
    if (size_ > 0) std::copy(data_.get(), data_.get() + size_, next.get());
    data_ = std::move(next);
    cap_ = cap;
  }
  std::unique_ptr<int64_t[]> data_;
  size_t size_ = 0;
  size_t cap_ = 0;
};

constexpr uint8_t kLabelGrad = 1, kLabelState = 2, kLabelSaved = 4;  // Entry::settled (invariant 16)

// log record tags (first word of each record)
constexpr int64_t kOp = 1;     // kOp, op_id, phase | module << 2, node, used, n_in, n_out, n_write, n_alloc, ids...
constexpr int64_t kAlloc = 2;  // kAlloc, sid, nbytes, fresh (1: an operator's output; 0: seen as input)
constexpr int64_t kFree = 3;   // kFree, sid

constexpr int64_t kForward = 0, kBackward = 1, kOptimizer = 2;

struct OpInfo {
  int64_t id = -1;           // interned name, -1 until assigned
  bool skip = false;         // composite-implicit, or ignored (detach, lift_fresh)
  std::vector<int> writes;   // schema argument indices written in place
  int stream_arg = -1;       // a Stream argument (record_stream): the stream the operator uses the inputs on
  bool retry = false;        // an out-of-memory error may be retried (invariant 11): no writes
  bool random = false;       // draws random numbers: its generator's state is kept for a retry (invariant 11)
  int gen_arg = -1;          // its Generator argument, -1 without one (the default generator then)
  bool collective = false;   // a c10d:: operator: the manager holds what it reads until the step ends
};

struct Entry {
  c10::weak_intrusive_ptr<c10::StorageImpl> weak;
  c10::StorageImpl* impl;  // its key in the table
  int64_t sid;
  int64_t nbytes;
  int64_t last_access = -1;
  int64_t count = 0;
  bool away = false;        // offloaded: must be fetched before any kernel reads it
  bool host_valid = false;  // its host copy equals the device bytes (no write since)
  bool watch = false;       // a copy is in flight: the manager must see the next access first
  int64_t stream = 0;       // c10::Stream::id() of its last access on the managed device (invariant 7)
  bool covered = false;     // its data's deleter is release_cb (invariant 9)
  bool heard = false;       // by_data_ maps `data` to it: the allocator reports its free (invariant 9)
  uint64_t data = 0;        // its data's address while heard
  bool known = false;       // registered by track(): Python may hold it without having read its kAlloc
  uint8_t settled = 0;      // kLabel* bits: its record's kind is as specific as that label (invariant 16)

  Entry(c10::weak_intrusive_ptr<c10::StorageImpl> w, c10::StorageImpl* i, int64_t s, int64_t n, int64_t st)
      : weak(std::move(w)), impl(i), sid(s), nbytes(n), stream(st) {}
};

// The observer's dispatch key: an out-of-tree functionality key above autograd and autocast that
// PyTorch itself never registers a kernel for (torchdistx's deferred initialisation uses it; the
// observer refuses to start where something else serves it).
constexpr c10::DispatchKey kKey = c10::DispatchKey::DeferredInit;

class Observer;
// The started observer. One per process: the key is included on the starting thread (autograd's
// worker threads inherit it), the observer it serves is not. Operators run on one thread at a time
// (autograd's caller waits for the engine), so the observer's tables need no lock.
std::atomic<Observer*> g_active{nullptr};
std::atomic<size_t> g_slots{0};  // slots drawn by the unboxed operators (Unboxed<Op>::call)

thread_local int tls_suspended = 0;            // suspend() depth on this thread
thread_local bool tls_suspend_excluded = false;  // the key's excluded state the outermost suspend() found

// One operator's storage ids, from before() to after(). The observer keeps one per nesting depth
// and reuses it, so that an operator costs no heap allocation once the buffers have grown.
struct Ctx {
  std::vector<c10::IValue> args;  // the boxed path's arguments, while a retry may need them (invariant 11)
  std::vector<int64_t> ins;
  std::vector<Entry*> in_entries;  // the entries of `ins`, in order
  std::vector<int64_t> writes;
  std::vector<int64_t> fault;
  std::vector<int64_t> outs;
  std::vector<int64_t> allocs;
  std::vector<int64_t> stale;  // written inputs whose host copy was valid until now (recency_live_ only)
  at::Generator rng;     // a random operator's generator, while a retry may need its state (invariant 11)
  at::Tensor rng_state;  // ... and that state before its kernel ran
  void clear() {
    args.clear();
    if (rng.defined()) {
      rng = at::Generator();
      rng_state.reset();
    }
    ins.clear();
    in_entries.clear();
    writes.clear();
    fault.clear();
    outs.clear();
    allocs.clear();
    stale.clear();
  }
};

void dispatch_cb(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);
void register_unboxed(torch::Library& lib);

// The tensors in one typed argument or return value of an operator with an unboxed kernel at the
// key. Every type such an operator takes or returns must be listed: a tensor-holding type missing
// here would hide its tensors from the observer (a fault missed), so any type that is neither a
// tensor container below nor a known plain type fails to compile.
template <class T>
struct Plain : std::false_type {};
#define DYNN_PLAIN(...) \
  template <>           \
  struct Plain<__VA_ARGS__> : std::true_type {}
DYNN_PLAIN(bool);
DYNN_PLAIN(int64_t);
DYNN_PLAIN(double);
DYNN_PLAIN(at::Scalar);
DYNN_PLAIN(c10::SymInt);
DYNN_PLAIN(at::IntArrayRef);
DYNN_PLAIN(c10::SymIntArrayRef);
DYNN_PLAIN(at::OptionalIntArrayRef);
DYNN_PLAIN(at::OptionalSymIntArrayRef);
DYNN_PLAIN(at::ScalarType);
DYNN_PLAIN(c10::string_view);
DYNN_PLAIN(std::array<bool, 3>);
DYNN_PLAIN(std::optional<at::Scalar>);
DYNN_PLAIN(std::optional<int64_t>);
DYNN_PLAIN(std::optional<double>);
DYNN_PLAIN(std::optional<bool>);
DYNN_PLAIN(std::optional<c10::SymInt>);
DYNN_PLAIN(std::optional<at::ScalarType>);
DYNN_PLAIN(std::optional<at::Layout>);
DYNN_PLAIN(std::optional<at::Device>);
DYNN_PLAIN(std::optional<at::MemoryFormat>);
DYNN_PLAIN(std::optional<at::Generator>);
DYNN_PLAIN(std::optional<c10::string_view>);
#undef DYNN_PLAIN

template <class T, class F>
void visit_tensors(const T&, F&&) {
  static_assert(Plain<std::decay_t<T>>::value, "dynn: an operator argument or return type the unboxed observer does not know");
}
template <class F>
void visit_tensors(const at::Tensor& t, F&& f) {
  f(t);
}
template <class F>
void visit_tensors(const std::optional<at::Tensor>& t, F&& f) {
  if (t.has_value()) f(*t);
}
template <class F>
void visit_tensors(const at::TensorList& ts, F&& f) {
  for (const at::Tensor& t : ts) f(t);
}
template <class F>
void visit_tensors(const at::ITensorListRef& ts, F&& f) {
  for (const at::Tensor& t : ts) f(t);
}
template <class F>
void visit_tensors(const c10::List<std::optional<at::Tensor>>& ts, F&& f) {  // Tensor?[] (indexing)
  for (size_t i = 0; i < ts.size(); ++i) {
    const std::optional<at::Tensor> t = ts.get(i);
    if (t.has_value()) f(*t);
  }
}
template <class F>
void visit_tensors(const std::vector<at::Tensor>& ts, F&& f) {
  for (const at::Tensor& t : ts) f(t);
}
template <class F, class... Ts>
void visit_tensors(const std::tuple<Ts...>& tp, F&& f) {
  std::apply([&](const auto&... x) { (visit_tensors(x, f), ...); }, tp);
}

// The key's registrations, made once per process at the first start: the fallback, and a
// fallthrough for every operator the observer skips, so that those cost nothing at the key.
// Operators registered later reach the fallback, which passes skipped ones through.
struct Registrations {
  std::string problem;  // why the key cannot be served ("" where it can)
  std::unique_ptr<torch::Library> fallback;
  std::unordered_map<std::string, std::unique_ptr<torch::Library>> skips;  // by namespace
  std::unique_ptr<torch::Library> unboxed;  // the unboxed kernels (register_unboxed)
};

// Operators the observer does not log: composite-implicit ones without a kernel of their own (what
// they decompose into is logged instead), metadata-only ones (detach, lift_fresh) and prim:: ones.
bool skipped(const c10::OperatorHandle& op) {
  const std::string& name = op.schema().name();
  if (name == "aten::detach" || name == "aten::lift_fresh" || name.rfind("prim::", 0) == 0) return true;
  const bool cia = op.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd);
  const bool own = op.hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
                   op.hasKernelForDispatchKey(c10::DispatchKey::CUDA) ||
                   op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd);
  return cia && !own;
}

std::atomic<bool> g_registered{false};

// Why the key cannot be served in this process, or "" where it can.
std::string key_problem() {
  if (g_registered.load() || !c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(kKey)) return "";
  return std::string("the dispatch key ") + c10::toString(kKey) +
         " already has a fallback in this process (torchdistx's deferred initialisation uses it)";
}

Registrations& registrations() {
  static Registrations* regs = [] {
    auto* r = new Registrations();
    auto& d = c10::Dispatcher::singleton();
    r->problem = key_problem();
    if (!r->problem.empty()) return r;
    r->fallback = std::make_unique<torch::Library>(torch::Library::IMPL, "_", kKey, __FILE__, __LINE__);
    r->fallback->fallback(torch::CppFunction::makeFromBoxedFunction<&dispatch_cb>());
    for (const c10::OperatorName& name : d.getAllOpNames()) {
      auto op = d.findSchema(name);
      const auto sep = name.name.find("::");
      if (!op.has_value() || sep == std::string::npos || !skipped(*op) || op->hasKernelForDispatchKey(kKey))
        continue;
      const std::string ns = name.name.substr(0, sep);
      auto& lib = r->skips[ns];
      if (!lib) lib = std::make_unique<torch::Library>(torch::Library::IMPL, ns, kKey, __FILE__, __LINE__);
      std::string full = name.name;
      if (!name.overload_name.empty()) full += "." + name.overload_name;
      lib->impl(full.c_str(), torch::CppFunction::makeFallthrough());
    }
    r->unboxed = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", kKey, __FILE__, __LINE__);
    register_unboxed(*r->unboxed);
    g_registered = true;
    return r;
  }();
  return *regs;
}

class Observer {
 public:
  Observer(const std::string& device_type, int64_t device_index)
      : device_type_(c10::Device(device_type).type()), device_index_(device_index),
        cover_(device_type_ == c10::DeviceType::CPU), hear_(device_type_ == c10::DeviceType::CUDA) {}

  ~Observer() {
    stop();
    table_.for_each([&](uint64_t, Entry* e) { entries_.release(e); });
  }

  // ---- life cycle ---------------------------------------------------------------------------
  void start(py::object on_fault, py::object on_decide, py::object on_oom) {
    TORCH_CHECK(!started_, "dynn: the event observer is already started");
    const std::string& problem = registrations().problem;
    TORCH_CHECK(problem.empty(), "dynn: the native event source cannot start: ", problem);
    Observer* none = nullptr;
    TORCH_CHECK(g_active.compare_exchange_strong(none, this),
                "dynn: another memory manager's native event source is active in this process; detach it first");
    on_fault_ = std::move(on_fault);
    on_decide_ = std::move(on_decide);
    on_oom_ = std::move(on_oom);
    covered::take_released(released_);  // left by an earlier observer
    covered::listen(true);
    start_hearing();
    if (hearing_)  // entries registered before the start (the model's parameters): heard from now on
      table_.for_each([&](uint64_t, Entry* e) {
        if (e->covered || e->heard) return;
        if (auto strong = e->weak.lock()) hear_entry(*e, strong.get());
      });
    was_included_ = c10::impl::tls_is_dispatch_key_included(kKey);
    c10::impl::tls_set_dispatch_key_included(kKey, true);
    last_node_ = thread_last_node();  // invariant 15
    started_ = true;
  }

  void stop() {
    if (started_) {
      c10::impl::tls_set_dispatch_key_included(kKey, was_included_);
      started_ = false;
      table_.for_each([&](uint64_t, Entry* e) {  // storages outlive the observer with their own deleters
        unhear(*e);
        if (!e->covered) return;
        if (auto strong = e->weak.lock()) covered::uncover(strong.get());
        set_covered(*e, false);
      });
      if (hearing_) heard::listen(heard::kNobody);
      hearing_ = false;
    }
    Observer* self = this;
    if (g_active.compare_exchange_strong(self, nullptr)) {  // not when an inactive one is destroyed
      covered::listen(false);
      covered::take_released(released_);
    }
    py::gil_scoped_acquire gil;
    on_fault_ = py::none();
    on_decide_ = py::none();
    on_oom_ = py::none();
    saved_st_ = py::dict();
    saved_pending_ = py::set();
    saved_types_ = py::tuple();
    saved_fallback_ = py::none();
    grad_st_ = py::dict();
    grad_pending_ = py::set();
    grad_settled_ = py::tuple();
    grad_fallback_ = py::none();
  }

  // ---- configuration ------------------------------------------------------------------------
  void set_budget(int64_t b) { budget_ = b; }
  void set_decide_every(int64_t n) { decide_every_ = n; }
  void set_sweep_every(int64_t n) { sweep_every_ = n; }
  // The manager's own tensor work on this thread is not observed between suspend() and resume().
  void suspend() {
    if (tls_suspended++ == 0) {
      tls_suspend_excluded = c10::impl::tls_is_dispatch_key_excluded(kKey);
      c10::impl::tls_set_dispatch_key_excluded(kKey, true);
    }
  }
  void resume() {
    if (tls_suspended > 0 && --tls_suspended == 0)
      c10::impl::tls_set_dispatch_key_excluded(kKey, tls_suspend_excluded);
  }
  void set_phase(int64_t p) { phase_override_ = p; }
  void set_in_step(bool v) {
    in_step_ = v;
    if (v) {
      last_node_ = thread_last_node();  // invariant 15: nodes made before the step are not its operators'
      position_ = 0;
      last_decide_ = 0;
      peak_ = used_;
      live_peak_ = used_ + away_;
      live_peak_position_ = 0;
    }
  }

  // ---- storages -----------------------------------------------------------------------------
  // The id of `t`'s storage, registering it (fresh=false: logged as seen) if new; -1 if unmanaged.
  int64_t track(const at::Tensor& t) {
    c10::StorageImpl* impl = managed_impl(t);
    if (impl == nullptr) return -1;
    const int64_t stream = table_.find(key(impl)) != nullptr ? 0 : current_stream();  // read for a new entry only
    Entry* e = lookup_or_add(impl, t, /*fresh=*/false, stream).first;
    e->known = true;
    return e->sid;
  }

  int64_t sid_of(const at::Tensor& t) {
    c10::StorageImpl* impl = managed_impl(t);
    if (impl == nullptr) return -1;
    Entry** e = table_.find(key(impl));
    return e == nullptr ? -1 : (*e)->sid;
  }

  // ---- autograd's saved tensors (runtime/storages.py: _pack) -------------------------------------
  // The pack hook of the manager's saved_tensors_hooks takes the common cases here: a tensor of
  // exactly one of `types` whose storage the table has, and whose record in `st` is saved already
  // (nothing to do) or missing (born since the log was read: its sid goes into `pending`, and the
  // record is labelled saved when its birth is read). Anything else goes to `fallback` (_pack),
  // whose answer is the hook's. What comes back is a detached alias of the tensor, as _pack's:
  // no reference cycle through an output's own node. stop() drops the four (`fallback` holds the
  // manager); a pack after that only detaches.
  void set_saved(py::dict st, py::set pending, py::tuple types, py::object fallback) {
    saved_st_ = std::move(st);
    saved_pending_ = std::move(pending);
    saved_types_ = std::move(types);
    saved_fallback_ = std::move(fallback);
  }

  py::object pack_saved(const py::handle& t) {
    PyObject* o = t.ptr();
    if (saved_fallback_.is_none()) return detached(THPVariable_Unpack(o));
    if (exact_type_in(o, saved_types_)) {
      const at::Tensor& v = THPVariable_Unpack(o);
      c10::StorageImpl* impl = managed_impl(v);
      Entry** e = impl == nullptr ? nullptr : table_.find(key(impl));
      if (e != nullptr) {
        Entry& en = **e;
        if (en.settled & kLabelSaved) return detached(v);
        PyObject* rec = record_of(saved_st_, en.sid);
        if (rec == nullptr) {
          saved_pending_.add(py::int_(en.sid));
          return detached(v);
        }
        if (record_saved(rec)) {
          en.settled |= kLabelSaved;
          return detached(v);
        }
      }
    }
    return saved_fallback_(t);
  }

  // The post-accumulate-grad hook of each parameter, for a policy that reads labels (_grad_ready):
  // in a step, the parameter's gradient is labelled "grad" as the optimizer hooks' walk labels one
  // (label_grad); where the label would change its record, `fallback` (_label_grad) labels it.
  // stop() drops the four.
  void set_grad_labels(py::dict st, py::set pending, py::tuple settled, py::object fallback) {
    grad_st_ = std::move(st);
    grad_pending_ = std::move(pending);
    grad_settled_ = std::move(settled);
    grad_fallback_ = std::move(fallback);
  }

  void grad_ready(const at::Tensor& p) {
    if (!in_step_ || grad_fallback_.is_none()) return;
    const at::Tensor& g = p.grad();
    if (label_grad(g, grad_st_, grad_pending_, grad_settled_))
      grad_fallback_(py::reinterpret_steal<py::object>(THPVariable_Wrap(g)));
  }

  // ---- the optimizer hooks' labels (runtime/steps.py: _mark_kind_of_grads, _mark_optimizer_state) ----
  // Each runs at every step; in a steady state nothing needs a label, so the walk is here and only
  // what the runtime's labelling (_track) would change comes back to Python. `st` is the runtime's
  // table (sid -> record); `settled`, the kinds a label leaves as they are (the label's own and the
  // more specific ones: a kind only ever gets more specific).

  // The gradients of `params` to label "grad": each defined gradient on the managed device that the
  // table has no entry for, or whose record's kind is not settled. One whose record is not in `st`
  // yet (born since the log was read) goes into `pending` instead: its record takes the label when
  // its birth is read.
  py::list grads_to_label(const std::vector<at::Tensor>& params, const py::dict& st, py::set pending,
                          const py::tuple& settled) {
    py::list out;
    for (const at::Tensor& p : params) {
      const at::Tensor& g = p.grad();
      if (label_grad(g, st, pending, settled)) out.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(g)));
    }
    return out;
  }

  // Labels gradient `g` "grad" where that needs no Python: returns true where Python's labelling
  // must (the table has no entry for it, or its record's kind is not settled). Nothing for an
  // undefined gradient or one not the manager's (the label would leave it alone); one whose record
  // is not in `st` yet goes into `pending`.
  bool label_grad(const at::Tensor& g, const py::dict& st, py::set& pending, const py::tuple& settled) {
    c10::StorageImpl* impl = managed_impl(g);  // (undefined: none)
    if (impl == nullptr) return false;
    Entry** e = table_.find(key(impl));
    const Label what = e == nullptr ? Label::kChange : label_of(**e, st, settled, kLabelGrad);
    if (what == Label::kNoRecord) pending.add(py::int_((*e)->sid));
    return what == Label::kChange;
  }

  // The optimizer's state tensors to label "opt_state": of the values of each per-parameter dict of
  // `state` (optimizer.state), those whose type is exactly one of `types` (torch.Tensor,
  // nn.Parameter: a subclass manages its own storage), on the managed device, and without a record
  // in `st` of a settled kind.
  py::list state_to_label(const py::handle& state, const py::dict& st, const py::tuple& types,
                          const py::tuple& settled) {
    py::list out;
    auto look = [&](PyObject* v) {
      if (!exact_type_in(v, types)) return;
      c10::StorageImpl* impl = managed_impl(THPVariable_Unpack(v));
      if (impl == nullptr) return;  // not the manager's (Adam's step counters on the host of a CUDA manager)
      Entry** e = table_.find(key(impl));
      if (e != nullptr && label_of(**e, st, settled, kLabelState) == Label::kNothing) return;
      out.append(py::reinterpret_borrow<py::object>(v));  // (no record yet: _track makes it, labelled)
    };
    auto values = [](PyObject* mapping, auto&& f) {
      if (PyDict_Check(mapping)) {  // (optimizer.state is a defaultdict)
        PyObject *k, *v;
        Py_ssize_t i = 0;
        while (PyDict_Next(mapping, &i, &k, &v)) f(v);
      } else {  // a mapping of another kind: read as Python reads it
        for (const py::handle v : py::reinterpret_borrow<py::object>(mapping).attr("values")()) f(v.ptr());
      }
    };
    values(state.ptr(), [&](PyObject* per) { values(per, look); });
    return out;
  }

  // The storage behind `sid` as a Python object, or None if it died.
  py::object storage(int64_t sid) {
    Entry** e = by_sid_.find(static_cast<uint64_t>(sid));
    if (e == nullptr) return py::none();
    auto strong = (*e)->weak.lock();
    if (!strong) return py::none();
    return py::reinterpret_steal<py::object>(torch::createPyObject(c10::Storage(std::move(strong))));
  }

  void set_away(int64_t sid, bool away) {
    Entry& e = entry(sid);
    if (e.away == away) return;
    unhear(e);  // its data goes (or went) with the move; a fetched copy is heard at its new address
    exposed_ -= exposed(e);
    e.away = away;
    used_ += away ? -e.nbytes : e.nbytes;
    away_ += away ? e.nbytes : -e.nbytes;
    c10::intrusive_ptr<c10::StorageImpl> back;
    if (!away && (back = e.weak.lock())) e.covered = cover_ && covered::cover(back.get());
    exposed_ += exposed(e);
    if (back) hear_entry(e, back.get());
    if (used_ > peak_) peak_ = used_;
  }

  void set_host_valid(int64_t sid, bool v) { entry(sid).host_valid = v; }
  // an eviction's copy was issued and the block given back: set_away(sid, true), and the host copy
  // equals the bytes until the next write
  void set_evicted(int64_t sid) {
    set_away(sid, true);
    entry(sid).host_valid = true;
  }
  void set_watch(int64_t sid, bool v) { entry(sid).watch = v; }
  void set_module(int64_t m) { module_ = m; }
  bool host_valid(int64_t sid) { return entry(sid).host_valid; }
  bool away(int64_t sid) { return entry(sid).away; }
  int64_t nbytes(int64_t sid) { return entry(sid).nbytes; }
  int64_t last_access(int64_t sid) { return entry(sid).last_access; }
  int64_t last_stream(int64_t sid) { return entry(sid).stream; }
  int64_t access_count(int64_t sid) { return entry(sid).count; }
  bool alive(int64_t sid) {
    Entry** e = by_sid_.find(static_cast<uint64_t>(sid));
    return e != nullptr && !(*e)->weak.expired();
  }

  // Forget storages that died; logs a kFree record for each. Returns how many. The table is keyed by
  // address, so its iteration order is the allocator's, which differs from one process to the next:
  // the deaths it finds are logged by storage id (invariant 14).
  int64_t sweep() {
    drain();
    ++sweeps_;
    dead_.clear();
    table_.for_each([&](uint64_t, Entry* e) {
      if (e->weak.expired()) dead_.push_back(e);
    });
    if (dead_.size() > 1)
      std::sort(dead_.begin(), dead_.end(), [](const Entry* a, const Entry* b) { return a->sid < b->sid; });
    for (Entry* e : dead_) forget(e);
    return static_cast<int64_t>(dead_.size());
  }

  // The log since the last call (int64 words), and the operator names interned since then.
  // compact=true keeps only what changes the storage table: no operator records, and no birth
  // and death of a storage that lived and died within the batch, except the death of one that
  // track() registered (Python may know it without having read its birth).
  py::tuple take_log(bool compact) {
    if (compact) compact_log();
    known_freed_.clear();
    batch_first_sid_ = next_sid_;
    py::bytes words(reinterpret_cast<const char*>(log_.data()), log_.size() * sizeof(int64_t));
    log_.clear();
    py::list names;
    for (size_t i = names_sent_; i < names_.size(); ++i) names.append(names_[i]);
    names_sent_ = names_.size();
    return py::make_tuple(words, names);
  }

  // Whether take_log() or take_recency() would return anything (a record, a name, a timeline word, a
  // stale or held storage): a parse with nothing to read changes nothing, so the caller may skip it.
  bool log_pending() const {
    return !log_.empty() || names_sent_ != names_.size() || !timeline_.empty() || !stale_.empty() ||
           !held_.empty();
  }

  // Whether a collective (a c10d:: operator) ran on storages since take_recency() last returned them:
  // until they are read, nothing else says they may not move.
  bool held_pending() const { return !held_.empty(); }

  // The last operator take_recency() would report: (name id, phase, inputs, outputs), the log left as it is.
  py::tuple last_op() const {
    return py::make_tuple(last_name_, last_phase_, py::cast(last_ins_), py::cast(last_outs_));
  }

  void compact_log() {
    // A storage born in this batch has a sid from batch_first_sid_ on (sids are issued in order):
    // born_at_[sid - batch_first_sid_] is the index of its kAlloc record. A pair found dead is
    // overwritten with tombstones (the negated tags), then every record but kAlloc and kFree goes.
    const int64_t first = batch_first_sid_;
    born_at_.assign(static_cast<size_t>(next_sid_ - first), -1);
    known_dead_.assign(born_at_.size(), 0);
    for (int64_t sid : known_freed_)
      if (sid >= first) known_dead_[sid - first] = 1;
    const size_t n = log_.size();
    for (size_t i = 0; i < n;) {
      const int64_t tag = log_[i];
      if (tag == kOp) {
        i += 9 + log_[i + 5] + log_[i + 6] + log_[i + 7] + log_[i + 8];
      } else if (tag == kAlloc) {
        const int64_t k = log_[i + 1] - first;
        TORCH_INTERNAL_ASSERT(k >= 0 && k < static_cast<int64_t>(born_at_.size()), "dynn: a kAlloc's sid is out of its batch");
        born_at_[k] = static_cast<int64_t>(i);
        i += 4;
      } else {
        const int64_t sid = log_[i + 1];
        if (sid >= first && born_at_[sid - first] >= 0) {
          log_[born_at_[sid - first]] = -kAlloc;
          if (!known_dead_[sid - first]) log_[i] = -kFree;
        }
        i += 2;
      }
    }
    size_t w = 0;
    for (size_t i = 0; i < n;) {
      const int64_t tag = log_[i];
      const size_t len = tag == kOp ? 9 + log_[i + 5] + log_[i + 6] + log_[i + 7] + log_[i + 8]
                         : (tag == kAlloc || tag == -kAlloc) ? 4 : 2;
      if (tag == kAlloc || tag == kFree) {
        std::copy(log_.data() + i, log_.data() + i + len, log_.data() + w);
        w += len;
      }
      i += len;
    }
    log_.shrink_to(w);
  }

  // ---- the lru policy's order, kept here (recency.h) ---------------------------------------
  // fraction: SmallStorages' fraction (0: one tier); None: no order kept.
  void set_recency(py::object fraction) {
    recency_live_ = false;
    if (fraction.is_none()) {
      recency_.reset();
    } else {
      recency_ = std::make_unique<Recency>(fraction.cast<double>());
    }
    timeline_.clear();
    stale_.clear();
    held_.clear();
  }
  // While live, each operator's touches go to the order as it runs, and the compact parse's
  // records (timeline, stale host copies, collectives, the last operator) are kept.
  void set_recency_live(bool v) {
    TORCH_CHECK(!v || recency_, "dynn: set_recency_live(True) needs set_recency(fraction) first");
    recency_live_ = v;
  }
  bool recency_live() const { return recency_live_; }
  void set_op_records_while_live(bool v) { op_records_while_live_ = v; }
  bool op_records_while_live() const { return op_records_while_live_; }
  void recency_alloc(int64_t sid, int64_t nbytes) { rec().alloc(sid, nbytes); }
  void recency_access(int64_t sid) { rec().access(sid); }
  void recency_free(int64_t sid) { rec().free(sid); }
  // Policy.on_touches' events (kind, sid, position, nbytes quadruples; kinds 0 access, 1 alloc,
  // 2 free: policies/base.py's TOUCH_*), applied in order.
  void recency_touches(const std::vector<int64_t>& events) {
    Recency& r = rec();
    TORCH_CHECK(events.size() % 4 == 0, "dynn: recency_touches takes kind, sid, position, nbytes quadruples");
    for (size_t i = 0; i < events.size(); i += 4) {
      const int64_t kind = events[i], sid = events[i + 1];
      if (kind == 1) r.alloc(sid, events[i + 3]);
      else if (kind == 2) r.free(sid);
      else r.access(sid);
    }
  }
  // The storages held at a step's start, told to the order as allocations of their sizes (the
  // table's, as an operator's allocations are told), in the order given: what recency_touches() of
  // (alloc, sid, -1, nbytes) quadruples does, without Python building them.
  // `sids`: a list of ints, or a dict whose keys are (the runtime's table), read in place.
  void recency_announce(const py::handle& sids) {
    Recency& r = rec();
    auto one = [&](PyObject* o) {
      const int64_t sid = PyLong_AsLongLong(o);
      if (sid == -1 && PyErr_Occurred()) throw py::error_already_set();
      Entry** e = by_sid_.find(static_cast<uint64_t>(sid));
      r.alloc(sid, e == nullptr ? 0 : (*e)->nbytes);
    };
    if (PyDict_Check(sids.ptr())) {
      PyObject *k, *v;
      Py_ssize_t i = 0;
      while (PyDict_Next(sids.ptr(), &i, &k, &v)) one(k);
      return;
    }
    for (const py::handle o : sids) one(o.ptr());
  }
  // Up to `max` storages of at least `min_bytes` after the cursor (tier, sid, stamp) that are on the
  // device with no copy in flight, least recently used first; returns them and the moved cursor
  // (tier 2: the walk is done).
  py::tuple recency_after(int64_t tier, int64_t sid, int64_t stamp, int64_t max, int64_t min_bytes) {
    std::vector<int64_t> out = rec().after(tier, sid, stamp, max, [&](int64_t s) {
      Entry** e = by_sid_.find(static_cast<uint64_t>(s));
      return e == nullptr || (*e)->away || (*e)->watch || (*e)->nbytes < min_bytes;
    });
    return py::make_tuple(py::cast(out), tier, sid, stamp);
  }
  // The order (tier -1: both tiers merged by stamp), least recently used first.
  std::vector<int64_t> recency_order(int64_t tier) { return tier < 0 ? rec().order() : rec().tier_order(static_cast<int>(tier)); }
  py::tuple recency_footprint() { return py::make_tuple(rec().live(), rec().peak()); }
  // What the compact parse reads instead of the operator records since the last call: the timeline
  // (position, used, phase per operator, int64 words), the storages written while they had a valid
  // host copy (stale now), the collectives' storages (a count, then that many sids, per collective), and the
  // last operator (name id, phase, inputs, outputs).
  // `timeline` false: the timeline is dropped, not returned (b'').
  py::tuple take_recency(bool timeline) {
    py::bytes tl(reinterpret_cast<const char*>(timeline_.data()),
                 timeline ? timeline_.size() * sizeof(int64_t) : 0);
    py::tuple out = py::make_tuple(tl, py::cast(stale_), py::cast(held_), last_name_, last_phase_,
                                   py::cast(last_ins_), py::cast(last_outs_));
    timeline_.clear();
    stale_.clear();
    held_.clear();
    return out;
  }

  // The first exception a handler raised since the last call, re-raised here.
  void take_error() {
    if (error_) {
      std::unique_ptr<py::error_already_set> err = std::move(error_);
      err->restore();
      throw py::error_already_set();
    }
  }

  int64_t used() {
    drain();
    return used_;
  }
  int64_t peak() const { return peak_; }
  int64_t peak_position() const { return peak_position_; }
  int64_t max_made() const { return max_made_; }
  void set_max_made(int64_t n) { max_made_ = n; }
  void reset_peak() {
    peak_ = used_;
    peak_position_ = 0;
    live_peak_ = used_ + away_;
    live_peak_position_ = 0;
  }
  int64_t away_bytes() const { return away_; }
  int64_t live_peak() const { return live_peak_; }
  int64_t live_peak_position() const { return live_peak_position_; }
  int64_t position() const { return position_; }
  int64_t tracked() const { return static_cast<int64_t>(table_.size()); }
  int64_t exposed_count() const { return exposed_; }
  // The exposed entries (sid, why): "unheard" (hearing is off), "dead" (not swept for yet), "not the
  // allocator's" (its data has another deleter), "shared" (another live entry is heard at its
  // address), "unseen" (not heard since it was registered or its data moved; heard when an
  // operator next touches it).
  std::vector<std::pair<int64_t, std::string>> exposed_entries() {
    std::vector<std::pair<int64_t, std::string>> out;
    table_.for_each([&](uint64_t, Entry* e) {
      if (exposed(*e) == 0) return;
      std::string why = "unseen";
      auto strong = e->weak.lock();
      if (!hearing_) {
        why = "unheard";
      } else if (!strong) {
        why = "dead";
      } else {
        c10::DataPtr& dp = strong->_mutable_data_ptr_no_checks();
        Entry** at = by_data_.find(reinterpret_cast<uintptr_t>(dp.get()));
        if (hear_deleter_ != nullptr && dp.get_deleter() != hear_deleter_)
          why = "not the allocator's";
        else if (at != nullptr && *at != e && !(*at)->weak.expired())
          why = "shared";
      }
      out.emplace_back(e->sid, why);
    });
    std::sort(out.begin(), out.end());
    return out;
  }
  int64_t sweeps() const { return sweeps_; }
  bool exact_peak() const { return exact_peak_; }
  bool hear() const { return hear_; }
  void set_hear(bool on) {
    TORCH_CHECK(!started_, "dynn: set the observer's hear before start()");
    hear_ = on;
  }
  bool hearing() const { return hearing_; }
  int64_t heard_count() const { return static_cast<int64_t>(by_data_.size() + shadowed_.size()); }
  void set_exact_peak(bool on) { exact_peak_ = on; }
  bool cover() const { return cover_; }
  void set_cover(bool on) {
    TORCH_CHECK(!started_, "dynn: set the observer's cover before start()");
    TORCH_CHECK(!on || device_type_ == c10::DeviceType::CPU,
                "dynn: CUDA storages are never covered (covered.h: recordStream must keep working)");
    cover_ = on;
  }
  int64_t faults() const { return faults_; }
  int64_t decisions() const { return decisions_; }
  int64_t observed() const { return observed_; }

 private:
  // ---- helpers ------------------------------------------------------------------------------
  // Counted in `exposed_`: in `used`, with data whose release the observer would not hear of.
  static int64_t exposed(const Entry& e) { return !e.away && !e.covered && !e.heard && e.nbytes > 0 ? 1 : 0; }

  // Starts hearing of frees (invariant 9) where asked and possible. On CUDA a probe block, taken
  // before the tracker is attached (the allocator's devices exist once CUDA is initialized), must
  // be reported when freed; its deleter is the caching allocator's, which an entry's data must
  // have to be heard. On the CPU only with covering off, and only the tests report (report_free).
  void start_hearing() {
    hearing_ = false;
    if (!hear_) return;
    if (device_type_ == c10::DeviceType::CPU) {
      if (cover_) return;
      heard_device_ = -1;
      hear_deleter_ = nullptr;
      heard::listen(heard_device_);
      hearing_ = true;
      return;
    }
    if (device_type_ != c10::DeviceType::CUDA) return;
    try {  // a probe that cannot be made or heard: the observer sweeps, as without hearing
      c10::impl::ExcludeDispatchKeyGuard quiet(kKey);
      at::Tensor probe = at::empty({512}, at::TensorOptions().dtype(at::kByte).device(
                                              device_type_, static_cast<c10::DeviceIndex>(device_index_)));
      if (!heard::attach_cuda()) return;
      const uint64_t addr = reinterpret_cast<uintptr_t>(probe.data_ptr());
      const c10::DeleterFnPtr deleter = probe.storage().data_ptr().get_deleter();
      heard_device_ = probe.device().index();
      heard::listen(heard_device_);
      probe.reset();
      heard::take(freed_);
      if (std::find(freed_.begin(), freed_.end(), addr) == freed_.end()) {
        heard::listen(heard::kNobody);
        return;
      }
      hear_deleter_ = deleter;
      hearing_ = true;
    } catch (const std::exception&) {
      heard::listen(heard::kNobody);
      hearing_ = false;
    }
  }

  // Hears `e` (alive, with `impl` its storage) at its data's present address, if it can be heard.
  void hear_entry(Entry& e, c10::StorageImpl* impl) {
    if (!hearing_ || e.away || e.heard) return;
    c10::DataPtr& dp = impl->_mutable_data_ptr_no_checks();
    if (dp.get() == nullptr || e.nbytes == 0) return;
    if (hear_deleter_ != nullptr && dp.get_deleter() != hear_deleter_) return;
    const uint64_t addr = reinterpret_cast<uintptr_t>(dp.get());
    // Another entry holds the address. A storage that died there (its free reported, not drained
    // yet: a drain here would log deaths at a place that depends on addresses, invariant 14) is
    // shadowed: still heard, its death logged by the drain that takes its free, which comes before
    // any later free of the address. A live one whose data moved elsewhere is no longer heard
    // (seen again, it is heard at its new address). Two live storages over one address: this one
    // stays exposed, and is heard when next seen.
    if (Entry** at = by_data_.find(addr)) {
      Entry* old = *at;
      if (!old->weak.expired()) {
        if (reinterpret_cast<uintptr_t>(old->impl->_mutable_data_ptr_no_checks().get()) == addr) return;
        unhear(*old);
      } else {
        by_data_.erase(addr);
        shadowed_.push_back(old);
      }
    }
    exposed_ -= exposed(e);
    e.heard = true;
    e.data = addr;
    by_data_.insert(addr, &e);
    exposed_ += exposed(e);
  }

  void unhear(Entry& e) {
    if (!e.heard) return;
    exposed_ -= exposed(e);
    Entry** at = by_data_.find(e.data);
    if (at != nullptr && *at == &e) {
      by_data_.erase(e.data);
    } else {  // shadowed: a newer entry holds its address in by_data_
      auto it = std::find(shadowed_.begin(), shadowed_.end(), &e);
      if (it != shadowed_.end()) shadowed_.erase(it);
    }
    e.heard = false;
    e.data = 0;
    exposed_ += exposed(e);
  }

  void set_covered(Entry& e, bool covered) {
    exposed_ -= exposed(e);
    e.covered = covered;
    exposed_ += exposed(e);
  }

  static uint64_t key(const c10::StorageImpl* impl) { return reinterpret_cast<uintptr_t>(impl); }

  // The sequence number of the last autograd node this thread made, -1 before its first.
  static int64_t thread_last_node() { return static_cast<int64_t>(at::sequence_number::peek()) - 1; }

  // Forgets a storage that died; logs a kFree record.
  void forget(Entry* e) {
    unhear(*e);
    exposed_ -= exposed(*e);
    (e->away ? away_ : used_) -= e->nbytes;
    int64_t* w = log_.extend(2);
    w[0] = kFree;
    w[1] = e->sid;
    if (e->known) known_freed_.push_back(e->sid);
    if (recency_) recency_->free(e->sid);
    by_sid_.erase(static_cast<uint64_t>(e->sid));
    table_.erase(key(e->impl));
    entries_.release(e);
  }

  // Acts on the releases release_cb reported (invariant 9): a storage that died is forgotten; one
  // alive (its data replaced or given up while away) is no longer covered. Each is judged by its
  // own state, so a report that outlived its entry changes nothing.
  void drain() {
    if (covered::any_released()) {
      covered::take_released(released_);
      for (c10::StorageImpl* impl : released_) {
        Entry** found = table_.find(key(impl));
        if (found == nullptr) continue;
        Entry* e = *found;
        if (e->weak.expired()) {
          forget(e);
        } else if (e->covered && impl->_mutable_data_ptr_no_checks().get_deleter() != &covered::release_cb) {
          set_covered(*e, false);
        }
      }
    }
    if (hearing_ && heard::any()) drain_heard();
  }

  // Acts on the frees the allocator reported (invariant 9): a heard storage that died is forgotten;
  // one alive whose data is no longer at the address (replaced) is no longer heard. An address
  // whose storage is alive at it (freed and taken again since) changes nothing.
  void drain_heard() {
    heard::take(freed_);
    for (uint64_t addr : freed_) {
      if (!shadowed_.empty()) {  // the earliest free of a shadowed entry's address is its own
        auto it = std::find_if(shadowed_.begin(), shadowed_.end(), [&](const Entry* e) { return e->data == addr; });
        if (it != shadowed_.end()) {
          forget(*it);  // unhear takes it out of shadowed_
          continue;
        }
      }
      Entry** found = by_data_.find(addr);
      if (found == nullptr) continue;
      Entry* e = *found;
      if (e->weak.expired()) {
        forget(e);
      } else if (reinterpret_cast<uintptr_t>(e->impl->_mutable_data_ptr_no_checks().get()) != addr) {
        unhear(*e);
      }
    }
  }

  c10::StorageImpl* managed_impl(const at::Tensor& t) const {
    if (!t.defined()) return nullptr;
    const c10::TensorImpl& ti = *t.unsafeGetTensorImpl();
    // tensor subclasses and wrappers (fake, functional) manage their own storage
    static const c10::DispatchKeySet wrappers({c10::DispatchKey::Python, c10::DispatchKey::Functionalize});
    if (ti.key_set().has_any(wrappers) || ti.layout() != c10::kStrided) return nullptr;
    const c10::Device d = ti.device();
    if (d.type() != device_type_) return nullptr;
    if (device_index_ >= 0 && d.index() != device_index_) return nullptr;
    // a Python number wrapped for one operator (`x.add_(1)`): only that operator's arguments hold it,
    // and on an accelerator it lives on the CPU anyway; untracked on every device alike (invariant 10)
    if (ti.is_wrapped_number()) return nullptr;
    // the storage field itself: neither virtual nor out of line, and null where there is none
    return ti.unsafe_storage().unsafeGetStorageImpl();
  }

  // What a label (`bit`; `settled`, the kinds it leaves as they are) would do to entry `e`'s record:
  // nothing (the bit set, or the record's kind settled: the bit is set then, invariant 16), or
  // change it, or there is no record in `st` yet (born since the log was read).
  enum class Label { kNothing, kChange, kNoRecord };
  static Label label_of(Entry& e, const py::dict& st, const py::tuple& settled, uint8_t bit) {
    if (e.settled & bit) return Label::kNothing;
    PyObject* rec = record_of(st, e.sid);
    if (rec == nullptr) return Label::kNoRecord;
    if (!settled_kind(rec, settled)) return Label::kChange;
    e.settled |= bit;
    return Label::kNothing;
  }

  // The record `st` keeps for `sid` (borrowed), or nullptr.
  static PyObject* record_of(const py::dict& st, int64_t sid) {
    py::int_ k(sid);
    PyObject* rec = PyDict_GetItemWithError(st.ptr(), k.ptr());
    if (rec == nullptr && PyErr_Occurred()) throw py::error_already_set();
    return rec;
  }
  // Whether `o`'s type is exactly one of `types`.
  static bool exact_type_in(PyObject* o, const py::tuple& types) {
    PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(o));
    for (const py::handle t : types)
      if (t.ptr() == type) return true;
    return false;
  }
  static py::object detached(const at::Tensor& t) {
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(t.detach()));
  }
  // The record's `saved` flag.
  static bool record_saved(PyObject* rec) {
    static PyObject* const name = PyUnicode_InternFromString("saved");
    py::object saved = py::reinterpret_steal<py::object>(PyObject_GetAttr(rec, name));
    if (!saved) throw py::error_already_set();
    const int yes = PyObject_IsTrue(saved.ptr());
    if (yes < 0) throw py::error_already_set();
    return yes != 0;
  }
  // Whether the record's `kind` is one of `settled` (strings).
  static bool settled_kind(PyObject* rec, const py::tuple& settled) {
    static PyObject* const name = PyUnicode_InternFromString("kind");
    py::object kind = py::reinterpret_steal<py::object>(PyObject_GetAttr(rec, name));
    if (!kind) throw py::error_already_set();
    for (const py::handle s : settled)
      if (s.ptr() == kind.ptr()) return true;  // (the kinds are the source's literals: interned)
    for (const py::handle s : settled) {
      const int eq = PyObject_RichCompareBool(kind.ptr(), s.ptr(), Py_EQ);
      if (eq < 0) throw py::error_already_set();
      if (eq) return true;
    }
    return false;
  }

  Recency& rec() {
    TORCH_CHECK(recency_, "dynn: the observer keeps no recency order (set_recency first)");
    return *recency_;
  }

  Entry& entry(int64_t sid) {
    Entry** e = by_sid_.find(static_cast<uint64_t>(sid));
    TORCH_CHECK(e != nullptr, "dynn: storage ", sid, " is not tracked");
    return **e;
  }

  // `impl`'s entry, and whether this call registered it.
  // `stream`: a new entry's last-access stream (the operator's path has read the current one).
  std::pair<Entry*, bool> lookup_or_add(c10::StorageImpl* impl, const at::Tensor& t, bool fresh, int64_t stream) {
    if (Entry** found = table_.find(key(impl))) {
      Entry& e = **found;
      if (e.away) return {&e, false};
      const int64_t n = static_cast<int64_t>(impl->nbytes());
      const bool is_covered = impl->_mutable_data_ptr_no_checks().get_deleter() == &covered::release_cb;
      const bool is_heard = e.heard && reinterpret_cast<uintptr_t>(impl->_mutable_data_ptr_no_checks().get()) == e.data;
      if (n != e.nbytes || !(is_covered || is_heard)) {  // resized in place (an out= argument), or its data replaced
        unhear(e);
        exposed_ -= exposed(e);
        used_ += n - e.nbytes;
        e.nbytes = n;
        e.covered = is_covered || (cover_ && covered::cover(impl));
        exposed_ += exposed(e);
        if (!e.covered) hear_entry(e, impl);
      }
      return {&e, false};
    }
    const int64_t n = static_cast<int64_t>(impl->nbytes());
    const int64_t sid = next_sid_++;
    Entry& fresh_entry = *entries_.make(t.storage().getWeakStorageImpl(), impl, sid, n, stream);
    table_.insert(key(impl), &fresh_entry);
    by_sid_.insert(static_cast<uint64_t>(sid), &fresh_entry);
    fresh_entry.covered = cover_ && covered::cover(impl);
    exposed_ += exposed(fresh_entry);
    if (!fresh_entry.covered) hear_entry(fresh_entry, impl);
    used_ += n;
    int64_t* w = log_extend(4);
    w[0] = kAlloc;
    w[1] = sid;
    w[2] = n;
    w[3] = fresh ? 1 : 0;
    if (!fresh && recency_live_) recency_->alloc(sid, n);  // told where the Python parse tells its kAlloc
    return {&fresh_entry, true};
  }

  // Appends `k` words to the log and returns the first: one capacity check per record.
  int64_t* log_extend(size_t k) {
    return log_.extend(k);
  }

  // An unboxed operator's info by the slot its Unboxed<Op> drew at registration: an index, not a
  // hash of its schema, on every call after the first.
  OpInfo& info(const c10::OperatorHandle& op, size_t slot) {
    if (slot < by_slot_.size() && by_slot_[slot] != nullptr) return *by_slot_[slot];
    OpInfo& inf = info(op);
    if (slot >= by_slot_.size()) by_slot_.resize(slot + 1, nullptr);
    by_slot_[slot] = &inf;  // unordered_map's elements stay where they are as it grows
    return inf;
  }

  OpInfo& info(const c10::OperatorHandle& op) {
    const void* key = &op.schema();
    auto it = ops_.find(key);
    if (it != ops_.end()) return it->second;
    OpInfo inf;
    inf.skip = skipped(op);
    bool random = random_by_name(op.schema().name());  // a failed attempt may have drawn
    const auto& args = op.schema().arguments();
    for (size_t i = 0; i < args.size(); ++i) {
      const auto* a = args[i].alias_info();
      if (a != nullptr && a->isWrite()) inf.writes.push_back(static_cast<int>(i));
      if (inf.stream_arg < 0 && args[i].type()->kind() == c10::TypeKind::StreamObjType)
        inf.stream_arg = static_cast<int>(i);
      c10::TypePtr t = args[i].type();
      if (auto opt = t->cast<c10::OptionalType>()) t = opt->getElementType();
      if (t->kind() == c10::TypeKind::GeneratorType && inf.gen_arg < 0) {
        inf.gen_arg = static_cast<int>(i);
        random = true;
      }
    }
    for (int i : undeclared_writes(op.schema().name()))  // (kept ascending: the walks read it in order)
      if (i < static_cast<int>(args.size()) && std::find(inf.writes.begin(), inf.writes.end(), i) == inf.writes.end())
        inf.writes.insert(std::upper_bound(inf.writes.begin(), inf.writes.end(), i), i);
    inf.retry = inf.writes.empty();
    inf.random = random;
    if (!inf.skip) {
      std::string name = op.schema().name();
      const std::string& overload = op.schema().overload_name();
      if (!overload.empty()) name += "." + overload;
      inf.id = static_cast<int64_t>(names_.size());
      inf.collective = name.rfind("c10d::", 0) == 0;
      names_.push_back(std::move(name));
    }
    return ops_.emplace(key, std::move(inf)).first->second;
  }

  template <typename F>
  static void for_tensors(const c10::IValue& v, F&& f) {
    if (v.isTensor()) {
      f(v.toTensor());
    } else if (v.isList()) {  // Tensor[], Tensor?[] and generic lists alike, read in place
      for (const c10::IValue& x : v.toListRef())
        if (x.isTensor()) f(x.toTensor());
    }
  }

  void add_unique(std::vector<int64_t>& v, int64_t sid) {
    for (int64_t x : v)
      if (x == sid) return;
    v.push_back(sid);
  }

  // The phase of an operator that runs `in_node` (inside an autograd node's apply: backward) or not.
  int64_t phase_of(bool in_node) {
    if (phase_override_ == kOptimizer) return kOptimizer;
    if (in_node) {
      seen_backward_ = true;
      return kBackward;
    }
    return seen_backward_ ? kBackward : kForward;
  }

  // Calls a Python handler with the key excluded (invariant 4); `make_args` builds its arguments once the GIL
  // is held (the operator's binding released it). An exception is kept (invariant 3). Returns false
  // where there is no handler, it raised, or it returned False.
  template <typename MakeArgs>
  bool call(py::object& handler, MakeArgs&& make_args) {
    c10::impl::ExcludeDispatchKeyGuard off(kKey);
    py::gil_scoped_acquire gil;
    if (handler.is_none()) return false;
    try {
      py::tuple args = make_args();
      return handler(*args).ptr() != Py_False;
    } catch (py::error_already_set& e) {
      if (!error_) error_ = std::make_unique<py::error_already_set>(std::move(e));
      return false;
    }
  }

  // An operator's kernel ran out of device memory (`e`, being handled; invariant 11). Called from
  // the catch clause around the kernel, which is all the operator's path carries: a try/catch costs
  // nothing until something is thrown, and everything here, the retry's kernel (built in the catch
  // clause) included, is out of line. Where the operator may be retried in this step, the OOM
  // handler makes room, `again()` gives the kernel its arguments back (false: it cannot) and
  // `kernel` runs once more. Otherwise `e` propagates; a second OOM is told to the handler and propagates.
  template <class Kernel, class Again>
  C10_NOINLINE decltype(auto) after_oom(const OpInfo& inf, const c10::OutOfMemoryError& e, const char* name,
                                        const Ctx& ctx, Kernel&& kernel, Again&& again) {
    if (!(inf.retry && in_step_) || !on_oom(e, name, ctx, false) || !again()) throw;  // rethrows `e`
    try {
      return kernel();
    } catch (const c10::OutOfMemoryError& twice) {
      on_oom(twice, name, ctx, true);
      throw;
    }
  }

  // Schema argument indices an operator writes in place although its schema does not mark them
  // (the batch norms update the running statistics they are given in training mode): they count as
  // written, for stale host copies (invariant 5) and for the OOM retry (invariant 11) alike.
  // runtime/oom.py's UNDECLARED_WRITES says the same.
  static std::vector<int> undeclared_writes(const std::string& name) {
    if (name == "aten::native_batch_norm" || name == "aten::cudnn_batch_norm" || name == "aten::miopen_batch_norm")
      return {3, 4};  // running_mean, running_var
    return {};
  }

  // Operators that draw from the default generator without a Generator argument.
  static bool random_by_name(const std::string& name) {
    return name == "aten::native_dropout" || name == "aten::_scaled_dot_product_flash_attention" ||
           name == "aten::_scaled_dot_product_efficient_attention" ||
           name == "aten::_scaled_dot_product_cudnn_attention" || name == "aten::_flash_attention_forward" ||
           name == "aten::_efficient_attention_forward";
  }

  // Before a random operator's kernel, in a step: the state of the generator it draws from (`given`,
  // else the managed device's default), restored before a retry (invariant 11). Out of line: only
  // random operators pay for it.
  C10_NOINLINE void save_rng(Ctx& ctx, const std::optional<at::Generator>& given) {
    at::Generator g = given.has_value() && given->defined()
                          ? *given
                          : at::globalContext().defaultGenerator(
                                c10::Device(device_type_, static_cast<c10::DeviceIndex>(device_index_)));
    std::lock_guard<std::mutex> lock(g.mutex());
    ctx.rng_state = g.get_state();
    ctx.rng = std::move(g);
  }
  static void restore_rng(Ctx& ctx) {
    if (!ctx.rng.defined()) return;
    std::lock_guard<std::mutex> lock(ctx.rng.mutex());
    ctx.rng.set_state(ctx.rng_state);
  }

  // The OOM handler: (message, the operator's input sids, its name, whether the retry failed too);
  // it returns whether to retry. The host may wait in it: this is the OOM path, not the hot path.
  bool on_oom(const c10::OutOfMemoryError& e, const char* name, const Ctx& ctx, bool failed) {
    return call(on_oom_, [&] {
      return py::make_tuple(py::str(e.what_without_backtrace()), py::cast(ctx.ins), py::str(name), failed);
    });
  }

  // ---- the operator -------------------------------------------------------------------------
 public:
  // The boxed path: every operator without an unboxed kernel at the key (below) reaches it with
  // its arguments on a stack.
  void dispatch(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    const c10::DispatchKeySet below = ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey);
    OpInfo& inf = info(op);
    if (inf.skip) {  // registered after the first start: its decomposition reaches the key
      op.redispatchBoxed(below, stack);
      return;
    }
    Ctx& ctx = enter();
    Leave leave{depth_};
    const size_t n = op.schema().arguments().size();
    const size_t first = stack->size() - n;
    size_t w = 0;  // next entry of inf.writes (ascending)
    const int64_t cur = current_stream();  // no kernel below the key changes the current stream
    int64_t on = cur;
    for (size_t i = 0; i < n; ++i) {
      const bool written = w < inf.writes.size() && inf.writes[w] == static_cast<int>(i);
      if (written) ++w;
      for_tensors((*stack)[first + i], [&](const at::Tensor& t) { see_input(t, written, on, ctx); });
    }
    if (inf.stream_arg >= 0) {  // record_stream(t, s): t is in use on s from here (invariant 7)
      const c10::IValue& v = (*stack)[first + inf.stream_arg];
      if (v.isStream() && v.toStream().device_type() == device_type_) on = v.toStream().id();
    }
    const char* name = op.schema().name().c_str();
    before_kernel(name, ctx, on);
    if (inf.retry && in_step_) {  // invariant 11
      ctx.args.assign(stack->begin() + first, stack->end());
      if (inf.random) {
        std::optional<at::Generator> given;
        if (inf.gen_arg >= 0 && (*stack)[first + inf.gen_arg].isGenerator())
          given = (*stack)[first + inf.gen_arg].toGenerator();
        save_rng(ctx, given);
      }
    }
    DropArgs drop{ctx};
    try {
      redispatch_boxed(op, below, stack);
    } catch (const c10::OutOfMemoryError& e) {
      after_oom(
          inf, e, name, ctx, [&, below] { redispatch_boxed(op, below, stack); },
          [&] {  // the failed attempt may have moved arguments out of the stack, or dropped them
            if (ctx.args.size() != n || stack->size() < first) return false;
            stack->resize(first);
            stack->insert(stack->end(), ctx.args.begin(), ctx.args.end());
            restore_rng(ctx);
            return true;
          });
    }
    const int64_t j = begin_outputs();
    int64_t made = 0;
    const size_t n_out = op.schema().returns().size();
    for (size_t r = stack->size() - n_out; r < stack->size(); ++r)
      for_tensors((*stack)[r], [&](const at::Tensor& t) { see_output(t, j, cur, made, ctx); });
    finish(inf, j, made, ctx);
  }

  // The unboxed path, for the operators registered with `Unboxed<Op>` (below): the same steps as
  // dispatch(), on the typed arguments, so that PyTorch neither boxes them nor unboxes them again
  // for the kernel. Argument i of the C++ signature is argument i of the schema (the dispatcher's
  // calling convention), so the schema's written indices apply as they are.
  // Inlined into its Unboxed<Op>::call, whatever the compiler's size heuristics say: one call less
  // per operator.
  template <class Op, class Ret, class... Args>
  C10_ALWAYS_INLINE Ret dispatch_unboxed(const c10::OperatorHandle& op, size_t slot, c10::DispatchKeySet below,
                                         Args... args) {
    OpInfo& inf = info(op, slot);
    if (inf.skip) return Op::redispatch(below, args...);
    Ctx& ctx = enter();
    Leave leave{depth_};
    const int64_t stream = current_stream();  // no kernel below the key changes the current stream
    size_t i = 0, w = 0;
    auto in = [&](const auto& arg) {
      const bool written = w < inf.writes.size() && inf.writes[w] == static_cast<int>(i);
      if (written) ++w;
      ++i;
      visit_tensors(arg, [&](const at::Tensor& t) { see_input(t, written, stream, ctx); });
    };
    (in(args), ...);
    before_kernel(Op::name, ctx, stream);
    if (inf.random && inf.retry && in_step_) {  // invariant 11: the generator it draws from, for a retry
      std::optional<at::Generator> gen;
      auto pick = [&](const auto& a) {
        if constexpr (std::is_same_v<std::decay_t<decltype(a)>, std::optional<at::Generator>>) gen = a;
      };
      (pick(args), ...);
      save_rng(ctx, gen);
    }
    // the kernel; after an out-of-memory error, once more on the same arguments: they are this
    // function's own, so the failed attempt left them as they were (`below` is copied into the
    // retry, so that the operator's path keeps it in a register)
    auto run = [&]() -> Ret {
      try {
        return redispatch_unboxed<Op, Ret>(below, args...);
      } catch (const c10::OutOfMemoryError& e) {
        return after_oom(
            inf, e, Op::name, ctx, [&, below]() -> Ret { return redispatch_unboxed<Op, Ret>(below, args...); },
            [&] {
              restore_rng(ctx);
              return true;
            });
      }
    };
    if constexpr (std::is_void_v<Ret>) {
      run();
      finish(inf, begin_outputs(), 0, ctx);
    } else {
      Ret out = run();
      const int64_t j = begin_outputs();
      int64_t made = 0;
      visit_tensors(out, [&](const at::Tensor& t) { see_output(t, j, stream, made, ctx); });
      finish(inf, j, made, ctx);
      return out;
    }
  }

 private:
  // The kernel below the key, with the key excluded while it runs.
  static void redispatch_boxed(const c10::OperatorHandle& op, c10::DispatchKeySet below, torch::jit::Stack* stack) {
    c10::impl::ExcludeDispatchKeyGuard inside(kKey);
    op.redispatchBoxed(below, stack);
  }
  template <class Op, class Ret, class... Args>
  static Ret redispatch_unboxed(c10::DispatchKeySet below, Args&... args) {
    c10::impl::ExcludeDispatchKeyGuard inside(kKey);
    return Op::redispatch(below, args...);
  }

  struct Leave {
    size_t& depth;
    ~Leave() { --depth; }
  };
  // The boxed path's copy of the arguments goes once the kernel has run or failed: it must not keep
  // the program's tensors alive.
  struct DropArgs {
    Ctx& ctx;
    ~DropArgs() { ctx.args.clear(); }
  };

  Ctx& enter() {
    if (depth_ == ctxs_.size()) ctxs_.push_back(std::make_unique<Ctx>());
    Ctx& ctx = *ctxs_[depth_++];
    ctx.clear();
    return ctx;
  }

  // One tensor among the operator's arguments (`written`: the schema marks its argument written).
  void see_input(const at::Tensor& t, bool written, int64_t stream, Ctx& ctx) {
    c10::StorageImpl* impl = managed_impl(t);
    if (impl == nullptr) {
      if (t.defined() && t.layout() != c10::kStrided) see_sparse_input(t, written, stream, ctx);
      return;
    }
    Entry* e = lookup_or_add(impl, t, /*fresh=*/false, stream).first;
    const size_t n_ins = ctx.ins.size();
    add_unique(ctx.ins, e->sid);
    if (ctx.ins.size() != n_ins) ctx.in_entries.push_back(e);
    if (e->away || e->watch) add_unique(ctx.fault, e->sid);
    if (written) {
      add_unique(ctx.writes, e->sid);
      if (e->host_valid && recency_live_) ctx.stale.push_back(e->sid);
      e->host_valid = false;
    }
  }

  // A sparse argument: its kernel reads the dense tensors it is made of (a COO tensor's indices and
  // values, a compressed one's two index tensors and values), whose storages are tracked like any
  // other once an operator shows them (`_values()`, or a sparse gradient made in backward), and so
  // may be away: each is an input, faulted back before the kernel (invariant 12).
  C10_NOINLINE void see_sparse_input(const at::Tensor& t, bool written, int64_t stream, Ctx& ctx) {
    // a wrapper's (fake, functional, a Python subclass) implementation is not the sparse one the
    // layout names; for every other tensor the layout says which it is
    static const c10::DispatchKeySet wrappers({c10::DispatchKey::Python, c10::DispatchKey::Functionalize});
    if (t.unsafeGetTensorImpl()->key_set().has_any(wrappers)) return;
    const c10::Layout layout = t.layout();
    if (layout == c10::kSparse) {
      auto* impl = static_cast<at::SparseTensorImpl*>(t.unsafeGetTensorImpl());
      see_input(impl->indices(), written, stream, ctx);
      see_input(impl->values(), written, stream, ctx);
    } else if (layout == c10::kSparseCsr || layout == c10::kSparseCsc || layout == c10::kSparseBsr ||
               layout == c10::kSparseBsc) {
      auto* impl = static_cast<at::SparseCsrTensorImpl*>(t.unsafeGetTensorImpl());
      see_input(impl->compressed_indices(), written, stream, ctx);
      see_input(impl->plain_indices(), written, stream, ctx);
      see_input(impl->values(), written, stream, ctx);
    }
  }

  // After the inputs were seen, before the kernel runs: faults, then the inputs' accesses.
  void before_kernel(const char* name, Ctx& ctx, int64_t stream) {
    ++observed_;
    if (!ctx.fault.empty()) {
      ++faults_;
      call(on_fault_, [&] { return py::make_tuple(py::cast(ctx.fault), py::cast(ctx.ins), py::str(name)); });
      for (Entry* e : ctx.in_entries)
        if (e->away) refuse_kernel(name, *e);  // invariant 12
    }
    // The inputs' accesses, at the position finish() gives the operator: once the fault handler
    // has seen the previous ones, and before the kernel, which may free an input (set_): its entry
    // may be gone after it. Until then each is alive (the arguments hold it), so no sweep erased it.
    for (Entry* e : ctx.in_entries) touch(*e, position_, stream);
  }

  // After the kernel: releases reported while it ran are acted on first; returns the operator's position.
  C10_ALWAYS_INLINE int64_t begin_outputs() {
    drain();
    return position_++;
  }

  // One tensor the operator returned.
  void see_output(const at::Tensor& t, int64_t j, int64_t stream, int64_t& made, Ctx& ctx) {
    c10::StorageImpl* impl = managed_impl(t);
    if (impl == nullptr) return;
    const auto [e, added] = lookup_or_add(impl, t, /*fresh=*/true, stream);
    if (added) {  // a new entry: its sid is not in allocs yet
      ctx.allocs.push_back(e->sid);
      made += e->nbytes;
    }
    const size_t n_outs = ctx.outs.size();
    add_unique(ctx.outs, e->sid);
    if (ctx.outs.size() != n_outs) touch(*e, j, stream);
  }

  // The operator's log record, sweeps, the peak, and the decision handler when one is due.
  void finish(const OpInfo& inf, int64_t j, int64_t made, Ctx& ctx) {
    std::vector<int64_t>& outs = ctx.outs;
    std::vector<int64_t>& allocs = ctx.allocs;
    // the autograd node: in backward the one running; in forward the one this op created, if any
    // (invariant 15)
    int64_t node = -1;
    const auto cur = torch::autograd::get_current_node();
    const int64_t phase = phase_of(cur != nullptr);
    if (cur != nullptr) {
      const uint64_t q = cur->sequence_nr();
      node = q < (uint64_t(1) << 62) ? static_cast<int64_t>(q) : -1;
    } else {
      const int64_t q = thread_last_node();
      if (q > last_node_) {
        last_node_ = q;
        node = q;
      }
    }
    const size_t n_in = ctx.ins.size(), n_out = outs.size(), n_w = ctx.writes.size(), n_a = allocs.size();
    if (!recency_live_ || op_records_while_live_) {  // invariant 13: while live, the compact parse drops them
      int64_t* w = log_extend(9 + n_in + n_out + n_w + n_a);
      w[0] = kOp;
      w[1] = inf.id;
      w[2] = phase | (module_ << 2);
      w[3] = node;
      w[4] = used_;
      w[5] = static_cast<int64_t>(n_in);
      w[6] = static_cast<int64_t>(n_out);
      w[7] = static_cast<int64_t>(n_w);
      w[8] = static_cast<int64_t>(n_a);
      w = std::copy(ctx.ins.begin(), ctx.ins.end(), w + 9);
      w = std::copy(outs.begin(), outs.end(), w);
      w = std::copy(ctx.writes.begin(), ctx.writes.end(), w);
      std::copy(allocs.begin(), allocs.end(), w);
    }
    if (recency_live_) told_live(inf, j, phase, ctx);
    bool swept = false;
    if (sweep_every_ > 0 && position_ % sweep_every_ == 0) {
      sweep();
      swept = true;
    }
    bool decide = decide_every_ > 0 && position_ - last_decide_ >= decide_every_;
    if (made > max_made_) max_made_ = made;
    // Over the budget less the most one operator has allocated: the manager makes room now, so
    // that the next operator fits (invariant 6)
    if (budget_ > 0 && used_ > budget_ - max_made_) {  // storages that died may be what puts it over
      if (!swept && exposed_ > 0) sweep();  // without exposed storages the drain found them all
      swept = true;
      decide = decide || used_ > budget_ - max_made_;
    }
    // `used` may still count exposed storages that died since the last sweep: a new peak is swept
    // first, so the peak is exact (invariant 9: without exposed storages `used` is exact already);
    // without `exact_peak_` the peak is an upper bound that counts them until the next sweep
    if (exact_peak_ && used_ > peak_ && !swept && exposed_ > 0) sweep();
    if (used_ > peak_) {
      peak_ = used_;
      peak_position_ = j;
    }
    if (used_ + away_ > live_peak_) {
      live_peak_ = used_ + away_;
      live_peak_position_ = j;
    }
    if (decide) {
      last_decide_ = position_;
      ++decisions_;
      call(on_decide_, [&] { return py::make_tuple(j); });
    }
  }

  // The operator's touches, told to the recency order where the Python parse tells them (its
  // allocations, then what it read and wrote: inputs in argument order, then outputs that are not
  // inputs), and what the compact parse needs of it instead of its log record (recency.h).
  // The operator's input and output lists move into last_ins_ and last_outs_ (its Ctx, cleared
  // before its next use, keeps their old buffers).
  void told_live(const OpInfo& inf, int64_t j, int64_t phase, Ctx& ctx) {
    for (int64_t sid : ctx.allocs) {
      Entry** e = by_sid_.find(static_cast<uint64_t>(sid));
      recency_->alloc(sid, e == nullptr ? 0 : (*e)->nbytes);
    }
    for (int64_t sid : ctx.ins) recency_->access(sid);
    for (int64_t sid : ctx.outs) {
      bool in = false;
      for (int64_t x : ctx.ins) in = in || x == sid;
      if (!in) recency_->access(sid);
    }
    last_name_ = inf.id;
    last_phase_ = phase;
    // after the kernel, as the Python parse reads the record's writes: a fault before it may still
    // need the host copy of an input the operator writes
    stale_.insert(stale_.end(), ctx.stale.begin(), ctx.stale.end());
    timeline_.insert(timeline_.end(), {j, used_, phase});
    if (inf.collective) {
      held_.push_back(static_cast<int64_t>(ctx.ins.size() + ctx.outs.size()));
      held_.insert(held_.end(), ctx.ins.begin(), ctx.ins.end());
      held_.insert(held_.end(), ctx.outs.begin(), ctx.outs.end());
    }
    last_ins_.swap(ctx.ins);
    last_outs_.swap(ctx.outs);
  }

  // The fault handler left an input away (it raised: a budget it could not meet, a failed copy):
  // the kernel would read a block that is not there, so the operator fails instead, naming the
  // handler's error, which stays kept for the next Python-side check (invariant 3).
  [[noreturn]] C10_NOINLINE void refuse_kernel(const char* name, const Entry& e) {
    std::string why = "the fault handler did not bring it back";
    if (error_) {
      py::gil_scoped_acquire gil;
      why = error_->what();
    }
    TORCH_CHECK(false, "dynn-runtime: operator ", name, " did not run: it reads storage ", e.sid,
                ", which is off the device, and the manager could not bring it back (", why,
                "). Its data is safe on the host and comes back at its next use once the cause is fixed.");
  }

  static void touch(Entry& e, int64_t j, int64_t stream) {
    e.last_access = j;
    e.stream = stream;
    ++e.count;
  }

  // The managed device's current stream on this thread (0 where the device type has no streams
  // registered: the CPU build's CUDA).
  int64_t current_stream() const {
    if (device_type_ == c10::DeviceType::CPU || !c10::impl::hasDeviceGuardImpl(device_type_)) return 0;
    const auto* guard = c10::impl::getDeviceGuardImpl(device_type_);
    return guard->getStream(c10::Device(device_type_, static_cast<c10::DeviceIndex>(device_index_))).id();
  }

  c10::DeviceType device_type_;
  int64_t device_index_;
  bool started_ = false;
  bool was_included_ = false;  // the key's included state on the starting thread before start()
  py::object on_fault_ = py::none();
  py::dict saved_st_;  // set_saved
  py::set saved_pending_;
  py::tuple saved_types_;
  py::object saved_fallback_ = py::none();
  py::dict grad_st_;  // set_grad_labels
  py::set grad_pending_;
  py::tuple grad_settled_;
  py::object grad_fallback_ = py::none();
  py::object on_decide_ = py::none();
  py::object on_oom_ = py::none();
  std::unique_ptr<py::error_already_set> error_;

  Pool<Entry> entries_;
  FlatMap<Entry*> table_;   // by StorageImpl address
  FlatMap<Entry*> by_sid_;  // by sid (>= 1)
  std::vector<Entry*> dead_;  // sweep()'s buffer
  std::vector<int64_t> known_freed_;  // sids track() registered that died since the last take_log()
  int64_t batch_first_sid_ = 1;       // next_sid_ at the last take_log()
  std::vector<int64_t> born_at_;      // compact_log()'s buffers
  std::vector<char> known_dead_;
  std::vector<c10::StorageImpl*> released_;  // drain()'s buffer
  std::vector<std::unique_ptr<Ctx>> ctxs_;  // by nesting depth
  size_t depth_ = 0;
  std::unordered_map<const void*, OpInfo> ops_;  // by the operator's schema (its address is stable)
  std::vector<OpInfo*> by_slot_;                  // ops_'s entries of the unboxed operators, by slot
  std::vector<std::string> names_;
  size_t names_sent_ = 0;
  Words log_;
  std::unique_ptr<Recency> recency_;  // the lru policy's order, where it is kept here
  bool recency_live_ = false;
  bool op_records_while_live_ = false;  // kOp records in a live step's log too (a test's reference reads them)
  std::vector<int64_t> timeline_;     // set_recency_live's records (take_recency)
  std::vector<int64_t> stale_;
  std::vector<int64_t> held_;
  std::vector<int64_t> last_ins_;
  std::vector<int64_t> last_outs_;
  int64_t last_name_ = -1;
  int64_t last_phase_ = 0;

  int64_t next_sid_ = 1;
  int64_t used_ = 0;
  int64_t peak_ = 0;
  int64_t peak_position_ = 0;
  int64_t away_ = 0;  // invariant 8
  int64_t exposed_ = 0;  // invariant 9
  int64_t sweeps_ = 0;   // walks of the table (sweep()), since the observer was made
  bool exact_peak_ = true;  // a new peak sweeps first where storages are exposed (finish())
  bool hear_;               // hear of frees where start() can (invariant 9): on CUDA by default
  bool hearing_ = false;    // start() found that it can: frees are reported (heard.h)
  int heard_device_ = heard::kNobody;
  c10::DeleterFnPtr hear_deleter_ = nullptr;  // the caching allocator's deleter (the probe's)
  FlatMap<Entry*> by_data_;  // heard entries by their data's address
  std::vector<Entry*> shadowed_;  // heard dead entries whose address a newer entry holds in by_data_
  std::vector<uint64_t> freed_;  // drain_heard()'s buffer
  // whether storages registered from now on are covered (invariant 9): on the CPU by default; off,
  // the CPU observer keeps the books as it does on CUDA (every storage exposed, deaths swept for)
  bool cover_;
  int64_t live_peak_ = 0;
  int64_t live_peak_position_ = 0;
  int64_t max_made_ = 0;  // the most bytes one operator has allocated so far
  int64_t budget_ = 0;
  int64_t decide_every_ = 0;
  int64_t sweep_every_ = 0;
  int64_t position_ = 0;
  int64_t last_decide_ = 0;
  int64_t last_node_ = -1;
  int64_t phase_override_ = -1;
  int64_t module_ = 0;
  bool in_step_ = false;
  bool seen_backward_ = false;
  int64_t faults_ = 0;
  int64_t decisions_ = 0;
  int64_t observed_ = 0;

 public:
  void set_seen_backward(bool v) { seen_backward_ = v; }
};

void dispatch_cb(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  Observer* self = g_active.load(std::memory_order_relaxed);
  if (self == nullptr) {  // the key is still included on a thread whose observer was stopped elsewhere
    c10::impl::ExcludeDispatchKeyGuard off(kKey);
    op.redispatchBoxed(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey), stack);
    return;
  }
  self->dispatch(op, ks, stack);
}

// An operator's unboxed kernel at the key: the observer's work on its typed arguments
// (Observer::dispatch_unboxed), for the operators the zoo, the README's example and the optimizers
// call most; the boxed fallback serves every other operator. The kernel receives the dispatch key
// set first, as redispatching kernels do.
template <class Op, class Sig = typename Op::schema>
struct Unboxed;
template <class Op, class Ret, class... Args>
struct Unboxed<Op, Ret(Args...)> {
  static Ret call(c10::DispatchKeySet ks, Args... args) {
    const c10::DispatchKeySet below = ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey);
    Observer* self = g_active.load(std::memory_order_relaxed);
    if (self == nullptr) {  // as in dispatch_cb: the key is still included where no observer runs
      c10::impl::ExcludeDispatchKeyGuard off(kKey);
      return Op::redispatch(below, args...);
    }
    static const c10::OperatorHandle handle =
        c10::Dispatcher::singleton().findSchemaOrThrow(Op::name, Op::overload_name);
    static const size_t slot = g_slots.fetch_add(1);  // this operator's index into each observer's OpInfo
    return self->template dispatch_unboxed<Op, Ret, Args...>(handle, slot, below, args...);
  }
};

template <class Op>
void register_one(torch::Library& lib) {
  auto op = c10::Dispatcher::singleton().findSchema({Op::name, Op::overload_name});
  if (!op.has_value() || skipped(*op) || op->hasKernelForDispatchKey(kKey)) return;
  std::string full = Op::name;
  if (Op::overload_name[0] != '\0') full += std::string(".") + Op::overload_name;
  lib.impl(full.c_str(), torch::CppFunction::makeFromUnboxedFunction(TORCH_FN(Unboxed<Op>::call)));
}

void register_unboxed(torch::Library& lib) {
  // the optimizers' element-wise updates (single-tensor Adam, SGD, ...)
  register_one<at::_ops::add__Tensor>(lib);
  register_one<at::_ops::mul__Tensor>(lib);
  register_one<at::_ops::lerp__Scalar>(lib);
  register_one<at::_ops::addcmul_>(lib);
  register_one<at::_ops::addcdiv_>(lib);
  register_one<at::_ops::sqrt>(lib);
  register_one<at::_ops::div_Tensor>(lib);
  register_one<at::_ops::div_Scalar>(lib);
  register_one<at::_ops::_local_scalar_dense>(lib);
  // forward and backward
  register_one<at::_ops::add_Tensor>(lib);
  register_one<at::_ops::sub_Tensor>(lib);
  register_one<at::_ops::mul_Tensor>(lib);
  register_one<at::_ops::t>(lib);
  register_one<at::_ops::mm>(lib);
  register_one<at::_ops::addmm>(lib);
  register_one<at::_ops::bmm>(lib);
  register_one<at::_ops::view>(lib);
  register_one<at::_ops::_unsafe_view>(lib);
  register_one<at::_ops::_reshape_alias>(lib);
  register_one<at::_ops::expand>(lib);
  register_one<at::_ops::transpose_int>(lib);
  register_one<at::_ops::permute>(lib);
  register_one<at::_ops::select_int>(lib);
  register_one<at::_ops::slice_Tensor>(lib);
  register_one<at::_ops::squeeze_dim>(lib);
  register_one<at::_ops::unsqueeze>(lib);
  register_one<at::_ops::index_select>(lib);
  register_one<at::_ops::index_add_>(lib);
  register_one<at::_ops::index_add>(lib);
  register_one<at::_ops::new_zeros>(lib);
  register_one<at::_ops::sum_dim_IntList>(lib);
  register_one<at::_ops::mean_dim>(lib);
  register_one<at::_ops::relu>(lib);
  register_one<at::_ops::threshold_backward>(lib);
  register_one<at::_ops::sigmoid>(lib);
  register_one<at::_ops::sigmoid_backward>(lib);
  register_one<at::_ops::tanh>(lib);
  register_one<at::_ops::tanh_backward>(lib);
  register_one<at::_ops::gelu>(lib);
  register_one<at::_ops::gelu_backward>(lib);
  register_one<at::_ops::_softmax>(lib);
  register_one<at::_ops::_softmax_backward_data>(lib);
  register_one<at::_ops::native_layer_norm>(lib);
  register_one<at::_ops::native_layer_norm_backward>(lib);
  register_one<at::_ops::clone>(lib);
  register_one<at::_ops::copy_>(lib);
  register_one<at::_ops::cat>(lib);
  register_one<at::_ops::stack>(lib);
  register_one<at::_ops::split_Tensor>(lib);
  register_one<at::_ops::unbind_int>(lib);
  register_one<at::_ops::clamp_min>(lib);
  register_one<at::_ops::linalg_vector_norm>(lib);
  register_one<at::_ops::masked_fill_Scalar>(lib);
  register_one<at::_ops::eq_Scalar>(lib);
  register_one<at::_ops::ones_like>(lib);
  register_one<at::_ops::empty_memory_format>(lib);
  register_one<at::_ops::mse_loss>(lib);
  register_one<at::_ops::mse_loss_backward>(lib);
  register_one<at::_ops::_log_softmax>(lib);
  register_one<at::_ops::_log_softmax_backward_data>(lib);
  register_one<at::_ops::nll_loss_forward>(lib);
  register_one<at::_ops::nll_loss_backward>(lib);
  // indexing and routing (mixtures of experts, variable lengths), embeddings, convolutions
  register_one<at::_ops::index_Tensor>(lib);
  register_one<at::_ops::index_put_>(lib);
  register_one<at::_ops::_index_put_impl_>(lib);
  register_one<at::_ops::index_copy>(lib);
  register_one<at::_ops::nonzero>(lib);
  register_one<at::_ops::gt_Scalar>(lib);
  register_one<at::_ops::slice_backward>(lib);
  register_one<at::_ops::detach_>(lib);
  register_one<at::_ops::embedding>(lib);
  register_one<at::_ops::embedding_dense_backward>(lib);
  register_one<at::_ops::convolution>(lib);
  register_one<at::_ops::convolution_backward>(lib);
  register_one<at::_ops::native_batch_norm>(lib);
  register_one<at::_ops::native_batch_norm_backward>(lib);
  register_one<at::_ops::mean>(lib);
  register_one<at::_ops::sum>(lib);
  register_one<at::_ops::neg>(lib);
  register_one<at::_ops::zeros_like>(lib);
  register_one<at::_ops::zeros>(lib);
  register_one<at::_ops::arange>(lib);
  register_one<at::_ops::_to_copy>(lib);
  // the zoo's own data (random draws inside a step)
  register_one<at::_ops::linspace>(lib);
  register_one<at::_ops::rand_generator>(lib);
  register_one<at::_ops::randn_generator>(lib);
  register_one<at::_ops::randint_low_generator>(lib);
  register_one<at::_ops::multinomial>(lib);
}

// ---- test-only operators ------------------------------------------------------------------------
// There is no out-of-memory error on the CPU, so the tests inject one: arm_test_oom(n) makes the
// next n calls of dynn_test::oom, dynn_test::oom_unboxed and dynn_test::oom_ (in place) throw
// c10::OutOfMemoryError, as the caching allocator does, before they compute. oom reaches the
// observer's boxed fallback, oom_unboxed an unboxed kernel of its own at the key (Unboxed<>, as the
// aten operators of register_unboxed). oom_random and oom_random_unboxed draw from their generator
// (the default one where none is given) first and then run out: the worst case for a retry, whose
// numbers are the first attempt's only where the generator's state is restored (invariant 11). The operators are registered by the first arm_test_oom()
// call, so a process that never arms one has no such operator.
std::atomic<int64_t> g_test_ooms{0};

void test_oom_check(const char* name, const at::Tensor& x) {
  if (!x.is_meta() && g_test_ooms.load() > 0) {  // a meta run (the Python source's size estimate) computes nothing
    --g_test_ooms;
    TORCH_CHECK_WITH(OutOfMemoryError, false, "dynn_test::", name,
                     ": out of memory (injected by arm_test_oom). Tried to allocate 1.00 MiB.");
  }
}

// Every argument changes the result: a retry that lost one (moved out of the stack) computes another.
at::Tensor test_oom(const at::Tensor& x, const std::optional<at::Tensor>& y, at::IntArrayRef dims) {
  test_oom_check("oom", x);
  at::Tensor r = y.has_value() ? x + *y : x * 2;
  return dims.empty() ? r : r.sum(dims);
}

at::Tensor& test_oom_(at::Tensor& x) {
  test_oom_check("oom_", x);
  return x.mul_(2);
}

at::Tensor test_oom_random(const at::Tensor& x, double p, std::optional<at::Generator> generator) {
  at::Tensor keep = at::empty_like(x).bernoulli_(1.0 - p, generator);
  test_oom_check("oom_random", x);
  return x * keep / (1.0 - p);
}

// dynn_test::oom_random_unboxed, as TestOomUnboxed below
struct TestOomRandomUnboxed {
  using schema = at::Tensor(const at::Tensor&, double, std::optional<at::Generator>);
  static constexpr const char* name = "dynn_test::oom_random_unboxed";
  static constexpr const char* overload_name = "";
  static at::Tensor redispatch(c10::DispatchKeySet ks, const at::Tensor& x, double p,
                               std::optional<at::Generator> generator) {
    static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, overload_name).typed<schema>();
    return op.redispatch(ks, x, p, std::move(generator));
  }
};

// dynn_test::oom_unboxed as the at::_ops structs describe an operator (what Unboxed<> reads).
struct TestOomUnboxed {
  using schema = at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&, at::IntArrayRef);
  static constexpr const char* name = "dynn_test::oom_unboxed";
  static constexpr const char* overload_name = "";
  static at::Tensor redispatch(c10::DispatchKeySet ks, const at::Tensor& x, const std::optional<at::Tensor>& y,
                               at::IntArrayRef dims) {
    static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, overload_name).typed<schema>();
    return op.redispatch(ks, x, y, dims);
  }
};

void arm_test_oom(int64_t n) {
  static torch::Library* lib = [] {
    auto* l = new torch::Library(torch::Library::DEF, "dynn_test", std::nullopt, __FILE__, __LINE__);
    l->def("oom(Tensor x, Tensor? y=None, int[] dims=[]) -> Tensor");
    l->def("oom_(Tensor(a!) x) -> Tensor(a!)");
    l->def("oom_unboxed(Tensor x, Tensor? y=None, int[] dims=[]) -> Tensor");
    l->def("oom_random(Tensor x, float p, *, Generator? generator=None) -> Tensor");
    l->def("oom_random_unboxed(Tensor x, float p, *, Generator? generator=None) -> Tensor");
    l->impl("oom", torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(test_oom)));
    l->impl("oom_", torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(test_oom_)));
    l->impl("oom_unboxed", torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(test_oom)));
    l->impl("oom_random", torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(test_oom_random)));
    l->impl("oom_random_unboxed",
            torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(test_oom_random)));
    return l;
  }();
  static torch::Library* at_key = [] {
    auto* l = new torch::Library(torch::Library::IMPL, "dynn_test", kKey, __FILE__, __LINE__);
    register_one<TestOomUnboxed>(*l);
    register_one<TestOomRandomUnboxed>(*l);
    return l;
  }();
  (void)lib;
  (void)at_key;
  g_test_ooms = n;
}

// A uint8 tensor over the whole of `storage` (an UntypedStorage), what the manager's copies read and
// write: the tensor `torch.empty(0, dtype=torch.uint8, device=d).set_(st, 0, (n,), (1,))` makes, built
// without those operators (bytes.h; runtime/storages.py's _u8 is the reference).
at::Tensor byte_view(py::handle storage) { return bytes_of(torch::createStorage(storage.ptr())); }

// The bytes of the tensors in the list or tuple `seq`, numel times element size each and 0 for an
// item that is not a tensor: runtime/lists.py's Python sum, read in C++ (the list operators' wrapper
// asks for every list of every call). -1 where an item is a tensor subclass, whose Python numel()
// may say otherwise: the caller then sums in Python.
int64_t list_nbytes(py::handle seq) {
  PyObject* fast = PySequence_Fast(seq.ptr(), "list_nbytes takes a list or a tuple");
  if (fast == nullptr) throw py::error_already_set();
  py::object keep = py::reinterpret_steal<py::object>(fast);
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  int64_t total = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* o = items[i];
    if (THPVariable_CheckExact(o)) {
      const at::Tensor& t = THPVariable_Unpack(o);
      total += static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size());
    } else if (THPVariable_Check(o)) {
      return -1;
    }
  }
  return total;
}

}  // namespace

void define_collector(py::module_& m);     // collector.cpp
void define_modules(py::module_& m);       // modules.cpp
void define_copies(py::module_& m);       // copies.cpp
bool add_operator_parse(PyObject* module);  // operators.cpp

}  // namespace dynn

PYBIND11_MODULE(_C, m) {
  m.doc() = "dynn-runtime's native event source (see dynn_runtime/runtime/events.py)";
  m.attr("ABI") = 27;
  if (!dynn::add_operator_parse(m.ptr())) throw py::error_already_set();
  m.attr("LOG_OP") = dynn::kOp;
  m.attr("LOG_ALLOC") = dynn::kAlloc;
  m.attr("LOG_FREE") = dynn::kFree;
  m.attr("HEAR_CUDA") = dynn::heard::built();
  m.attr("RAW_CUDA_COPIES") = dynn::cuda_copy::built();
  m.def("list_nbytes", &dynn::list_nbytes, py::arg("seq"),
        "the bytes of a list's tensors (0 for an item that is not one; -1: a tensor subclass among them)");
  m.def("byte_view", &dynn::byte_view, py::arg("storage"),
        "a uint8 tensor over the whole of an UntypedStorage (runtime/storages.py's _u8, natively)");
  m.def(
      "report_free", [](int device, uint64_t addr) { dynn::heard::report(device, addr); }, py::arg("device"),
      py::arg("addr"), "tests: the allocator freed the block at addr on device (-1: the CPU), as heard.h hears it");
  m.def("problem", &dynn::key_problem, "why the native event source cannot start in this process, or ''");
  m.def("arm_test_oom", &dynn::arm_test_oom, py::arg("n"),
        "tests: the next n calls of dynn_test::oom and dynn_test::oom_ throw c10::OutOfMemoryError");
  m.def(
      "key_state",
      [] {
        return py::make_tuple(c10::impl::tls_is_dispatch_key_included(dynn::kKey),
                              c10::impl::tls_is_dispatch_key_excluded(dynn::kKey));
      },
      "(included, excluded): the observer's dispatch key in this thread's local key sets");
  using dynn::Observer;
  py::class_<Observer>(m, "Observer")
      .def(py::init<const std::string&, int64_t>(), py::arg("device_type"), py::arg("device_index") = -1)
      .def("start", &Observer::start, py::arg("on_fault"), py::arg("on_decide"), py::arg("on_oom") = py::none())
      .def("stop", &Observer::stop)
      .def("set_budget", &Observer::set_budget)
      .def("set_decide_every", &Observer::set_decide_every)
      .def("set_sweep_every", &Observer::set_sweep_every)
      .def("suspend", &Observer::suspend)
      .def("resume", &Observer::resume)
      .def("set_phase", &Observer::set_phase)
      .def("set_in_step", &Observer::set_in_step)
      .def("set_seen_backward", &Observer::set_seen_backward)
      .def("track", &Observer::track)
      .def("sid_of", &Observer::sid_of)
      .def("set_saved", &Observer::set_saved, py::arg("st"), py::arg("pending"), py::arg("types"),
           py::arg("fallback"))
      .def("pack_saved", &Observer::pack_saved)
      .def("set_grad_labels", &Observer::set_grad_labels, py::arg("st"), py::arg("pending"), py::arg("settled"),
           py::arg("fallback"))
      .def("grad_ready", &Observer::grad_ready)
      .def("grads_to_label", &Observer::grads_to_label, py::arg("params"), py::arg("st"), py::arg("pending"),
           py::arg("settled"))
      .def("state_to_label", &Observer::state_to_label, py::arg("state"), py::arg("st"), py::arg("types"),
           py::arg("settled"))
      .def("storage", &Observer::storage)
      .def("set_away", &Observer::set_away)
      .def("set_host_valid", &Observer::set_host_valid)
      .def("set_evicted", &Observer::set_evicted)
      .def("set_watch", &Observer::set_watch)
      .def("set_module", &Observer::set_module)
      .def("host_valid", &Observer::host_valid)
      .def("away", &Observer::away)
      .def("nbytes", &Observer::nbytes)
      .def("last_access", &Observer::last_access)
      .def("last_stream", &Observer::last_stream)
      .def("access_count", &Observer::access_count)
      .def("alive", &Observer::alive)
      .def("sweep", &Observer::sweep)
      .def("take_log", &Observer::take_log, py::arg("compact") = false)
      .def("log_pending", &Observer::log_pending)
      .def("held_pending", &Observer::held_pending)
      .def("last_op", &Observer::last_op)
      .def("take_error", &Observer::take_error)
      .def("set_recency", &Observer::set_recency, py::arg("fraction"))
      .def("set_recency_live", &Observer::set_recency_live)
      .def_property_readonly("recency_live", &Observer::recency_live)
      .def_property("op_records_while_live", &Observer::op_records_while_live, &Observer::set_op_records_while_live)
      .def("recency_alloc", &Observer::recency_alloc)
      .def("recency_access", &Observer::recency_access)
      .def("recency_free", &Observer::recency_free)
      .def("recency_touches", &Observer::recency_touches)
      .def("recency_announce", &Observer::recency_announce)
      .def("recency_after", &Observer::recency_after, py::arg("tier"), py::arg("sid"), py::arg("stamp"),
           py::arg("max"), py::arg("min_bytes") = 0)
      .def("recency_order", &Observer::recency_order, py::arg("tier") = -1)
      .def("recency_footprint", &Observer::recency_footprint)
      .def("take_recency", &Observer::take_recency, py::arg("timeline") = true)
      .def_property_readonly("used", &Observer::used)
      .def_property_readonly("peak", &Observer::peak)
      .def_property_readonly("peak_position", &Observer::peak_position)
      .def_property("max_made", &Observer::max_made, &Observer::set_max_made)
      .def("reset_peak", &Observer::reset_peak)
      .def_property_readonly("position", &Observer::position)
      .def_property_readonly("tracked", &Observer::tracked)
      .def_property_readonly("exposed", &Observer::exposed_count)
      .def("exposed_entries", &Observer::exposed_entries,
           "(sid, why) of each entry whose death only a sweep finds (invariant 9)")
      .def_property_readonly("sweeps", &Observer::sweeps)
      .def_property("exact_peak", &Observer::exact_peak, &Observer::set_exact_peak)
      .def_property("hear", &Observer::hear, &Observer::set_hear)
      .def_property_readonly("hearing", &Observer::hearing)
      .def_property_readonly("heard", &Observer::heard_count)
      .def_property("cover", &Observer::cover, &Observer::set_cover)
      .def_property_readonly("faults", &Observer::faults)
      .def_property_readonly("decisions", &Observer::decisions)
      .def_property_readonly("observed", &Observer::observed)
      .def_property_readonly("away", &Observer::away_bytes)
      .def_property_readonly("live_peak", &Observer::live_peak)
      .def_property_readonly("live_peak_position", &Observer::live_peak_position);
  dynn::define_collector(m);
  dynn::define_modules(m);
  dynn::define_copies(m);
}

#pragma once
// DyNN-Offload: the reclaim protocol core of the patched CUDA caching allocator.
//
// This header is deliberately free of any PyTorch include so that dynn-runtime
// compiles and unit-tests it on machines without a PyTorch source tree
// (tests/native/cpp/reclaim_core_test.cpp). The allocator-facing glue lives in
// c10/cuda/DynnHooks.{h,cpp}; the contract is written down in
// patches/README.md ("Reclaim hook").
//
// Protocol, as numbered rules (the allocator call site relies on each):
//  1. The hook is called only when an allocation cannot be satisfied after
//     the allocator's own recovery (cached-block release), before the OOM
//     error is raised, and never during CUDA graph capture.
//  2. The hook is called WITHOUT the allocator mutex held: reclaim_and_retry
//     unlocks the caller's lock around the call and relocks it afterwards,
//     also when the hook throws. The caller must hold the lock exactly once
//     (the allocator's public methods never nest, so that holds upstream).
//  3. Because of 2, the hook may free memory through the allocator (offload a
//     tensor, drop a cache): those frees take the mutex normally. Frees of
//     the requesting device made on the calling thread while the hook runs
//     are accounted (note_free) as "observed" bytes.
//  4. The hook is not re-entered on a thread: an allocation that fails from
//     inside the hook (e.g. a staging buffer) does not call the hook again;
//     it fails as it would without the patch ("nested skip").
//  5. A hook returns the bytes it freed. The allocation is retried when the
//     hook reported or was observed to free anything; at most max_attempts
//     hook calls are made per failed allocation, then OOM is raised.
//  6. A hook that throws is treated as having freed nothing: the exception is
//     recorded (last_error) and not propagated through the allocator, which
//     then raises its normal OOM.
//  7. GIL: a Python hook's trampoline acquires the GIL itself. That cannot
//     deadlock with the allocator because rule 2 guarantees the allocator
//     mutex is never held while a thread waits for the GIL; a thread that
//     holds the GIL and allocates only ever waits for the allocator mutex,
//     which the reclaiming thread has released.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

namespace dynn_native {

// Bumped when the contract above changes incompatibly; reported by the
// feature probe (torch._C._dynn_features()["protocol"]).
constexpr int kReclaimProtocolVersion = 1;

struct ReclaimRequest {
  int device = 0; // CUDA device index of the failed allocation
  std::size_t bytes = 0; // rounded size the allocator could not satisfy
  void* stream = nullptr; // cudaStream_t of the allocation (opaque here)
  int attempt = 0; // 1-based hook call number for this allocation
};

struct ReclaimResult {
  std::size_t reported = 0; // what the hook returned
  std::size_t observed = 0; // what note_free saw on this thread meanwhile
  bool raised = false; // the hook threw (rule 6)
  std::size_t effective() const {
    return reported > observed ? reported : observed;
  }
};

// The hook: returns the number of bytes it freed (rule 5).
using ReclaimHook = std::function<std::size_t(const ReclaimRequest&)>;

struct ReclaimStats {
  std::uint64_t calls = 0; // hook invocations
  std::uint64_t recovered = 0; // allocations that succeeded after a retry
  std::uint64_t exhausted = 0; // allocations that still failed (-> OOM)
  std::uint64_t nested_skipped = 0; // rule 4
  std::uint64_t errors = 0; // rule 6
  std::uint64_t bytes_reported = 0;
  std::uint64_t bytes_observed = 0;
};

namespace detail {
// Per-thread reclaim state. One instance per shared object: every caller of
// the core must live in the same library (c10_cuda); other libraries go
// through the exported functions of DynnHooks.h.
struct ThreadState {
  int depth = 0; // >0 while this thread runs a reclaim hook
  int device = -1; // device of the request being reclaimed
  std::size_t observed = 0; // bytes freed on this thread during the hook
};
inline ThreadState& thread_state() {
  static thread_local ThreadState state;
  return state;
}
} // namespace detail

// RAII: marks this thread as "inside the reclaim hook" (rules 3 and 4).
class ReclaimScope {
 public:
  explicit ReclaimScope(int device) : saved_(detail::thread_state()) {
    auto& s = detail::thread_state();
    s.depth += 1;
    s.device = device;
    s.observed = 0;
  }
  ~ReclaimScope() {
    detail::thread_state() = saved_;
  }
  ReclaimScope(const ReclaimScope&) = delete;
  ReclaimScope& operator=(const ReclaimScope&) = delete;

  static bool active() {
    return detail::thread_state().depth > 0;
  }
  static std::size_t observed() {
    return detail::thread_state().observed;
  }

 private:
  detail::ThreadState saved_;
};

// Releases a held lock for its lifetime and re-acquires it on every exit
// path (rule 2). Lock is std::unique_lock-like: owns_lock/unlock/lock.
template <class Lock>
class UnlockGuard {
 public:
  explicit UnlockGuard(Lock& lock) : lock_(lock), was_locked_(lock.owns_lock()) {
    if (was_locked_) {
      lock_.unlock();
    }
  }
  ~UnlockGuard() {
    if (was_locked_) {
      lock_.lock();
    }
  }
  UnlockGuard(const UnlockGuard&) = delete;
  UnlockGuard& operator=(const UnlockGuard&) = delete;

 private:
  Lock& lock_;
  bool was_locked_;
};

class ReclaimRegistry {
 public:
  // Installs `hook`, replacing any previous one; returns a token for
  // clear_hook. The previous hook may still be running on another thread:
  // callers hold their own shared_ptr copy, so replacing is safe.
  std::uint64_t set_hook(ReclaimHook hook) {
    std::lock_guard<std::mutex> g(mu_);
    hook_ = std::make_shared<const ReclaimHook>(std::move(hook));
    token_ = ++next_token_;
    has_hook_.store(true, std::memory_order_release);
    return token_;
  }

  // Removes the hook if `token` is current (0: whatever is installed).
  bool clear_hook(std::uint64_t token = 0) {
    std::lock_guard<std::mutex> g(mu_);
    if (!hook_ || (token != 0 && token != token_)) {
      return false;
    }
    hook_.reset();
    has_hook_.store(false, std::memory_order_release);
    return true;
  }

  bool has_hook() const {
    return has_hook_.load(std::memory_order_acquire);
  }

  void set_max_attempts(int n) {
    max_attempts_.store(n < 1 ? 1 : n, std::memory_order_relaxed);
  }
  int max_attempts() const {
    return max_attempts_.load(std::memory_order_relaxed);
  }

  // Called by the allocator's free path (outside its mutex) for every free.
  // Cheap when no reclaim is running on this thread.
  void note_free(int device, std::size_t bytes) {
    auto& s = detail::thread_state();
    if (s.depth > 0 && s.device == device) {
      s.observed += bytes;
    }
  }

  // Runs the hook once under a ReclaimScope; never throws (rule 6).
  ReclaimResult call(const ReclaimRequest& req) {
    std::shared_ptr<const ReclaimHook> hook;
    {
      std::lock_guard<std::mutex> g(mu_);
      hook = hook_;
      stats_.calls += hook ? 1 : 0;
    }
    ReclaimResult r;
    if (!hook) {
      return r;
    }
    ReclaimScope scope(req.device);
    try {
      r.reported = (*hook)(req);
    } catch (const std::exception& e) {
      r.raised = true;
      record_error(e.what());
    } catch (...) {
      r.raised = true;
      record_error("unknown exception");
    }
    r.observed = ReclaimScope::observed();
    std::lock_guard<std::mutex> g(mu_);
    stats_.bytes_reported += r.reported;
    stats_.bytes_observed += r.observed;
    return r;
  }

  ReclaimStats stats() const {
    std::lock_guard<std::mutex> g(mu_);
    return stats_;
  }
  std::string last_error() const {
    std::lock_guard<std::mutex> g(mu_);
    return last_error_;
  }
  void reset_stats() {
    std::lock_guard<std::mutex> g(mu_);
    stats_ = ReclaimStats{};
    last_error_.clear();
  }

  // Bookkeeping used by reclaim_and_retry.
  void count_nested_skip() {
    std::lock_guard<std::mutex> g(mu_);
    stats_.nested_skipped += 1;
  }
  void count_outcome(bool recovered) {
    std::lock_guard<std::mutex> g(mu_);
    (recovered ? stats_.recovered : stats_.exhausted) += 1;
  }

 private:
  void record_error(const char* what) {
    std::lock_guard<std::mutex> g(mu_);
    stats_.errors += 1;
    last_error_ = what ? what : "";
  }

  mutable std::mutex mu_; // guards hook_, token_, stats_, last_error_; leaf lock
  std::shared_ptr<const ReclaimHook> hook_;
  std::uint64_t token_ = 0;
  std::uint64_t next_token_ = 0;
  std::atomic<bool> has_hook_{false};
  std::atomic<int> max_attempts_{3};
  ReclaimStats stats_;
  std::string last_error_;
};

// The retry loop the allocator calls after its own recovery failed.
// `lock` is the allocator's held lock (released around the hook, rule 2);
// `try_alloc` re-runs the allocation with the lock held and returns true on
// success. Returns true when the allocation was satisfied.
template <class Lock, class TryAlloc>
bool reclaim_and_retry(
    ReclaimRegistry& registry,
    ReclaimRequest req,
    Lock& lock,
    TryAlloc&& try_alloc) {
  if (!registry.has_hook()) {
    return false;
  }
  if (ReclaimScope::active()) {
    registry.count_nested_skip(); // rule 4
    return false;
  }
  const int attempts = registry.max_attempts();
  for (int attempt = 1; attempt <= attempts; ++attempt) {
    req.attempt = attempt;
    ReclaimResult r;
    {
      UnlockGuard<Lock> unlocked(lock);
      r = registry.call(req);
    }
    if (r.raised || r.effective() == 0) {
      break; // nothing was freed: retrying cannot help (rule 5)
    }
    if (try_alloc()) {
      registry.count_outcome(true);
      return true;
    }
  }
  registry.count_outcome(false);
  return false;
}

} // namespace dynn_native

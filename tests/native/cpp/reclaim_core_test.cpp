// Exercises the torch-free protocol cores of the DyNN-Offload patch series
// (patches/new_files/c10/cuda/DynnReclaim.h and
// patches/new_files/torch/csrc/autograd/dynn_engine_core.h) against a
// simulated caching allocator. Run: reclaim_core_test CASE; exit 0 = pass.
// Built and driven by tests/native/test_native_core_cpp.py.

#include <c10/cuda/DynnReclaim.h>
#include <torch/csrc/autograd/dynn_engine_core.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using namespace dynn_native;

static int g_failures = 0;
#define CHECK(cond)                                                        \
  do {                                                                     \
    if (!(cond)) {                                                         \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, \
                   #cond);                                                 \
      ++g_failures;                                                        \
    }                                                                      \
  } while (0)

// A caching allocator reduced to what the protocol touches: one std::mutex
// (not recursive: re-locking it on the same thread would deadlock, so every
// re-entrant free below proves rule 2), a capacity, live blocks, and the same
// call-site shape as the patched DeviceCachingAllocator::malloc.
struct FakeAllocator {
  std::mutex mutex;
  std::size_t capacity;
  std::size_t used = 0;
  std::map<int, std::size_t> live;
  int next_id = 1;
  ReclaimRegistry& registry;
  int device = 0;

  FakeAllocator(ReclaimRegistry& r, std::size_t cap) : capacity(cap), registry(r) {}

  bool try_alloc_locked(std::size_t bytes, int* id) {
    if (used + bytes > capacity) return false;
    used += bytes;
    *id = next_id++;
    live[*id] = bytes;
    return true;
  }

  // Returns block id, or 0 on "OOM".
  int malloc(std::size_t bytes) {
    std::unique_lock<std::mutex> lock(mutex);
    int id = 0;
    bool found = try_alloc_locked(bytes, &id);
    if (!found) {
      ReclaimRequest req;
      req.device = device;
      req.bytes = bytes;
      found = reclaim_and_retry(registry, req, lock, [&] {
        // rule 2: the retry runs with the lock held again
        if (!lock.owns_lock()) throw std::logic_error("retry without lock");
        return try_alloc_locked(bytes, &id);
      });
    }
    if (!lock.owns_lock()) throw std::logic_error("lock lost");
    return found ? id : 0;
  }

  void free(int id) {
    std::size_t bytes = 0;
    {
      std::lock_guard<std::mutex> g(mutex);
      auto it = live.find(id);
      if (it == live.end()) return;
      bytes = it->second;
      used -= bytes;
      live.erase(it);
    }
    registry.note_free(device, bytes); // outside the mutex, like notify_free
  }

  bool mutex_is_free() {
    if (!mutex.try_lock()) return false;
    mutex.unlock();
    return true;
  }
};

static void case_no_hook_oom() {
  ReclaimRegistry reg;
  FakeAllocator a(reg, 100);
  CHECK(a.malloc(60) != 0);
  CHECK(a.malloc(60) == 0);
  CHECK(reg.stats().calls == 0);
}

static void case_reentrant_free_recovers() {
  ReclaimRegistry reg;
  FakeAllocator a(reg, 100);
  int victim = a.malloc(60);
  bool lock_free_in_hook = false;
  reg.set_hook([&](const ReclaimRequest& req) -> std::size_t {
    lock_free_in_hook = a.mutex_is_free(); // rule 2
    CHECK(req.bytes == 60);
    CHECK(req.attempt == 1);
    a.free(victim); // re-entrant free through the allocator (rule 3)
    return 60;
  });
  int id = a.malloc(60);
  CHECK(id != 0);
  CHECK(lock_free_in_hook);
  auto s = reg.stats();
  CHECK(s.calls == 1);
  CHECK(s.recovered == 1);
  CHECK(s.bytes_observed == 60);
  CHECK(s.bytes_reported == 60);
}

static void case_observed_bytes_count() {
  // The hook under-reports (returns 0) but frees through the allocator: the
  // observed bytes alone justify the retry.
  ReclaimRegistry reg;
  FakeAllocator a(reg, 100);
  int victim = a.malloc(80);
  reg.set_hook([&](const ReclaimRequest&) -> std::size_t {
    a.free(victim);
    return 0;
  });
  CHECK(a.malloc(50) != 0);
  CHECK(reg.stats().bytes_observed == 80);
  CHECK(reg.stats().recovered == 1);
}

static void case_other_device_frees_not_counted() {
  ReclaimRegistry reg;
  FakeAllocator a(reg, 100);
  a.malloc(80);
  reg.set_hook([&](const ReclaimRequest&) -> std::size_t {
    reg.note_free(/*device=*/1, 4096); // another device: not ours
    return 0;
  });
  CHECK(a.malloc(50) == 0);
  CHECK(reg.stats().bytes_observed == 0);
  CHECK(reg.stats().calls == 1); // nothing freed: no second attempt
}

static void case_bounded_retries() {
  ReclaimRegistry reg;
  reg.set_max_attempts(4);
  FakeAllocator a(reg, 100);
  std::vector<int> smalls;
  for (int i = 0; i < 10; ++i) smalls.push_back(a.malloc(10));
  int calls = 0;
  reg.set_hook([&](const ReclaimRequest& req) -> std::size_t {
    ++calls;
    CHECK(req.attempt == calls);
    if (!smalls.empty()) {
      a.free(smalls.back()); // frees 10 bytes: never enough for 50
      smalls.pop_back();
    }
    return 10;
  });
  CHECK(a.malloc(50) == 0);
  CHECK(calls == 4);
  CHECK(reg.stats().exhausted == 1);
  // and the same loop succeeds when enough accumulates within the bound
  reg.set_max_attempts(5);
  calls = 0;
  CHECK(a.malloc(50) != 0);
  CHECK(calls == 1); // 40 were already free + 10 more
}

static void case_hook_throws() {
  ReclaimRegistry reg;
  FakeAllocator a(reg, 100);
  a.malloc(90);
  reg.set_hook([&](const ReclaimRequest&) -> std::size_t {
    throw std::runtime_error("offload failed");
  });
  CHECK(a.malloc(50) == 0); // OOM, no exception escapes (rule 6)
  CHECK(a.mutex_is_free()); // and the lock was released by malloc's scope
  CHECK(reg.stats().errors == 1);
  CHECK(reg.last_error() == "offload failed");
  CHECK(reg.stats().calls == 1);
}

static void case_nested_oom_not_reentered() {
  ReclaimRegistry reg;
  FakeAllocator a(reg, 100);
  int victim = a.malloc(90);
  int depth_seen = 0;
  int nested_result = -1;
  reg.set_hook([&](const ReclaimRequest&) -> std::size_t {
    ++depth_seen;
    CHECK(ReclaimScope::active());
    nested_result = a.malloc(70); // fails inside the hook: rule 4
    a.free(victim);
    return 90;
  });
  CHECK(a.malloc(50) != 0);
  CHECK(depth_seen == 1);
  CHECK(nested_result == 0);
  CHECK(reg.stats().nested_skipped == 1);
  CHECK(!ReclaimScope::active());
}

static void case_gil_no_deadlock() {
  // `gil` stands in for the Python GIL. Thread P holds it and allocates and
  // frees in a loop (needs the allocator mutex); thread R hits OOM and its
  // hook takes the GIL. Were the allocator mutex held during the hook, R
  // would wait for the GIL while P waits for the mutex: deadlock.
  ReclaimRegistry reg;
  FakeAllocator a(reg, 1000);
  std::mutex gil;
  std::vector<int> victims;
  for (int i = 0; i < 9; ++i) victims.push_back(a.malloc(100));
  reg.set_hook([&](const ReclaimRequest&) -> std::size_t {
    std::lock_guard<std::mutex> g(gil);
    std::size_t freed = 0;
    for (int i = 0; i < 3 && !victims.empty(); ++i) {
      a.free(victims.back());
      victims.pop_back();
      freed += 100;
    }
    return freed;
  });
  std::atomic<bool> p_holds{false}, done{false};
  std::thread p([&] {
    std::lock_guard<std::mutex> g(gil);
    p_holds = true;
    for (int i = 0; i < 2000; ++i) {
      int id = a.malloc(1);
      if (id) a.free(id);
    }
  });
  while (!p_holds) std::this_thread::yield();
  std::thread r([&] {
    CHECK(a.malloc(300) != 0);
    done = true;
  });
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (!done) {
    std::fprintf(stderr, "deadlock: reclaim did not finish within 10 s\n");
    std::fflush(stderr);
    std::_Exit(3);
  }
  p.join();
  r.join();
}

static void case_concurrent_threads() {
  ReclaimRegistry reg;
  FakeAllocator a(reg, 4000);
  std::mutex victims_mu;
  std::vector<int> victims;
  for (int i = 0; i < 40; ++i) victims.push_back(a.malloc(100));
  reg.set_hook([&](const ReclaimRequest& req) -> std::size_t {
    std::size_t freed = 0;
    while (freed < req.bytes) {
      int v;
      {
        std::lock_guard<std::mutex> g(victims_mu);
        if (victims.empty()) break;
        v = victims.back();
        victims.pop_back();
      }
      a.free(v);
      freed += 100;
    }
    return freed;
  });
  std::atomic<int> ok{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t) {
    ts.emplace_back([&] {
      for (int i = 0; i < 5; ++i) {
        if (a.malloc(100)) ++ok;
      }
    });
  }
  for (auto& t : ts) t.join();
  CHECK(ok == 20);
  CHECK(a.used <= a.capacity);
}

static void case_clear_hook_token() {
  ReclaimRegistry reg;
  auto t1 = reg.set_hook([](const ReclaimRequest&) -> std::size_t { return 0; });
  auto t2 = reg.set_hook([](const ReclaimRequest&) -> std::size_t { return 0; });
  CHECK(t1 != t2);
  CHECK(!reg.clear_hook(t1)); // stale token: a newer hook is installed
  CHECK(reg.has_hook());
  CHECK(reg.clear_hook(t2));
  CHECK(!reg.has_hook());
  CHECK(!reg.clear_hook());
}

static void case_engine_lookahead_and_fetch() {
  EngineHookRegistry reg(/*ring_capacity=*/3);
  std::vector<std::uint64_t> fetched;
  std::vector<std::uint64_t> ahead;
  reg.note_ready(1, [] { return std::string("never evaluated"); }); // no hook yet
  CHECK(reg.pending() == 0);
  reg.set_fetch_hook([&](std::uint64_t seq, const std::string& name) {
    fetched.push_back(seq);
    CHECK(name == "MulBackward0");
  });
  reg.set_lookahead_hook([&](const std::vector<ReadyNode>& nodes) {
    for (auto& n : nodes) ahead.push_back(n.sequence_nr);
  });
  for (std::uint64_t s = 10; s < 15; ++s) {
    reg.note_ready(s, [] { return std::string("X"); });
  }
  CHECK(reg.pending() == 3); // capacity 3: 10 and 11 dropped
  reg.before_node(14, [] { return std::string("MulBackward0"); });
  CHECK(fetched.size() == 1 && fetched[0] == 14);
  CHECK(ahead.size() == 3 && ahead[0] == 12 && ahead[2] == 14);
  auto s = reg.stats();
  CHECK(s.dropped == 2);
  CHECK(s.fetch_calls == 1 && s.lookahead_calls == 1 && s.lookahead_nodes == 3);
  reg.before_node(13, [] { return std::string("MulBackward0"); });
  CHECK(reg.stats().lookahead_calls == 1); // empty ring: no look-ahead call
}

static void case_engine_reentrancy_and_errors() {
  EngineHookRegistry reg;
  int fetch_calls = 0;
  reg.set_fetch_hook([&](std::uint64_t seq, const std::string&) {
    ++fetch_calls;
    // a backward started from inside the hook reaches before_node again
    reg.before_node(seq + 1, [] { return std::string("inner"); });
    if (seq == 99) throw std::runtime_error("cannot fetch");
  });
  reg.set_lookahead_hook([&](const std::vector<ReadyNode>&) {
    throw std::runtime_error("advice only");
  });
  reg.note_ready(5, [] { return std::string("n"); });
  reg.before_node(1, [] { return std::string("outer"); });
  CHECK(fetch_calls == 1);
  CHECK(reg.stats().nested_skipped == 1);
  CHECK(reg.stats().lookahead_errors == 1); // swallowed (rule 4)
  bool threw = false;
  try {
    reg.before_node(99, [] { return std::string("x"); });
  } catch (const std::runtime_error& e) {
    threw = std::strcmp(e.what(), "cannot fetch") == 0;
  }
  CHECK(threw); // fetch errors propagate into the engine (rule 4)
  reg.before_node(2, [] { return std::string("after"); }); // depth restored
  CHECK(fetch_calls == 3);
  reg.clear();
  CHECK(!reg.active());
}

struct Case {
  const char* name;
  void (*fn)();
};
static const Case kCases[] = {
    {"no_hook_oom", case_no_hook_oom},
    {"reentrant_free_recovers", case_reentrant_free_recovers},
    {"observed_bytes_count", case_observed_bytes_count},
    {"other_device_frees_not_counted", case_other_device_frees_not_counted},
    {"bounded_retries", case_bounded_retries},
    {"hook_throws", case_hook_throws},
    {"nested_oom_not_reentered", case_nested_oom_not_reentered},
    {"gil_no_deadlock", case_gil_no_deadlock},
    {"concurrent_threads", case_concurrent_threads},
    {"clear_hook_token", case_clear_hook_token},
    {"engine_lookahead_and_fetch", case_engine_lookahead_and_fetch},
    {"engine_reentrancy_and_errors", case_engine_reentrancy_and_errors},
};

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "--list") == 0) {
    for (const auto& c : kCases) std::printf("%s\n", c.name);
    return 0;
  }
  int ran = 0;
  for (const auto& c : kCases) {
    if (argc > 1 && std::strcmp(argv[1], c.name) != 0) continue;
    c.fn();
    ++ran;
  }
  if (ran == 0) {
    std::fprintf(stderr, "unknown case\n");
    return 2;
  }
  return g_failures == 0 ? 0 : 1;
}

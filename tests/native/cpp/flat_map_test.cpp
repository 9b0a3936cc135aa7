// Checks dynn_runtime/csrc/flat_map.h against std::unordered_map under random inserts, lookups
// and erases, with the key patterns the observer uses (addresses 16 bytes apart, sequential ids)
// and with keys chosen to collide. Exit 0 = pass. Built and run by tests/native/test_flat_map_cpp.py.

#include "flat_map.h"

#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

static int g_failures = 0;
#define CHECK(cond)                                                                   \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      if (++g_failures > 20) return;                                                  \
    }                                                                                 \
  } while (0)

static void against_reference(const char* name, uint64_t (*make_key)(uint64_t, std::mt19937_64&)) {
  std::mt19937_64 rng(42);
  dynn::FlatMap<int64_t> map;
  std::unordered_map<uint64_t, int64_t> ref;
  std::vector<uint64_t> keys;
  uint64_t next = 1;
  for (int step = 0; step < 200000; ++step) {
    const int op = static_cast<int>(rng() % 10);
    if (op < 4 || keys.empty()) {  // insert a new key
      const uint64_t k = make_key(next++, rng);
      if (ref.count(k)) continue;
      const int64_t v = static_cast<int64_t>(rng());
      map.insert(k, v);
      ref[k] = v;
      keys.push_back(k);
    } else if (op < 8) {  // erase a present key (or, sometimes, an absent one)
      const size_t i = rng() % keys.size();
      const uint64_t k = keys[i];
      CHECK(map.erase(k));
      CHECK(!map.erase(k));
      ref.erase(k);
      keys[i] = keys.back();
      keys.pop_back();
    } else {  // look up a present key and an absent one
      const uint64_t k = keys[rng() % keys.size()];
      int64_t* v = map.find(k);
      CHECK(v != nullptr && *v == ref.at(k));
      const uint64_t other = make_key(next + 1000000, rng);
      CHECK((map.find(other) == nullptr) == (ref.count(other) == 0));
    }
    CHECK(map.size() == ref.size());
  }
  for (const auto& [k, v] : ref) {
    int64_t* got = map.find(k);
    CHECK(got != nullptr && *got == v);
  }
  size_t seen = 0;
  map.for_each([&](uint64_t k, int64_t v) {
    ++seen;
    auto it = ref.find(k);
    if (it == ref.end() || it->second != v) ++g_failures;
  });
  CHECK(seen == ref.size());
  std::fprintf(stderr, "%s: %zu keys left, %d failures\n", name, ref.size(), g_failures);
}

static void pool_reuses_released_objects() {
  struct Obj {
    explicit Obj(int* live) : live(live) { ++*live; }
    ~Obj() { --*live; }
    int* live;
  };
  int live = 0;
  dynn::Pool<Obj> pool;
  std::vector<Obj*> objs;
  for (int i = 0; i < 1000; ++i) objs.push_back(pool.make(&live));
  CHECK(live == 1000);
  Obj* first = objs[0];
  for (Obj* o : objs) pool.release(o);
  CHECK(live == 0);
  Obj* again = pool.make(&live);
  CHECK(live == 1);
  CHECK(again == first || again == objs.back());  // recycled, not newly allocated
  pool.release(again);
}

int main() {
  against_reference("addresses", [](uint64_t i, std::mt19937_64&) -> uint64_t { return 0x7f0000000000ull + 16 * i; });
  against_reference("ids", [](uint64_t i, std::mt19937_64&) -> uint64_t { return i; });
  against_reference("random", [](uint64_t, std::mt19937_64& r) -> uint64_t { return r() | 1; });
  // keys that differ only in their top bits land in few home slots: long probe runs to erase within
  against_reference("colliding", [](uint64_t i, std::mt19937_64&) -> uint64_t { return (i % 64 + 1) | (i / 64) << 58; });
  pool_reuses_released_objects();
  return g_failures == 0 ? 0 : 1;
}

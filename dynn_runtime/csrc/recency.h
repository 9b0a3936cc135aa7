// The lru policy's order of storages, kept by the observer as the operators run.
//
// `Recency` holds what `LRUPolicy` keeps in Python (policies/recency.py's `RecencyOrder` and
// policies/base.py's `SmallStorages`): every storage told of and not freed, ordered by its last
// touch (an allocation or an access) in two tiers, large storages then small ones, where a storage
// is small when its size is under `fraction` of the largest footprint (bytes of live storages told
// of) seen so far. The observer applies an operator's touches here in the order the Python
// mechanism tells them (its allocations, then its inputs in argument order, then the outputs that
// are not inputs), so the order, and the victims a walk yields, are those of the Python policy told
// the same calls; tests/runtime/test_native_recency.py runs both side by side.
//
// Invariants:
//   1. Every storage told of and not freed has exactly one node, in the list of its tier; each list
//      is in increasing stamp (a touch gives the node the next stamp and moves it to its tier's tail).
//   2. `live_` is the sum of `nbytes` over nodes with `sized` (told by an allocation), `peak_` the
//      most it has been; a storage only ever accessed counts 0 bytes, as SmallStorages' dictionary
//      lookup with a default of 0 does.
//   3. Nothing here touches a tensor or Python: a walk's caller (the observer) filters candidates by
//      its own table (storages away or with a copy in flight are skipped).

#pragma once

#include "flat_map.h"

#include <cstdint>
#include <vector>

namespace dynn {

class Recency {
 public:
  explicit Recency(double fraction) : fraction_(fraction) {}
  Recency(const Recency&) = delete;
  Recency& operator=(const Recency&) = delete;
  ~Recency() {
    for (int t = 0; t < 2; ++t)
      for (Node* n = head_[t]; n != nullptr;) {
        Node* next = n->next;
        pool_.release(n);
        n = next;
      }
  }

  // `sid` was allocated (or announced again) with `nbytes`: counted live, classed, made the most recent.
  void alloc(int64_t sid, int64_t nbytes) {
    Node* n = find(sid);
    if (n != nullptr && n->sized) live_ -= n->nbytes;
    if (n == nullptr) n = add(sid);
    n->nbytes = nbytes;
    n->sized = true;
    live_ += nbytes;
    if (live_ > peak_) peak_ = live_;
    place(n);
  }

  // `sid` was read or written: classed again, made the most recent.
  void access(int64_t sid) {
    Node* n = find(sid);
    if (n == nullptr) n = add(sid);
    place(n);
  }

  // `sid` was freed (nothing if it was never told of, or already freed).
  void free(int64_t sid) {
    Node** found = nodes_.find(key(sid));
    if (found == nullptr) return;
    Node* n = *found;
    if (n->sized) live_ -= n->nbytes;
    unlink(n);
    nodes_.erase(key(sid));
    pool_.release(n);
  }

  // Up to `max` storages that follow the cursor (`tier`, `sid`, `stamp`: the last one a walk was
  // given; sid 0 starts at the head of tier 0) and that `skip` does not refuse, least recently
  // touched first, tier 0 before tier 1. The cursor moves past what was scanned. A cursor whose node
  // was touched or freed since (a walk's caller does neither, but stays safe) resumes at the first
  // node of its tier with a later stamp.
  template <typename Skip>
  std::vector<int64_t> after(int64_t& tier, int64_t& sid, int64_t& stamp, int64_t max, Skip&& skip) {
    std::vector<int64_t> out;
    if (tier < 0 || tier > 1) return out;
    const Node* n = nullptr;
    if (sid == 0) {
      n = head_[tier];
    } else {
      Node* const* found = nodes_.find(key(sid));
      if (found != nullptr && (*found)->stamp == stamp && (*found)->tier == tier) {
        n = (*found)->next;
      } else {
        for (n = head_[tier]; n != nullptr && n->stamp <= stamp; n = n->next) {
        }
      }
    }
    while (static_cast<int64_t>(out.size()) < max) {
      while (n == nullptr && tier == 0) {
        tier = 1;
        n = head_[1];
      }
      if (n == nullptr) break;
      sid = n->sid;
      stamp = n->stamp;
      if (!skip(n->sid)) out.push_back(n->sid);
      n = n->next;
    }
    if (n == nullptr && tier == 1) tier = 2;  // the walk is done
    return out;
  }

  // Every storage told of and not freed, least recently touched first (both tiers merged by stamp).
  std::vector<int64_t> order() const {
    std::vector<int64_t> out;
    const Node* a = head_[0];
    const Node* b = head_[1];
    while (a != nullptr || b != nullptr) {
      if (b == nullptr || (a != nullptr && a->stamp < b->stamp)) {
        out.push_back(a->sid);
        a = a->next;
      } else {
        out.push_back(b->sid);
        b = b->next;
      }
    }
    return out;
  }

  // The storages of `tier`, least recently touched first.
  std::vector<int64_t> tier_order(int tier) const {
    std::vector<int64_t> out;
    for (const Node* n = head_[tier & 1]; n != nullptr; n = n->next) out.push_back(n->sid);
    return out;
  }

  int64_t live() const { return live_; }
  int64_t peak() const { return peak_; }
  int64_t size() const { return static_cast<int64_t>(nodes_.size()); }

 private:
  struct Node {
    int64_t sid = 0;
    int64_t stamp = 0;
    int64_t nbytes = 0;
    bool sized = false;
    int tier = -1;  // -1: in no list yet
    Node* prev = nullptr;
    Node* next = nullptr;
  };

  // sids start at 1; the map's keys must be nonzero
  static uint64_t key(int64_t sid) { return static_cast<uint64_t>(sid); }

  Node* find(int64_t sid) {
    Node** found = nodes_.find(key(sid));
    return found == nullptr ? nullptr : *found;
  }

  Node* add(int64_t sid) {
    Node* n = pool_.make();
    n->sid = sid;
    nodes_.insert(key(sid), n);
    return n;
  }

  // Class `n` by the threshold of this moment and make it the most recent of its tier (invariant 1).
  void place(Node* n) {
    const bool small = fraction_ > 0 && static_cast<double>(n->sized ? n->nbytes : 0) < fraction_ * static_cast<double>(peak_);
    unlink(n);
    const int t = small ? 1 : 0;
    n->tier = t;
    n->stamp = ++stamp_;
    n->prev = tail_[t];
    n->next = nullptr;
    if (tail_[t] != nullptr) tail_[t]->next = n; else head_[t] = n;
    tail_[t] = n;
  }

  void unlink(Node* n) {
    if (n->tier < 0) return;
    const int t = n->tier;
    if (n->prev != nullptr) n->prev->next = n->next; else head_[t] = n->next;
    if (n->next != nullptr) n->next->prev = n->prev; else tail_[t] = n->prev;
    n->prev = n->next = nullptr;
    n->tier = -1;
  }

  double fraction_;
  int64_t stamp_ = 0;
  int64_t live_ = 0;
  int64_t peak_ = 0;
  Node* head_[2] = {nullptr, nullptr};
  Node* tail_[2] = {nullptr, nullptr};
  FlatMap<Node*> nodes_;
  Pool<Node> pool_;
};

}  // namespace dynn

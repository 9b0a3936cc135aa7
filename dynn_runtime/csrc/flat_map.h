// The observer's tables: an open-addressing hash map from a nonzero 64-bit key (a storage's address,
// a storage id) to a pointer, and a pool that gives the pointed-to objects stable addresses.
//
// Every operator looks up its storages and every storage birth and death inserts and erases, so
// these replace std::unordered_map's node allocation and pointer chasing with one probe sequence
// in one array (linear probing, at most half full, backward-shift erase: no tombstones).

#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <utility>
#include <vector>

namespace dynn {

template <typename V>
class FlatMap {
 public:
  FlatMap() { rehash(16); }

  size_t size() const { return size_; }

  // The value under `key`, or nullptr.
  V* find(uint64_t key) {
    for (size_t i = home(key);; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.key == key) return &s.value;
      if (s.key == kEmpty) return nullptr;
    }
  }

  // Inserts `key`, which must not be present.
  void insert(uint64_t key, V value) {
    if (2 * (size_ + 1) > slots_.size()) rehash(2 * slots_.size());
    place(key, std::move(value));
    ++size_;
  }

  // Erases `key`; false if it was not present. Entries after it in its probe run move back, so
  // each stays reachable from its home slot.
  bool erase(uint64_t key) {
    size_t i = home(key);
    while (slots_[i].key != key) {
      if (slots_[i].key == kEmpty) return false;
      i = (i + 1) & mask_;
    }
    for (size_t j = (i + 1) & mask_;; j = (j + 1) & mask_) {
      Slot& s = slots_[j];
      if (s.key == kEmpty) break;
      // s may fill the hole at i unless its home lies cyclically in (i, j]
      if (((j - home(s.key)) & mask_) >= ((j - i) & mask_)) {
        slots_[i] = std::move(s);
        i = j;
      }
    }
    slots_[i].key = kEmpty;
    --size_;
    return true;
  }

  // Calls f(key, value) for every entry; f must not insert or erase.
  template <typename F>
  void for_each(F&& f) {
    for (Slot& s : slots_)
      if (s.key != kEmpty) f(s.key, s.value);
  }

 private:
  static constexpr uint64_t kEmpty = 0;
  struct Slot {
    uint64_t key = kEmpty;
    V value{};
  };

  // Fibonacci hashing: the top bits of key * 2^64/phi (addresses' low bits are alignment zeros)
  size_t home(uint64_t key) const { return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_); }

  void place(uint64_t key, V value) {
    size_t i = home(key);
    while (slots_[i].key != kEmpty) i = (i + 1) & mask_;
    slots_[i].key = key;
    slots_[i].value = std::move(value);
  }

  void rehash(size_t capacity) {  // a power of two
    std::vector<Slot> old(capacity);
    old.swap(slots_);
    mask_ = capacity - 1;
    shift_ = 64;
    for (size_t c = capacity; c > 1; c >>= 1) --shift_;
    for (Slot& s : old)
      if (s.key != kEmpty) place(s.key, std::move(s.value));
  }

  std::vector<Slot> slots_;
  size_t size_ = 0;
  size_t mask_ = 0;
  int shift_ = 64;
};

// Objects of type T at addresses that stay valid until release(), recycled after it.
template <typename T>
class Pool {
 public:
  Pool() = default;
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;
  ~Pool() = default;  // the owner releases every live object first

  template <typename... Args>
  T* make(Args&&... args) {
    if (free_.empty()) {
      chunks_.push_back(std::make_unique<Raw[]>(kChunk));
      for (size_t i = kChunk; i-- > 0;) free_.push_back(reinterpret_cast<T*>(&chunks_.back()[i]));
    }
    T* p = free_.back();
    free_.pop_back();
    return new (p) T(std::forward<Args>(args)...);
  }

  void release(T* p) {
    p->~T();
    free_.push_back(p);
  }

 private:
  static constexpr size_t kChunk = 256;
  struct alignas(T) Raw {
    unsigned char bytes[sizeof(T)];
  };
  std::vector<std::unique_ptr<Raw[]>> chunks_;
  std::vector<T*> free_;
};

}  // namespace dynn

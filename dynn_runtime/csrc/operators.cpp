// The pilot's bulk parse of the operator log (NativeSource._native_operators in
// dynn_runtime/runtime/native_source.py) in C: the same loop over the same words, making the same
// Python objects and the same writes on the manager's records, in the same order.
//
// Invariants (each is the Python loop's, which stays the reference: NativeSource.operators_in_c):
//  1. Every object the loop makes is an ordinary instance of the Python class: an Op is made by
//     calling the class (its dataclass __init__), a _Born by its tp_new (object.__new__) with the
//     slots _Born.__init__ assigns written in place, so each compares, pickles and prints as one
//     the Python loop makes.
//  2. An operator's busy set is made as `set(ins).union(outs)` makes it (a set of the inputs, copied,
//     then the outputs added one by one): its iteration order, which orders `accessed`, is the
//     Python loop's.
//  3. Python code runs only in the rare cases, through the manager's own methods, with
//     `mm.position` current before each call: a written storage with a host copy
//     (_drop_stale_hosts), a collective (_record_batch_born, _hold_for_collective), a first-seen
//     operator name (_idiom_of), a corrupt log (internal_assert).
//  4. The log is the list of int64 words take_log gave (events.cpp's layout); the ints of the
//     records' tuples are the list's own objects. A word that starts no record raises the Python
//     loop's internal error; a record that runs past the log's end raises one too (where the Python
//     loop would fail to unpack it, or read it short).
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <cstdint>
#include <vector>

namespace dynn {
namespace {

// owns one reference (nullptr allowed)
struct Ref {
  PyObject* p = nullptr;
  Ref() = default;
  explicit Ref(PyObject* o) : p(o) {}
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  ~Ref() { Py_XDECREF(p); }
  void reset(PyObject* o) {
    Py_XDECREF(p);
    p = o;
  }
  PyObject* get() const { return p; }
  explicit operator bool() const { return p != nullptr; }
};

enum : int64_t { kLogOp = 1, kLogAlloc = 2, kLogFree = 3 };  // events.cpp's kOp, kAlloc, kFree

#define DYNN_NAMES(X)                                                                                 \
  X(st) X(_names) X(_ops) X(_cur) X(_saved_pending) X(_grad_pending) X(phase) X(_last_busy)            \
  X(_last_outs) X(_last_name) X(_modules) X(_idiom_by_name) X(_pre) X(position) X(node_modules) X(paths) \
  X(last_access) X(last_access_t) X(count) X(pf) X(prefetch_hits) X(host) X(_drop_stale_hosts)         \
  X(_idiom_of) X(_record_batch_born) X(_hold_for_collective) X(name) X(idiom) X(module) X(inputs)       \
  X(outputs) X(writes) X(allocs) X(duration_s) X(flops) X(nbytes) X(node) X(kind) X(saved) X(fresh)     \
  X(pos) X(dead) X(activation) X(temp) X(input) X(grad) X(recordless) X(_new_native) X(_frees) X(_pinned)  \
  X(status) X(set_status) X(_drop_host) X(host_valid)

struct Names {
#define X(n) PyObject* n = nullptr;
  DYNN_NAMES(X)
#undef X
  PyObject* empty = nullptr;   // ""
  PyObject* c10d = nullptr;    // "c10d::"
  PyObject* zero_f = nullptr;  // 0.0
  PyObject* zero = nullptr;    // 0
  PyObject* minus1 = nullptr;  // -1
  PyObject* one = nullptr;     // 1
  PyObject* no_args = nullptr; // ()
};
Names N;

bool init_names() {
#define X(n) \
  if (!(N.n = PyUnicode_InternFromString(#n))) return false;
  DYNN_NAMES(X)
#undef X
  return (N.empty = PyUnicode_InternFromString("")) && (N.c10d = PyUnicode_InternFromString("c10d::")) &&
         (N.zero_f = PyFloat_FromDouble(0.0)) && (N.zero = PyLong_FromLong(0)) &&
         (N.minus1 = PyLong_FromLong(-1)) && (N.one = PyLong_FromLong(1)) && (N.no_args = PyTuple_New(0));
}

// a new instance of a Python class without running its __init__ (invariant 1)
PyObject* bare(PyTypeObject* type) { return type->tp_new(type, N.no_args, nullptr); }

bool set(PyObject* o, PyObject* name, PyObject* v) { return PyObject_SetAttr(o, name, v) == 0; }

// o.name += 1
bool incr(PyObject* o, PyObject* name) {
  Ref v(PyObject_GetAttr(o, name));
  if (!v) return false;
  Ref w(PyNumber_Add(v.get(), N.one));
  return w && set(o, name, w.get());
}

// a tuple of ints only: no cycle can pass through it, so the cyclic collector need not scan it
// (what the collector itself does to such a tuple when it first meets it)
PyObject* untracked(PyObject* t) {
  if (t && PyObject_GC_IsTracked(t)) PyObject_GC_UnTrack(t);
  return t;
}

// The __slots__ of a class, read and written at their offsets: what a slot's member descriptor
// does, without the attribute lookup. A map holds one exact type (a strong reference); an object of
// another type goes through the generic attribute protocol.
struct SlotMap {
  PyTypeObject* type = nullptr;
  Py_ssize_t off[8] = {};
  int n = 0;

  // the offsets of `names` in `t`; false (and no map) where one is not a writable object slot
  bool resolve(PyTypeObject* t, PyObject* const* names, int count) {
    Py_CLEAR(type);
    for (int k = 0; k < count; ++k) {
      PyObject* d = _PyType_Lookup(t, names[k]);  // borrowed
      if (!d || !Py_IS_TYPE(d, &PyMemberDescr_Type)) return false;
      PyMemberDef* m = reinterpret_cast<PyMemberDescrObject*>(d)->d_member;
      if (m->type != T_OBJECT_EX || (m->flags & READONLY)) return false;
      off[k] = m->offset;
    }
    n = count;
    type = reinterpret_cast<PyTypeObject*>(Py_NewRef(reinterpret_cast<PyObject*>(t)));
    return true;
  }
  PyObject** at(PyObject* o, int k) const { return reinterpret_cast<PyObject**>(reinterpret_cast<char*>(o) + off[k]); }
  // borrowed; nullptr for a slot never set
  PyObject* get(PyObject* o, int k) const { return *at(o, k); }
  void put(PyObject* o, int k, PyObject* v) const {
    PyObject* old = *at(o, k);
    *at(o, k) = Py_NewRef(v);
    Py_XDECREF(old);
  }
};

// a record's access fields (Record/_S) and a birth's fields (_Born), in these orders
enum { kRecLast, kRecLastT, kRecCount, kRecPf, kRecN };
enum { kBornNbytes, kBornKind, kBornSaved, kBornFresh, kBornPos, kBornLast, kBornCount, kBornDead, kBornN };
SlotMap g_rec, g_born;

// the map for o's type, or nullptr (the generic protocol)
const SlotMap* rec_slots(PyObject* o) {
  PyTypeObject* t = Py_TYPE(o);
  if (t == g_rec.type) return &g_rec;
  PyObject* names[kRecN] = {N.last_access, N.last_access_t, N.count, N.pf};
  return g_rec.resolve(t, names, kRecN) ? &g_rec : nullptr;
}

const SlotMap* born_slots(PyTypeObject* t) {
  if (t == g_born.type) return &g_born;
  PyObject* names[kBornN] = {N.nbytes, N.kind, N.saved, N.fresh, N.pos, N.last_access, N.count, N.dead};
  return g_born.resolve(t, names, kBornN) ? &g_born : nullptr;
}

// slot k of o += 1 (an int slot)
bool incr_slot(const SlotMap* m, PyObject* o, int k) {
  PyObject* v = m->get(o, k);
  if (!v) {
    PyErr_SetString(PyExc_AttributeError, "parse_operators: a count slot is not set");
    return false;
  }
  PyObject* w = PyNumber_Add(v, N.one);
  if (!w) return false;
  PyObject* old = *m->at(o, k);
  *m->at(o, k) = w;
  Py_XDECREF(old);
  return true;
}

// the words of [a, b) as a tuple of the list's own ints
PyObject* words_tuple(PyObject* const* items, Py_ssize_t a, Py_ssize_t b) {
  PyObject* t = PyTuple_New(b - a);
  if (!t) return nullptr;
  for (Py_ssize_t k = a; k < b; ++k) {
    Py_INCREF(items[k]);
    PyTuple_SET_ITEM(t, k - a, items[k]);
  }
  return untracked(t);
}

bool word(PyObject* const* items, Py_ssize_t k, int64_t* out) {
  long long v = PyLong_AsLongLong(items[k]);
  if (v == -1 && PyErr_Occurred()) return false;
  *out = v;
  return true;
}

// d.setdefault(key, []).append(v)
bool append_at(PyObject* d, PyObject* key, PyObject* v) {
  Ref fresh(PyList_New(0));
  if (!fresh) return false;
  PyObject* l = PyDict_Check(d) ? PyDict_SetDefault(d, key, fresh.get())  // borrowed
                                : nullptr;
  if (l) return PyList_Check(l) ? PyList_Append(l, v) == 0 : PyObject_CallMethod(l, "append", "O", v) != nullptr;
  if (PyErr_Occurred()) return false;
  Ref got(PyObject_CallMethod(d, "setdefault", "OO", key, fresh.get()));
  if (!got) return false;
  Ref r(PyObject_CallMethod(got.get(), "append", "O", v));
  return bool(r);
}

bool call_method(PyObject* o, PyObject* name, PyObject* a, PyObject* b = nullptr, PyObject* c = nullptr) {
  PyObject* args[4] = {o, a, b, c};
  size_t n = 2 + (b != nullptr) + (c != nullptr);
  Ref r(PyObject_VectorcallMethod(name, args, n | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr));
  return bool(r);
}

// internal_assert(False, message): raises the runtime's error for a corrupt log
PyObject* corrupt(PyObject* internal_assert, const char* fmt, long long a, long long b) {
  Ref msg(PyUnicode_FromFormat(fmt, a, b));
  if (!msg) return nullptr;
  Ref r(PyObject_CallFunctionObjArgs(internal_assert, Py_False, msg.get(), nullptr));
  if (r) PyErr_SetString(PyExc_RuntimeError, "runtime: internal_assert(False) returned");
  return nullptr;
}

// parse_operators(mm, log, now, ctx) -> (events, dead, timeline words: bytes of int64 triples); see
// native_source.py
PyObject* parse_operators(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyList_Check(args[1]) || !PyFloat_Check(args[2]) || !PyTuple_Check(args[3]) ||
      PyTuple_GET_SIZE(args[3]) != 9) {
    PyErr_SetString(PyExc_TypeError, "parse_operators(mm, log: list, now: float, ctx: 9-tuple)");
    return nullptr;
  }
  PyObject* mm = args[0];
  PyObject* log = args[1];
  PyObject* now = args[2];
  PyObject* ctx = args[3];
  PyObject* OPERATOR = PyTuple_GET_ITEM(ctx, 0);
  PyObject* TOUCH_ALLOC = PyTuple_GET_ITEM(ctx, 1);
  PyObject* TOUCH_FREE = PyTuple_GET_ITEM(ctx, 2);
  PyObject* phases = PyTuple_GET_ITEM(ctx, 3);
  PyObject* phase_codes = PyTuple_GET_ITEM(ctx, 4);
  PyObject* op_cls = PyTuple_GET_ITEM(ctx, 5);
  PyObject* born_cls = PyTuple_GET_ITEM(ctx, 6);
  PyObject* internal_assert = PyTuple_GET_ITEM(ctx, 7);
  if (!PyTuple_Check(phases) || PyTuple_GET_SIZE(phases) != 4 || !PyTuple_Check(phase_codes) ||
      PyTuple_GET_SIZE(phase_codes) != 4 || !PyType_Check(op_cls) || !PyType_Check(born_cls)) {
    PyErr_SetString(PyExc_TypeError, "parse_operators: ctx is (OPERATOR, TOUCH_ALLOC, TOUCH_FREE, phases, "
                                     "phase codes, Op, _Born, internal_assert, ABSENT)");
    return nullptr;
  }
  auto* born_type = reinterpret_cast<PyTypeObject*>(born_cls);
  const SlotMap* bslots = born_slots(born_type);  // nullptr: _Born without these slots, the generic protocol

  Ref st(PyObject_GetAttr(mm, N.st)), names(PyObject_GetAttr(mm, N._names)), ops(PyObject_GetAttr(mm, N._ops)),
      cur(PyObject_GetAttr(mm, N._cur)), saved_pending(PyObject_GetAttr(mm, N._saved_pending)),
      grad_pending(PyObject_GetAttr(mm, N._grad_pending)), phase(PyObject_GetAttr(mm, N.phase)),
      busy(PyObject_GetAttr(mm, N._last_busy)), last_outs(PyObject_GetAttr(mm, N._last_outs)),
      name(PyObject_GetAttr(mm, N._last_name)), mods(PyObject_GetAttr(mm, N._modules)),
      idioms(PyObject_GetAttr(mm, N._idiom_by_name)), pre(PyObject_GetAttr(mm, N._pre)),
      position_obj(PyObject_GetAttr(mm, N.position));
  if (!st || !names || !ops || !cur || !saved_pending || !grad_pending || !phase || !busy || !last_outs || !name ||
      !mods || !idioms || !pre || !position_obj)
    return nullptr;
  if (!PyDict_Check(st.get()) || !PyDict_Check(idioms.get()) || !PyList_Check(names.get()) ||
      !PyList_Check(ops.get())) {
    PyErr_SetString(PyExc_TypeError, "parse_operators: the manager's st, _idiom_by_name (dicts), _names, _ops "
                                     "(lists) are not of the types this parse reads");
    return nullptr;
  }
  Ref node_modules, paths;
  if (mods.get() != Py_None) {
    node_modules.reset(PyObject_GetAttr(mods.get(), N.node_modules));
    paths.reset(PyObject_GetAttr(mods.get(), N.paths));
    if (!node_modules || !paths) return nullptr;
  }
  long long position = PyLong_AsLongLong(position_obj.get());
  if (position == -1 && PyErr_Occurred()) return nullptr;
  long long synced = position;  // what mm.position holds
  auto sync = [&]() -> bool {
    if (position == synced) return true;
    Ref p(PyLong_FromLongLong(position));
    if (!p || !set(mm, N.position, p.get())) return false;
    synced = position;
    return true;
  };

  Ref events(PyList_New(0)), dead(PyList_New(0)), born(PyDict_New());
  if (!events || !dead || !born) return nullptr;
  std::vector<int64_t> tl;  // (position, used, phase code) per operator: the timeline's words

  // the words read through a tuple of the list's items: the Python code the rare cases run cannot
  // move them
  Ref words(PyList_AsTuple(log));
  if (!words) return nullptr;
  PyObject* const* items = &PyTuple_GET_ITEM(words.get(), 0);
  const Py_ssize_t n = PyTuple_GET_SIZE(words.get());
  Py_ssize_t i = 0;
  while (i < n) {
    int64_t tag;
    if (!word(items, i, &tag)) return nullptr;
    if (tag == kLogOp) {
      if (i + 9 > n) {
        if (!sync()) return nullptr;
        return corrupt(internal_assert, "runtime: corrupt native event log (an operator record at word %lld runs "
                                        "past its end, word %lld)", i, n);
      }
      int64_t name_id, pm, cnt[4];
      if (!word(items, i + 1, &name_id) || !word(items, i + 2, &pm)) return nullptr;
      for (int c = 0; c < 4; ++c)
        if (!word(items, i + 5 + c, &cnt[c])) return nullptr;
      if (cnt[0] < 0 || cnt[1] < 0 || cnt[2] < 0 || cnt[3] < 0 ||
          i + 9 + cnt[0] + cnt[1] + cnt[2] + cnt[3] > n) {
        if (!sync()) return nullptr;
        return corrupt(internal_assert, "runtime: corrupt native event log (an operator record at word %lld runs "
                                        "past its end, word %lld)", i, n);
      }
      PyObject* node = items[i + 3];
      PyObject* used = items[i + 4];
      Py_ssize_t k = i + 9;
      Ref ins(words_tuple(items, k, k + cnt[0]));
      k += cnt[0];
      Ref outs(words_tuple(items, k, k + cnt[1]));
      k += cnt[1];
      Ref writes(words_tuple(items, k, k + cnt[2]));
      k += cnt[2];
      Ref allocs(words_tuple(items, k, k + cnt[3]));
      i = k + cnt[3];
      if (!ins || !outs || !writes || !allocs) return nullptr;
      Ref j(PyLong_FromLongLong(position));
      if (!j) return nullptr;
      // names[name_id], as Python indexes it
      Ref name_obj(PySequence_GetItem(names.get(), name_id));
      if (!name_obj) return nullptr;
      name.reset(name_obj.p);
      name_obj.p = nullptr;
      const int ph = static_cast<int>(pm & 3);
      phase.reset(Py_NewRef(PyTuple_GET_ITEM(phases, ph)));
      int64_t module = pm >> 2;
      if (cnt[2]) {  // a written storage's stale host copy: only a record with a host copy can have one
        bool any = false;
        for (Py_ssize_t w = 0; w < cnt[2] && !any; ++w) {
          PyObject* x = PyDict_GetItemWithError(st.get(), PyTuple_GET_ITEM(writes.get(), w));
          if (!x) {
            if (PyErr_Occurred()) return nullptr;
            continue;
          }
          Ref h(PyObject_GetAttr(x, N.host));
          if (!h) return nullptr;
          any = h.get() != Py_None;
        }
        if (any && (!sync() || !call_method(mm, N._drop_stale_hosts, writes.get()))) return nullptr;
      }
      // _op_of
      Ref iv(Py_XNewRef(PyDict_GetItemWithError(idioms.get(), name.get())));
      if (!iv) {
        if (PyErr_Occurred() || !sync()) return nullptr;
        PyObject* a[2] = {mm, name.get()};
        iv.reset(PyObject_VectorcallMethod(N._idiom_of, a, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr));
        if (!iv) return nullptr;
      }
      Ref path;
      if (!node_modules) {
        path.reset(Py_NewRef(N.empty));
      } else {
        if (ph == 1) {  // "backward": the module of its autograd node
          PyObject* m = PyDict_Check(node_modules.get()) ? PyDict_GetItemWithError(node_modules.get(), node) : nullptr;
          if (PyErr_Occurred()) return nullptr;
          if (!PyDict_Check(node_modules.get())) {
            Ref got(PyObject_CallMethod(node_modules.get(), "get", "OO", node, N.zero));
            if (!got) return nullptr;
            module = PyLong_AsLongLong(got.get());
          } else {
            module = m ? PyLong_AsLongLong(m) : 0;
          }
          if (module == -1 && PyErr_Occurred()) return nullptr;
        }
        Py_ssize_t np = PySequence_Size(paths.get());
        if (np < 0) return nullptr;
        if (module < np) {
          path.reset(PySequence_GetItem(paths.get(), module));
          if (!path) return nullptr;
        } else {
          path.reset(Py_NewRef(N.empty));
        }
      }
      // Op's fields positional, in declaration order (invariant 1)
      PyObject* fields[12] = {name.get(), iv.get(), phase.get(), path.get(), ins.get(), outs.get(),
                              writes.get(), allocs.get(), N.zero_f, N.zero, N.zero, node};
      Ref op(PyObject_Vectorcall(op_cls, fields, 12, nullptr));
      if (!op) return nullptr;
      if (PyList_Append(ops.get(), op.get()) != 0) return nullptr;
      {  // invariant 2
        Ref s_in(PySet_New(ins.get()));
        if (!s_in) return nullptr;
        busy.reset(PySet_New(s_in.get()));
        if (!busy) return nullptr;
        for (Py_ssize_t o = 0; o < cnt[1]; ++o)
          if (PySet_Add(busy.get(), PyTuple_GET_ITEM(outs.get(), o)) != 0) return nullptr;
      }
      last_outs.reset(Py_NewRef(outs.get()));
      int c10d = PyUnicode_Check(name.get()) ? static_cast<int>(PyUnicode_Tailmatch(name.get(), N.c10d, 0,
                                                                                      PY_SSIZE_T_MAX, -1))
                                             : 0;
      if (c10d < 0) return nullptr;
      if (c10d) {  // the observer does not see the Work: held until the step ends
        if (!sync() || !call_method(mm, N._record_batch_born, born.get(), dead.get(), now) ||
            !call_method(mm, N._hold_for_collective, busy.get(), Py_None))
          return nullptr;
      }
      Ref accessed(PyList_New(0));
      Ref it(PyObject_GetIter(busy.get()));
      if (!accessed || !it) return nullptr;
      while (PyObject* sid_raw = PyIter_Next(it.get())) {
        Ref sid(sid_raw);
        Ref s(Py_XNewRef(PyDict_GetItemWithError(st.get(), sid.get())));
        if (s) {
          int hit;
          if (const SlotMap* m = rec_slots(s.get())) {
            m->put(s.get(), kRecLast, j.get());
            m->put(s.get(), kRecLastT, now);
            if (!incr_slot(m, s.get(), kRecCount)) return nullptr;
            PyObject* pf = m->get(s.get(), kRecPf);
            hit = pf == Py_True ? 1 : pf == Py_False ? 0 : pf ? PyObject_IsTrue(pf) : -1;
            if (hit < 0) {
              if (!PyErr_Occurred()) PyErr_SetString(PyExc_AttributeError, "parse_operators: a record's pf is not set");
              return nullptr;
            }
            if (hit) m->put(s.get(), kRecPf, Py_False);
          } else {
            if (PyErr_Occurred()) return nullptr;
            if (!set(s.get(), N.last_access, j.get()) || !set(s.get(), N.last_access_t, now) ||
                !incr(s.get(), N.count))
              return nullptr;
            Ref pf(PyObject_GetAttr(s.get(), N.pf));
            if (!pf) return nullptr;
            hit = PyObject_IsTrue(pf.get());
            if (hit < 0 || (hit && !set(s.get(), N.pf, Py_False))) return nullptr;
          }
          if (hit && !incr(cur.get(), N.prefetch_hits)) return nullptr;
        } else {
          if (PyErr_Occurred()) return nullptr;
          PyObject* b = PyDict_GetItemWithError(born.get(), sid.get());
          if (!b) {
            if (PyErr_Occurred()) return nullptr;
            continue;
          }
          if (bslots && Py_TYPE(b) == bslots->type) {
            bslots->put(b, kBornLast, j.get());
            if (!incr_slot(bslots, b, kBornCount)) return nullptr;
          } else if (!set(b, N.last_access, j.get()) || !incr(b, N.count)) {
            return nullptr;
          }
        }
        if (PyList_Append(accessed.get(), sid.get()) != 0) return nullptr;
      }
      if (PyErr_Occurred()) return nullptr;
      Ref ev(PyTuple_Pack(4, OPERATOR, j.get(), op.get(), accessed.get()));
      if (!ev || PyList_Append(events.get(), ev.get()) != 0) return nullptr;
      const long long used_word = PyLong_AsLongLong(used);
      const long long code = PyLong_AsLongLong(PyTuple_GET_ITEM(phase_codes, ph));
      if ((used_word == -1 || code == -1) && PyErr_Occurred()) return nullptr;
      tl.insert(tl.end(), {static_cast<int64_t>(position), static_cast<int64_t>(used_word), static_cast<int64_t>(code)});
      position += 1;
    } else if (tag == kLogAlloc) {
      if (i + 4 > n) {
        if (!sync()) return nullptr;
        return corrupt(internal_assert, "runtime: corrupt native event log (an allocation record at word %lld runs "
                                        "past its end, word %lld)", i, n);
      }
      PyObject* sid = items[i + 1];
      PyObject* nb = items[i + 2];
      PyObject* fresh = items[i + 3];
      i += 4;
      int is_fresh = PyObject_IsTrue(fresh);
      if (is_fresh < 0) return nullptr;
      int known = PyDict_Contains(st.get(), sid);
      if (known == 0) known = PyDict_Contains(born.get(), sid);
      if (known < 0) return nullptr;
      Ref pos_obj(PyLong_FromLongLong(position));
      if (!pos_obj) return nullptr;
      if (!known) {  // _new_native's labels (movable: a birth in a step), kept until the record or the death
        PyObject* kind;
        PyObject* saved = Py_False;
        int sp = PySequence_Contains(saved_pending.get(), sid);
        if (sp < 0) return nullptr;
        if (sp) {
          kind = N.activation;
          saved = Py_True;
        } else {
          kind = is_fresh ? N.temp : N.input;
        }
        int gp = PySequence_Contains(grad_pending.get(), sid);
        if (gp < 0) return nullptr;
        if (gp) kind = N.grad;
        Ref b(bare(born_type));
        if (!b) return nullptr;
        if (bslots) {  // _Born.__init__'s assignments
          PyObject* v[kBornN] = {nb, kind, saved, fresh, pos_obj.get(), N.minus1, N.zero, Py_False};
          for (int f = 0; f < kBornN; ++f) bslots->put(b.get(), f, v[f]);
        } else if (!set(b.get(), N.nbytes, nb) || !set(b.get(), N.kind, kind) || !set(b.get(), N.saved, saved) ||
                   !set(b.get(), N.fresh, fresh) || !set(b.get(), N.pos, pos_obj.get()) ||
                   !set(b.get(), N.last_access, N.minus1) || !set(b.get(), N.count, N.zero) ||
                   !set(b.get(), N.dead, Py_False)) {
          return nullptr;
        }
        if (PyDict_SetItem(born.get(), sid, b.get()) != 0) return nullptr;
      }
      if (!is_fresh) {
        if (!append_at(pre.get(), pos_obj.get(), sid)) return nullptr;
        Ref ev(untracked(PyTuple_Pack(3, TOUCH_ALLOC, sid, position == 0 ? N.minus1 : pos_obj.get())));
        if (!ev || PyList_Append(events.get(), ev.get()) != 0) return nullptr;
      }
    } else if (tag == kLogFree) {
      if (i + 2 > n) {
        if (!sync()) return nullptr;
        return corrupt(internal_assert, "runtime: corrupt native event log (a free record at word %lld runs past "
                                        "its end, word %lld)", i, n);
      }
      PyObject* sid = items[i + 1];
      i += 2;
      PyObject* b = PyDict_GetItemWithError(born.get(), sid);
      if (PyErr_Occurred()) return nullptr;
      bool told = false;
      Ref entry;
      if (b) {
        const bool fast = bslots && Py_TYPE(b) == bslots->type;
        Ref was(fast ? Py_XNewRef(bslots->get(b, kBornDead)) : PyObject_GetAttr(b, N.dead));
        if (!was) {
          if (!PyErr_Occurred()) PyErr_SetString(PyExc_AttributeError, "parse_operators: a birth's dead is not set");
          return nullptr;
        }
        int d = PyObject_IsTrue(was.get());
        if (d < 0) return nullptr;
        if (!d) {
          if (fast)
            bslots->put(b, kBornDead, Py_True);
          else if (!set(b, N.dead, Py_True))
            return nullptr;
          Ref pos_obj(PyLong_FromLongLong(position));
          if (!pos_obj) return nullptr;
          entry.reset(PyTuple_Pack(3, sid, pos_obj.get(), b));
          told = true;
        }
      } else {
        int known = PyDict_Contains(st.get(), sid);
        if (known < 0) return nullptr;
        if (known) {  // an unknown storage's death is told to nobody (_forget_native)
          Ref pos_obj(PyLong_FromLongLong(position));
          if (!pos_obj) return nullptr;
          entry.reset(PyTuple_Pack(3, sid, pos_obj.get(), Py_None));
          told = true;
        } else {
          if (PySet_Check(saved_pending.get())) {
            if (PySet_Discard(saved_pending.get(), sid) < 0) return nullptr;
          } else {
            Ref r(PyObject_CallMethod(saved_pending.get(), "discard", "O", sid));
            if (!r) return nullptr;
          }
        }
      }
      if (told) {
        if (!entry || PyList_Append(dead.get(), entry.get()) != 0) return nullptr;
        Ref ev(untracked(PyTuple_Pack(2, TOUCH_FREE, sid)));
        if (!ev || PyList_Append(events.get(), ev.get()) != 0) return nullptr;
      }
    } else {
      if (!sync()) return nullptr;
      return corrupt(internal_assert, "runtime: corrupt native event log (tag %lld at word %lld)", tag, i);
    }
  }
  if (!sync() || !set(mm, N.phase, phase.get()) || !set(mm, N._last_busy, busy.get()) ||
      !set(mm, N._last_outs, last_outs.get()) || !set(mm, N._last_name, name.get()))
    return nullptr;
  // the births of the batch, in birth order: a dead one's entry in the recordless table, a live
  // one's record (_new_native) with the access fields the batch gave it
  Ref recordless(PyObject_GetAttr(mm, N.recordless));
  if (!recordless) return nullptr;
  Ref items_born(PyDict_Items(born.get()));  // a snapshot: _new_native runs Python code
  if (!items_born) return nullptr;
  for (Py_ssize_t at = 0; at < PyList_GET_SIZE(items_born.get()); ++at) {
    PyObject* kv = PyList_GET_ITEM(items_born.get(), at);
    PyObject* sid = PyTuple_GET_ITEM(kv, 0);
    PyObject* b = PyTuple_GET_ITEM(kv, 1);
    Ref was(PyObject_GetAttr(b, N.dead));
    if (!was) return nullptr;
    int d = PyObject_IsTrue(was.get());
    if (d < 0) return nullptr;
    if (d) {
      if (PyObject_SetItem(recordless.get(), sid, b) != 0) return nullptr;
      continue;
    }
    Ref fresh(PyObject_GetAttr(b, N.fresh)), nb(PyObject_GetAttr(b, N.nbytes)), pos(PyObject_GetAttr(b, N.pos)),
        count(PyObject_GetAttr(b, N.count));
    if (!fresh || !nb || !pos || !count) return nullptr;
    int f = PyObject_IsTrue(fresh.get());
    if (f < 0) return nullptr;
    PyObject* a[6] = {mm, sid, f ? N.temp : N.input, nb.get(), Py_True, pos.get()};
    Ref x(PyObject_VectorcallMethod(N._new_native, a, 6 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr));
    if (!x) return nullptr;
    int c = PyObject_IsTrue(count.get());
    if (c < 0) return nullptr;
    if (c) {
      Ref last(PyObject_GetAttr(b, N.last_access));
      if (!last || !set(x.get(), N.last_access, last.get()) || !set(x.get(), N.last_access_t, now) ||
          !set(x.get(), N.count, count.get()))
        return nullptr;
    }
  }
  Ref timeline(PyBytes_FromStringAndSize(reinterpret_cast<const char*>(tl.data()),
                                         static_cast<Py_ssize_t>(tl.size() * sizeof(int64_t))));
  if (!timeline) return nullptr;
  return PyTuple_Pack(3, events.get(), dead.get(), timeline.get());
}

// forget_dead(mm, dead, ctx): the deaths of a batch parse_operators read, after the policy's call
// (NativeSource._tell_operators's last loop)
PyObject* forget_dead(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyList_Check(args[1]) || !PyTuple_Check(args[2]) || PyTuple_GET_SIZE(args[2]) != 9) {
    PyErr_SetString(PyExc_TypeError, "forget_dead(mm, dead: list, ctx: 9-tuple)");
    return nullptr;
  }
  PyObject* mm = args[0];
  PyObject* dead = args[1];
  PyObject* ABSENT = PyTuple_GET_ITEM(args[2], 8);
  Ref st(PyObject_GetAttr(mm, N.st)), saved_pending(PyObject_GetAttr(mm, N._saved_pending)),
      grad_pending(PyObject_GetAttr(mm, N._grad_pending)), recordless(PyObject_GetAttr(mm, N.recordless)),
      frees(PyObject_GetAttr(mm, N._frees)), pinned(PyObject_GetAttr(mm, N._pinned));
  if (!st || !saved_pending || !grad_pending || !recordless || !frees || !pinned) return nullptr;
  auto discard = [](PyObject* s, PyObject* key) -> bool {
    if (PySet_Check(s)) return PySet_Discard(s, key) >= 0;
    Ref r(PyObject_CallMethod(s, "discard", "O", key));
    return bool(r);
  };
  for (Py_ssize_t k = 0; k < PyList_GET_SIZE(dead); ++k) {
    Ref entry(Py_NewRef(PyList_GET_ITEM(dead, k)));
    if (!PyTuple_Check(entry.get()) || PyTuple_GET_SIZE(entry.get()) != 3) {
      PyErr_SetString(PyExc_TypeError, "forget_dead: an entry is not (sid, position, _Born or None)");
      return nullptr;
    }
    PyObject* sid = PyTuple_GET_ITEM(entry.get(), 0);
    PyObject* pos = PyTuple_GET_ITEM(entry.get(), 1);
    PyObject* b = PyTuple_GET_ITEM(entry.get(), 2);
    if (!discard(saved_pending.get(), sid)) return nullptr;
    if (b != Py_None) {  // no record: nothing held, away or pinned
      if (PyObject_DelItem(recordless.get(), sid) != 0 || !discard(grad_pending.get(), sid) ||
          !append_at(frees.get(), pos, sid))
        return nullptr;
      continue;
    }
    // st.pop(sid, None)
    Ref x(Py_XNewRef(PyDict_Check(st.get()) ? PyDict_GetItemWithError(st.get(), sid) : nullptr));
    if (!x) {
      if (PyErr_Occurred()) return nullptr;
      if (!PyDict_Check(st.get())) {
        PyErr_SetString(PyExc_TypeError, "forget_dead: the manager's st is not a dict");
        return nullptr;
      }
      continue;  // forgotten meanwhile (the policy's call reached a handler that read the table)
    }
    if (PyDict_DelItem(st.get(), sid) != 0) return nullptr;
    Ref status(PyObject_GetAttr(x.get(), N.status));
    if (!status) return nullptr;
    if (status.get() != ABSENT && !call_method(mm, N.set_status, x.get(), ABSENT)) return nullptr;
    Ref host(PyObject_GetAttr(x.get(), N.host));
    if (!host) return nullptr;
    if (host.get() != Py_None) {
      if (!call_method(mm, N._drop_host, x.get())) return nullptr;
    } else if (!set(x.get(), N.host_valid, Py_False)) {  // _drop_host's work without a host copy
      return nullptr;
    }
    if (!append_at(frees.get(), pos, sid) || !discard(pinned.get(), sid)) return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"parse_operators", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(parse_operators)),
     METH_FASTCALL,
     "parse_operators(mm, log, now, ctx) -> (events, dead, timeline words as int64 bytes): NativeSource._native_operators's "
     "loop over a batch of the operator log and its births' records (dynn_runtime/runtime/native_source.py)"},
    {"forget_dead", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(forget_dead)), METH_FASTCALL,
     "forget_dead(mm, dead, ctx): the deaths of a batch parse_operators read, after the policy's call"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

// adds parse_operators to the module (called from events.cpp's module init)
bool add_operator_parse(PyObject* module) { return init_names() && PyModule_AddFunctions(module, kMethods) == 0; }

}  // namespace dynn

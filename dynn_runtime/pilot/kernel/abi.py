"""The kernel's ABI: the feature columns and the structures Python and C exchange, as one table.

The kernel's C units include ``pilot_kernel.h``, which :func:`header` writes from this module and from the
feature table (:mod:`dynn_runtime.pilot.layout`): the column numbers ``F_<GROUP>`` / ``X_<GROUP>``,
the thresholds, and the structures below with their sizes in 8-byte words. The Python side fills
the same structures by field name (:meth:`Struct.index`, :meth:`Struct.ctypes`), so a field or a
feature is declared once. ``python -m dynn_runtime.pilot.kernel.abi`` (or :func:`write_header`) rewrites the header;
``--check`` exits 1 when the checked-in header differs (a test checks it). At load time
:func:`layout` is compared with what the library reports (``dynn_pilot_layout``), so a library
built from another header is refused instead of reading the wrong columns.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from dataclasses import dataclass
from pathlib import Path

from ...trace.format import KINDS
from ..layout import CAND_TABLE, CTX_TABLE, HINT_MAX, THRESH

__all__ = ["ABI", "MAX_H", "MAX_K", "LANES", "STATE", "POINT", "POLICY", "MODEL", "OP", "ALLOC", "FUSED",
           "FUSED_ALLOC_WORDS", "FUSED_ACCESS_WORDS", "BATCH", "BATCH_OP", "BATCH_FREE", "BATCH_LINK", "BATCH_OP_HEAD",
           "BATCH_ACCESS_WORDS", "BATCH_FREE_WORDS", "Struct", "header", "layout", "HEADER", "write_header"]

#: bumped whenever the meaning of a structure or a call changes without changing the layout
ABI = 13
#: the widest hidden layer and the most (padded) outputs the kernel takes; the outputs are padded to
#: whole blocks of LANES floats (one 512-bit or two 256-bit vectors)
MAX_H, MAX_K, LANES = 256, 64, 16
HEADER = Path(__file__).with_name("pilot_kernel.h")

_CTYPES = {"int64_t": ctypes.c_int64, "double": ctypes.c_double}


@dataclass(frozen=True)
class Struct:
    """A C structure of 8-byte fields: ``(C type, name, comment)`` in declaration order."""

    name: str
    doc: str
    fields: tuple[tuple[str, str, str], ...]

    @property
    def words(self) -> int:
        return len(self.fields)

    @functools.cached_property
    def _positions(self) -> dict[str, int]:
        return {name: i for i, (_, name, _) in enumerate(self.fields)}

    def index(self, field: str) -> int:
        """The word a field occupies (its position: every field is 8 bytes)."""
        i = self._positions.get(field)
        if i is None:
            raise KeyError(f"pilot kernel ABI: {self.name} has no field {field!r}")
        return i

    def ctypes(self) -> type[ctypes.Structure]:
        """The structure as a ctypes class (pointers as ``c_void_p``)."""
        fields = [(n, ctypes.c_void_p if t.endswith("*") else _CTYPES[t]) for t, n, _ in self.fields]
        return type(f"_{self.name}", (ctypes.Structure,), {"_fields_": fields, "__doc__": self.doc})

    def c_source(self) -> str:
        lines = [f"/* {self.doc} */", "typedef struct {"]
        for t, n, c in self.fields:
            decl = f"    {t}{'' if t.endswith('*') else ' '}{n};"
            lines.append(f"{decl:<34}/* {c} */" if c else decl)
        lines.append(f"}} {self.name};")
        lines.append(f"#define {self.name.removeprefix('dynn_').upper()}_WORDS {self.words}")
        return "\n".join(lines)


def _f(t: str, *names: str, c: str = "") -> tuple[tuple[str, str, str], ...]:
    return tuple((t, n, c) for n in names)


#: a FeatureState's arrays and scalars (filled by kernel.tables.StateTable)
STATE = Struct("dynn_state", "the feature state's arrays and scalars, one word per field", (
    *_f("const uint8_t *", "active", c="bool (cap,)"),
    *_f("const int64_t *", "sid", "kind"),
    *_f("const float *", "saved", "persistent", "log_bytes"),
    *_f("const int64_t *", "born", "born_phase", "last", "last_phase"),
    *_f("const float *", "count", "count_phase"),
    *_f("const int64_t *", "count_phase_of"),
    *_f("const float *", "acc_phase", c="(cap, 3)"),
    *_f("const float *", "producer_iv", c="(cap, 6)"),
    *_f("const float *", "has_producer"),
    *_f("const float *", "consumer_iv", c="(cap, 6)"),
    *_f("const int64_t *", "stack_idx", "stack_pos", "announce", "prev"),
    *_f("double *", "pred", c="owned by the policy"),
    *_f("uint8_t *", "touched", c="bool (cap,), owned by the policy"),
    *_f("const int64_t *", "prev_pos", c="previous iteration: each counterpart's access positions,"),
    *_f("const int64_t *", "prev_off", c="counterpart i's at prev_pos[prev_off[i]:prev_off[i + 1]]"),
    *_f("const float *", "prev_count"),
    *_f("const float *", "hist", c="hist_fast (6) then hist_slow (6)"),
    *_f("const float *", "l8", c="float32(log1p(n) / 8.0), the float64 path, n < ntab"),
    *_f("const float *", "l4", c="log1p(float32(n)) / 4, the float32 path"),
    *_f("const float *", "l6", c="log1p(float32(n)) / 6, the float32 path"),
    *_f("const float *", "lest", c="float32(log1p(n * ratio) / 8.0)"),
    *_f("int64_t", "cap"),
    *_f("int64_t", "nk", c="len(prev_pos)"),
    *_f("int64_t", "ntab", c="entries of each table"),
    *_f("int64_t", "prev_len"),
    *_f("double", "ratio"),
    *_f("double", "log1p_ratio", c="float32(log1p(ratio)), widened"),
    *_f("int64_t", "n_prev", c="counterparts: len(prev_count)"),
    *_f("const int64_t *", "mirror_tgt", c="per slot: the forward storage it follows, -1: none"),
    *_f("const int64_t *", "mir_pos", c="forward storage i's forward access positions:"),
    *_f("const int64_t *", "mir_off", c="mir_pos[mir_off[i]:mir_off[i + 1]] (sorted)"),
    *_f("const int64_t *", "mir_sid", c="forward storage i's id"),
    *_f("int64_t", "n_mir"),
    *_f("const int64_t *", "hint_at", c="per slot: the hinted workload step; -1 none, -2 done"),
))

#: one call's scalars at a decision point (kernel.tables.StateTable.set_point)
POINT = Struct("dynn_point", "one call: the feature state's scalars at the decision point, the slots asked for, "
               "and the counterparts of pending external storages once the kernel asked for them (rem, nrem; "
               "nrem -1: not given yet)", (
    *_f("int64_t", "pos", "phase", "phase_start", "frontier", "p_here", "q", "stack_counter"),
    *_f("int64_t", "n_live", c="live storages (log_candidates); -1: count them"),
    *_f("double", "hist_allocs"),
    *_f("const int64_t *", "rows"),
    *_f("int64_t", "m"),
    *_f("const int64_t *", "rem"),
    *_f("int64_t", "nrem"),
    *_f("int64_t", "mirror", c="forward position of the node backward runs (-1: none)"),
    *_f("int64_t", "h_active", c="the iteration has workload hints"),
    *_f("int64_t", "h_step", c="the current step,"),
    *_f("int64_t", "h_start", c="its first operator,"),
    *_f("int64_t", "h_len", c="operators per step"),
))

#: the policy's side of dynn_pilot_decide (kernel.tables.PolicyTable)
POLICY = Struct("dynn_policy", "the policy's side of dynn_pilot_decide", (
    *_f("const double *", "logreps", c="log of the buckets' representative distances"),
    *_f("const double *", "lower", c="lower end of each bucket's distances"),
    *_f("double *", "due", c="per slot"),
    *_f("int64_t *", "sids_out", c="per row: storage id and prediction"),
    *_f("double *", "score_out"),
    *_f("double", "quantile", "recheck"),
))

#: the folded model (kernel.tables.ModelTable)
MODEL = Struct("dynn_model", "the folded model (PilotModel._folded): w1 (F, H), wx (C, H), bx (H), W2 (H, H), "
               "b2, and W3 (H, KP), b3 (KP) with the K outputs zero-padded to KP, a multiple of LANES; then the "
               "input range the rows and the context are clamped to (PilotModel.bounds)", (
    *_f("const float *", "w1", "wx", "bx", "w2", "b2", "w3", "b3"),
    *_f("int64_t", "nf", "nc", "h", "k", "kp"),
    *_f("const float *", "lo", "hi", "lo_ctx", "hi_ctx"),
))

#: one operator for dynn_pilot_op (kernel.calls.NativeKernel.op)
OP = Struct("dynn_op", "one operator for dynn_pilot_op: what FeatureState.op looked up in Python, the "
            "stack's scalars in and out, and room for the results (per access the replayed next use, -1: "
            "none; the accesses that need FeatureState._match_external first)", (
    *_f("int64_t", "position", "phase"),
    *_f("const float *", "iv", c="the operator's idiom vector / 3 (6)"),
    *_f("const float *", "ivk", c="iv twice, times (1 - decay) (12)"),
    *_f("const float *", "decay", c="the histories' decays (12)"),
    *_f("float *", "hist", c="the histories, updated in place (12)"),
    *_f("const int64_t *", "alloc_slots", c="its allocations' slots"),
    *_f("const int64_t *", "alloc_prev", c="their counterparts: >= -1 set, -2 leave"),
    *_f("int64_t", "n_alloc"),
    *_f("const int64_t *", "acc_slots", c="the storages it read or wrote; -1: unknown"),
    *_f("int64_t", "n_acc"),
    *_f("int64_t", "frontier", "stack_counter"),
    *_f("int64_t *", "replay", c="out, per access"),
    *_f("int64_t *", "match", c="out: indices into acc_slots"),
    *_f("int64_t", "n_match", c="out"),
))

#: one storage for dynn_pilot_alloc (kernel.calls.NativeKernel.alloc): passed by address, since
#: ctypes converts nine scalar arguments at several times the cost of setting the fields
ALLOC = Struct("dynn_alloc", "one storage for dynn_pilot_alloc: what FeatureState.alloc computed in Python", (
    *_f("int64_t", "slot", "kind", "announce"),
    *_f("int64_t", "position", c="-1: alive when the iteration started"),
    *_f("int64_t", "phase", "prev"),
    *_f("double", "saved", "log_bytes"),
))

#: words per allocation and per told access in dynn_fused's ``words`` (the order of the fields in FUSED's comment)
FUSED_ALLOC_WORDS, FUSED_ACCESS_WORDS = 8, 3

#: one operator for dynn_pilot_operator (PilotPolicy's fused on_operator on the native backend)
FUSED = Struct("dynn_fused", "one operator for dynn_pilot_operator: PilotPolicy.on_operator's notifications and "
               "on_op's per-operator update in one call. words: per allocation (slot, sid, kind, saved, nbytes, "
               "prev, cprev, skip), then per access told to the policy (slot or -1, sid, skip), then per storage "
               "the operator read or wrote (slot or -1)", (
    *_f("int64_t", "position", "phase"),
    *_f("int64_t", "born_phase", c="the state's phase before this operator"),
    *_f("int64_t", "stage", c="1: the allocations' writes, 2: the rest, 3: both"),
    *_f("const float *", "iv", "ivk", "decay"),
    *_f("float *", "hist"),
    *_f("const int64_t *", "words"),
    *_f("int64_t", "n_alloc", "n_told", "n_acc"),
    *_f("double", "prior", c="a fresh storage's provisional prediction"),
    *_f("int64_t", "announced", "frontier", "stack_counter", c="in and out"),
    *_f("uint8_t *", "away", "skip", c="the policy's, per slot"),
    *_f("int64_t *", "where", c="per slot scratch (any contents)"),
    *_f("void *", "heap", c="the policy's eviction heap"),
    *_f("int64_t *", "replay", c="out, per access (-1: none)"),
    *_f("int64_t *", "match", c="out: indices into the accesses"),
    *_f("int64_t *", "need", c="out: indices into the told accesses that need the prior"),
    *_f("int64_t", "n_match", "n_need", c="out"),
))

#: dynn_pilot_operators' record stream: a record's first word is its tag. An operator: the tag, then
#: (position, phase, born_phase, iv address, ivk address, n_alloc, n_told, n_acc, prior row), then its
#: words as dynn_fused's except that a told access has a fourth word, its storage class (the prior's
#: column); a death: the tag, then (slot, whether to report its log_bytes: it died in forward); a
#: backward mirror's link of an allocation: the tag, then (slot, the forward storage it follows)
BATCH_OP, BATCH_FREE, BATCH_LINK = 1, 2, 3
BATCH_OP_HEAD, BATCH_ACCESS_WORDS, BATCH_FREE_WORDS = 10, 4, 3

#: a run of operators and deaths for dynn_pilot_operators (PilotPolicy.on_operators on the native backend)
BATCH = Struct("dynn_batch", "a run of records for dynn_pilot_operators: each operator as dynn_pilot_operator "
               "takes it (through the dynn_fused at fused, whose per-operator fields it fills) with the "
               "provisional priors here, each death's slot released", (
    *_f("void *", "fused", c="the policy's dynn_fused: its arrays, heap, scalars and result buffers"),
    *_f("const int64_t *", "words", c="the records"),
    *_f("int64_t", "n_words"),
    *_f("int64_t", "at", c="in: the first record's word; out: past the last record taken"),
    *_f("const double *", "priors", c="the prior table: per phase row, per storage class"),
    *_f("int64_t", "n_rows", "n_class"),
    *_f("double *", "freed_lb", c="out: log_bytes of each death that reports it, in order"),
    *_f("int64_t", "n_freed", c="in and out"),
))

STRUCTS = (STATE, POINT, POLICY, MODEL, OP, ALLOC, FUSED, BATCH)


def _starts(table: tuple[tuple[str, tuple[str, ...]], ...], prefix: str) -> list[tuple[str, int]]:
    out, i = [], 0
    for group, cols in table:
        out.append((f"{prefix}{group.upper()}", i))
        i += len(cols)
    return out


def layout() -> list[int]:
    """What a library built from the current header reports (``dynn_pilot_layout``)."""
    return [ABI, *(s.words for s in STRUCTS), FUSED_ALLOC_WORDS, FUSED_ACCESS_WORDS, BATCH_OP, BATCH_FREE,
            BATCH_LINK, BATCH_OP_HEAD, BATCH_ACCESS_WORDS, BATCH_FREE_WORDS, MAX_H, MAX_K, LANES,
            sum(len(c) for _, c in CAND_TABLE), sum(len(c) for _, c in CTX_TABLE), len(KINDS), len(THRESH),
            *THRESH, HINT_MAX, *(i for _, i in _starts(CAND_TABLE, "F_")), *(i for _, i in _starts(CTX_TABLE, "X_"))]


def header() -> str:
    """The text of ``pilot_kernel.h``."""
    out = ["/* GENERATED by dynn_runtime/pilot/kernel/abi.py from dynn_runtime/pilot/layout.py: do not edit.",
           " * Regenerate with `python -m dynn_runtime.pilot.kernel.abi`. */",
           "#ifndef DYNN_PILOT_KERNEL_H", "#define DYNN_PILOT_KERNEL_H", "", "#include <stdint.h>", "",
           f"#define DYNN_PILOT_ABI {ABI}", f"#define MAX_H {MAX_H}", f"#define MAX_K {MAX_K}", f"#define LANES {LANES}",
           f"#define FUSED_ALLOC {FUSED_ALLOC_WORDS}", f"#define FUSED_ACCESS {FUSED_ACCESS_WORDS}",
           f"#define BATCH_OP {BATCH_OP}", f"#define BATCH_FREE {BATCH_FREE}", f"#define BATCH_LINK {BATCH_LINK}",
           f"#define BATCH_OP_HEAD {BATCH_OP_HEAD}",
           f"#define BATCH_ACCESS {BATCH_ACCESS_WORDS}", f"#define BATCH_FREE_WORDS {BATCH_FREE_WORDS}",
           "", "/* ---- feature columns: a group's columns are F_<GROUP> + i ---- */",
           f"#define NF {sum(len(c) for _, c in CAND_TABLE)}", f"#define NC {sum(len(c) for _, c in CTX_TABLE)}",
           f"#define N_KINDS {len(KINDS)}", f"#define N_THRESH {len(THRESH)}", f"#define HINT_MAX {HINT_MAX}"]
    for prefix, table in (("F_", CAND_TABLE), ("X_", CTX_TABLE)):
        out.append("enum {")
        starts = _starts(table, prefix)
        out += [f"    {name} = {i}," for name, i in starts]
        out.append("};")
    out.append(f"static const int64_t THRESH[N_THRESH] = {{{', '.join(str(t) for t in THRESH)}}};")
    out.append("")
    for s in STRUCTS:
        out += [s.c_source(), ""]
    values = ", ".join(str(v) for v in layout())
    out += ["/* what dynn_pilot_layout reports: abi.layout() */", f"#define DYNN_PILOT_LAYOUT {{{values}}}", "",
            "#endif", ""]
    return "\n".join(out)


def write_header(check: bool = False) -> bool:
    """Write ``pilot_kernel.h`` from the table (``check``: only compare). Whether the file on disk
    equals the generated text (after writing: always)."""
    text = header()
    if check:
        return HEADER.is_file() and HEADER.read_text() == text
    HEADER.write_text(text)
    return True


if __name__ == "__main__":
    sys.exit(0 if write_header(check="--check" in sys.argv[1:]) else 1)

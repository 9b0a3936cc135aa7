"""Anchored edits: apply the DyNN-Offload patch series to a PyTorch source tree.

The series is data (``patches/series`` lists ``patches/edits/<name>.json``). Each
spec names new files (copied from ``patches/new_files/``) and edits; an edit
inserts a few call-site lines before or after an *anchor*, a run of consecutive
lines that must match exactly once in the file.

Rules (each is tested in tests/build_tools/test_anchored_edit.py):

1. An anchor found zero or several times is an error naming the file, the edit
   and the anchor; nothing is written (all files are planned before any write).
2. Inserted lines are wrapped in ``dynn-patch begin/end <patch>:<id>`` comment
   markers; a tree that already carries the block is left alone (idempotent),
   and a block whose content differs from the spec is an error.
3. A new file that exists with other content is an error; with the same
   content it is left alone.
4. ``revert`` removes every marker block of the series and the new files.
5. ``generate`` writes the unified ``patches/<name>.patch`` files from a tree
   (pristine or patched), so the committed series always corresponds to the
   anchors.
6. ``check`` never writes and never stops at the first problem: it reports
   every new file and every anchor (matched, not found, ambiguous, already
   applied, conflict, file missing) and exits 1 when any of them would stop
   ``apply``. ``apply`` prints the same report, then writes only if all is
   well. Anyone with a PyTorch checkout can run either without building.

Usage (also ``python -m build_tools.anchored_edit ...``)::

    python build_tools/anchored_edit.py check    --tree third_party/pytorch
    python build_tools/anchored_edit.py apply    --tree third_party/pytorch
    python build_tools/anchored_edit.py revert   --tree third_party/pytorch
    python build_tools/anchored_edit.py generate --tree third_party/pytorch [--out patches/]
"""

from __future__ import annotations

import argparse
import difflib
import enum
import hashlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PATCHES_DIR = REPO_ROOT / "patches"
if __package__ in (None, "") and str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # run as a script: make dynn_runtime importable

__all__ = [
    "BaseError",
    "AnchoredEditError",
    "Edit",
    "PatchSpec",
    "Status",
    "AnchorResult",
    "CheckRow",
    "Plan",
    "load_series",
    "plan_series",
    "check_series",
    "format_check",
    "apply_series",
    "revert_series",
    "generate_patches",
    "sha256_file",
]

_COMMENT = {".cpp": "//", ".h": "//", ".cu": "//", ".cc": "//", ".hpp": "//"}


def _error_cls():
    # build_tools runs from a bare checkout too (Docker build stage, no torch yet):
    # fall back to RuntimeError when dynn_runtime is not importable.
    try:
        from dynn_runtime.errors import NativeError

        return NativeError
    except ImportError:  # pragma: no cover - exercised only outside the venv
        return RuntimeError


BaseError = _error_cls()


class AnchoredEditError(BaseError):
    """An anchor is missing or ambiguous, or the tree holds conflicting content."""


def comment_prefix(path: str) -> str:
    """Line-comment syntax for `path` (C++ files use //, CMake/Bazel/Python use #)."""
    return _COMMENT.get(Path(path).suffix, "#")


@dataclass(frozen=True, slots=True)
class Edit:
    """One insertion of call-site lines next to an anchor."""

    id: str
    file: str
    anchor: tuple[str, ...]
    where: str  # "before" the anchor's first line or "after" its last line
    lines: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PatchSpec:
    """One patch of the series: new files plus anchored edits."""

    name: str
    summary: str
    new_files: tuple[str, ...]
    edits: tuple[Edit, ...]
    spec_path: Path


class Status(enum.Enum):
    TO_APPLY = "to apply"
    APPLIED = "already applied"


class AnchorResult(enum.Enum):
    """What ``check`` found for one anchored edit or new file (rule 6)."""

    MATCHED = "matched"  # anchor found exactly once: apply would insert here
    TO_ADD = "to add"  # new file absent: apply would create it
    APPLIED = "already applied"  # marker block / identical new file present
    NOT_FOUND = "not found"
    AMBIGUOUS = "ambiguous"
    CONFLICT = "conflict"  # marker block or new file present with other content
    FILE_MISSING = "file missing"

    @property
    def ok(self) -> bool:
        return self in (AnchorResult.MATCHED, AnchorResult.TO_ADD, AnchorResult.APPLIED)


@dataclass(frozen=True, slots=True)
class CheckRow:
    """One line of the ``check`` report."""

    patch: str
    file: str
    what: str  # edit id, or "new file"
    result: AnchorResult
    detail: str = ""  # 1-based line(s) of the anchor, or why it failed


@dataclass(slots=True)
class Plan:
    """What applying the series to a tree would do, computed without writing."""

    tree: Path
    # file -> (original text, patched text); original is what the tree holds now
    files: dict[str, tuple[str, str]] = field(default_factory=dict)
    new_files: dict[str, tuple[Path, Status]] = field(default_factory=dict)
    statuses: list[tuple[str, str, Status]] = field(default_factory=list)  # (patch, id|file, status)

    @property
    def up_to_date(self) -> bool:
        return all(s is Status.APPLIED for _, _, s in self.statuses)


def load_series(patches_dir: Path = PATCHES_DIR) -> list[PatchSpec]:
    """Read ``series`` and the JSON specs it lists, validating their shape."""
    series_file = patches_dir / "series"
    if not series_file.is_file():
        raise AnchoredEditError(
            f"build_tools: expected a series file at {series_file}, found none. "
            "Run from a dynn-runtime checkout or pass --patches-dir."
        )
    specs = []
    for raw in series_file.read_text().splitlines():
        name = raw.split("#", 1)[0].strip()
        if not name:
            continue
        spec_path = patches_dir / "edits" / f"{name}.json"
        try:
            data = json.loads(spec_path.read_text())
        except FileNotFoundError:
            raise AnchoredEditError(
                f"build_tools: series lists {name!r} but {spec_path} does not exist."
            ) from None
        except json.JSONDecodeError as exc:
            raise AnchoredEditError(f"build_tools: {spec_path} is not valid JSON: {exc}.") from None
        edits = []
        for e in data.get("edits", []):
            where = e.get("where")
            if where not in ("before", "after") or not e.get("anchor") or not e.get("lines"):
                raise AnchoredEditError(
                    f"build_tools: edit {e.get('id')!r} in {spec_path} needs a non-empty 'anchor' and "
                    f"'lines' and where='before'|'after'; found where={where!r}."
                )
            edits.append(Edit(e["id"], e["file"], tuple(e["anchor"]), where, tuple(e["lines"])))
        ids = [e.id for e in edits]
        if len(set(ids)) != len(ids):
            raise AnchoredEditError(f"build_tools: duplicate edit ids in {spec_path}: {ids}.")
        specs.append(
            PatchSpec(data.get("patch", name), data.get("summary", ""), tuple(data.get("new_files", [])),
                      tuple(edits), spec_path)
        )
    return specs


def _markers(patch: str, edit: Edit, indent: str) -> tuple[str, str]:
    c = comment_prefix(edit.file)
    return (f"{indent}{c} dynn-patch begin {patch}:{edit.id}", f"{indent}{c} dynn-patch end {patch}:{edit.id}")


def _read(path: Path) -> str:
    with open(path, encoding="utf-8", newline="") as f:  # keep CRLF as is
        return f.read()


def _write(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)


def _split(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def _bare(line: str) -> str:
    return line.rstrip("\r\n")


def _newline_of(lines: list[str]) -> str:
    return "\r\n" if lines and lines[0].endswith("\r\n") else "\n"


def _find_anchor(lines: list[str], anchor: tuple[str, ...]) -> list[int]:
    n = len(anchor)
    bare = [_bare(x) for x in lines]
    return [i for i in range(len(bare) - n + 1) if tuple(bare[i : i + n]) == anchor]


def _locate(text: str, patch: str, edit: Edit) -> tuple[AnchorResult, int, str]:
    """Classify `edit` against `text` without changing it: (result, line index, detail)."""
    bare = [_bare(x) for x in _split(text)]
    # Rule 2: an existing block means "already applied" if it matches the spec.
    begin_suffix = f"dynn-patch begin {patch}:{edit.id}"
    begins = [i for i, b in enumerate(bare) if b.strip().endswith(begin_suffix)]
    if begins:
        i = begins[0]
        indent = bare[i][: len(bare[i]) - len(bare[i].lstrip())]
        _, end = _markers(patch, edit, indent)
        expected = list(edit.lines)
        found = bare[i + 1 : i + 1 + len(expected)]
        closed = i + 1 + len(expected) < len(bare) and bare[i + 1 + len(expected)] == end
        if len(begins) > 1 or found != expected or not closed:
            return AnchorResult.CONFLICT, i, f"marker block at line {i + 1} differs from {patch}.json"
        return AnchorResult.APPLIED, i, f"marker block at line {i + 1}"
    hits = _find_anchor(_split(text), edit.anchor)
    if not hits:
        return AnchorResult.NOT_FOUND, -1, f"anchor {list(edit.anchor)!r}"
    if len(hits) > 1:
        return AnchorResult.AMBIGUOUS, -1, f"found {len(hits)} times (at lines {[h + 1 for h in hits]})"
    return AnchorResult.MATCHED, hits[0], f"line {hits[0] + 1}"


def _apply_edit(text: str, patch: str, edit: Edit) -> tuple[str, Status]:
    result, i, detail = _locate(text, patch, edit)
    if result is AnchorResult.APPLIED:
        return text, Status.APPLIED
    if result is AnchorResult.CONFLICT:
        raise AnchoredEditError(
            f"build_tools: {edit.file}: edit {patch}:{edit.id} is present but differs from "
            f"{patch}.json (expected {len(edit.lines)} lines between the markers). The tree was patched "
            "by another version of the series: run `python build_tools/anchored_edit.py revert --tree "
            "DIR` (or `git checkout -- .` in the source tree) and apply again."
        )
    if result is not AnchorResult.MATCHED:
        what = "not found" if result is AnchorResult.NOT_FOUND else detail
        raise AnchoredEditError(
            f"build_tools: {edit.file}: anchor of edit {patch}:{edit.id} {what}; expected exactly once. "
            f"Anchor: {list(edit.anchor)!r}. Upstream moved: find the new call site, update the anchor in "
            f"patches/edits/{patch}.json, then regenerate the patches (`anchored_edit.py check` lists "
            "every anchor's result at once)."
        )
    lines = _split(text)
    nl = _newline_of(lines)
    ref = edit.anchor[0] if edit.where == "before" else edit.anchor[-1]
    indent = ref[: len(ref) - len(ref.lstrip())]
    begin, end = _markers(patch, edit, indent)
    block = [begin + nl] + [x + nl for x in edit.lines] + [end + nl]
    at = i if edit.where == "before" else i + len(edit.anchor)
    if at == len(lines) and lines and not lines[-1].endswith(("\n", "\r")):
        lines[-1] += nl
    return "".join(lines[:at] + block + lines[at:]), Status.TO_APPLY


def plan_series(
    tree: Path, specs: Sequence[PatchSpec], new_files_root: Path = PATCHES_DIR / "new_files"
) -> Plan:
    """Compute every change (rules 1-3) without writing; raises on the first conflict."""
    tree = Path(tree)
    if not tree.is_dir():
        raise AnchoredEditError(
            f"build_tools: expected a PyTorch source tree at {tree}, found no directory. "
            "Clone it with build_tools/build_wheel.py or pass --source DIR."
        )
    plan = Plan(tree=tree)
    for spec in specs:
        for rel in spec.new_files:
            src = new_files_root / rel
            if not src.is_file():
                raise AnchoredEditError(f"build_tools: {spec.name} lists new file {rel} but {src} is missing.")
            dst = tree / rel
            if dst.exists():
                if dst.read_bytes() != src.read_bytes():
                    raise AnchoredEditError(
                        f"build_tools: {dst} exists and differs from {src}. Expected it absent (pristine "
                        "tree) or identical (already patched); revert the tree and apply again."
                    )
                status = Status.APPLIED
            else:
                status = Status.TO_APPLY
            plan.new_files[rel] = (src, status)
            plan.statuses.append((spec.name, rel, status))
        for edit in spec.edits:
            if edit.file not in plan.files:
                path = tree / edit.file
                if not path.is_file():
                    raise AnchoredEditError(
                        f"build_tools: {spec.name}:{edit.id} edits {edit.file}, which is missing from {tree}. "
                        "Is this a PyTorch source tree of the pinned release (patches/PYTORCH_PIN)?"
                    )
                text = _read(path)
                plan.files[edit.file] = (text, text)
            original, current = plan.files[edit.file]
            new, status = _apply_edit(current, spec.name, edit)
            plan.files[edit.file] = (original, new)
            plan.statuses.append((spec.name, edit.id, status))
    return plan


def check_series(
    tree: Path, specs: Sequence[PatchSpec], new_files_root: Path = PATCHES_DIR / "new_files"
) -> list[CheckRow]:
    """Report every new file and anchor of the series against `tree` (rule 6); writes nothing.

    Edits are simulated in series order on an in-memory copy, so an anchor is
    judged against the text that ``apply`` would see at that point.
    """
    tree = Path(tree)
    if not tree.is_dir():
        raise AnchoredEditError(
            f"build_tools: expected a PyTorch source tree at {tree}, found no directory. "
            "Pass the root of a PyTorch checkout (the folder holding c10/ and torch/)."
        )
    rows: list[CheckRow] = []
    texts: dict[str, str | None] = {}
    for spec in specs:
        for rel in spec.new_files:
            src, dst = new_files_root / rel, tree / rel
            if not dst.exists():
                result = AnchorResult.TO_ADD
            elif src.is_file() and dst.read_bytes() == src.read_bytes():
                result = AnchorResult.APPLIED
            else:
                result = AnchorResult.CONFLICT
            rows.append(CheckRow(spec.name, rel, "new file", result))
        for edit in spec.edits:
            if edit.file not in texts:
                path = tree / edit.file
                texts[edit.file] = _read(path) if path.is_file() else None
            text = texts[edit.file]
            if text is None:
                rows.append(CheckRow(spec.name, edit.file, edit.id, AnchorResult.FILE_MISSING, str(tree)))
                continue
            result, _, detail = _locate(text, spec.name, edit)
            if result is AnchorResult.MATCHED:
                texts[edit.file], _ = _apply_edit(text, spec.name, edit)
            rows.append(CheckRow(spec.name, edit.file, edit.id, result, detail))
    return rows


def format_check(rows: Sequence[CheckRow]) -> str:
    """The ``check`` report: one aligned line per row, then a summary line."""
    width_file = max((len(r.file) for r in rows), default=4)
    width_what = max((len(f"{r.patch[:4]}:{r.what}") for r in rows), default=4)
    out = []
    for r in rows:
        what = f"{r.patch[:4]}:{r.what}"
        out.append(f"{r.file:<{width_file}}  {what:<{width_what}}  {r.result.value:<15}  {r.detail}".rstrip())
    bad = [r for r in rows if not r.result.ok]
    out.append(
        f"{len(rows)} checked, {len(rows) - len(bad)} ok, {len(bad)} failed"
        + ("" if not bad else ": " + ", ".join(f"{r.patch[:4]}:{r.what}" for r in bad))
    )
    return "\n".join(out)


def apply_series(plan: Plan) -> list[str]:
    """Write a plan; returns the paths written (empty when already applied)."""
    written = []
    for rel, (src, status) in plan.new_files.items():
        if status is Status.TO_APPLY:
            dst = plan.tree / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())
            written.append(rel)
    for rel, (original, new) in plan.files.items():
        if new != original:
            _write(plan.tree / rel, new)
            written.append(rel)
    return written


def strip_blocks(text: str) -> str:
    """Remove every dynn-patch marker block (rule 4)."""
    out, skipping = [], False
    for line in _split(text):
        b = _bare(line).strip()
        if " dynn-patch begin " in f" {b}":
            skipping = True
            continue
        if " dynn-patch end " in f" {b}":
            skipping = False
            continue
        if not skipping:
            out.append(line)
    return "".join(out)


def revert_series(
    tree: Path, specs: Sequence[PatchSpec], new_files_root: Path = PATCHES_DIR / "new_files"
) -> list[str]:
    """Undo the series in `tree`; returns the paths changed."""
    changed = []
    files = sorted({e.file for s in specs for e in s.edits})
    for rel in files:
        path = tree / rel
        if path.is_file():
            text = _read(path)
            new = strip_blocks(text)
            if new != text:
                _write(path, new)
                changed.append(rel)
    for spec in specs:
        for rel in spec.new_files:
            dst, src = tree / rel, new_files_root / rel
            if dst.is_file() and src.is_file() and dst.read_bytes() == src.read_bytes():
                dst.unlink()
                changed.append(rel)
                # folders apply created for new files (torch/csrc/dynn) go too; git trees hold no
                # empty folders, so an empty one here was made by the series
                parent = dst.parent
                while parent != tree and parent.is_dir() and not any(parent.iterdir()):
                    parent.rmdir()
                    parent = parent.parent
    return changed


def _diff(rel: str, before: str | None, after: str) -> str:
    a = [] if before is None else _split(before)
    b = _split(after)
    head = f"diff --git a/{rel} b/{rel}\n"
    if before is None:
        head += "new file mode 100644\n"
    body = difflib.unified_diff(a, b, "/dev/null" if before is None else f"a/{rel}", f"b/{rel}", n=3)
    return head + "".join(body)


def generate_patches(
    tree: Path,
    specs: Sequence[PatchSpec],
    out_dir: Path,
    new_files_root: Path = PATCHES_DIR / "new_files",
    source_note: str = "",
) -> list[Path]:
    """Write one unified ``<name>.patch`` per spec, cumulative in series order (rule 5)."""
    tree = Path(tree)
    out_dir.mkdir(parents=True, exist_ok=True)
    state: dict[str, str] = {}
    written = []
    for spec in specs:
        parts = []
        for rel in spec.new_files:
            parts.append(_diff(rel, None, (new_files_root / rel).read_text(encoding="utf-8")))
        touched = []
        for edit in spec.edits:
            if edit.file not in state:
                path = tree / edit.file
                if not path.is_file():
                    raise AnchoredEditError(f"build_tools: cannot generate: {path} is missing.")
                state[edit.file] = strip_blocks(_read(path))
            if edit.file not in touched:
                touched.append(edit.file)
        before = {rel: state[rel] for rel in touched}
        for edit in spec.edits:
            state[edit.file], _ = _apply_edit(state[edit.file], spec.name, edit)
        for rel in touched:
            parts.append(_diff(rel, before[rel], state[rel]))
        header = (
            f"From: dynn-runtime patches/edits/{spec.name}.json (generated by build_tools/anchored_edit.py)\n"
            f"Subject: [PATCH] {spec.summary}\n"
        )
        if source_note:
            header += f"Generated against: {source_note}\n"
        target = out_dir / f"{spec.name}.patch"
        target.write_text(header + "\n" + "".join(parts), encoding="utf-8")
        written.append(target)
    return written


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="anchored_edit.py", description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["check", "apply", "revert", "generate"])
    p.add_argument("--tree", required=True, type=Path, help="PyTorch source tree")
    p.add_argument("--patches-dir", type=Path, default=PATCHES_DIR, help="default: patches/ of this checkout")
    p.add_argument("--out", type=Path, help="generate: output folder (default: --patches-dir)")
    p.add_argument("--source-note", default="", help="generate: what the tree is, for the patch header")
    args = p.parse_args(argv)
    specs = load_series(args.patches_dir)
    nf = args.patches_dir / "new_files"
    try:
        if args.command == "check":
            rows = check_series(args.tree, specs, nf)
            print(format_check(rows))
            return 0 if all(r.result.ok for r in rows) else 1
        if args.command == "apply":
            rows = check_series(args.tree, specs, nf)
            print(format_check(rows))
            if not all(r.result.ok for r in rows):
                print("anchored_edit: nothing written (fix the anchors above first)", file=sys.stderr)
                return 1
            written = apply_series(plan_series(args.tree, specs, nf))
            print(f"wrote {len(written)} file(s)" if written else "tree already patched; nothing written")
        elif args.command == "revert":
            changed = revert_series(args.tree, specs, nf)
            print(f"reverted {len(changed)} file(s)")
        else:
            for path in generate_patches(args.tree, specs, args.out or args.patches_dir, nf, args.source_note):
                print(f"wrote {path}")
    except AnchoredEditError as exc:
        print(f"anchored_edit: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main())

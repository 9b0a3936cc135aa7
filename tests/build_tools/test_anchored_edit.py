"""Anchored edits against the stand-in tree: found, applied once, idempotent, failing loudly."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from build_tools import anchored_edit as ae

ROOT = Path(__file__).resolve().parents[2]
PATCHES = ROOT / "patches"


def _apply(tree: Path, specs=None) -> list[str]:
    return ae.apply_series(ae.plan_series(tree, specs or ae.load_series()))


def _snapshot(tree: Path) -> dict[str, bytes]:
    return {str(p.relative_to(tree)): p.read_bytes() for p in sorted(tree.rglob("*")) if p.is_file()}


def test_series_lists_every_spec_and_new_file():
    specs = ae.load_series()
    assert [s.name for s in specs] == [p.stem for p in sorted((PATCHES / "edits").glob("*.json"))]
    listed = {rel for s in specs for rel in s.new_files}
    on_disk = {str(p.relative_to(PATCHES / "new_files")) for p in (PATCHES / "new_files").rglob("*") if p.is_file()}
    assert listed == on_disk
    for s in specs:  # call sites stay small: the logic lives in the new files
        assert all(len(e.lines) <= 10 for e in s.edits)


def test_apply_inserts_each_block_exactly_once(tree):
    written = _apply(tree)
    assert "c10/cuda/CUDACachingAllocator.cpp" in written and "c10/cuda/DynnReclaim.h" in written
    for spec in ae.load_series():
        for edit in spec.edits:
            text = (tree / edit.file).read_text()
            assert text.count(f"dynn-patch begin {spec.name}:{edit.id}") == 1
            assert len(ae._find_anchor(ae._split(text), edit.anchor)) == 1  # anchor kept intact
    alloc = (tree / "c10/cuda/CUDACachingAllocator.cpp").read_text()
    # the reclaim call site sits right before the OOM branch
    assert alloc.index("reclaim_and_retry") < alloc.index("// For any error code other than")
    engine = (tree / "torch/csrc/autograd/engine.cpp").read_text()
    assert engine.index("before_node(*func)") < engine.index("auto outputs = call_function")


def test_apply_is_idempotent(tree):
    _apply(tree)
    before = _snapshot(tree)
    plan = ae.plan_series(tree, ae.load_series())
    assert plan.up_to_date
    assert ae.apply_series(plan) == []
    assert _snapshot(tree) == before


def test_revert_restores_the_pristine_tree(tree):
    pristine = _snapshot(tree)
    _apply(tree)
    ae.revert_series(tree, ae.load_series())
    assert _snapshot(tree) == pristine
    assert not (tree / "torch/csrc/dynn").exists()  # the folder apply created is gone too


def test_missing_anchor_fails_loudly_and_writes_nothing(tree):
    f = tree / "torch/csrc/autograd/engine.cpp"
    f.write_text(f.read_text().replace("  auto outputs = call_function(graph_task, func, inputs);\n",
                                       "  auto outputs = call_function(graph_task, func, inputs, 1);\n"))
    before = _snapshot(tree)
    with pytest.raises(ae.AnchoredEditError) as info:
        _apply(tree)
    msg = str(info.value)
    assert msg.startswith("build_tools: torch/csrc/autograd/engine.cpp: anchor of edit")
    assert "engine-fetch-call-site" in msg and "not found" in msg and "expected exactly once" in msg
    assert _snapshot(tree) == before  # planned before any write


def test_ambiguous_anchor_fails_loudly(tree):
    f = tree / "c10/cuda/CUDACachingAllocator.cpp"
    f.write_text(f.read_text() + "    *devPtr = (void*)block->ptr;\n")
    with pytest.raises(ae.AnchoredEditError, match=r"alloc-observer-call-site found 2 times"):
        _apply(tree)


def test_multiline_anchor_must_match_consecutive_lines(tree):
    f = tree / "c10/cuda/CUDACachingAllocator.cpp"
    f.write_text(f.read_text().replace("    if (!block_found) {\n      // For any",
                                       "    if (!block_found) {\n\n      // For any"))
    with pytest.raises(ae.AnchoredEditError, match="alloc-reclaim-call-site not found"):
        _apply(tree)


def test_block_from_another_series_version_is_an_error(tree):
    _apply(tree)
    f = tree / "torch/csrc/autograd/engine.cpp"
    f.write_text(f.read_text().replace("before_node(*func);", "before_node(*func, 2);"))
    with pytest.raises(ae.AnchoredEditError, match="present but differs"):
        ae.plan_series(tree, ae.load_series())


def test_conflicting_new_file_is_an_error(tree):
    (tree / "c10/cuda/DynnHooks.h").write_text("// someone else's file\n")
    with pytest.raises(ae.AnchoredEditError, match="exists and differs"):
        _apply(tree)


def test_missing_upstream_file_says_what_is_wrong(tree):
    (tree / "torch/csrc/Module.cpp").unlink()
    with pytest.raises(ae.AnchoredEditError, match="missing from .*pinned release"):
        _apply(tree)


def test_crlf_files_keep_their_line_endings(tree):
    f = tree / "c10/cuda/CMakeLists.txt"
    f.write_bytes(f.read_bytes().replace(b"\n", b"\r\n"))
    _apply(tree)
    data = f.read_bytes()
    assert b"    DynnHooks.cpp\r\n" in data and b"\n" not in data.replace(b"\r\n", b"")


def test_bad_spec_is_rejected(tmp_path):
    (tmp_path / "edits").mkdir()
    (tmp_path / "series").write_text("0001-x\n")
    (tmp_path / "edits" / "0001-x.json").write_text(json.dumps(
        {"edits": [{"id": "a", "file": "f", "anchor": ["x"], "where": "around", "lines": ["y"]}]}))
    with pytest.raises(ae.AnchoredEditError, match="where='before'|'after'"):
        ae.load_series(tmp_path)


def test_committed_patches_match_the_anchors(tmp_path):
    """patches/*.patch are exactly what `generate` produces from patches/anchor_context."""
    note = next(line for line in (PATCHES / f"{ae.load_series()[0].name}.patch").read_text().splitlines()
                if line.startswith("Generated against: ")).removeprefix("Generated against: ")
    out = ae.generate_patches(PATCHES / "anchor_context", ae.load_series(), tmp_path, source_note=note)
    for p in out:
        assert p.read_text() == (PATCHES / p.name).read_text(), (
            f"{p.name} is stale: run python build_tools/anchored_edit.py generate --tree patches/anchor_context "
            "--source-note '...'")


def test_generate_from_a_patched_tree_is_the_same(tree, tmp_path):
    a = ae.generate_patches(tree, ae.load_series(), tmp_path / "a")
    _apply(tree)
    b = ae.generate_patches(tree, ae.load_series(), tmp_path / "b")
    assert [p.read_text() for p in a] == [p.read_text() for p in b]


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_git_apply_of_generated_patches_equals_anchored_apply(tree, tmp_path):
    patches = ae.generate_patches(tree, ae.load_series(), tmp_path / "p")
    other = tmp_path / "other"
    shutil.copytree(tree, other)
    subprocess.run(["git", "apply", *map(str, patches)], cwd=other, check=True, capture_output=True)
    _apply(tree)
    assert _snapshot(other) == _snapshot(tree)


def test_cli_check_apply_revert(tree, capsys):
    assert ae._main(["check", "--tree", str(tree)]) == 0
    out = capsys.readouterr().out
    assert "matched" in out and "to add" in out and out.rstrip().endswith("ok, 0 failed")
    assert ae._main(["apply", "--tree", str(tree)]) == 0
    assert ae._main(["apply", "--tree", str(tree)]) == 0
    assert "already patched" in capsys.readouterr().out
    assert ae._main(["revert", "--tree", str(tree)]) == 0
    assert ae._main(["check", "--tree", str(tree / "nope")]) == 2
    assert "expected a PyTorch source tree" in capsys.readouterr().err


def _edit_ids():
    return [(s.name, e.id) for s in ae.load_series() for e in s.edits]


def test_check_reports_every_anchor_and_writes_nothing(tree):
    before = _snapshot(tree)
    rows = ae.check_series(tree, ae.load_series())
    assert _snapshot(tree) == before
    edits = [(r.patch, r.what) for r in rows if r.what != "new file"]
    assert edits == _edit_ids()
    assert all(r.result is ae.AnchorResult.MATCHED for r in rows if r.what != "new file")
    assert {r.result for r in rows if r.what == "new file"} == {ae.AnchorResult.TO_ADD}


def test_check_goes_on_past_failures_and_names_each(tree, capsys):
    alloc = tree / "c10/cuda/CUDACachingAllocator.cpp"
    text = alloc.read_text()
    alloc.write_text(text.replace("    *devPtr = (void*)block->ptr;\n", ""))  # not found
    engine = tree / "torch/csrc/autograd/engine.cpp"
    engine.write_text(engine.read_text() + "    heap_.push(std::move(item));\n")  # ambiguous
    (tree / "build_variables.bzl").unlink()  # file missing
    rows = {(r.patch[:4], r.what): r for r in ae.check_series(tree, ae.load_series())}
    assert rows[("0001", "alloc-observer-call-site")].result is ae.AnchorResult.NOT_FOUND
    assert rows[("0001", "free-observer-call-site")].result is ae.AnchorResult.MATCHED  # kept going
    assert rows[("0002", "engine-ready-call-site")].result is ae.AnchorResult.AMBIGUOUS
    assert rows[("0002", "bazel-core-sources")].result is ae.AnchorResult.FILE_MISSING
    assert rows[("0003", "bazel-python-sources")].result is ae.AnchorResult.FILE_MISSING
    assert ae._main(["check", "--tree", str(tree)]) == 1
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert "4 failed" in last and "0001:alloc-observer-call-site" in last


def test_check_after_apply_says_already_applied_and_sees_conflicts(tree):
    _apply(tree)
    rows = ae.check_series(tree, ae.load_series())
    assert {r.result for r in rows} == {ae.AnchorResult.APPLIED}
    cmake = tree / "c10/cuda/CMakeLists.txt"
    cmake.write_text(cmake.read_text().replace("    DynnHooks.cpp\n", "    Other.cpp\n"))
    rows = {r.what: r.result for r in ae.check_series(tree, ae.load_series())}
    assert rows["cmake-sources"] is ae.AnchorResult.CONFLICT


def test_cli_apply_prints_every_anchor_and_writes_nothing_on_a_failure(tree, capsys):
    f = tree / "torch/csrc/Module.cpp"
    f.write_text(f.read_text().replace("THPEngine_initModule", "THPEngine_init"))
    before = _snapshot(tree)
    assert ae._main(["apply", "--tree", str(tree)]) == 1
    out = capsys.readouterr()
    assert "0003:module-init-call-site" in out.out and "not found" in out.out and "matched" in out.out
    assert "nothing written" in out.err and _snapshot(tree) == before

"""`dynn idioms` through the main command line."""

from __future__ import annotations

import csv

from dynn_runtime.cli import main
from dynn_runtime.idioms import agreement, all_vectors


def test_table_lists_every_operator(capsys):
    assert main(["idioms"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [ln for ln in out[2:] if ln.strip()]
    assert len(rows) == len(all_vectors())
    conv = next(ln for ln in rows if ln.split()[0] == "convolution")
    assert conv.split()[1:] == ["0", "1", "0", "1", "1", "2", "override:convolution"]


def test_single_op_shows_rule(capsys):
    assert main(["idioms", "--op", "max_pool3d"]) == 0
    out = capsys.readouterr().out
    assert "0 0 0 1 0 1" in out and "rule         pool" in out and "window       1" in out


def test_unknown_op_exit_code_and_message(capsys):
    assert main(["idioms", "--op", "max_pool3" + "dd"]) == 2
    err = capsys.readouterr().err
    assert "idioms: unknown operator 'max_pool3dd'" in err and "max_pool3d" in err


def test_export_csv_round_trip(tmp_path, capsys):
    path = tmp_path / "idioms.csv"
    assert main(["idioms", "--export", "csv", "-o", str(path)]) == 0
    with path.open() as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == ["operator", "i0", "i1", "i2", "i3", "i4", "i5"]
    names = [r[0] for r in rows[1:]]
    assert names == sorted(names) and len(names) == len(set(names))
    vecs = all_vectors()
    assert {r[0]: tuple(int(x) for x in r[1:]) for r in rows[1:]} == {
        k: v.as_tuple() for k, v in vecs.items()
    }


def test_export_csv_to_stdout(capsys):
    assert main(["idioms", "--export", "csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "operator,i0,i1,i2,i3,i4,i5"
    assert "transpose,1,0,0,0,0,0" in lines


def test_agreement_command(capsys):
    assert main(["idioms", "--agreement"]) == 0
    out = capsys.readouterr().out
    rep = agreement()
    assert f"{rep.exact}/{rep.compared} exact" in out
    assert "per position:" in out
    for m in rep.mismatches:
        assert m.op in out

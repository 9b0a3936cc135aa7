"""Unit tests of the idiom tool: vectors of hand-checked operators, lookup forms, errors, caching."""

from __future__ import annotations

import dataclasses
import doctest
import os
import subprocess
import sys

import pytest
import torch

import dynn_runtime.idioms as idioms
from dynn_runtime.errors import ConfigError, DynnError
from dynn_runtime.idioms import IDIOM_NAMES, IdiomVector, all_vectors, idiom_vector
from dynn_runtime.idioms import generator as gen

aten = torch.ops.aten


# Hand-checked: each line says which idiom(s) the op must show and why.
KNOWN = {
    # in-place pointwise: read-modify-write of self, nothing else (paper row add_)
    "add_.Tensor": ((0, 1, 0, 0, 0, 0), "inplace"),
    "relu_": ((0, 1, 0, 0, 0, 0), "inplace"),
    # out-of-place pointwise: one elementwise stage
    "add.Tensor": ((0, 0, 0, 0, 1, 0), "pointwise"),
    # transpose: a view that permutes the order (paper row transpose)
    "transpose.int": ((1, 0, 0, 0, 0, 0), "transpose"),
    "permute": ((1, 0, 0, 0, 0, 0), "transpose"),
    # conv2d: a front end decomposed into `convolution` (paper row conv2d)
    "conv2d": ((0, 0, 0, 0, 1, 0), "conv"),
    # a lowered planar convolution kernel: accumulate, window reduction, MAC + bias, window 2
    "mkldnn_convolution": ((0, 1, 0, 1, 2, 2), "conv"),
    "conv_transpose2d.input": ((1, 1, 0, 1, 2, 2), "conv"),
    "slow_conv3d": ((0, 1, 0, 1, 2, 3), "conv"),
    # pools: a window reduction; max_pool3d has the window idiom, max_pool2d not (paper rows)
    "max_pool3d": ((0, 0, 0, 1, 0, 1), "pool"),
    "max_pool2d": ((0, 0, 0, 1, 0, 0), "pool"),
    "avg_pool1d": ((0, 0, 0, 1, 0, 1), "pool"),
    # views: no data movement
    "view": ((0, 0, 0, 0, 0, 0), "view"),
    "expand": ((0, 0, 0, 0, 0, 0), "view"),
    # matrix products: accumulate into the output, a contraction, a MAC stage (+ bias for addmm)
    "mm": ((0, 1, 0, 1, 1, 0), "matmul"),
    "addmm": ((0, 1, 0, 1, 2, 0), "matmul"),
    # index ops: gather reads indirectly; scatter writes indirectly; scatter_add accumulates
    "gather": ((0, 0, 1, 0, 0, 0), "index_read"),
    "scatter.src": ((0, 1, 1, 0, 0, 0), "index_write"),
    "scatter_add": ((0, 1, 1, 1, 0, 0), "index_accumulate"),
    "gather_backward": ((0, 1, 1, 1, 0, 0), "index_accumulate"),
    "embedding_backward": ((0, 1, 1, 1, 1, 0), "index_accumulate"),
    # pointwise backward: VJP (reduction) + derivative arithmetic (paper rows *_backward)
    "tanh_backward": ((0, 0, 0, 1, 1, 0), "pointwise_backward"),
    # reductions
    "sum.dim_IntList": ((0, 0, 0, 1, 0, 0), "reduction"),
    # copies
    "cat": ((0, 0, 0, 0, 0, 0), "copy"),
    "clone": ((0, 0, 0, 0, 0, 0), "copy"),
}


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_known_vectors(name):
    values, source = KNOWN[name]
    v = idiom_vector(name)
    assert v.as_tuple() == values, f"{name}: {v}"
    assert v.source == source


def test_idiom_names_and_vector_type():
    assert len(IDIOM_NAMES) == 6 and len(set(IDIOM_NAMES)) == 6
    v = idiom_vector("mm")
    assert isinstance(v, IdiomVector)
    assert tuple(v) == v.as_tuple() and len(v) == 6 and v[3] == 1
    assert dict(zip(IDIOM_NAMES, v, strict=True)) == {n: getattr(v, n) for n in IDIOM_NAMES}
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.transpose = 1


def test_all_forms_of_an_operator_agree():
    expected = idiom_vector("aten::convolution")
    assert expected.as_tuple() == (0, 1, 0, 1, 1, 2)
    assert idiom_vector("convolution") == expected
    assert idiom_vector("convolution.default") == expected
    assert idiom_vector(aten.convolution.default) == expected
    assert idiom_vector(aten.convolution) == expected
    assert idiom_vector(aten.add_.Tensor) == idiom_vector("add_.Tensor")
    assert idiom_vector(aten.relu.default) == idiom_vector("relu")


def test_out_overload_sets_accumulate_but_base_name_uses_functional_overload():
    assert idiom_vector("mm.out").as_tuple() == (0, 1, 0, 1, 1, 0)
    assert idiom_vector("mm.out").source == "matmul+out"
    assert idiom_vector("add.out").as_tuple() == (0, 1, 0, 0, 0, 0)
    assert all_vectors()["add"].as_tuple() == (0, 0, 0, 0, 1, 0)  # add.Tensor, not add.out
    assert all_vectors()["where"].source == "pointwise"  # where.self, not where(condition)


def test_unknown_operator_error_names_it_and_suggests():
    with pytest.raises(ConfigError) as info:
        idiom_vector("convolutoin")
    msg = str(info.value)
    assert isinstance(info.value, DynnError)
    assert msg.startswith("idioms: ")
    assert "'convolutoin'" in msg
    assert "convolution" in msg.split("Did you mean:")[1]


def test_unknown_overload_lists_choices():
    with pytest.raises(ConfigError, match=r"idioms: .*add_.*no overload 'Nope'.*Tensor"):
        idiom_vector("add_.Nope")


def test_wrong_type_is_a_clear_error():
    with pytest.raises(ConfigError, match="idioms: idiom_vector expects"):
        idiom_vector(42)


def test_every_operator_gets_a_vector_with_a_known_rule():
    vecs = all_vectors()
    assert len(vecs) > 1000
    assert list(vecs) == sorted(vecs)
    from dynn_runtime.idioms.rules import OVERRIDES, RULE_NAMES

    for name, v in vecs.items():
        assert all(isinstance(x, int) and x >= 0 for x in v.as_tuple()), name
        assert v.transpose in (0, 1) and v.accumulate in (0, 1) and v.indirect in (0, 1), name
        head = v.source.split("+")[0]
        assert head in RULE_NAMES or head.startswith("override:"), (name, v.source)
    assert len(OVERRIDES) <= 15
    defaults = sum(1 for v in vecs.values() if v.source == "default")
    assert defaults < 0.1 * len(vecs)


def test_generator_is_deterministic_in_process():
    first = all_vectors()
    gen._all_vectors.cache_clear()
    gen._vector_by_name.cache_clear()
    gen._primary_overload.cache_clear()
    second = all_vectors()
    assert first == second


def test_generator_is_deterministic_across_processes(tmp_path):
    from dynn_runtime.idioms.cli import export_csv

    out = tmp_path / "other.csv"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    code = (
        "import sys; from dynn_runtime.idioms.cli import export_csv; "
        "open(sys.argv[1], 'w').write(export_csv())"
    )
    subprocess.run([sys.executable, "-c", code, str(out)], check=True, env=env)
    assert out.read_text() == export_csv()


def test_cached_lookup_is_a_cache_hit():
    op = aten.mul.Tensor
    idiom_vector(op)  # warm
    before_fast = gen.overload_cache_info()
    before_name = gen.cache_info()
    for _ in range(1000):
        idiom_vector(op)
    after_fast = gen.overload_cache_info()
    after_name = gen.cache_info()
    assert after_fast.hits - before_fast.hits == 1000
    assert after_fast.misses == before_fast.misses
    assert after_name.misses == before_name.misses  # no rule was re-run
    idiom_vector("mul.Tensor")
    before = gen.cache_info()
    idiom_vector("mul.Tensor")
    assert gen.cache_info().hits == before.hits + 1


@pytest.mark.parametrize(
    "module",
    [
        "dynn_runtime.idioms",
        "dynn_runtime.idioms.vector",
        "dynn_runtime.idioms.generator",
        "dynn_runtime.idioms.agreement",
    ],
)
def test_docstring_examples_run(module):
    import importlib

    mod = importlib.import_module(module)
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = [t for t in finder.find(mod, module) if t.examples]
    assert tests, f"{module} has no docstring examples"
    for t in tests:
        runner.run(t)
    assert runner.failures == 0


def test_public_api():
    for name in ("IDIOM_NAMES", "IdiomVector", "idiom_vector", "all_vectors", "agreement", "AgreementReport"):
        assert name in idioms.__all__
        assert getattr(idioms, name).__doc__


def test_docs_examples_run():
    import pathlib

    doc = pathlib.Path(__file__).resolve().parents[2] / "docs" / "idioms.md"
    result = doctest.testfile(str(doc), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 3 and result.failed == 0

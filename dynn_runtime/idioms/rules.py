"""Rules that turn an operator's schema, tags and name into an idiom vector.

The generator looks at facts any registered operator carries (its ``FunctionSchema`` with alias
annotations, its ``torch.Tag`` set, its name) and applies the rules below **in order; the first
rule that matches decides**. A vector's ``source`` is the name of that rule, ``override:<op>``
for the few operators listed in :data:`OVERRIDES`, or ``default`` when nothing matched.

Numbered semantics (the reasons are in ``docs/idioms.md``):

1. An override wins over everything (a short table of genuine rule failures).
2. Operators that touch no tensor (profiler markers, TorchScript scalar ops) are all-zero.
3. A mutating variant (in-place ``name_`` / ``Tensor(a!) self``, or ``out=``) is the functional
   variant with ``accumulate`` set; for a pointwise operator the read-modify-write replaces the
   elementwise stage, so it is ``(0, 1, 0, 0, 0, 0)`` (the paper's ``relu_`` and ``add_``).
4. Family rules by name and arguments, most specific first: transposes, im2col, convolutions,
   pools, normalisation layers, losses, index accumulate / write / read, sorting, matrix
   products, attention, softmax, reductions, pointwise backward, dropout, pointwise, copies,
   views, factories.
5. ``quantized_*`` operators get ``accumulate`` set on top of their family's vector (int8 kernels
   accumulate in int32 and requantize into the output).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from .names import (
    _ATTENTION_RE,
    _COPY,
    _DROPOUT_RE,
    _FFT_RE,
    _INDEX_ACCUMULATE,
    _INDEX_READ,
    _INDEX_READ_REDUCE,
    _INDEX_WRITE,
    _INTERPOLATE_RE,
    _LINALG_RE,
    _LOSS_NAMES,
    _MATMUL,
    _NORM_RE,
    _OUTER,
    _POINTWISE_ALIASES,
    _RANDOM,
    _REDUCTIONS,
    _REDUCTIONS_COMPUTE,
    _REGION_SCATTER,
    _RNN_RE,
    _SOFTMAX_RE,
    _SORT,
    _SORT_SELECT,
    _TRANSPOSE,
    _UNFOLD_WINDOW,
    _VOLUMETRIC_CONV,
)
from .vector import IdiomVector

__all__ = ["OpFacts", "OVERRIDES", "RULE_NAMES", "facts_from_op", "apply_rules"]


@dataclass(frozen=True, slots=True)
class OpFacts:
    """What the rules may look at for one operator overload (all read from the registry)."""

    namespace: str
    """``aten`` for ATen operators."""
    base: str
    """Base name without namespace or overload, e.g. ``add_``."""
    overload: str
    """Overload name; ``""`` for the default overload."""
    tags: frozenset[str] = field(default_factory=frozenset)
    """Names of the operator's ``torch.Tag`` values (``pointwise``, ``inplace``, ...)."""
    arg_names: tuple[str, ...] = ()
    """Names of all arguments, in order."""
    arg_types: tuple[str, ...] = ()
    """``str(type)`` of each argument, e.g. ``Tensor``, ``Optional[Tensor]``, ``List[int]``."""
    list_lengths: tuple[int, ...] = ()
    """The fixed length ``N`` of each ``int[N]`` argument (IntArrayRef windows); empty if none."""
    n_tensor_args: int = 0
    """Tensor (or tensor list) arguments, optional ones included."""
    n_tensor_returns: int = 0
    """Tensor (or tensor list) returns."""
    inplace: bool = False
    """A positional argument is written (``Tensor(a!) self``)."""
    out: bool = False
    """A keyword-only argument is written (``out=``), or the op is tagged ``out``."""
    mutates_other: bool = False
    """Some other argument is written (running statistics of batch norm, ...)."""
    view: bool = False
    """A return aliases an input without writing it (``Tensor(a) -> Tensor(a)``)."""
    required_bias: bool = False
    """A non-optional ``bias`` tensor argument (the output is initialised with it)."""

    @property
    def tokens(self) -> tuple[str, ...]:
        """The base name split at underscores, empty parts dropped."""
        return tuple(t for t in self.base.split("_") if t)

    @property
    def functional_base(self) -> str:
        """The base name without a trailing in-place underscore."""
        return self.base[:-1] if self.base.endswith("_") and not self.base.endswith("__") else self.base

    @property
    def is_backward(self) -> bool:
        """Named as a backward (gradient) operator."""
        return "backward" in self.tokens


def _type_is_tensor(t: str) -> bool:
    return "Tensor" in t


def facts_from_op(op) -> OpFacts:
    """Collect :class:`OpFacts` from a ``torch._ops.OpOverload``."""
    schema = op._schema
    ns, _, rest = schema.name.partition("::")
    if not rest:
        ns, rest = "aten", ns
    overload = schema.overload_name
    arg_names, arg_types, lens = [], [], []
    n_tensor_args = 0
    inplace = out = mutates_other = False
    required_bias = False
    for i, a in enumerate(schema.arguments):
        t = str(a.type)
        arg_names.append(a.name)
        arg_types.append(t)
        if a.N is not None and "int" in t.lower():
            lens.append(int(a.N))
        if _type_is_tensor(t):
            n_tensor_args += 1
        if a.name == "bias" and t == "Tensor":
            required_bias = True
        ai = a.alias_info
        if ai is not None and ai.is_write:
            if a.kwarg_only:
                out = True
            elif i == 0:
                inplace = True
            else:
                mutates_other = True
    n_tensor_returns = sum(1 for r in schema.returns if _type_is_tensor(str(r.type)))
    write_sets = set()
    for a in schema.arguments:
        if a.alias_info is not None and a.alias_info.is_write:
            write_sets |= set(a.alias_info.before_set)
    view = False
    for r in schema.returns:
        ai = r.alias_info
        if ai is not None and not ai.is_write and not (set(ai.before_set) & write_sets):
            view = True
    tags = frozenset(str(t).rsplit(".", 1)[-1] for t in getattr(op, "tags", ()))
    if "out" in tags:
        out = True
    if "inplace" in tags and not out:
        inplace = True
    return OpFacts(
        namespace=ns,
        base=rest,
        overload=overload,
        tags=tags,
        arg_names=tuple(arg_names),
        arg_types=tuple(arg_types),
        list_lengths=tuple(lens),
        n_tensor_args=n_tensor_args,
        n_tensor_returns=n_tensor_returns,
        inplace=inplace,
        out=out,
        mutates_other=mutates_other,
        view=view,
        required_bias=required_bias,
    )


# --------------------------------------------------------------------------------------------
# Overrides: genuine rule failures only. Keyed by base name; each says why no rule can see it.
# --------------------------------------------------------------------------------------------
OVERRIDES: dict[str, tuple[int, int, int, int, int, int]] = {
    # `convolution` is the autograd-level front end that picks a backend at run time; the paper
    # gives it one elementwise stage (it delegates the MAC + bias work to `_convolution` and the
    # backend kernels, which get 2). Its schema is the same as `_convolution`'s minus the backend
    # flags, so no schema rule can tell the two apart.
    "convolution": (0, 1, 0, 1, 1, 2),
    # `Tensor.data` returns a storage-sharing alias that autograd does not track, so writes
    # through it are in-place writes to the original; the schema (`data(Tensor self) -> Tensor`)
    # carries no alias annotation, so the view/in-place rules cannot see the aliasing.
    "data": (0, 1, 0, 0, 0, 0),
}

def _rank(f: OpFacts) -> int:
    """Window rank from ``int[N]`` arguments, else from a ``1d/2d/3d`` in the name, else 0."""
    if f.list_lengths:
        return max(f.list_lengths)
    m = re.search(r"([123])d(?:_|$)", f.base)
    return int(m.group(1)) if m else 0


# Each rule takes facts and returns six values or None (no match).
Rule = Callable[[OpFacts], "tuple[int, ...] | None"]


def _r_no_tensors(f: OpFacts):
    if f.n_tensor_args == 0 and f.n_tensor_returns == 0:
        return (0, 0, 0, 0, 0, 0)
    return None


def _r_transpose(f: OpFacts):
    if f.functional_base in _TRANSPOSE:
        return (1, 0, 0, 0, 0, 0)
    return None


def _r_unfold_window(f: OpFacts):
    if f.base in _UNFOLD_WINDOW:
        # The paper's im2col/col2im backward vector: a transposing unfold (patch-major order),
        # a window gather-sum, one arithmetic stage, and a window idiom.
        return (1, 0, 0, 1, 1, 1)
    return None


_CONV_RE = re.compile(r"(^|_)(conv|convolution)(\d?d?|_|$)")


def _r_conv(f: OpFacts):
    b = f.functional_base
    if not _CONV_RE.search(b) or "convert" in b:
        return None
    if re.fullmatch(r"conv[123]d", b):
        # Functional front ends: ATen decomposes them into `convolution` before any kernel runs,
        # so the paper gives them one elementwise stage and no access pattern of their own.
        return (0, 0, 0, 0, 1, 0)
    toks = f.tokens
    transposing = int(
        "transpose" in toks
        or "tbc" in toks
        or "depthwise" in toks
        or "depthwise2d" in toks
        or "depthwise3d" in toks
        or "transpose1d" in toks
        or "transpose2d" in toks
        or "transpose3d" in toks
    )
    fused_adds = sum(1 for t in toks if t == "add")
    fused_acts = sum(1 for t in toks if t in ("relu", "silu", "gelu", "sigmoid", "tanh", "clamp"))
    # Multiply-accumulate stage + bias epilogue; a required bias is folded into the output's
    # initialisation instead (conv_tbc), leaving one stage.
    stages = (1 if f.required_bias else 2) + fused_acts
    window = 3 if b in _VOLUMETRIC_CONV else 2
    return (transposing, 1, 0, 1 + fused_adds, stages, window)


def _r_pool(f: OpFacts):
    b = f.functional_base
    if "pool" not in b:
        return None
    if "unpool" in b:
        return (0, 1, 1, 0, 0, 0)  # scatter through saved indices
    rank = _rank(f)
    # Window idiom of a pool: 1 when the window is not a plain planar max stencil: average and
    # adaptive pools (per-output bounds and divisor; ATen runs the 1-D ones through the 2-D kernel
    # on an unsqueezed view), volumetric windows, and mkldnn's blocked layout (extra block loop).
    irregular = (
        "avg" in b
        or "adaptive" in b
        or "fractional" in b
        or "lp_pool" in b
        or rank == 3
        or b.startswith("mkldnn")
    )
    return (0, 0, 0, 1, 0, int(irregular))


def _r_norm(f: OpFacts):
    if _NORM_RE.search(f.functional_base):
        # statistics (reduction), broadcast of per-channel values (indirect), normalise+affine
        # (elementwise), running/saved statistics written into existing buffers (accumulate).
        return (0, 1, 1, 1, 1, 0)
    return None


def _is_loss(b: str) -> bool:
    return any(k in b for k in _LOSS_NAMES)


def _r_loss(f: OpFacts):
    b = f.functional_base
    if not _is_loss(b):
        return None
    indexed = int("nll" in b or "ctc" in b or "multilabel" in b or "multi_margin" in b)
    if f.is_backward:
        # gradient scaled in place by grad_output / N (accumulate), grad_output broadcast or target
        # indices (indirect), vector-Jacobian product (reduction), derivative arithmetic unless the
        # loss only selects by target (nll).
        return (0, 1, 1, 1, 0 if indexed else 1, 0)
    return (0, 0, indexed, 1, 0 if indexed else 1, 0)


def _r_index_accumulate(f: OpFacts):
    b = f.functional_base
    if b in _INDEX_ACCUMULATE:
        stage = int("scale_grad_by_freq" in f.arg_names or "per_sample_weights" in f.arg_names)
        return (0, 1, 1, 1, stage, 0)
    return None


def _r_index_write(f: OpFacts):
    if f.functional_base in _INDEX_WRITE:
        return (0, 1, 1, 0, 0, 0)
    return None


def _r_index_read(f: OpFacts):
    b = f.functional_base
    if b in _INDEX_READ:
        return (0, 0, 1, int(b in _INDEX_READ_REDUCE), 0, 0)
    return None


def _r_sort(f: OpFacts):
    b = f.functional_base
    if b in _SORT:
        # a data-dependent permutation (transpose) addressed through computed indices (indirect);
        # selections (top-k, unique, median) also reduce.
        return (1, 0, 1, int(b in _SORT_SELECT), 0, 0)
    return None


def _r_region_scatter(f: OpFacts):
    if f.functional_base in _REGION_SCATTER:
        return (0, 1, 0, 0, 0, 0)
    return None


def _r_matmul(f: OpFacts):
    b = f.functional_base
    if b in _OUTER:
        return (0, 0, 1, 0, 1, 0)  # outer product: each input re-read along the other's length
    if b in _MATMUL or b.startswith("fbgemm_linear") or b.startswith("_fbgemm"):
        if "fbgemm" in b:
            # the paper's fbgemm vector: packed (blocked) weights are read through the packing
            # layout (indirect); the int8 GEMM and requantisation are one stage.
            return (0, 1, 1, 1, 1, 0)
        epilogue = int(b.startswith("add") or b.startswith("badd") or "bias" in f.arg_names)
        act = int("activation" in b)
        return (0, 1, 0, 1, 1 + epilogue + act, 0)
    return None


def _r_attention(f: OpFacts):
    if _ATTENTION_RE.search(f.functional_base):
        # two contractions (QK^T, PV) around a softmax (broadcast of row statistics).
        return (0, 1, 1, 2, 2, 0)
    return None


def _r_softmax(f: OpFacts):
    if _SOFTMAX_RE.search(f.functional_base):
        return (0, 0, 1, 1, 1, 0)  # row reduction, broadcast back, exp/normalise
    return None


def _r_reduction(f: OpFacts):
    b = f.functional_base
    if b in _REDUCTIONS or "reduction" in f.tags or b.startswith("_foreach_norm"):
        return (0, 0, 0, 1, int(b in _REDUCTIONS_COMPUTE), 0)
    return None


def _forward_is_pointwise(f: OpFacts) -> bool:
    import torch

    fwd = f.functional_base.replace("_backward", "")
    for name in (fwd, fwd.lstrip("_")):
        packet = getattr(getattr(torch.ops, f.namespace, None), name, None) if name else None
        if packet is None:
            continue
        try:
            for ov in packet.overloads():
                if torch.Tag.pointwise in getattr(packet, ov).tags:
                    return True
        except (AttributeError, RuntimeError):
            continue
    return False


def _r_pointwise_backward(f: OpFacts):
    if not f.is_backward:
        return None
    if (
        "pointwise" in f.tags
        or "threshold" in f.base
        or _forward_is_pointwise(f)
        or _DROPOUT_RE.search(f.base)
        or "activation" in f.base
    ):
        # grad_output (x) f'(x): the vector-Jacobian product (reduction) and the derivative
        # arithmetic (elementwise).
        return (0, 0, 0, 1, 1, 0)
    return None


def _r_dropout(f: OpFacts):
    if _DROPOUT_RE.search(f.functional_base):
        return (0, 0, 0, 0, 1, 0)  # random mask multiply
    return None


def _r_foreach(f: OpFacts):
    b = f.functional_base
    if b.startswith(("_fused_adam", "_fused_sgd", "_fused_adagrad")):
        return (0, 0, 0, 0, 1, 0)  # a whole optimizer step as list-wise pointwise arithmetic
    if not b.startswith("_foreach_"):
        return None
    inner = b[len("_foreach_") :]
    if inner in ("copy", "zero"):
        return (0, 0, 0, 0, 0, 0)
    if inner.startswith("norm") or inner in _REDUCTIONS:
        return (0, 0, 0, 1, 1, 0)
    return (0, 0, 0, 0, 1, 0)  # list-wise pointwise arithmetic


def _r_rnn(f: OpFacts):
    if _RNN_RE.search(f.functional_base):
        # gate contractions (input and hidden GEMMs) accumulated into the gates, then the gate
        # nonlinearities and the cell update as elementwise stages.
        return (0, 1, 0, 1, 2, 0)
    return None


def _r_linalg(f: OpFacts):
    b = f.functional_base
    if _LINALG_RE.search(b) and b not in _REDUCTIONS and "reduction" not in f.tags:
        # factorisations and solves: contractions that update their factors in place.
        return (0, 1, 0, 1, 1, 0)
    return None


def _r_fft(f: OpFacts):
    if _FFT_RE.search(f.functional_base):
        # butterflies: bit-reversed (permuted) order, pairwise combining, twiddle arithmetic.
        return (1, 0, 0, 1, 1, 0)
    return None


def _r_interpolate(f: OpFacts):
    if _INTERPOLATE_RE.search(f.functional_base):
        # computed source coordinates (indirect), weighted sum of neighbours (reduction + arithmetic);
        # the backward scatters into overlapping neighbours (accumulate).
        return (0, int(f.is_backward), 1, 1, 1, 0)
    return None


def _r_random(f: OpFacts):
    if f.functional_base in _RANDOM:
        return (0, 0, 0, 0, 1, 0)  # one generated value per element
    return None


def _r_pointwise_alias(f: OpFacts):
    b = f.functional_base
    if b in _POINTWISE_ALIASES or b.startswith(("special_", "fake_quantize", "_fake_quantize", "_amp_")):
        return (0, 0, 0, 0, 1, 0)
    return None


def _r_metadata(f: OpFacts):
    if f.n_tensor_returns == 0:
        return (0, 0, 0, 0, 0, 0)  # answers a question about metadata; reads no elements
    return None


def _r_vjp(f: OpFacts):
    if f.is_backward or f.base.endswith("_grad"):
        return (0, 0, 0, 1, 0, 0)  # a vector-Jacobian product: contraction with grad_output
    return None


def _r_pointwise(f: OpFacts):
    if f.functional_base in _COPY:
        return None  # clone is tagged pointwise but only moves data
    if "pointwise" in f.tags:
        return (0, 0, 0, 0, 1, 0)
    return None


def _r_copy(f: OpFacts):
    b = f.functional_base
    if b in _COPY or "view_copy" in f.tags or b.endswith("_copy"):
        return (0, 0, 0, 0, 0, 0)
    return None


def _r_view(f: OpFacts):
    if f.view or "inplace_view" in f.tags:
        return (0, 0, 0, 0, 0, 0)
    return None


_FACTORY_NAMES = {
    "empty",
    "empty_strided",
    "zeros",
    "ones",
    "full",
    "arange",
    "range",
    "linspace",
    "logspace",
    "eye",
    "rand",
    "randn",
    "randint",
    "randperm",
    "scalar_tensor",
    "tensor",
    "normal",
    "uniform",
    "empty_permuted",
    "_empty_affine_quantized",
    "_efficientzerotensor",
    "tril_indices",
    "triu_indices",
    "poisson",
    "random",
    "exponential",
    "geometric",
    "cauchy",
    "log_normal",
    "bartlett_window",
    "blackman_window",
    "hamming_window",
    "hann_window",
    "kaiser_window",
}


def _r_factory(f: OpFacts):
    b = f.functional_base
    if (
        b in _FACTORY_NAMES
        or b.endswith("_like")
        or b.startswith("new_")
        or (f.n_tensor_args == 0 and f.n_tensor_returns > 0)
    ):
        return (0, 0, 0, 0, 0, 0)  # a fresh write stream, no reads
    return None


_FAMILY_RULES: tuple[tuple[str, Rule], ...] = (
    ("transpose", _r_transpose),
    ("unfold_window", _r_unfold_window),
    ("conv", _r_conv),
    ("pool", _r_pool),
    ("norm", _r_norm),
    ("loss", _r_loss),
    ("index_accumulate", _r_index_accumulate),
    ("index_write", _r_index_write),
    ("index_read", _r_index_read),
    ("sort", _r_sort),
    ("region_scatter", _r_region_scatter),
    ("matmul", _r_matmul),
    ("attention", _r_attention),
    ("rnn", _r_rnn),
    ("linalg", _r_linalg),
    ("fft", _r_fft),
    ("interpolate", _r_interpolate),
    ("softmax", _r_softmax),
    ("reduction", _r_reduction),
    ("pointwise_backward", _r_pointwise_backward),
    ("dropout", _r_dropout),
    ("random", _r_random),
    ("foreach", _r_foreach),
    ("pointwise", _r_pointwise),
    ("pointwise_alias", _r_pointwise_alias),
    ("copy", _r_copy),
    ("view", _r_view),
    ("factory", _r_factory),
    ("metadata", _r_metadata),
    ("vjp", _r_vjp),
)

RULE_NAMES: tuple[str, ...] = ("no_tensors", *(n for n, _ in _FAMILY_RULES), "inplace", "out", "default")
"""Every rule name a vector's ``source`` can carry (besides ``override:<op>`` and the
``+mutating`` / ``+quantized`` suffixes)."""

# Rules whose functional vector is pure per-element arithmetic: a mutating variant of these
# becomes (0, 1, 0, 0, 0, 0) (read-modify-write replaces the elementwise stage).
_POINTWISE_RULES = {
    "pointwise",
    "pointwise_alias",
    "dropout",
    "random",
    "foreach",
    "copy",
    "factory",
    "view",
    "no_tensors",
    "metadata",
}


def _family(f: OpFacts) -> IdiomVector | None:
    for name, rule in _FAMILY_RULES:
        v = rule(f)
        if v is not None:
            return IdiomVector.of(v, name)
    return None


def apply_rules(f: OpFacts) -> IdiomVector:
    """The idiom vector of one operator overload; see the module docstring for the order."""
    key = f.functional_base
    if f.base in OVERRIDES:
        return IdiomVector.of(OVERRIDES[f.base], f"override:{f.base}")
    if key in OVERRIDES and key != f.base:
        v = IdiomVector.of(OVERRIDES[key], f"override:{key}")
        return v.replace(accumulate=1)
    v = _r_no_tensors(f)
    if v is not None:
        return IdiomVector.of(v, "no_tensors")
    fam = _family(f)
    base_source = fam.source if fam is not None else None
    mutating = f.inplace or f.out
    if mutating and "inplace_view" not in f.tags:
        kind = "inplace" if f.inplace else "out"
        if fam is None or base_source in _POINTWISE_RULES:
            v = IdiomVector(0, 1, 0, 0, 0, 0, source=kind)
        else:
            v = fam.replace(accumulate=1, source=f"{base_source}+{kind}")
    elif fam is None:
        return IdiomVector(0, 0, 0, 0, 0, 0, source="default")
    else:
        v = fam
        if f.mutates_other and v.accumulate == 0:
            v = v.replace(accumulate=1, source=f"{base_source}+mutating")
    if "quantized" in f.tokens or f.base.startswith("quantized"):
        v = v.replace(accumulate=1, source=f"{v.source}+quantized")
    return v

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

# --------------------------------------------------------------------------------------------
# Name sets used by the family rules.
# --------------------------------------------------------------------------------------------
_TRANSPOSE = {
    "transpose",
    "t",
    "permute",
    "swapaxes",
    "swapdims",
    "movedim",
    "moveaxis",
    "adjoint",
    "numpy_T",
    "mT",
    "mH",
    "matrix_H",
    "H",
    "T",
    "transpose_copy",
    "permute_copy",
    "t_copy",
    "_mkldnn_transpose",
    "_permute",
    "pixel_shuffle",
    "pixel_unshuffle",
    "channel_shuffle",
    "native_channel_shuffle",
}
_UNFOLD_WINDOW = {"im2col", "col2im", "im2col_backward", "col2im_backward"}
# Dense convolution kernels that unfold a full 3-D volume (ATen's ConvolutionMM3d "finput").
_VOLUMETRIC_CONV = {"slow_conv3d", "slow_conv3d_forward", "slow_conv3d_backward"}
_NORM_RE = re.compile(r"(batch_norm|layer_norm|group_norm|instance_norm|rms_norm|batch_norm_legit)")
_LOSS_NAMES = (
    "loss",
    "binary_cross_entropy",
    "cross_entropy",
    "kl_div",
    "nll_loss",
    "ctc_loss",
    "cosine_embedding",
)
_INDEX_ACCUMULATE = {
    "scatter_add",
    "scatter_reduce",
    "index_add",
    "index_reduce",
    "put",
    "index_put",
    "_index_put_impl",
    "embedding_backward",
    "embedding_dense_backward",
    "embedding_sparse_backward",
    "_embedding_bag_backward",
    "_embedding_bag_dense_backward",
    "_embedding_bag_sparse_backward",
    "_embedding_bag_per_sample_weights_backward",
    "gather_backward",
    "segment_reduce",
    "_segment_reduce_backward",
    "index_select_backward",
    "bincount",
    "histc",
    "histogram",
    "histogramdd",
    "_histogramdd_from_bin_cts",
    "_histogramdd_from_bin_tensors",
    "_pack_padded_sequence_backward",
    "value_selecting_reduction_backward",
    "_gather_sparse_backward",
    "reflection_pad1d_backward",
    "reflection_pad2d_backward",
    "reflection_pad3d_backward",
    "replication_pad1d_backward",
    "replication_pad2d_backward",
    "replication_pad3d_backward",
    "upsample_nearest1d_backward",
    "upsample_nearest2d_backward",
    "upsample_nearest3d_backward",
    "_upsample_nearest_exact1d_backward",
    "_upsample_nearest_exact2d_backward",
    "_upsample_nearest_exact3d_backward",
    "_nested_select_backward",
    "_unsafe_index_put",
    "_unsafe_masked_index_put_accumulate",
    "embedding_renorm",
}
_INDEX_WRITE = {
    "scatter",
    "index_copy",
    "index_fill",
    "masked_scatter",
    "_unsafe_masked_index",
    "max_unpool2d",
    "max_unpool3d",
    "masked_scatter_backward",
    "one_hot",
}
_INDEX_READ = {
    "gather",
    "index_select",
    "index",
    "embedding",
    "take",
    "take_along_dim",
    "masked_select",
    "nonzero",
    "nonzero_static",
    "argwhere",
    "bucketize",
    "searchsorted",
    "_unsafe_index",
    "embedding_bag",
    "_embedding_bag",
    "_embedding_bag_forward_only",
    "sparse_mask",
    "masked_select_backward",
    "nonzero_numpy",
    "_sparse_mask_projection",
    "multinomial",
    "_pack_padded_sequence",
    "_pad_packed_sequence",
    "pad_sequence",
    "_jagged_to_padded_dense_forward",
    "_padded_dense_to_jagged_forward",
    "_nested_tensor_from_mask",
    "_nested_tensor_from_mask_left_aligned",
    "_convert_indices_from_coo_to_csr",
    "_convert_indices_from_csr_to_coo",
    "one_hot_index",
    "grid_sampler",
    "grid_sampler_2d",
    "grid_sampler_3d",
    "_grid_sampler_2d_cpu_fallback",
    "upsample_nearest1d",
    "upsample_nearest2d",
    "upsample_nearest3d",
    "_upsample_nearest_exact1d",
    "_upsample_nearest_exact2d",
    "_upsample_nearest_exact3d",
}
_INDEX_READ_REDUCE = {"embedding_bag", "_embedding_bag", "_embedding_bag_forward_only", "multinomial"}
_SORT = {
    "sort",
    "argsort",
    "msort",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "unique_dim_consecutive",
    "topk",
    "kthvalue",
    "median",
    "nanmedian",
    "mode",
    "isin",
    "quantile",
    "nanquantile",
}
_SORT_SELECT = {
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "unique_dim_consecutive",
    "topk",
    "kthvalue",
    "median",
    "nanmedian",
    "mode",
    "isin",
    "quantile",
    "nanquantile",
}
_MATMUL = {
    "mm",
    "bmm",
    "matmul",
    "addmm",
    "addbmm",
    "baddbmm",
    "addmv",
    "mv",
    "dot",
    "vdot",
    "inner",
    "linear",
    "bilinear",
    "_trilinear",
    "einsum",
    "tensordot",
    "chain_matmul",
    "linalg_multi_dot",
    "_addmm_activation",
    "_int_mm",
    "_weight_int8pack_mm",
    "_weight_int4pack_mm",
    "_convert_weight_to_int4pack",
    "cdist",
    "_cdist_forward",
    "_cdist_backward",
    "_euclidean_dist",
    "mkldnn_linear",
    "mkldnn_linear_backward",
    "mkldnn_linear_backward_input",
    "_mixed_dtypes_linear",
    "sparse_sampled_addmm",
    "_sparse_sparse_matmul",
    "_sparse_semi_structured_linear",
    "_sparse_semi_structured_mm",
    "_sparse_semi_structured_addmm",
    "_cslt_sparse_mm",
    "_dyn_quant_matmul_4bit",
    "_weight_int4pack_mm_for_cpu",
    "_weight_int4pack_mm_with_scales_and_zeros",
    "_wrapped_quantized_linear_prepacked",
    "linalg_vecdot",
    "_sparse_mm_reduce_impl",
    "_scaled_mm_v2",
    "_scaled_grouped_mm_v2",
    "mkldnn_linear_backward_weights",
    "_mm_dtype",
    "_scaled_mm",
    "_scaled_grouped_mm",
    "_grouped_mm",
    "linalg_matmul",
    "matmul_backward",
    "linear_backward",
    "_sparse_mm",
    "_sparse_addmm",
    "sspaddmm",
    "hspmm",
    "smm",
    "_mps_linear",
}
_OUTER = {"outer", "ger", "addr"}
_ATTENTION_RE = re.compile(
    r"(scaled_dot_product|_attention|flash_attention|efficient_attention|cudnn_attention|_transformer_encoder|"
    r"_transform_bias_rescale_qkv)"
)
_SOFTMAX_RE = re.compile(r"(softmax|softmin)")
_REDUCTIONS = {
    "sum",
    "nansum",
    "mean",
    "nanmean",
    "prod",
    "amax",
    "amin",
    "aminmax",
    "max",
    "min",
    "argmax",
    "argmin",
    "all",
    "any",
    "var",
    "std",
    "var_mean",
    "std_mean",
    "norm",
    "linalg_vector_norm",
    "linalg_norm",
    "frobenius_norm",
    "nuclear_norm",
    "logsumexp",
    "count_nonzero",
    "cumsum",
    "cumprod",
    "cummax",
    "cummin",
    "logcumsumexp",
    "trace",
    "renorm",
    "_cummax_helper",
    "_cummin_helper",
    "native_norm",
    "linalg_matrix_norm",
    "dist",
    "cosine_similarity",
    "pairwise_distance",
    "special_logsumexp",
    "_logcumsumexp",
    "max_values",
    "min_values",
    "sum_to_size",
    "allclose",
    "equal",
    "trapezoid",
    "trapz",
    "cumulative_trapezoid",
    "_aminmax",
    "_is_all_true",
    "_is_any_true",
    "_choose_qparams_per_tensor",
    "choose_qparams_optimized",
    "_sparse_sum",
    "_sparse_csr_sum",
    "_sparse_csr_prod",
    "norm_except_dim",
}
# Reductions whose result needs per-element arithmetic beyond add/compare.
_REDUCTIONS_COMPUTE = {
    "mean",
    "nanmean",
    "var",
    "std",
    "var_mean",
    "std_mean",
    "norm",
    "linalg_vector_norm",
    "linalg_norm",
    "frobenius_norm",
    "nuclear_norm",
    "logsumexp",
    "logcumsumexp",
    "renorm",
    "native_norm",
    "linalg_matrix_norm",
    "dist",
    "cosine_similarity",
    "pairwise_distance",
    "special_logsumexp",
    "_logcumsumexp",
    "prod",
    "cumprod",
}
_DROPOUT_RE = re.compile(r"(dropout|bernoulli|rrelu_with_noise)")
_COPY = {
    "clone",
    "copy",
    "_to_copy",
    "to",
    "contiguous",
    "cat",
    "_cat",
    "concat",
    "concatenate",
    "stack",
    "_stack",
    "hstack",
    "vstack",
    "dstack",
    "column_stack",
    "row_stack",
    "diag",
    "diag_embed",
    "repeat",
    "tile",
    "flip",
    "fliplr",
    "flipud",
    "roll",
    "rot90",
    "constant_pad_nd",
    "pad",
    "reflection_pad1d",
    "reflection_pad2d",
    "reflection_pad3d",
    "replication_pad1d",
    "replication_pad2d",
    "replication_pad3d",
    "_copy_from",
    "_copy_from_and_resize",
    "fill",
    "zero",
    "lift",
    "lift_fresh_copy",
    "resize",
    "_to_dense",
    "to_dense",
    "to_sparse",
    "_nested_tensor_from_tensor_list",
    "block_diag",
    "tril",
    "triu",
    "repeat_interleave",
    "narrow_copy",
    "_pad_circular",
    "_pad_enum",
    "set",
    "cartesian_prod",
    "combinations",
    "meshgrid",
    "broadcast_tensors",
    "_reshape_copy",
    "item",
    "_local_scalar_dense",
    "lift_fresh",
    "_assert_async",
    "_functional_assert_async",
    "unfold_copy",
}
# Writes a gradient into a zero-filled tensor at a (strided) region of it.
_REGION_SCATTER = {
    "slice_backward",
    "select_backward",
    "diagonal_backward",
    "as_strided_scatter",
    "slice_scatter",
    "select_scatter",
    "diagonal_scatter",
    "unfold_backward",
    "narrow_backward",
    "index_backward",
}

_POINTWISE_ALIASES = {
    "absolute",
    "arccos",
    "arccosh",
    "arcsin",
    "arcsinh",
    "arctan",
    "arctan2",
    "arctanh",
    "divide",
    "multiply",
    "subtract",
    "negative",
    "greater",
    "greater_equal",
    "less",
    "less_equal",
    "not_equal",
    "fix",
    "rsub",
    "floor_divide",
    "true_divide",
    "__and__",
    "__or__",
    "__xor__",
    "__lshift__",
    "__rshift__",
    "hardswish",
    "prelu",
    "_prelu_kernel",
    "glu",
    "log_sigmoid",
    "log_sigmoid_forward",
    "_masked_scale",
    "_add_relu",
    "isclose",
    "cross",
    "linalg_cross",
    "complex",
    "polar",
    "int_repr",
    "dequantize",
    "quantize_per_tensor",
    "quantize_per_channel",
    "quantize_per_tensor_dynamic",
    "vander",
    "linalg_vander",
    "diff",
    "gradient",
    "_dirichlet_grad",
    "_standard_gamma_grad",
    "_make_per_tensor_quantized_tensor",
    "_make_per_channel_quantized_tensor",
    "_saturate_weight_to_fp16",
    "glu_jvp",
    "_compute_linear_combination",
}
_RANDOM = {
    "binomial",
    "normal_functional",
    "poisson",
    "_standard_gamma",
    "_sample_dirichlet",
    "_sobol_engine_draw",
    "_philox_normal",
    "_philox_uniform",
    "_philox_key_split",
    "_philox_key_fold_in",
}
_RNN_RE = re.compile(r"(^|_)(lstm|gru|rnn)(_|$)")
_LINALG_RE = re.compile(
    r"^_?(linalg_|cholesky|lu_|lu$|qr$|svd$|det$|logdet$|slogdet$|inverse$|pinverse$|triangular_solve$|"
    r"orgqr$|ormqr$|geqrf$|matrix_exp|matrix_power$|kron$|cov$|corrcoef$|pdist$|_pdist|_lu_with_info|"
    r"_cholesky|_linalg)"
)
_FFT_RE = re.compile(r"^_?(fft_|stft$|istft$|_fft)")
_INTERPOLATE_RE = re.compile(r"upsample_(bilinear|bicubic|linear|trilinear|lanczos)|grid_sampler|affine_grid")
_ALIAS_VIEWS = {
    "_unsafe_view",
    "unsafe_chunk",
    "unsafe_split",
    "unsafe_split_with_sizes",
    "_reshape_from_tensor",
    "_mkldnn_reshape",
    "atleast_1d",
    "atleast_2d",
    "atleast_3d",
    "_add_batch_dim",
    "_remove_batch_dim",
    "_lazy_clone",
    "_to_cpu",
    "to_mkldnn",
    "to_dense_backward",
    "to_mkldnn_backward",
    "_pin_memory",
    "resize_as",
    "_resize_output",
    "type_as",
    "chalf",
    "flatten_dense_tensors",
    "unflatten_dense_tensors",
    "_shape_as_tensor",
    "to_padded_tensor",
    "nested_to_padded_tensor",
    "_nested_from_padded",
    "_nested_from_padded_and_nested_example",
    "_nested_from_padded_tensor",
    "_chunk_cat",
    "diagflat",
    "_coalesce",
    "_coalesced",
    "copy_sparse_to_sparse",
    "_new_zeros_with_same_feature_meta",
}
_COPY |= _ALIAS_VIEWS  # aliasing/reshaping ops whose schema carries no alias annotation


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

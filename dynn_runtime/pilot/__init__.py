"""The pilot model: learned prediction of tensor accesses for dynamic networks (DyNN-Offload).

At a decision point (every ``group`` operators and at phase changes) the model scores every live
storage in one batch and predicts when it will next be used, as a bucketed distance (next group,
within 4 groups, within 16, later this iteration, not again this iteration). The ``pilot`` policy
(:class:`PilotPolicy`, registered with the other policies) evicts the storages predicted furthest
and prefetches those predicted soonest. Features are generic (kinds, sizes, recency, idiom vectors
of producer and consumers, the saved-activation stack, the previous iteration aligned by operator),
so the model works on a user's own workload too. See ``docs/pilot.md``.

>>> from dynn_runtime.policies import make_policy
>>> policy = make_policy("pilot")              # the weights shipped in the package, loaded on first use
>>> policy.name, policy.requires
('pilot', frozenset({'pilot'}))

Python API: :func:`train` / :func:`evaluate` / :func:`save_model` / :func:`load_model`, online
refit (:class:`OnlineRefit`), inference cost (:func:`inference_cost`).
"""

from .features import BUCKET_EDGES, CAND_FEATURES, COARSE_NAMES, CTX_FEATURES, FeatureState
from .model import WEIGHTS_VERSION, PilotConfig, PilotModel, fit, load_model, save_model
from .policy import PilotPolicy, default_weights_path
from .training.cost import inference_cost
from .training.data import build_rows, load_traces, walk, zoo_traces
from .training.evaluate import METHODS, WINDOW_OPS, evaluate, render_table
from .training.online import OnlineRefit, shift_experiment
from .training.train import train

__all__ = [
    "PilotPolicy", "PilotModel", "PilotConfig", "FeatureState",
    "train", "evaluate", "fit", "save_model", "load_model", "default_weights_path",
    "OnlineRefit", "shift_experiment", "inference_cost",
    "walk", "build_rows", "load_traces", "zoo_traces", "render_table",
    "CAND_FEATURES", "CTX_FEATURES", "BUCKET_EDGES", "COARSE_NAMES", "METHODS", "WINDOW_OPS", "WEIGHTS_VERSION",
]

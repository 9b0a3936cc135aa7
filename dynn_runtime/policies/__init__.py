"""Memory policies, one interface for the simulator and the live runtime (see :mod:`.base`).

Registered: ``none``, ``lru``, ``save_on_cpu``, ``uvm``, ``checkpoint``, ``dtr``, ``replay``,
``oracle``, ``hybrid_oracle`` (:mod:`.hybrid`: recompute or copy per victim), and ``pilot`` and
``hybrid`` (:mod:`dynn_runtime.pilot`, registered lazily: the module is imported on the first lookup
of the name and its weights load on first use).

>>> from dynn_runtime.policies import POLICIES, make_policy
>>> sorted(POLICIES)
['checkpoint', 'dtr', 'hybrid', 'hybrid_oracle', 'lru', 'none', 'oracle', 'pilot', 'replay', 'save_on_cpu', 'uvm']
>>> make_policy("oracle", provides=("history",))
Traceback (most recent call last):
...
dynn_runtime.errors.PolicyError: policies: oracle needs future, which this caller does not provide (e.g. 'future' is only known to the simulator replaying a recorded trace; 'pilot' needs trained weights).
"""

from . import basic, hybrid, nextuse, recompute  # noqa: F401  (registration)
from .base import POLICIES, Action, MemoryView, Policy, make_policy, policy_names, register, register_lazy

# a plug-in, named here and imported on first use: the interface does not depend on it
register_lazy("pilot", "dynn_runtime.pilot.policy")
register_lazy("hybrid", "dynn_runtime.pilot.hybrid")

__all__ = ["POLICIES", "Action", "MemoryView", "Policy", "make_policy", "policy_names", "register",
           "register_lazy"]

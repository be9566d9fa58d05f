"""Expert residency, what the server runs: the cache policy of the GPU expert pool and the
manager that applies it around each forward pass (planning a pool offline, from routing traces:
moet_vllm.planning).

- :mod:`.policy`: :class:`ResidencyPolicy` (decayed frequency, pins, scans, slot assignment) and
  the :class:`Plan` the residency manager applies between forward passes.
- :mod:`.fp4tier`: :class:`Fp4Tier`, which pairs the FP4 pool holds (heat, the confidence gate).
"""

from .policy import (
    DEFAULT_HALF_LIFE_STEPS,
    DEFAULT_PROTECTED_FRACTION,
    Plan,
    ResidencyPolicy,
    key_ids,
    key_pairs,
    routed_keys,
)

__all__ = [
    "DEFAULT_HALF_LIFE_STEPS",
    "DEFAULT_PROTECTED_FRACTION",
    "Plan",
    "ResidencyPolicy",
    "key_ids",
    "key_pairs",
    "routed_keys",
]

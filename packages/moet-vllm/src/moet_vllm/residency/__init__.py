"""Expert residency: the serving cache policy of the GPU expert pool and its simulator.

- :mod:`.policy`: :class:`ResidencyPolicy` (decayed frequency, pins, scans, slot assignment) and
  the :class:`Plan` the residency manager applies between forward passes.
- :mod:`.fp4tier`: :class:`Fp4Tier`, which pairs the FP4 pool holds (heat, the confidence gate).
- :mod:`.simulate`: trace-driven simulation of LRU, LFU, decayed frequency and Belady's MIN, and a
  provable lower bound on replay steps.
- :mod:`.traces`: the routing-trace format, coverage curves, seeded synthetic traces.
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

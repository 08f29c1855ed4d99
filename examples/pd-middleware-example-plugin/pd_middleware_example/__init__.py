"""Example pd-middleware plugins (see docs/plugins.md in the pd-middleware repository).

- ``arm_tally`` (hook): counts payloads per A/B arm; can fail every n-th payload on
  purpose, to see how failures are reported.
- ``min_prob_one_hot`` (synthesizer): the exact one-hot proposal, refusing payloads
  whose drafted token probability is below a floor.
"""

from __future__ import annotations

from .min_prob import SYNTHESIZER, MinProbOneHot, MinProbOptions
from .tally import HOOK, ArmTally, ArmTallyOptions

__all__ = ["HOOK", "SYNTHESIZER", "ArmTally", "ArmTallyOptions", "MinProbOneHot", "MinProbOptions"]

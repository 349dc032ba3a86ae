"""Test settings for quant_core.

Hypothesis runs derandomized (the same examples on every run and machine) with no
per-example deadline: timing never decides whether a unit test passes.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("quant_core", deadline=None, derandomize=True, database=None, print_blob=True)
# Exploratory runs: HYPOTHESIS_PROFILE=explore pytest ... (random, more examples).
settings.register_profile("explore", deadline=None, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "quant_core"))

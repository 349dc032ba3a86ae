"""Test settings for quant_algos: hypothesis derandomized, no per-example deadline
(timing never decides whether a unit test passes)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hypothesis import settings

sys.path.insert(0, str(Path(__file__).parent))  # the numpy reference helpers

settings.register_profile("quant_algos", deadline=None, derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", deadline=None, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "quant_algos"))

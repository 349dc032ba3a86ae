from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _seed_and_threads() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)

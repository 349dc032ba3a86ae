"""Each ATen op family the exporter translates, written by its emitter and run with onnx's
reference evaluator against torch (onnxruntime runs the same cases in
tests-integration/test_torch_fx_onnx_ops.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx.reference import ReferenceEvaluator
from onnx_cases import CASES, check_case


def _reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return list(ReferenceEvaluator(model).run(None, feeds))


@pytest.mark.parametrize("name", sorted(CASES))
def test_op_family_matches_torch_in_the_reference_evaluator(name: str) -> None:
    check_case(name, _reference)

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


def test_bitwise_ops_on_integers_are_refused_naming_the_node() -> None:
    """``|`` on integer tensors computes bits; written as ONNX ``Or`` it would be wrong."""
    import torch
    from onnx_cases import Lambda

    from quant_core.errors import ModelError
    from quant_torch_fx.export_form import aten_graph
    from quant_torch_fx.onnx_emit import emit_onnx

    model = Lambda(lambda x: ((x > 0).to(torch.int32) | (x < 1).to(torch.int32)).float())
    example = (torch.randn(2, 3),)
    with torch.no_grad():
        gm = aten_graph(model.eval(), example, dynamic_batch=False)
    with pytest.raises(ModelError, match=r"node 'or.*bitwise op on \['torch.int32'\] tensors; allowed: bool"):
        emit_onnx(gm, opset=17, input_names=["x"], output_names=None)

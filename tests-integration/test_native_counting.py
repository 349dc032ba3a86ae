"""quant_core's native histogram count as users get it: its C source ships in the installed
package and builds where a compiler is on PATH, and both backends write the same bytes
with it and without it (histogram presets, whose counts it computes)."""

from __future__ import annotations

import io
import shutil
import sysconfig

import pytest

from quant_core.observers import native

torch = pytest.importorskip("torch")
quant_onnx = pytest.importorskip("quant_onnx")
from quant_torch_fx import ModelQuantizer  # noqa: E402


def test_the_source_ships_and_builds_where_a_compiler_is(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    assert native.SOURCE.is_file(), native.SOURCE  # package data in the wheel
    monkeypatch.setenv(native.CACHE_DIR, str(tmp_path))
    with native.switched(True) as counter:
        has_compiler = any(shutil.which(str(c).split()[0]) for c in ("cc", sysconfig.get_config_var("CC")) if c)
        assert (counter is not None) == has_compiler, native.status()


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.fc = torch.nn.Linear(16, 5)

    def forward(self, x):  # type: ignore[no-untyped-def]
        x = torch.relu(self.conv1(x))
        x = torch.nn.functional.hardswish(self.conv2(x))
        return self.fc(x.mean(dim=(2, 3)))


@pytest.mark.parametrize("preset", ["xint8", "a8w8_percentile"])
def test_both_backends_write_the_same_bytes_with_and_without_it(preset: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model, images = Net().eval(), torch.randn(24, 3, 12, 12) * 2.0
    buffer = io.BytesIO()
    torch.onnx.export(model, (images[:1],), buffer, dynamo=False, opset_version=17)
    written: dict[bool, tuple[bytes, bytes]] = {}
    for on in (True, False):
        with native.switched(on) as counter:
            if on and counter is None:
                pytest.skip(native.status())
            onnx_bytes = quant_onnx.quantize(buffer.getvalue(), None, preset, images.numpy(), quiet=True)
            q = ModelQuantizer(preset, quiet=True)
            path = q.export_onnx(
                q.quantize_model(model, images[:1], [images[:12], images[12:]]), images[:1], tmp_path / f"{on}.onnx"
            )
            written[on] = (onnx_bytes.model.SerializeToString(), path.read_bytes())
    assert written[True][0] == written[False][0]
    assert written[True][1] == written[False][1]

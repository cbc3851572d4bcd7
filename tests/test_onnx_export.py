"""ONNX export of every vision family (tiny configs): torch.onnx's dynamo exporter, checked with onnxruntime.

Needs the `onnx` extra (`pip install -c constraints.txt -e '.[onnx]'`: onnx, onnxscript, onnxruntime), which `make`
installs: without it the tests fail (a plain import), they are not skipped. The legacy TorchScript-based exporter
(`dynamo=False`) is refused by the long-short and GRC layers with a message (it exported their in-place buffer writes
wrongly: outputs off by 0.05-0.6), never wrong numbers.
"""
import contextlib
import io
import re
from pathlib import Path

import numpy as np
import onnxruntime as ort
import onnxscript  # noqa: F401  (the dynamo exporter needs it: fail here, not inside torch.onnx)
import pytest
import torch
from _helpers import TINY_TWO_STAGE_FAMILIES, tiny_model

README = (Path(__file__).resolve().parents[1] / 'README.md').read_text()

# two stages a family: the export's time grows faster than the graph (onnxscript's optimizer matches its patterns
# against the whole graph)
TINY = TINY_TWO_STAGE_FAMILIES
# cvt_ls_13 exports in test_readme_export_line_runs (the README's snippet), the others here: one export each
EXPORTED = [name for name in TINY if name != 'cvt_ls_13']
LEGACY_REFUSED = ['cvt_ls_13', 'vil_ls_medium', 'pvt_tiny_grc', 'pvt_v2_b0_grc', 'swin_tiny_patch4_window7_224_grc',
                  'vit_small_patch16_224_grc']


def _tiny(name: str) -> tuple:
    model = tiny_model(name, num_classes=10, **TINY[name]).eval()
    size = TINY[name].get('img_size', 64)
    return model, torch.randn(2, 3, size, size)


def _onnxruntime(path: Path, x: torch.Tensor) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=['CPUExecutionProvider'])
    return session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]


@pytest.mark.parametrize('name', EXPORTED)
def test_dynamo_export_matches_onnxruntime_and_leaves_eager_unchanged(name, tmp_path):
    model, x = _tiny(name)
    with torch.no_grad():
        before = model(x)
    path = tmp_path / f'{name}.onnx'
    with contextlib.redirect_stdout(io.StringIO()):  # the exporter prints its steps
        torch.onnx.export(model, (x,), str(path), dynamo=True, opset_version=18)
    np.testing.assert_allclose(_onnxruntime(path, x), before.numpy(), rtol=0, atol=1e-4)
    with torch.no_grad():
        assert torch.equal(model(x), before), 'export changed later eager outputs'


@pytest.mark.parametrize('name', LEGACY_REFUSED)
def test_legacy_exporter_is_refused_with_a_message(name, tmp_path):
    model, x = _tiny(name)
    with pytest.raises(RuntimeError, match='dynamo=True'):
        torch.onnx.export(model, (x,), str(tmp_path / 'm.onnx'), dynamo=False, opset_version=18)


def test_readme_export_line_runs(tmp_path, monkeypatch):
    """The README's export snippet, as written, on a tiny cvt_ls_13 in place of the full-size one: onnxruntime gives
    torch's outputs, and the export leaves eager outputs unchanged."""
    block = re.search(r'```python\n(# ONNX export.*?)```', README, flags=re.S)
    assert block, 'README.md lost its ONNX export snippet'
    code = block.group(1)
    model, x = _tiny('cvt_ls_13')
    monkeypatch.chdir(tmp_path)
    namespace = {'model': model, 'x': x}
    code = code.replace("model = timm.create_model('cvt_ls_13').eval()\n", '')
    code = code.replace('x = torch.randn(1, 3, 224, 224)\n', '')
    with torch.no_grad():
        before = model(x)
    with contextlib.redirect_stdout(io.StringIO()):
        exec(code, namespace)
    np.testing.assert_allclose(_onnxruntime(tmp_path / 'cvt_ls_13.onnx', x), before.numpy(), rtol=0, atol=1e-4)
    with torch.no_grad():
        assert torch.equal(model(x), before), 'export changed later eager outputs'

"""Export guards shared by the layers.

Written for lsvision, Apache-2.0.
"""
import torch

__all__ = ['refuse_legacy_onnx_export', 'is_exporting']


@torch.jit.unused
def _in_legacy_onnx_export() -> bool:
    # the TorchScript-based exporter traces (torch.jit); the dynamo exporter goes through torch.export instead
    return torch.onnx.is_in_onnx_export() and torch.jit.is_tracing()


def is_exporting() -> bool:
    """Whether torch.export (the dynamo ONNX exporter's front end) is tracing: the layers then take their inference
    path, since an exported graph is for inference (the training paths' custom autograd Functions read overlapping
    strided views, which ONNX does not express)."""
    if torch.jit.is_scripting():
        return False
    return _is_exporting()


@torch.jit.unused
def _is_exporting() -> bool:
    return torch.compiler.is_exporting()


def refuse_legacy_onnx_export(layer: str) -> None:
    """Raise where the legacy TorchScript-based ONNX exporter (`torch.onnx.export(..., dynamo=False)`) runs `layer`.

    That exporter mis-translates the layers' in-place writes into views of fresh buffers: onnxruntime's outputs were
    off by 0.05-0.6 with no error. The dynamo exporter gives the same numbers as torch.
    """
    if not torch.jit.is_scripting() and _in_legacy_onnx_export():
        raise RuntimeError(
            f'{layer} cannot be exported by the legacy TorchScript-based ONNX exporter (it exports its in-place '
            'buffer writes wrongly); export with torch.onnx.export(model, args, path, dynamo=True)')

"""Export guards shared by the layers.

Written for lsvision, Apache-2.0.
"""
import torch

__all__ = ['refuse_legacy_onnx_export', 'training_paths_enabled']


@torch.jit.unused
def _in_legacy_onnx_export() -> bool:
    # the TorchScript-based exporter traces (torch.jit); the dynamo exporter goes through torch.export instead
    return torch.onnx.is_in_onnx_export() and torch.jit.is_tracing()


def training_paths_enabled() -> bool:
    """Whether the layers may take their training paths (custom autograd Functions that recompute in backward, the
    memory-saving product forms): autograd records this forward (grad enabled), and neither TorchScript nor a graph
    capture runs. Under torch.export (the dynamo ONNX exporter's front end) or torch.jit.trace (fvcore's
    FlopCountAnalysis, which timm's benchmark.py runs with grad enabled) the layers take their plain path.

    An exported graph is for inference (the training paths' custom autograd Functions read overlapping strided views,
    which ONNX does not express), and a traced one records a custom Function as an opaque ``prim::PythonOp``, whose
    FLOPs fvcore does not count (cvt_ls_13 at 4.654 instead of 4.953 GFLOPs) and which cannot be saved. The plain
    path computes the same outputs and gradients, keeping more activations for backward.
    """
    if torch.jit.is_scripting():
        return False
    return torch.is_grad_enabled() and not (torch.jit.is_tracing() or _is_exporting())


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

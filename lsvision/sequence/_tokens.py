"""The token-id check every sequence model runs before its embedding (an id outside the vocabulary would otherwise be
a bare ``IndexError`` of ``nn.Embedding`` on CPU, or a device-side assert on CUDA)."""
import torch

__all__ = ['check_token_ids']

_INTEGER_DTYPES = (torch.long, torch.int, torch.int16, torch.uint8)


def check_token_ids(ids: torch.Tensor, vocab_size: int, model: str = 'the model') -> None:
    """Raise a ValueError naming the vocabulary size when ``ids`` are not (B, N) integer ids in [0, vocab_size).

    The range is read on CPU tensors only, and not while tracing, compiling or exporting (it needs the values: a host
    sync on an accelerator, a data-dependent branch in a graph).

    Args:
        ids: Token ids (B, N).
        vocab_size: Rows of the model's token embedding.
        model: What the ids go into, for the message.
    """
    if ids.dim() != 2 or ids.dtype not in _INTEGER_DTYPES:
        raise ValueError(f'expected token ids (B, N) of an integer dtype, got {tuple(ids.shape)} {ids.dtype}')
    if (not ids.numel() or ids.device.type != 'cpu' or torch.jit.is_tracing() or torch.compiler.is_compiling()
            or torch.compiler.is_exporting()):
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(
            f'token ids must be in [0, {vocab_size}): {model} has a vocabulary of {vocab_size} tokens '
            f'(vocab_size={vocab_size}), got ids in [{lo}, {hi}]. Build it with vocab_size={max(hi + 1, vocab_size)} '
            'or more, or map the ids into its vocabulary (e.g. an unknown-token id).')

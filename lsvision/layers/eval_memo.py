"""What layers need to reuse input-independent terms in inference: folded conv/BatchNorm weights, standardized
weights, the frozen-cache products of GRC. Written once for every layer that caches such terms.

A layer keeps an :class:`EvalMemo` as a plain attribute (not state: never in the state dict) and asks it for each
term by name, with the tensors the term is computed from::

    self._memos = EvalMemo()
    ...
    @torch.jit.unused
    def _folded_dw(self):
        return self._memos.get('folded_dw', self._fold_sources(), self._compute_folded_dw, extra=(self.bn.eps,))

Callers check :func:`eval_fast_path` first; the memo itself only compares keys.
"""
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch

__all__ = ['EvalMemo', 'eval_fast_path', 'version_key']


def eval_fast_path(training: bool) -> bool:
    """True in eager inference without autograd: a layer may then use terms it computed on an earlier call.

    Never while tracing, scripting or compiling, so that FLOP counting and exported graphs see the full computation.
    """
    if training or torch.is_grad_enabled() or torch.jit.is_scripting() or torch.jit.is_tracing():
        return False
    return not torch.compiler.is_compiling()


def version_key(tensors: Iterable[torch.Tensor]) -> Optional[Tuple[Tuple[int, int], ...]]:
    """(address, version) of each tensor: it changes on every in-place write (optimizer step, load_state_dict,
    `copy_` under no_grad) and when a tensor is replaced. Writes through `.data` do not bump versions.

    Returns None for inference tensors (made under `torch.inference_mode`), which have no version counter: don't
    cache then.
    """
    try:
        return tuple((t.data_ptr(), t._version) for t in tensors)
    except RuntimeError:
        return None


class EvalMemo:
    """Named values computed from parameters and buffers, kept until one of their source tensors changes.

    Each entry is kept under the :func:`version_key` of its sources plus an `extra` part (an eps, a dtype: whatever
    else the value depends on). :meth:`get` returns the kept value while the key matches and otherwise computes it
    again. Values are always computed outside inference mode and without autograd, so they are normal tensors that
    a later training or no-grad call can use. Sources that are inference tensors have no versions: their values are
    never kept.

    A plain Python object, not module state: TorchScript ignores it (only `torch.jit.unused` methods may use it),
    `copy.deepcopy` and pickling copy it along with the module (a copy's tensors have other addresses, so its kept
    values are recomputed on first use). Layers that drop their memos on a train/eval switch call :meth:`clear`.
    """

    __slots__ = ('_entries',)

    def __init__(self):
        self._entries: Dict[str, Tuple[tuple, Any]] = {}

    def get(
            self,
            name: str,
            sources: Iterable[torch.Tensor],
            compute: Callable[..., Any],
            *args: Any,
            extra: tuple = (),
            compute_unkept: bool = True,
    ) -> Any:
        """The value of entry `name`: the kept one if `sources` and `extra` are unchanged, else `compute(*args)`.

        The caller decides whether memos apply at all (:func:`eval_fast_path`). `compute` is a function or bound
        method (no lambdas: the calling methods are parsed by TorchScript), called under
        `torch.inference_mode(False)` and `torch.no_grad()`.

        Args:
            name: Entry name, one per kept value.
            sources: The tensors the value is computed from; an in-place write (version) or a new tensor (address)
                makes the kept value stale.
            compute: Computes the value from `args`.
            *args: Arguments of `compute`.
            extra: Anything else the value depends on (hashable, compared with ==), e.g. `(bn.eps,)` or `(dtype,)`.
            compute_unkept: What to do when the value cannot be kept (inference-tensor sources): compute it (True)
                or return None (False), for callers that have a cheaper path without the memo.
        """
        key = version_key(sources)
        if key is not None:
            key = (key, extra)
            hit = self._entries.get(name)
            if hit is not None and hit[0] == key:
                return hit[1]
        elif not compute_unkept:
            return None
        with torch.inference_mode(False), torch.no_grad():
            value = compute(*args)
        if key is not None:
            self._entries[name] = (key, value)
        return value

    def clear(self) -> None:
        """Drop all kept values (they are recomputed on next use)."""
        self._entries.clear()

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f'EvalMemo({sorted(self._entries)})'

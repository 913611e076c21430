"""What ``gpumon run``'s hooks do about ``torch.compile``: break none of its graphs.

Two kinds of hook meet the compiler (dynamo):

* The module-call wrapper and the optimizer hooks run inside what it traces (a compiled
  model's call, a compiled optimizer step). Their first test is ``tracing()``'s two parts,
  ``is_dynamo_compiling() or flag._is_compiling_flag``: ``torch.compiler.is_compiling()`` in one
  Python call instead of two, which the compiler reads as the constant True while it traces,
  so they return there before anything of gpumon is traced. The flag is what
  ``is_compiling()`` reads for ``torch.export``'s non-strict tracing, which runs them as Python.
* The backward and DataLoader wrappers wrap what the compiler never traces: it breaks its
  graph before ``Tensor.backward()`` and a DataLoader's ``next()``, and runs them as Python
  does. But from inside a compiled function, what they call is new code to it, which it would
  try to compile, breaking a graph of its own at the torch call inside (and timing nothing).
  So once the job calls ``torch.compile`` they are put back wrapped in ``torch._dynamo.disable``
  (``run_as_python``): the compiler leaves them and what they call alone. That costs each call
  a few Python calls more (the compiler is loaded by every job with a torch optimizer, so it
  is done for the jobs that compile only).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

_COMPILER = "torch._dynamo"


def tracing(compiler: Any) -> tuple[Callable[[], bool], Any]:
    """``(is_dynamo_compiling, flag)`` for the hooks' first test; where this torch lacks either
    part, ``(is_compiling, a stand-in whose flag calls is_compiling())``."""
    is_compiling = compiler.is_compiling
    dynamo_compiling = getattr(compiler, "is_dynamo_compiling", None)
    if dynamo_compiling is not None and isinstance(getattr(compiler, "_is_compiling_flag", None), bool):
        return dynamo_compiling, compiler
    return is_compiling, _Flag(is_compiling)


class _Flag:
    """``torch.compiler`` as the hooks' test reads it, for a torch without the flag."""

    def __init__(self, is_compiling: Callable[[], bool]) -> None:
        self._is_compiling = is_compiling

    @property
    def _is_compiling_flag(self) -> bool:
        return self._is_compiling()


def run_as_python(owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
    """If ``owner.name`` is ``wrapper``, wrap it in the compiler's ``disable``: the compiler
    runs it, and everything it calls, as Python does. Nothing happens where this torch lacks
    it (its graphs may then break at the wrapper, as they did before)."""
    disable = getattr(sys.modules.get(_COMPILER), "disable", None)
    if disable is None or getattr(owner, name, None) is not wrapper:
        return
    try:
        setattr(owner, name, disable(wrapper, recursive=True))
    except Exception:  # a compiler that changed: the wrapper stays as it is
        pass

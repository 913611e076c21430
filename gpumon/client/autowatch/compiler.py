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
  So once the compiler is loaded they are put back wrapped in ``torch._dynamo.disable``
  (``run_as_python``): the compiler leaves them and what they call alone, for about 0.3 µs a
  call. The compiler is imported by the first ``torch.compile`` (about a second); a job that
  never compiles pays neither: ``once_loaded`` waits for that import.
"""

from __future__ import annotations

import importlib.machinery
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


def once_loaded(then: Callable[[], None]) -> None:
    """Call ``then()`` now if the compiler is loaded, else as soon as it is imported (in place
    of what an earlier call asked for then)."""
    if _COMPILER in sys.modules:
        then()
        return
    for finder in sys.meta_path:
        if isinstance(finder, _AfterCompiler):
            finder.then = then
            return
    sys.meta_path.insert(0, _AfterCompiler(then))


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


class _AfterCompiler:
    """A meta path finder that finds nothing of its own: it lets the path find the compiler,
    and once the compiler's module has run, calls ``then()``."""

    def __init__(self, then: Callable[[], None]) -> None:
        self.then = then

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != _COMPILER:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # (None: the rest of the path looks for it)
        spec.loader = _Then(spec.loader, self.then)  # type: ignore[assignment]
        return spec


class _Then:
    """Loads the compiler as its own loader would, then calls ``then()``."""

    def __init__(self, loader: Any, then: Callable[[], None]) -> None:
        self._loader = loader
        self._then = then

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        try:
            self._then()
        except Exception:  # never an error in the job's import
            pass

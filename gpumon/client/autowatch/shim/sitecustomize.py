"""Loaded by every Python process ``gpumon run`` starts (its folder leads ``PYTHONPATH``).

It costs a process that never imports torch nothing but this file: it waits for torch to be
imported, and only then loads gpumon's hooks (``gpumon.client.autowatch.hooks``). Then it runs
the ``sitecustomize`` that would have run without it, if there is one further along the path.
With ``GPUMON_RUN_DISABLE=1`` it only does the latter.
"""

import os
import sys
from typing import Any


class _AfterTorch:
    """A meta path finder that finds nothing itself: when ``torch`` is imported, it lets the
    rest of ``sys.meta_path`` find it and installs the hooks once it has run."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = None if find is None else find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        spec.loader = _Loader(loader)
        return spec


class _Loader:
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        try:
            from gpumon.client.autowatch.hooks import install

            install()
        except Exception:  # an older or newer torch, no gpumon here: the job runs unwatched
            pass


def _chain() -> None:
    """Run the ``sitecustomize`` further along ``sys.path``, as Python would have."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if os.environ.get("GPUMON_RUN_DISABLE") != "1" and "torch" not in sys.modules:
    sys.meta_path.insert(0, _AfterTorch())
_chain()

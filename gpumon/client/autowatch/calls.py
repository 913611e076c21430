"""Which module calls pass ``gpumon run``'s wrapper (``hooks`` decides when): every one, through
``Module.__call__``, while the models are learnt; then only those of the models' classes, each
given a ``__call__`` of its own, so that the modules inside a model and a parameter-less loss
module are called as torch calls them. ``unwrap()`` restores every class as it was: a class
that had no ``__call__`` of its own has none again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]
"""Makes the wrapper of a call from the call it wraps."""

_restore: list[Callable[[], None]] = []
_torch_module: Any = None  # torch.nn.Module, once a class's call was wrapped


def any_wrapped() -> bool:
    """Whether some module call is wrapped now."""
    return bool(_restore)


def wrap_every_call(wrap: Wrap) -> None:
    """Wrap ``Module.__call__``: every module call passes the wrapper."""
    from torch.nn.modules import module

    unwrap()
    _wrap_class_call(module.Module, module.Module.__dict__["__call__"], wrap)


def wrap_class_calls(classes: Iterable[type], wrap: Wrap) -> None:
    """Wrap the calls of ``classes`` only, and no longer ``Module.__call__``.

    Each class's own call is wrapped as the class defines it (a subclass's, never its base's
    wrapper); one it inherits from ``Module`` is looked up there at each call
    (``module_call``), so that a patch of ``Module.__call__`` (``torch.fx``'s tracer records
    submodule calls so) still reaches the models' instances."""
    global _torch_module
    from torch.nn.modules import module

    unwrap()
    _torch_module = module.Module
    owners = [(cls, next(c for c in cls.__mro__ if "__call__" in c.__dict__)) for cls in classes]
    for cls, owner in owners:
        _wrap_class_call(cls, module_call if owner is module.Module else owner.__dict__["__call__"], wrap)


def module_call(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``Module.__call__`` as it is now (torch's, or a patch in place over it)."""
    return _torch_module.__call__(self, *args, **kwargs)


def unwrap() -> None:
    """Every class's call as it was before it was wrapped."""
    for restore in reversed(_restore):
        restore()
    _restore.clear()


def _wrap_class_call(cls: type, original: Callable[..., Any], wrap: Wrap) -> None:
    own = cls.__dict__.get("__call__")
    wrapper = functools.wraps(original)(wrap(original))
    cls.__call__ = wrapper  # type: ignore[method-assign]

    def restore() -> None:
        if cls.__dict__.get("__call__") is wrapper:
            if own is None:
                delattr(cls, "__call__")
            else:
                cls.__call__ = own  # type: ignore[method-assign]

    _restore.append(restore)

"""The one base of every error gpumon raises, so a caller can catch them all in one clause.

Each error class derives from :class:`GpumonError` and keeps the builtin base that says what
kind of failure it is (``ConfigError`` is also a ``ValueError``), so a caller that catches the
builtin still catches it. This module imports nothing: every layer may import it.
"""

from __future__ import annotations


class GpumonError(Exception):
    """Something gpumon cannot do; the subclass says what, the message says why."""


__all__ = ["GpumonError"]

"""The one compiled part: the hook's hot path in C (``gpumon.client._hook``).

Optional: where it does not build (no compiler, not Linux) gpumon installs without it and the
hook runs its pure-Python twin, ``gpumon.client.core._core``.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "gpumon.client._hook",
            sources=["gpumon/client/_hook.c"],
            optional=True,
            extra_compile_args=["-O2", "-Wall", "-Wno-unused-parameter"],
        )
    ]
)

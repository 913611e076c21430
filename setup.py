"""The one compiled part: the hook's hot path in C (``gpumon.client.core._hook``).

Optional: where it does not build (no compiler, not Linux) gpumon installs without it and the
hook runs its pure-Python twins, ``gpumon.client.core.step_core`` first of them. The C twin of each
Python module is a file of its own in ``gpumon/client/core/hook/`` (``hook.h`` lists them);
``module.c``, the module itself, comes first.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "gpumon.client.core._hook",
            sources=[
                "gpumon/client/core/hook/module.c",
                "gpumon/client/core/hook/step_core.c",
                "gpumon/client/core/hook/step_finder.c",
                "gpumon/client/core/hook/run_hooks.c",
                "gpumon/client/core/hook/cuda_runtime.c",
                "gpumon/client/core/hook/format_step.c",
            ],
            depends=["gpumon/client/core/hook/hook.h"],
            optional=True,
            # The parts share their declarations through hook.h; nothing of them but the
            # module's init is visible outside the extension.
            extra_compile_args=["-O2", "-Wall", "-Wno-unused-parameter", "-fvisibility=hidden"],
        )
    ]
)

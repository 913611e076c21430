"""Compile the fake NVML library (fake_nvml.c) into ``libnvidia-ml.so.1``.

Usage from Python::

    from gpumon.testing.fakenvml import build_fake_nvml
    lib = build_fake_nvml(tmp_dir)                    # .../libnvidia-ml.so.1
    old = build_fake_nvml(other_dir, old_driver=True)

and then start a process with ``LD_LIBRARY_PATH=<lib.parent>`` and
``FAKE_NVML_SCENARIO=<scenario file>``; ``pynvml.nvmlInit()`` in that process
loads the fake (:func:`gpumon.testing.fakenvml.fake_nvml_env` builds that environment).
From a shell: ``python -m gpumon.testing.fakenvml.build OUT_DIR [--old-driver]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from gpumon.errors import GpumonError

SOURCE = Path(__file__).resolve().parent / "fake_nvml.c"
LIBRARY_NAME = "libnvidia-ml.so.1"
BASE_FLAGS = ("-shared", "-fPIC", "-O2", "-pthread", "-Wall", "-Werror")
OLD_DRIVER_DEFINE = "-DFAKE_NVML_OLD_DRIVER"


class FakeNvmlBuildError(GpumonError, RuntimeError):
    """The fake NVML library could not be built."""


def _compiler() -> str:
    cc = os.environ.get("CC", "gcc")
    path = shutil.which(cc)
    if path is None:
        raise FakeNvmlBuildError(
            f"C compiler {cc!r} not found on PATH; the fake NVML library "
            f"({SOURCE.name}) needs gcc (install it, e.g. `apt-get install gcc`)"
        )
    return path


def _flags(old_driver: bool) -> list[str]:
    return [*BASE_FLAGS, *([OLD_DRIVER_DEFINE] if old_driver else [])]


def build_fake_nvml(out_dir: Path, *, old_driver: bool = False) -> Path:
    """Build ``out_dir/libnvidia-ml.so.1`` and return its path.

    The build is skipped when the library is newer than ``fake_nvml.c`` and was
    built with the same flags (recorded in a stamp file beside it).  Put the two
    variants in different directories: both must be named ``libnvidia-ml.so.1``.
    Raises :class:`FakeNvmlBuildError` if gcc is missing or the compile fails.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / LIBRARY_NAME
    stamp = out_dir / (LIBRARY_NAME + ".flags")
    flags = _flags(old_driver)
    wanted = " ".join(flags)
    try:
        fresh = (
            lib.stat().st_mtime_ns >= SOURCE.stat().st_mtime_ns
            and stamp.read_text() == wanted
        )
    except OSError:
        fresh = False
    if fresh:
        return lib

    cc = _compiler()
    fd, tmp_name = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out_dir)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        proc = subprocess.run(
            [cc, *flags, "-o", str(tmp), str(SOURCE)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise FakeNvmlBuildError(
                f"compiling {SOURCE.name} failed ({proc.returncode}):\n"
                f"{proc.stdout}{proc.stderr}"
            )
        os.replace(tmp, lib)  # atomic: a concurrent loader never sees half a file
        stamp.write_text(wanted)
    finally:
        tmp.unlink(missing_ok=True)
    return lib


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--old-driver", action="store_true",
                        help="omit the newer symbols (see README.md)")
    args = parser.parse_args(argv)
    print(build_fake_nvml(args.out_dir, old_driver=args.old_driver))


if __name__ == "__main__":
    main()

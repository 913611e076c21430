"""CUDA events through the runtime's C functions, the GIL held (``_hook.cuda_runtime``).

This machine has no GPU: the lookup is shown to find nothing here (so the torch-event path
and host clocks are taken, and nothing crashes), then to find a stand-in runtime
(tests/client/native/fake_cudart.c, built here) by the same route a real one is found, a
library named ``libcudart*`` that the process already loaded, and the whole hook to time
phases through it. The real runtime is exercised by benchmarks/gpu_checks/hook.py on a GPU.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gpumon.client import StepMonitor
from gpumon.client.core import cuda_clock
from gpumon.client.core.transport import MemoryTransport
from gpumon.wire import StepRecord
from tests.client.test_cuda_timing import FakeCuda

_hook = pytest.importorskip("gpumon.client.core._hook") if sys.platform != "linux" else None
if _hook is None:
    from gpumon.client.core import _hook

SOURCE = Path(__file__).parent / "native" / "fake_cudart.c"
SYMBOLS = ("cudaEventCreateWithFlags", "cudaEventRecord", "cudaEventQuery", "cudaEventElapsedTime",
           "cudaEventDestroy", "cudaSetDevice")


def test_no_runtime_loaded_here_means_none_and_the_torch_path() -> None:
    import torch  # CPU build: its libraries have no CUDA runtime

    assert not torch.cuda.is_available()
    assert all(not hasattr(ctypes.CDLL(None), name) for name in SYMBOLS)
    assert _hook.cuda_runtime(0, None) is None
    assert cuda_clock.native_runtime(0, None) is None
    clock = cuda_clock.CudaClock(FakeCuda(), 0, True)
    assert clock.runtime is None and clock.event() is not None  # torch's events
    assert cuda_clock.detect(True) is None  # no CUDA at all: host clocks


def test_bad_arguments_are_clear_errors() -> None:
    with pytest.raises(TypeError):
        _hook.cuda_runtime(0)
    with pytest.raises(TypeError):
        _hook.cuda_runtime(0, 5)


@pytest.fixture(scope="module")
def fake_runtime(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The stand-in, built and loaded as torch loads libcudart: by name, not globally."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "no C compiler: run scripts/test, which installs gcc"
    library = tmp_path_factory.mktemp("cudart") / "libcudart.so.12"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(library), str(SOURCE)], check=True)
    fake = ctypes.CDLL(str(library), mode=ctypes.RTLD_LOCAL)
    fake.fake_last_stream.restype = ctypes.c_void_p
    fake.fake_set_time_ms.argtypes = [ctypes.c_double]
    return fake


def test_the_loaded_runtime_is_found_and_times_events(fake_runtime: ctypes.CDLL) -> None:
    streams: list[int] = []

    def current_raw_stream(device: int) -> int:
        streams.append(device)
        return 0x7000

    runtime = _hook.cuda_runtime(3, current_raw_stream)
    assert runtime is not None
    fake_runtime.fake_set_time_ms(1.0)
    start = runtime.record()
    fake_runtime.fake_set_time_ms(3.5)
    end = runtime.record()
    assert isinstance(start, int) and streams == [3, 3]
    assert fake_runtime.fake_last_stream() == 0x7000
    fake_runtime.fake_set_completed(0)
    assert runtime.query(end) is False
    fake_runtime.fake_set_completed(1)
    assert runtime.query(end) is True and fake_runtime.fake_last_device() == 3
    assert runtime.elapsed_ms(start, end) == pytest.approx(2.5)
    runtime.release(start)
    runtime.release(end)
    created = fake_runtime.fake_created()
    again = runtime.record()  # reused from the pool
    assert fake_runtime.fake_created() == created and again in (start, end)
    runtime.release(again)


def test_a_refused_record_is_counted_and_never_raises(fake_runtime: ctypes.CDLL) -> None:
    runtime = _hook.cuda_runtime(0, None)
    fake_runtime.fake_fail_records(1)
    try:
        assert runtime.record() is None and runtime.record() is None
    finally:
        fake_runtime.fake_fail_records(0)
    assert runtime.record_errors == 2
    # A current-stream call that fails falls back to the default stream, for good.
    broken = _hook.cuda_runtime(0, lambda device: 1 // 0)
    assert isinstance(broken.record(), int) and fake_runtime.fake_last_stream() is None


def test_the_hook_times_phases_through_the_runtime(
        fake_runtime: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCuda()  # torch.cuda's other parts (allocator statistics, device properties)
    runtime = _hook.cuda_runtime(0, None)
    monkeypatch.setattr(cuda_clock, "detect", lambda reset_peak: cuda_clock.CudaClock(
        fake, 0, reset_peak, memory_interval_s=0.0, device_interval_s=0.0, runtime=runtime))
    transport = MemoryTransport()
    mon = StepMonitor(run="native", transport=transport)
    recorded_before = fake_runtime.fake_recorded()  # the library counts for the whole module
    gpu_ms = 0.0
    fake_runtime.fake_set_time_ms(gpu_ms)
    for _ in range(3):
        with mon.step():
            with mon.phase("forward"):
                gpu_ms += 7.0
                fake_runtime.fake_set_time_ms(gpu_ms)
            with mon.phase("backward"):
                gpu_ms += 11.0
                fake_runtime.fake_set_time_ms(gpu_ms)
            time.sleep(0.02)
    mon.close()
    steps = [r for r in transport.records() if isinstance(r, StepRecord)]
    assert len(steps) == 3 and fake.events_created == 0  # torch's events never used
    for step in steps:
        assert step.device_phases == ("forward", "backward")
        assert step.phases_s["forward"] == pytest.approx(0.007, rel=1e-5)
        assert step.phases_s["backward"] == pytest.approx(0.011, rel=1e-5)
    assert runtime.pooled >= 2  # events went back for reuse
    # Three events a step at least: each phase's start and end, the backward's start sharing
    # the forward's end when it follows at once.
    assert fake_runtime.fake_recorded() - recorded_before >= 9
    assert fake_runtime.fake_records_without_gil() == 0


def test_the_gil_check_sees_a_caller_without_it(fake_runtime: ctypes.CDLL) -> None:
    # ctypes releases the GIL around foreign calls, as torch's Event.record() does: the
    # check above would have counted such a record.
    before = fake_runtime.fake_records_without_gil()
    event = ctypes.c_void_p()
    assert fake_runtime.cudaEventCreateWithFlags(ctypes.byref(event), 0) == 0
    assert fake_runtime.cudaEventRecord(event, None) == 0
    assert fake_runtime.fake_records_without_gil() == before + 1
    fake_runtime.cudaEventDestroy(event)


def test_detect_picks_the_runtime_when_torch_runs_on_cuda(
        fake_runtime: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch) -> None:
    # torch as it looks on a GPU machine (mocked: this one has none), with the stand-in loaded.
    fake = FakeCuda()
    cuda: Any = SimpleNamespace(**{k: getattr(fake, k) for k in dir(fake) if not k.startswith("__")})
    cuda.is_available = cuda.is_initialized = lambda: True
    cuda.current_device = lambda: 0
    torch = SimpleNamespace(cuda=cuda, _C=SimpleNamespace(_cuda_getCurrentRawStream=lambda d: 0x42))
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.delenv("GPUMON_PURE_PYTHON", raising=False)  # the C core may be used
    clock = cuda_clock.detect(True)
    assert clock is not None and clock.runtime is not None
    assert isinstance(clock.event(), int) and fake_runtime.fake_last_stream() == 0x42
    monkeypatch.setenv("GPUMON_PURE_PYTHON", "1")  # no C: torch's events
    clock = cuda_clock.detect(True)
    assert clock is not None and clock.runtime is None

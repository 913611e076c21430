"""What the benchmarks share: the peers' venv, the NVML library they load, step records, timing.

The peers (nvitop-exporter, gpustat, TensorBoard) are installed from PyPI into their own
venv, ``benchmarks/.peers-venv`` (git-ignored), created on first use from
``peers-requirements.txt``; gpumon's own ``.venv`` stays lean.
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
import time
import venv
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from gpumon.testing import http_get  # noqa: E402
from gpumon.testing.fakenvml import BASE_FLAGS, SCENARIOS, SOURCE, FakeNvmlBuildError, Scenario  # noqa: E402
from gpumon.wire import encode_record, pack_datagrams  # noqa: E402

PEERS_VENV = HERE / ".peers-venv"
REQUIREMENTS = HERE / "peers-requirements.txt"
STUBS = HERE / "peer_nvml_stubs.c"
SCENARIO = SCENARIOS / "h100_8x_live.scn"
LAUNCHER = HERE / "counted.py"


def peers_python() -> Path:
    """The peers' venv interpreter; the venv is created or brought up to date first."""
    python = PEERS_VENV / "bin" / "python"
    stamp = PEERS_VENV / ".requirements"
    wanted = REQUIREMENTS.read_text()
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python
    print(f"installing the peers into {PEERS_VENV.relative_to(ROOT)} ...", file=sys.stderr)
    if not python.exists():
        venv.EnvBuilder(with_pip=True).create(PEERS_VENV)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(REQUIREMENTS)],
                   check=True)
    stamp.write_text(wanted)
    return python


def build_peer_nvml(out_dir: Path) -> Path:
    """``out_dir/libnvidia-ml.so.1``: the fake NVML plus the entry points the peers need.

    One change to the fake: its event wait re-reads the scenario file every 50 ms (for tests
    that rewrite it mid-run); here it waits in one-second slices, as a real driver sleeps in
    the kernel, so gpumon's XID watcher is not billed 20 wakeups a second no driver costs.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    source = SOURCE.read_text()
    slice_50ms = "#define WAIT_SLICE_S 0.05"
    if slice_50ms not in source:
        raise FakeNvmlBuildError(f"{SOURCE.name} no longer has {slice_50ms!r}: update {__file__}")
    patched = out_dir / "fake_nvml_bench.c"
    patched.write_text(source.replace(slice_50ms, "#define WAIT_SLICE_S 1.0"))
    lib = out_dir / "libnvidia-ml.so.1"
    proc = subprocess.run(
        [os.environ.get("CC", "gcc"), *BASE_FLAGS, "-o", str(lib), str(patched), str(STUBS)],
        capture_output=True, text=True)
    if proc.returncode != 0:
        raise FakeNvmlBuildError(f"compiling the peers' NVML failed:\n{proc.stdout}{proc.stderr}")
    return lib


@contextmanager
def live_node(out_dir: Path) -> Iterator[Path]:
    """The 8×H100 scenario with one live host process per GPU as its compute process (as on
    a training node), so collectors that look processes up (psutil) do their real work."""
    scenario = Scenario.load(SCENARIO)
    sleepers = [subprocess.Popen(["sleep", "86400"]) for _ in range(scenario.gpu_count)]
    try:
        for index, sleeper in enumerate(sleepers):
            gpu = scenario.gpu(index)
            used = gpu.processes[0][1] if gpu.processes else 60 * 2**30
            gpu.processes = [(sleeper.pid, used)]
        yield scenario.dump(out_dir / "h100_8x_live_node.scn")
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()


def thread_cpu_ns(pid: int) -> dict[int, int]:
    """CPU nanoseconds of every live thread of ``pid``, by thread id: the scheduler's own
    account in /proc/PID/task/*/schedstat (psutil's clock ticks are 10 ms coarse)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended meanwhile
    return out


def cpu_seconds(pid: int) -> float:
    """CPU time of every live thread of ``pid``."""
    return sum(thread_cpu_ns(pid).values()) / 1e9


def thread_names(pid: int) -> dict[int, str]:
    """Python thread names of ``pid`` by thread id (py-spy, from the peers' venv)."""
    dump = subprocess.run([str(PEERS_VENV / "bin" / "py-spy"), "dump", "--pid", str(pid)],
                          capture_output=True, text=True, check=True).stdout
    return {int(tid): name for tid, name in re.findall(r'^Thread (\d+) \(\w+\): "(.*)"$', dump, re.M)}


def get(url: str) -> bytes:
    """The body of a GET that must answer 200."""
    status, body = http_get(url, timeout=10)
    if status != 200:
        raise RuntimeError(f"GET {url} answered {status}: {body[:200]!r}")
    return body


def latencies(url: str, count: int) -> tuple[list[float], int]:
    """Wall seconds of ``count`` sequential GETs, and the size of the last body."""
    times, size = [], 0
    for _ in range(count):
        start = time.perf_counter()
        size = len(get(url))
        times.append(time.perf_counter() - start)
    return times, size


def print_table(header: list[str], rows: list[list[str]]) -> None:
    """A plain text table, first column left-aligned, the others right-aligned."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        cells = [f"{row[0]:<{widths[0]}}"] + [f"{c:>{w}}" for c, w in zip(row[1:], widths[1:], strict=True)]
        print("  ".join(cells))


def step_record(run: str, rank: int, step: int, t_start: float, duration_s: float,
                gpus: int = 8) -> dict[str, object]:
    """A realistic step record on the wire: five phases, counts and allocator statistics."""
    return {
        "v": 1, "kind": "step", "run": run, "rank": rank, "world": 64, "local_rank": rank % gpus,
        "gpu": rank % gpus, "step": step, "t_start": t_start, "duration": duration_s,
        "samples": 32, "tokens": 65536, "flops": 3.1e15, "pid": 4242,
        "phases": {"data": 0.03 * duration_s, "forward": 0.3 * duration_s,
                   "backward": 0.55 * duration_s, "comm": 0.06 * duration_s,
                   "optimizer": 0.04 * duration_s},
        "mem": {"allocated": 51_234_567_890, "reserved": 60_000_000_000,
                "peak": 58_123_456_789 + step % 1000, "retries": 0, "ooms": 0},
    }


def send_steps(path: str, ranks: int, steps: int, step_s: float, t0: float,
               records_per_s: float, retry_s: float = 0.05) -> tuple[int, int]:
    """Send ``steps`` steps of ``ranks`` ranks, step k of every rank stamped ``t0 + k·step_s``,
    paced at ``records_per_s``; a full socket queue is retried for ``retry_s`` (as the
    client's sender does) before the datagram counts as lost. Returns (sent, lost)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    sent = lost = 0
    start = time.perf_counter()
    for k in range(steps):
        batch = [step_record("bench", r, k, t0 + k * step_s, step_s) for r in range(ranks)]
        for datagram, count in pack_datagrams(encode_record(r) for r in batch):
            deadline = time.perf_counter() + retry_s
            while True:
                try:
                    sock.sendto(datagram, path)
                    sent += count
                    break
                except BlockingIOError:
                    if time.perf_counter() >= deadline:
                        lost += count
                        break
                    time.sleep(0.0002)
        ahead = (k + 1) * ranks / records_per_s - (time.perf_counter() - start)
        if ahead > 0:
            time.sleep(ahead)
    return sent, lost



def pure_python_step_monitor() -> type:
    """``StepMonitor`` on the pure-Python core, beside the C one in the same process (a second
    copy of its module, loaded with ``GPUMON_PURE_PYTHON=1``): the before of the C core,
    measured in the same run as the after."""
    spec = importlib.util.find_spec("gpumon.client.monitor")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    previous = os.environ.get("GPUMON_PURE_PYTHON")
    os.environ["GPUMON_PURE_PYTHON"] = "1"
    try:
        spec.loader.exec_module(module)
    finally:
        if previous is None:
            del os.environ["GPUMON_PURE_PYTHON"]
        else:
            os.environ["GPUMON_PURE_PYTHON"] = previous
    assert module.IMPLEMENTATION == "python"
    return module.StepMonitor  # type: ignore[no-any-return]

"""Read and write the fake NVML library's scenario files (format: README.md).

Tests use this to compute expected values from the very file the C library
reads, and to change a scenario while a process is using it::

    scn = Scenario.load(SCENARIOS / "h100_8x.scn")
    gpu = scn.gpu(3)
    gpu.as_int("power_mw")         # configured value, or the library's default
    gpu["util_gpu"] = 12           # values are kept as the strings written
    scn.dump(tmp_path / "live.scn")  # atomic; the mtime visibly changes

Comments are not kept, except the comment block at the top of the file.
"""

from __future__ import annotations

import copy
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from gpumon.errors import GpumonError

SCENARIOS = Path(__file__).resolve().parent / "scenarios"

#: keys that take one value at the top level, with the library's defaults
GLOBAL_DEFAULTS: dict[str, str] = {
    "driver_version": "550.54.15",
    "nvml_version": "12.550.54.15",
    "cuda_driver_version": "12040",
    "init_error": "SUCCESS",
}
GLOBAL_KEYS = frozenset(GLOBAL_DEFAULTS) | {"gpu_count"}

#: counter-like keys: the value at init time and its growth per second
COUNTERS: dict[str, str] = {
    "nvlink_tx_kib": "nvlink_tx_kib_per_s",
    "nvlink_rx_kib": "nvlink_rx_kib_per_s",
    "pcie_tx_bytes": "pcie_tx_bytes_per_s",
    "pcie_rx_bytes": "pcie_rx_bytes_per_s",
    "energy_mj": "energy_mj_per_s",
}

#: scenario key -> NVML GPM metric id (nvmlGpmMetricId_t)
GPM_METRICS: dict[str, int] = {
    "gpm_graphics_util": 1,
    "gpm_sm_util": 2,
    "gpm_sm_occupancy": 3,
    "gpm_integer_util": 4,
    "gpm_tensor_util": 5,
    "gpm_dfma_tensor_util": 6,
    "gpm_hmma_tensor_util": 7,
    "gpm_dmma_tensor_util": 8,
    "gpm_imma_tensor_util": 9,
    "gpm_dram_bw_util": 10,
    "gpm_fp64_util": 11,
    "gpm_fp32_util": 12,
    "gpm_fp16_util": 13,
    "gpm_pcie_tx_mib_per_s": 20,
    "gpm_pcie_rx_mib_per_s": 21,
    "gpm_nvlink_rx_mib_per_s": 60,
    "gpm_nvlink_tx_mib_per_s": 61,
}

ARCHITECTURES: dict[str, int] = {
    "kepler": 2, "maxwell": 3, "pascal": 4, "volta": 5, "turing": 6,
    "ampere": 7, "ada": 8, "hopper": 9, "blackwell": 10,
}

UNSUPPORTED_GROUPS = frozenset({
    "memory", "utilization", "power", "energy", "temperature", "clocks",
    "clock_reasons", "ecc", "nvlink", "pcie", "gpm", "mig", "processes",
    "events", "samples",
})


def gpu_defaults(index: int) -> dict[str, str]:
    """What the library reports for GPU ``index`` when a key is absent."""
    return {
        "name": "NVIDIA H100 80GB HBM3",
        "uuid": f"GPU-fa4e0000-0000-4000-8000-{index:012x}",
        "pci_bus_id": f"00000000:{0x10 + index:02X}:00.0",
        "pci_device_id": "0x233010DE",
        "pci_subsystem_id": "0x16C110DE",
        "architecture": "hopper",
        "memory_total": "85520809984",
        "memory_used": "0",
        "memory_reserved": "0",
        "util_gpu": "0",
        "util_memory": "0",
        "power_mw": "70000",
        "power_limit_mw": "700000",
        "temperature_c": "35",
        "sm_clock_mhz": "1980",
        "mem_clock_mhz": "2619",
        "video_clock_mhz": "1545",
        "max_sm_clock_mhz": "1980",
        "max_mem_clock_mhz": "2619",
        "max_video_clock_mhz": "1980",
        "clock_event_reasons": "0",
        "supported_clock_event_reasons": "0x1FF",
        "ecc_corrected_volatile": "0",
        "ecc_corrected_aggregate": "0",
        "ecc_uncorrected_volatile": "0",
        "ecc_uncorrected_aggregate": "0",
        "mig_mode": "0",
        "mig_pending_mode": "0",
        "nvlink_links": "0",
        "lost": "0",
        **{k: "0" for k in COUNTERS if k != "energy_mj"},
        **{r: "0" for k, r in COUNTERS.items() if k != "energy_mj"},
        "energy_mj": "0",
        # graphics clocks follow the SM clocks and energy grows at power_mw
        # unless set; see Gpu.get()
    }


_DERIVED = {
    "graphics_clock_mhz": "sm_clock_mhz",
    "max_graphics_clock_mhz": "max_sm_clock_mhz",
    "energy_mj_per_s": "power_mw",
}

GPU_SINGLE_KEYS = (
    frozenset(gpu_defaults(0)) | frozenset(_DERIVED) | frozenset(GPM_METRICS)
    | {"lost_after_s", "memory_temperature_c"}
)


def _number(text: str) -> int:
    return int(text, 0)


@dataclass
class Gpu:
    """One ``gpu N ...`` block.  ``values`` holds single-valued keys as written."""

    index: int
    values: dict[str, str] = field(default_factory=dict)
    unsupported: list[str] = field(default_factory=list)
    processes: list[tuple[int, int]] = field(default_factory=list)  # (pid, used bytes)
    xids: list[tuple[int, float]] = field(default_factory=list)  # (xid, seconds after init)
    hangs: dict[str, float] = field(default_factory=dict)  # symbol -> seconds
    gpm_metrics: dict[int, float] = field(default_factory=dict)  # `gpm_metric ID VALUE`

    def get(self, key: str, default: str | None = None) -> str | None:
        """The configured value, else the library's default, else ``default``."""
        if key in self.values:
            return self.values[key]
        if key in _DERIVED:
            return self.get(_DERIVED[key], default)
        return gpu_defaults(self.index).get(key, default)

    def __getitem__(self, key: str) -> str:
        value = self.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def __setitem__(self, key: str, value: object) -> None:
        if key not in GPU_SINGLE_KEYS:
            raise KeyError(f"unknown gpu key {key!r}")
        self.values[key] = str(value)

    def __delitem__(self, key: str) -> None:
        del self.values[key]

    def __contains__(self, key: object) -> bool:
        return key in self.values

    def as_int(self, key: str) -> int:
        """An integer value (decimal or 0x hex); architecture names map to ids."""
        text = self[key]
        if key == "architecture" and text in ARCHITECTURES:
            return ARCHITECTURES[text]
        return _number(text)

    def as_float(self, key: str) -> float:
        return float(self[key])

    def counter(self, key: str, elapsed_s: float) -> float:
        """Expected counter value ``elapsed_s`` after init (no rewrites meanwhile)."""
        return self.as_float(key) + self.as_float(COUNTERS[key]) * elapsed_s

    def gpm(self, metric_id: int) -> float | None:
        """Configured value of a GPM metric, None when the scenario lacks it."""
        for key, mid in GPM_METRICS.items():
            if mid == metric_id and key in self.values:
                return float(self.values[key])
        return self.gpm_metrics.get(metric_id)

    def lines(self) -> list[str]:
        i = self.index
        out = [f"gpu {i} {k} {v}" for k, v in self.values.items()]
        if self.unsupported:
            out.append(f"gpu {i} unsupported {' '.join(self.unsupported)}")
        out += [f"gpu {i} gpm_metric {mid} {_fmt(v)}" for mid, v in self.gpm_metrics.items()]
        out += [f"gpu {i} process {pid} {used}" for pid, used in self.processes]
        out += [f"gpu {i} xid {code} at_s {_fmt(at)}" for code, at in self.xids]
        out += [f"gpu {i} hang {sym} {_fmt(s)}" for sym, s in self.hangs.items()]
        return out


def _fmt(x: float) -> str:
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


class ScenarioError(GpumonError, ValueError):
    pass


@dataclass
class Scenario:
    values: dict[str, str] = field(default_factory=dict)
    hangs: dict[str, float] = field(default_factory=dict)
    gpus: dict[int, Gpu] = field(default_factory=dict)
    comment: str = ""  # the comment block at the top, without the leading '# '

    # ---- access -------------------------------------------------------
    def get(self, key: str) -> str:
        return self.values.get(key, GLOBAL_DEFAULTS.get(key, ""))

    def __getitem__(self, key: str) -> str:
        return self.get(key)

    def __setitem__(self, key: str, value: object) -> None:
        if key not in GLOBAL_KEYS:
            raise KeyError(f"unknown top-level key {key!r}")
        self.values[key] = str(value)

    def __delitem__(self, key: str) -> None:
        del self.values[key]

    @property
    def gpu_count(self) -> int:
        if "gpu_count" in self.values:
            return _number(self.values["gpu_count"])
        return max(self.gpus, default=-1) + 1

    def gpu(self, index: int) -> Gpu:
        """The block of GPU ``index`` (created empty, i.e. all defaults, if absent)."""
        if index not in self.gpus:
            self.gpus[index] = Gpu(index)
        return self.gpus[index]

    def copy(self) -> Scenario:
        return copy.deepcopy(self)

    # ---- text ---------------------------------------------------------
    @classmethod
    def loads(cls, text: str, source: str = "<string>") -> Scenario:
        scn = cls()
        header: list[str] = []
        in_header = True
        for lineno, raw in enumerate(text.splitlines(), 1):
            stripped = raw.strip()
            if in_header:
                if stripped.startswith("#"):
                    header.append(stripped[1:].removeprefix(" "))
                    continue
                if not stripped:
                    continue
                in_header = False
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                scn._parse_line(line)
            except (ValueError, IndexError, KeyError) as exc:
                raise ScenarioError(f"{source}:{lineno}: {exc}: {line!r}") from None
        scn.comment = "\n".join(header)
        return scn

    def _parse_line(self, line: str) -> None:
        words = line.split()
        key = words[0]
        if key == "hang":
            _, sym, secs = words
            self.hangs[sym] = float(secs)
            return
        if key != "gpu":
            if len(words) != 2 or key not in GLOBAL_KEYS:
                raise ValueError(f"bad top-level line (key {key!r})")
            self.values[key] = words[1]
            return
        index = int(words[1])
        gkey = words[2]
        gpu = self.gpu(index)
        args = words[3:]
        if gkey == "name":
            gpu.values["name"] = line.split(None, 3)[3]
        elif gkey == "unsupported":
            bad = [g for g in args if g not in UNSUPPORTED_GROUPS]
            if bad or not args:
                raise ValueError(f"unknown groups {bad}")
            gpu.unsupported += [g for g in args if g not in gpu.unsupported]
        elif gkey == "process":
            pid, used = args
            gpu.processes.append((int(pid, 0), int(used, 0)))
        elif gkey == "xid":
            code, at_word, at = args
            if at_word != "at_s":
                raise ValueError("expected: xid CODE at_s SECONDS")
            gpu.xids.append((int(code, 0), float(at)))
        elif gkey == "hang":
            sym, secs = args
            gpu.hangs[sym] = float(secs)
        elif gkey == "gpm_metric":
            mid, value = args
            gpu.gpm_metrics[int(mid, 0)] = float(value)
        else:
            (value,) = args
            if gkey not in GPU_SINGLE_KEYS:
                raise KeyError(f"unknown gpu key {gkey!r}")
            gpu.values[gkey] = value

    def dumps(self) -> str:
        out = [f"# {c}".rstrip() for c in self.comment.splitlines()] if self.comment else []
        if out:
            out.append("")
        out += [f"{k} {v}" for k, v in self.values.items()]
        out += [f"hang {sym} {_fmt(s)}" for sym, s in self.hangs.items()]
        for index in sorted(self.gpus):
            out.append("")
            out += self.gpus[index].lines()
        return "\n".join(out) + "\n"

    # ---- files --------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Scenario:
        path = Path(path)
        return cls.loads(path.read_text(), source=str(path))

    def dump(self, path: str | os.PathLike[str]) -> Path:
        """Write atomically (temp file + os.replace) so a reader never sees half a
        file, and make sure the mtime differs from the replaced file's."""
        path = Path(path)
        try:
            old_mtime: int | None = path.stat().st_mtime_ns
        except FileNotFoundError:
            old_mtime = None
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.dumps())
                f.flush()
                os.fsync(f.fileno())
            if old_mtime is not None and os.stat(tmp_name).st_mtime_ns <= old_mtime:
                bumped = old_mtime + 10_000_000  # +10 ms
                os.utime(tmp_name, ns=(bumped, bumped))
            os.replace(tmp_name, path)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        return path

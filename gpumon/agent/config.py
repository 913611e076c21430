"""Agent configuration: defaults < TOML file < environment (GPUMON_*) < command-line flags."""

from __future__ import annotations

import dataclasses
import grp
import ipaddress
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from gpumon.agent.collectors import DEFAULTS, NAMES
from gpumon.analysis.thresholds import Thresholds
from gpumon.errors import GpumonError

DEFAULT_PORT = 9403  # 9400 is dcgm-exporter's, which often runs beside gpumon
DEFAULT_SOCKET = "/run/gpumon/ingest.sock"
DEFAULT_POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
DEFAULT_TRACE_DIR = "/var/tmp/gpumon-traces"
COLLECTORS = NAMES  # the names of the table in agent/collectors/


class ConfigError(GpumonError, ValueError):
    """A configuration value is invalid; the message says which and why."""


@dataclass(frozen=True)
class AgentConfig:
    """Everything the agent needs to run. Every field can come from a flag, env or file."""

    address: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    socket: str = DEFAULT_SOCKET
    socket_group: str | None = None
    """Group the ingest socket is given (name or gid); unset: ``gpumon`` if it exists."""
    interval: float = 1.0
    simulate: int = 0
    record: str | None = None
    collectors: tuple[str, ...] = DEFAULTS
    allowed_uids: tuple[int, ...] = ()
    rank_ttl_seconds: float = 300.0
    unsaved_alert_seconds: float = 3600.0
    """Step time a rank may do without a checkpoint before GpumonWorkAtRisk fires (exported as
    ``gpumon_unsaved_threshold_seconds``; docs/goodput.md)."""
    max_ranks: int = 1024
    log_level: str = "info"
    web_config: str | None = None
    node_name: str = ""
    """The node's name on ``gpumon_rank_info`` and ``gpumon_gpu_owner_info``; unset: the host name."""
    pod_resources_socket: str = DEFAULT_POD_RESOURCES_SOCKET
    """The kubelet's PodResources socket, asked where its directory exists."""
    trace_dir: str = DEFAULT_TRACE_DIR
    """Where ranks write the profiler traces asked of them (docs/traces.md)."""
    trace_max_bytes: int = 2 * 1024**3
    trace_steps: int = 3
    trace_auto: bool = False
    """Ask for a trace when a rank turns straggler or stays communication/host-bound: off by
    default, since a trace slows the steps it covers and keeps code paths on the node's disk."""
    trace_auto_windows: int = 3
    trace_auto_every_seconds: float = 1800.0
    thresholds: Thresholds = field(default_factory=Thresholds)
    config: str | None = field(default=None, compare=False)

    def enabled(self, collector: str) -> bool:
        """Whether a collector is switched on."""
        return collector in self.collectors


_ENV_PREFIX = "GPUMON_"
LOG_LEVELS = ("debug", "info", "warning", "error")
_TABLES = ("agent", "thresholds")


def _env_name(name: str) -> str:
    return _ENV_PREFIX + name.upper()


def load_config(flags: Mapping[str, Any], env: Mapping[str, str] | None = None) -> AgentConfig:
    """Merge the layers and validate; raises ConfigError with a one-line reason that says
    where a bad value came from (the file, the environment variable or the flag).

    Unknown keys and tables in the file are errors; unknown ``GPUMON_*`` variables are not,
    since the training-side client reads some of its own (``GPUMON_RUN``, ...).
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    config_path = flags.get("config") or env.get(_env_name("config"))
    if config_path:
        from_file = _read_file(Path(config_path))
        values.update(from_file)
        origins.update(dict.fromkeys(from_file, f"config file {config_path}: "))
        values["config"] = str(config_path)
    known = {f.name for f in fields(AgentConfig)}
    for name in known - {"config", "thresholds"}:
        raw = env.get(_env_name(name))
        if raw is not None and raw != "":
            values[name] = _from_env(name, raw)
            origins[name] = f"environment {_env_name(name)}: "
    for name, value in flags.items():
        if value is not None and name in known:
            values[name] = value
            origins[name] = ""  # a flag: the command line the user just typed
    return _validate(values, origins)


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:  # TOML is UTF-8 by definition
        raise ConfigError(f"config file {path} is not valid UTF-8 "
                          f"(byte {exc.start}: {exc.reason})") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    tables = sorted(k for k, v in data.items() if isinstance(v, dict))
    unknown_tables = [t for t in tables if t not in _TABLES]
    if unknown_tables:
        raise ConfigError(f"config file {path}: unknown table(s) "
                          f"{', '.join(f'[{t}]' for t in unknown_tables)}; "
                          f"known tables are {', '.join(f'[{t}]' for t in _TABLES)}")
    if "agent" in data:
        stray = sorted(set(data) - set(_TABLES))
        if stray:  # a key above [agent] is not read as the agent's: say so
            raise ConfigError(f"config file {path}: key(s) {', '.join(stray)} outside any "
                              "table; agent settings go in the [agent] table")
        section = data["agent"]
    else:  # a file of agent settings alone may leave out the [agent] header
        section = {k: v for k, v in data.items() if k != "thresholds"}
    if not isinstance(section, dict):
        raise ConfigError(f"config file {path}: [agent] must be a table")
    known = {f.name for f in fields(AgentConfig)} - {"config", "thresholds"}
    unknown = sorted(set(section) - known)
    if unknown:
        raise ConfigError(f"config file {path}: unknown key(s) {', '.join(unknown)}; "
                          f"known keys are {', '.join(sorted(known))}")
    values = dict(section)
    if "thresholds" in data:
        values["thresholds"] = _thresholds(data["thresholds"], path)
    return values


def _thresholds(table: Any, path: Path) -> Thresholds:
    """The classifier's thresholds from a [thresholds] table (names as in Thresholds)."""
    if not isinstance(table, dict):
        raise ConfigError(f"config file {path}: [thresholds] must be a table")
    known = {f.name for f in fields(Thresholds)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"config file {path}: unknown threshold(s) {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(known))}")
    values: dict[str, Any] = {k: (frozenset(v) if isinstance(v, list) else v) for k, v in table.items()}
    try:
        return dataclasses.replace(Thresholds(), **values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config file {path}: [thresholds]: {exc}") from exc


def _from_env(name: str, raw: str) -> Any:
    if name in ("collectors", "allowed_uids"):
        return [part.strip() for part in raw.split(",") if part.strip()]
    return raw


def _validate(values: dict[str, Any], origins: Mapping[str, str]) -> AgentConfig:
    out: dict[str, Any] = {}
    for f in fields(AgentConfig):
        if f.name not in values:
            continue
        value = values[f.name]
        where = f"{origins.get(f.name, '')}{f.name}={value!r}"
        if f.name == "port":
            out[f.name] = _int(value, where, 0, 65535)
        elif f.name in ("interval", "rank_ttl_seconds"):
            out[f.name] = _float(value, where, 0.05, 86400.0)
        elif f.name == "unsaved_alert_seconds":
            out[f.name] = _float(value, where, 1.0, 30 * 86400.0)
        elif f.name == "simulate":
            out[f.name] = _int(value, where, 0, 64)
        elif f.name == "max_ranks":
            out[f.name] = _int(value, where, 1, 1_000_000)
        elif f.name == "address":
            out[f.name] = _address(value, where)
        elif f.name == "socket_group":
            out[f.name] = _group(value, where)
        elif f.name == "collectors":
            names = _list(value, where)
            bad = [n for n in names if n not in COLLECTORS]
            if bad:
                raise ConfigError(f"{where}: unknown collector(s) {', '.join(map(str, bad))}; "
                                  f"choose from {', '.join(COLLECTORS)}")
            out[f.name] = tuple(dict.fromkeys(names))
        elif f.name == "allowed_uids":
            out[f.name] = tuple(_int(v, where, 0, 2**32 - 1) for v in _list(value, where))
        elif f.name == "log_level":
            if str(value).lower() not in LOG_LEVELS:
                raise ConfigError(f"{where}: choose one of {', '.join(LOG_LEVELS)}")
            out[f.name] = str(value).lower()
        elif f.name == "thresholds":
            out[f.name] = value
        elif f.name == "node_name":
            out[f.name] = str(value).strip()
        elif f.name in ("trace_max_bytes", "trace_steps", "trace_auto_windows"):
            low, high = {"trace_max_bytes": (0, 2**62), "trace_steps": (1, 50),
                         "trace_auto_windows": (1, 1000)}[f.name]
            out[f.name] = _int(value, where, low, high)
        elif f.name == "trace_auto_every_seconds":
            out[f.name] = _float(value, where, 1.0, 7 * 86400.0)
        elif f.name == "trace_auto":
            out[f.name] = _bool(value, where)
        elif f.name in ("socket", "record", "config", "web_config", "pod_resources_socket",
                        "trace_dir"):
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{where}: expected a non-empty path")
            out[f.name] = value
    return dataclasses.replace(AgentConfig(), **out)


def _int(value: Any, where: str, low: int, high: int) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected an integer")
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected an integer") from None
    if isinstance(value, float) and value != number:
        raise ConfigError(f"{where}: expected an integer")
    if not low <= number <= high:
        raise ConfigError(f"{where}: must be between {low} and {high}")
    return number


def _bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "on", "yes"):
        return True
    if text in ("0", "false", "off", "no"):
        return False
    raise ConfigError(f"{where}: expected true or false")


def _float(value: Any, where: str, low: float, high: float) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a number of seconds")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected a number of seconds") from None
    if not low <= number <= high:  # also rejects NaN
        raise ConfigError(f"{where}: must be between {low:g} and {high:g} seconds")
    return number


def _address(value: Any, where: str) -> str:
    text = str(value)
    if text in ("", "localhost"):
        return text or "0.0.0.0"
    try:
        ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        raise ConfigError(f"{where}: expected an IP address such as 0.0.0.0 or 127.0.0.1") from None
    return text.strip("[]")


def _group(value: Any, where: str) -> str:
    """A group that exists on this node, by name or number (kept as given)."""
    text = str(value).strip()
    try:
        if text.isdigit():
            grp.getgrgid(int(text))
        else:
            grp.getgrnam(text)
    except (KeyError, OverflowError):
        raise ConfigError(f"{where}: no such group on this node") from None
    return text


def _list(value: Any, where: str) -> list[Any]:
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ConfigError(f"{where}: expected a list")

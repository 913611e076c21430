"""Configuration layering (defaults < file < env < flags) and validation messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumon.agent.config import DEFAULT_PORT, ConfigError, load_config


def test_defaults() -> None:
    cfg = load_config({}, env={})
    assert cfg.port == DEFAULT_PORT == 9403
    assert cfg.socket == "/run/gpumon/ingest.sock"
    assert cfg.interval == 1.0
    assert cfg.collectors == ("nvml", "host", "ingest", "owners")
    assert cfg.node_name == ""  # the host name
    assert cfg.pod_resources_socket == "/var/lib/kubelet/pod-resources/kubelet.sock"


def test_layers_flags_beat_env_beat_file(tmp_path: Path) -> None:
    path = tmp_path / "gpumon.toml"
    path.write_text('[agent]\nport = 9500\ninterval = 2.5\nsocket = "/tmp/from-file.sock"\n'
                    'collectors = ["nvml", "ingest"]\n')
    env = {"GPUMON_CONFIG": str(path), "GPUMON_PORT": "9600", "GPUMON_INTERVAL": "0.5"}
    cfg = load_config({"port": 9700}, env=env)
    assert cfg.port == 9700                   # flag
    assert cfg.interval == 0.5                # env over file
    assert cfg.socket == "/tmp/from-file.sock"  # file over default
    assert cfg.collectors == ("nvml", "ingest")
    assert not cfg.enabled("host")


def test_env_lists() -> None:
    cfg = load_config({}, env={"GPUMON_ALLOWED_UIDS": "1000, 1001", "GPUMON_COLLECTORS": "host"})
    assert cfg.allowed_uids == (1000, 1001)
    assert cfg.collectors == ("host",)


def test_socket_group_by_name_or_number() -> None:
    assert load_config({}, env={"GPUMON_SOCKET_GROUP": "nogroup"}).socket_group == "nogroup"
    assert load_config({"socket_group": "0"}, env={}).socket_group == "0"
    assert load_config({}, env={}).socket_group is None


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        ({"port": 70000}, {}, "port=70000: must be between 0 and 65535"),
        ({}, {"GPUMON_PORT": "http"}, "port='http': expected an integer"),
        ({"interval": 0.0}, {}, "interval=0.0: must be between"),
        ({}, {"GPUMON_INTERVAL": "nan"}, "interval='nan': must be between"),
        ({"simulate": -1}, {}, "simulate=-1"),
        ({"address": "example.org"}, {}, "expected an IP address"),
        ({"collectors": ["gpu"]}, {}, "unknown collector(s) gpu"),
        ({"log_level": "loud"}, {}, "choose one of debug"),
        ({}, {"GPUMON_ALLOWED_UIDS": "root"}, "expected an integer"),
        ({"socket_group": "no-such-group"}, {}, "socket_group='no-such-group': no such group"),
        ({}, {"GPUMON_SOCKET_GROUP": "4294967295"}, "no such group"),
    ],
)
def test_invalid_values_name_the_key(flags: dict, env: dict, message: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(flags, env=env)
    assert message in str(excinfo.value)


def test_bad_files(tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config({"config": str(missing)}, env={})
    broken = tmp_path / "broken.toml"
    broken.write_text("[agent\nport = 1\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config({"config": str(broken)}, env={})
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[agent]\nprot = 9403\n")
    with pytest.raises(ConfigError, match="unknown key\\(s\\) prot"):
        load_config({"config": str(unknown)}, env={})


def test_thresholds_table(tmp_path: Path) -> None:
    path = tmp_path / "gpumon.toml"
    path.write_text("[agent]\nport = 9500\n[thresholds]\ninput_high_fraction = 0.3\n"
                    "compute_mfu_min = 0.4\n")
    cfg = load_config({"config": str(path)}, env={})
    assert cfg.thresholds.input_high_fraction == 0.3
    assert cfg.thresholds.compute_mfu_min == 0.4
    assert cfg.thresholds.comm_high_fraction == 0.15  # untouched ones keep their defaults


@pytest.mark.parametrize(("table", "message"), [
    ("input_hihg_fraction = 0.3", "unknown threshold(s) input_hihg_fraction"),
    ("input_high_fraction = 1.5", "input_high_fraction must be within [0, 1]"),
    ("input_moderate_fraction = 0.5", "input_moderate_fraction exceeds input_high_fraction"),
])
def test_bad_thresholds_are_named(tmp_path: Path, table: str, message: str) -> None:
    path = tmp_path / "gpumon.toml"
    path.write_text(f"[thresholds]\n{table}\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config({"config": str(path)}, env={})
    assert message in str(excinfo.value)


@pytest.mark.parametrize(("text", "message"), [
    ("port = 9500\n[agent]\ninterval = 2.0\n",
     "key(s) port outside any table; agent settings go in the [agent] table"),
    ("[agent]\nport = 9500\n[tresholds]\ninput_high_fraction = 0.3\n",
     "unknown table(s) [tresholds]; known tables are [agent], [thresholds]"),
    ("[agnet]\nport = 9500\n", "unknown table(s) [agnet]"),
    ("[agent]\nport = 9500\n[agent.extra]\nx = 1\n", "unknown key(s) extra"),
])
def test_stray_keys_and_misspelled_tables_are_refused(tmp_path: Path, text: str,
                                                      message: str) -> None:
    path = tmp_path / "gpumon.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as excinfo:
        load_config({"config": str(path)}, env={})
    assert str(excinfo.value).startswith(f"config file {path}: ")
    assert message in str(excinfo.value)


def test_a_bad_value_names_where_it_came_from(tmp_path: Path) -> None:
    path = tmp_path / "gpumon.toml"
    path.write_text("[agent]\ninterval = 0.0\nport = 9500\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config({"config": str(path)}, env={})
    assert str(excinfo.value) == (f"config file {path}: interval=0.0: must be between 0.05 "
                                  "and 86400 seconds")
    with pytest.raises(ConfigError) as excinfo:
        load_config({"config": str(path)}, env={"GPUMON_INTERVAL": "fast"})
    assert str(excinfo.value) == ("environment GPUMON_INTERVAL: interval='fast': expected a "
                                  "number of seconds")
    # A flag over a bad file value: the flag's value is the one used, and it is fine.
    assert load_config({"config": str(path), "interval": 2.0}, env={}).interval == 2.0

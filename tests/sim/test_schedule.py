"""Schedules: the TOML format, its errors, and where in a schedule a time falls."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumon.sim.schedule import (
    BUILTIN_SCHEDULES,
    Phase,
    PhaseKind,
    ScheduleError,
    load_schedule,
    parse_schedule,
)


@pytest.mark.parametrize("name", BUILTIN_SCHEDULES)
def test_builtin_schedules_cover_every_kind(name: str) -> None:
    schedule = load_schedule(name)
    assert {p.kind for p in schedule.phases} == set(PhaseKind)
    assert schedule.source == f"built-in schedule {name!r}"


def test_a_file_with_options(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text('[[phase]]\nkind = "compute"\nseconds = 5\n\n'
                    '[[phase]]\nkind = "straggler"\nseconds = 7.5\nrank = 2\nslowdown = 2\n\n'
                    '[[phase]]\nkind = "leak"\nseconds = 10\npeak_ratio = 0.95\n')
    schedule = load_schedule(path)
    assert schedule.phases == (
        Phase(PhaseKind.COMPUTE, 5.0),
        Phase(PhaseKind.STRAGGLER, 7.5, rank=2, slowdown=2.0),
        Phase(PhaseKind.LEAK, 10.0, peak_ratio=0.95),
    )
    assert schedule.seconds == 22.5
    assert schedule.source == str(path)


def test_at_walks_the_phases_and_loops_or_ends() -> None:
    schedule = parse_schedule('[[phase]]\nkind = "compute"\nseconds = 2\n'
                              '[[phase]]\nkind = "input"\nseconds = 3\n')
    assert schedule.at(0.0) == (0, 0.0)
    assert schedule.at(1.5) == (0, 1.5)
    assert schedule.at(2.0) == (1, 0.0)
    assert schedule.at(4.5) == (1, 2.5)
    position, into = schedule.at(6.0) or (None, None)
    assert (position, into) == (2, 1.0)  # the second pass, counted on
    assert schedule.phase(2).kind is PhaseKind.COMPUTE
    assert schedule.at(5.0, loop=False) is None


@pytest.mark.parametrize(("text", "message"), [
    ("", "no phases"),
    ("phase = 3", "no phases"),
    ("title = 'x'\n[[phase]]\nkind = 'compute'\nseconds = 5", "unknown key(s) title"),
    ("[[phase]]\nkind = 'gpu'\nseconds = 5", "phase 1: kind='gpu'; choose one of compute, input"),
    ("[[phase]]\nseconds = 5", "phase 1: kind=None"),
    ("[[phase]]\nkind = 'compute'", "phase 1: seconds is required"),
    ("[[phase]]\nkind = 'compute'\nseconds = 0.5", "seconds=0.5: must be between 1 and 86400"),
    ("[[phase]]\nkind = 'compute'\nseconds = 'long'", "seconds='long': expected a number"),
    ("[[phase]]\nkind = 'compute'\nseconds = true", "seconds=True: expected a number"),
    ("[[phase]]\nkind = 'compute'\nseconds = 5\nrank = 1",
     "unknown key(s) rank for kind 'compute'; allowed: kind, seconds"),
    ("[[phase]]\nkind = 'compute'\nseconds = 5\n[[phase]]\nkind = 'straggler'\nseconds = 5\n"
     "rank = -1", "phase 2: rank=-1"),
    ("[[phase]]\nkind = 'straggler'\nseconds = 5\nslowdown = 0.5", "slowdown=0.5: must be"),
    ("[[phase]]\nkind = 'leak'\nseconds = 5\npeak_ratio = 1.2", "peak_ratio=1.2: must be"),
    ("[[phase]\nkind = 'compute'", "is not valid TOML"),
])
def test_invalid_schedules_say_where(text: str, message: str) -> None:
    with pytest.raises(ScheduleError) as info:
        parse_schedule(text, "s.toml")
    assert str(info.value).startswith("s.toml")
    assert message in str(info.value)


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ScheduleError, match="cannot read schedule .*missing.toml"):
        load_schedule(tmp_path / "missing.toml")

"""The one way watchers attach to a monitor (``StepMonitor.extensions``) and the one table of
wrappers ``watch()`` knows (``watch.WRAPPERS``).

A watcher gets one extension of each class per monitor however often it attaches, its errors
are counted and never raised, its device clock keeps no monitor alive, and a new wrapper is one
row of the table. The watchers themselves name none of the monitor's private attributes.
"""

from __future__ import annotations

import ast
import gc
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumon.client import StepMonitor
from gpumon.client.comm.tap import _ledgers
from gpumon.client.core.transport import MemoryTransport
from gpumon.client.watchers import watch
from gpumon.client.watchers.cpu_wait import CpuWaitClock
from gpumon.wire import StepRecord

CLIENT = Path(watch.__file__).resolve().parent.parent
WATCHERS = sorted(
    [p for p in CLIENT.rglob("*.py") if p.name != "monitor.py"] + list((CLIENT.parent / "sim").rglob("*.py"))
)
"""Every module that drives a monitor from outside it: watchers, integrations, the simulator."""


def _names_a_monitor(node: ast.expr) -> bool:
    """``monitor``/``mon``, or ``self.monitor``/``self.mon``/``self._monitor``."""
    if isinstance(node, ast.Name):
        return node.id in ("monitor", "mon")
    return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "self" and node.attr in ("monitor", "mon", "_monitor"))


class Counter:
    made = 0

    def __init__(self) -> None:
        Counter.made += 1
        self.begins = 0

    def step_begin(self) -> None:
        self.begins += 1

    def step_end(self, fields: dict[str, object]) -> None:
        fields["cpu_wait"] = 0.0


class Broken:
    def step_begin(self) -> None:
        raise RuntimeError("a watcher bug")

    def step_end(self, fields: dict[str, object]) -> None:
        raise RuntimeError("a watcher bug")


@pytest.fixture
def transport() -> MemoryTransport:
    return MemoryTransport()


@pytest.fixture
def mon(transport: MemoryTransport) -> Iterator[StepMonitor]:
    monitor = StepMonitor(run="seam", transport=transport, rank=0, world=2)
    yield monitor
    monitor.close()


def steps(mon: StepMonitor, n: int) -> None:
    for _ in range(n):
        with mon.step():
            pass


def test_attach_is_idempotent_per_class(mon: StepMonitor) -> None:
    Counter.made = 0
    first = mon.extensions.attach(Counter)
    again = mon.extensions.attach(Counter, lambda: Counter())
    assert again is first and Counter.made == 1  # the factory is not called again
    assert mon.extensions.get(Counter) is first and mon.extensions.get(Broken) is None
    steps(mon, 4)
    assert first.begins == 4  # registered once: called once per step


def test_the_factory_is_used_on_first_attach(mon: StepMonitor) -> None:
    made = Counter()
    assert mon.extensions.attach(Counter, lambda: made) is made


def test_extension_errors_are_counted_not_raised(mon: StepMonitor, transport: MemoryTransport) -> None:
    mon.extensions.attach(Broken)
    counter = mon.extensions.attach(Counter)
    steps(mon, 5)  # would raise here if an error escaped
    mon.flush()
    records = [r for r in transport.records() if isinstance(r, StepRecord)]
    assert len(records) == 5 and all(r.cpu_wait_s == 0.0 for r in records)
    assert mon.stats.extension_errors == mon.extensions.errors == 3 * 2  # begin and end, then off
    assert counter.begins == 5


def test_watch_twice_attaches_each_watcher_once(mon: StepMonitor, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    row = watch.Wrapper("ddp", __name__, "FakeWrapper", lambda m, model: calls.append(model),
                        holds_model=True)
    monkeypatch.setattr(watch, "WRAPPERS", (row,))
    inner = object()
    wrapper = FakeWrapper(inner)
    assert mon.watch(wrapper) is wrapper and mon.watch(wrapper) is wrapper
    assert calls == [wrapper, wrapper]  # the row's watcher is asked each time...
    clock = mon.extensions.get(CpuWaitClock)
    assert clock is not None and mon.extensions.attach(CpuWaitClock) is clock  # ...the CPU clock once
    assert watch.kind_of(wrapper) == "ddp" and watch.kind_of(inner) is None
    assert watch.find_wrapper(inner) is wrapper


def test_a_nesting_row_is_found_inside_a_plain_module(monkeypatch: pytest.MonkeyPatch) -> None:
    row = watch.Wrapper("fsdp", __name__, "FakeWrapper", lambda m, model: None,
                        holds_model=False, nests=True)
    monkeypatch.setattr(watch, "WRAPPERS", (row,))
    outer = Modules([object(), FakeWrapper(None)])
    assert watch.kind_of(outer) == "fsdp" and watch.kind_of(Modules([object()])) is None
    assert watch.find_wrapper(None) is None  # not a wrapper that holds a model


def test_every_row_names_a_kind_and_a_watcher() -> None:
    assert {w.kind for w in watch.WRAPPERS} == {"ddp", "fsdp", "deepspeed"}
    assert all(callable(w.watch) and w.module and w.name for w in watch.WRAPPERS)
    assert len({(w.module, w.name) for w in watch.WRAPPERS}) == len(watch.WRAPPERS)


def test_the_comm_ledger_keeps_no_monitor_alive(transport: MemoryTransport) -> None:
    mon = StepMonitor(run="seam", transport=transport, rank=0, world=2)
    ledger = watch.comm_ledger(mon)
    assert watch.comm_ledger(mon) is ledger
    assert ledger.device_clock is mon.extensions.device_clock and ledger.device_clock() is None
    _ledgers.append(ledger)  # what the process-wide tap does with it
    try:
        gone = weakref.ref(mon)
        mon.close()
        del mon
        gc.collect()
        assert gone() is None
    finally:
        _ledgers.remove(ledger)


def test_attach_after_close_makes_but_never_calls(mon: StepMonitor) -> None:
    mon.close()
    late = mon.extensions.attach(Counter)
    steps(mon, 2)
    assert late.begins == 0


def test_watchers_name_no_private_attribute_of_the_monitor() -> None:
    for path in WATCHERS:
        tree = ast.parse(path.read_text())
        private = [
            f"{path.name}:{node.lineno} monitor.{node.attr}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and _names_a_monitor(node.value)
            and node.attr.startswith("_")
        ]
        assert private == []
        assert "getattr(monitor" not in path.read_text()


def test_no_attribute_check_is_silenced_in_the_client() -> None:
    silenced = [f"{p.name}:{n}" for p in CLIENT.rglob("*.py")
                for n, line in enumerate(p.read_text().splitlines(), 1) if "attr-defined" in line]
    assert silenced == []


class FakeWrapper:
    """Stands in for a distributed wrapper class (none can be made without its framework's
    process group); only its place in ``WRAPPERS`` matters here."""

    def __init__(self, module: object) -> None:
        self.module = module


class Modules:
    def __init__(self, subs: list[Any]) -> None:
        self._subs = subs

    def modules(self) -> Iterator[Any]:
        yield self
        yield from self._subs

"""Hostile datagrams against a live agent (hypothesis): nothing crashes it, every rejected
object is counted by reason, and valid records still get through afterwards."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumon.agent.lifecycle import Agent
from gpumon.wire import DROP_REASONS, MAX_DATAGRAM_BYTES
from tests.helpers import (
    library_agent,
    scrape_metrics,
    values,
    wait_for,
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children,
                                                                      max_size=4),
    max_leaves=20,
)
FIELDS = ("v", "kind", "run", "rank", "step", "duration", "phases", "mem", "world", "gpu",
          "pid", "t_start", "samples", "tokens", "flops", "event", "comm", "memb")
hostile_records = st.fixed_dictionaries(
    {"v": st.sampled_from([1, 1, 2, "1", True, None])},
    optional={name: json_values for name in FIELDS[1:]},
)
datagrams = st.one_of(
    st.binary(max_size=512),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.lists(hostile_records, max_size=8).map(lambda v: json.dumps(v).encode()),
    hostile_records.map(lambda v: json.dumps(v).encode()),
    st.just(b"[" * 5000 + b"]" * 5000),
    st.just(b"9" * 5000),
    st.just(b'{"v":1,"kind":"step","run":"' + b"a" * (MAX_DATAGRAM_BYTES) + b'"}'),
)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    """One agent for every example and the check after them (a module's worth of fuzzing)."""
    with library_agent(tmp_path_factory.mktemp("fuzz") / "ingest.sock",
                       collectors=("ingest",)) as node:
        yield node


scrape = scrape_metrics
KNOWN_REASONS = set(DROP_REASONS) | {"too_many_ranks", "agent_overloaded",
                                           "agent_overloaded_process"}


def handled(node: Agent) -> int:
    """Datagrams the agent's ingest has decoded so far (read in its process)."""
    server = node.ingest  # the agent as a library: its ingest server, read directly
    assert server is not None, node.ingest_problem
    return server.datagrams_total


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=datagrams)
def test_hostile_datagrams_never_take_the_agent_down(fuzzed: Agent, payload: bytes) -> None:
    before = handled(fuzzed)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.sendto(payload, fuzzed.config.socket)
        except OSError:
            return  # larger than the kernel allows: nothing reached the agent
    # Each datagram is handled, whatever it held, before the next is sent; none raised inside
    # the agent, and whatever it refused is counted under a reason it documents.
    wait_for(lambda: handled(fuzzed) == before + 1, timeout=5.0, interval=0.002,
             what="the datagram handled")
    dropped = dict(fuzzed.rank_store.dropped_total)
    assert "internal_error" not in dropped, payload[:200]
    assert set(dropped) <= KNOWN_REASONS, dropped


def test_agent_still_ingests_and_counted_only_known_reasons(fuzzed: Agent) -> None:
    good = {"v": 1, "kind": "step", "run": "after-fuzz", "rank": 0, "step": 1, "duration": 0.1}
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(json.dumps(good).encode(), fuzzed.config.socket)
    m = wait_for(lambda: (lambda m: values(m, "gpumon_steps_total", run="after-fuzz") and m)(
        scrape(fuzzed)), what="a valid step after the fuzzing")
    reasons = {dict(labels)["reason"] for (name, labels) in m
               if name == "gpumon_ingest_dropped_total"}
    assert reasons, "hostile input must have been counted"
    assert reasons <= KNOWN_REASONS, reasons
    assert values(m, "gpumon_ingest_dropped_total", reason="internal_error") == []

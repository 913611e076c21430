"""What drives a rank's loop, as its hello says (``watch(engine)`` on a DeepSpeed engine sends
``framework`` and ``zero_stage``): carried on the wire, kept by the store, exported as
``gpumon_rank_framework_info``; a hello without them changes nothing."""

from __future__ import annotations

from gpumon.collectors.samples import SenderCredentials
from gpumon.export.exposition import render
from gpumon.export.step_metrics import StepFamilies
from gpumon.state.ranks import RankStore
from gpumon.testing import parse_metrics
from gpumon.testing.metrics import series
from gpumon.wire import HelloRecord, decode_datagram, encode_record


def test_the_hello_carries_the_framework_and_its_zero_stage() -> None:
    hello = HelloRecord("job", 1, 2, framework="deepspeed", zero_stage=3)
    assert decode_datagram(encode_record(hello)).records == [hello]
    plain = HelloRecord("job", 1, 2)
    assert b"framework" not in encode_record(plain)
    assert decode_datagram(encode_record(plain)).records == [plain]


def test_a_bad_framework_or_stage_drops_the_hello_with_its_reason() -> None:
    base = encode_record(HelloRecord("job", 0, 2, framework="deepspeed", zero_stage=2))
    assert decode_datagram(base.replace(b'"zero_stage":2', b'"zero_stage":4')).rejected == ["bad_value"]
    assert decode_datagram(base.replace(b'"zero_stage":2', b'"zero_stage":true')).rejected == ["bad_type"]
    assert decode_datagram(base.replace(b'"deepspeed"', b'"deep speed"')).rejected == ["bad_label"]


def test_the_store_exports_what_the_latest_hello_said() -> None:
    store = RankStore(ttl_s=60.0)
    hellos = [HelloRecord("job", 0, 2), HelloRecord("job", 1, 2, framework="deepspeed", zero_stage=1)]
    store.ingest(hellos, SenderCredentials(), 0.0, 1_000_000.0)
    # A later hello without the fields (a monitor not yet watching) keeps what was said.
    store.ingest([HelloRecord("job", 1, 2)], SenderCredentials(), 1.0, 1_000_001.0)
    families = StepFamilies()
    scrape = render([*families.steps(store.ranks(), *store.counters(), {}, {})]).decode()
    rows = series(parse_metrics(scrape), "gpumon_rank_framework_info")
    assert rows == [({"run": "job", "rank": "1", "framework": "deepspeed", "zero_stage": "1"}, 1.0)]

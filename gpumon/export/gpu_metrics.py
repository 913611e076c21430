"""Prometheus families for the node: GPUs, host and the agent itself, from a NodeSnapshot."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import InfoMetricFamily, Metric

from gpumon import __version__
from gpumon.collectors.gpu_fields import GPU_FIELDS
from gpumon.export.exposition import CounterFamily, GaugeFamily
from gpumon.state.node import NodeSnapshot

GPU_LABELS = ["gpu", "uuid", "model"]



def _exported(kind: str) -> tuple[tuple[str, str, str], ...]:
    """(GpuSample field, metric name, help) of the exported fields of one kind."""
    return tuple((f.name, f.metric, f.help) for f in GPU_FIELDS
                 if f.metric is not None and f.kind == kind)


# Absent fields produce no series. Counters are named without the _total suffix.
GPU_GAUGES = _exported("gauge")
GPU_COUNTERS = _exported("counter")


def node_families(snap: NodeSnapshot) -> Iterator[Metric]:
    """All GPU, host and agent families of one snapshot."""
    yield from _gpu_families(snap)
    yield from _host_families(snap)
    yield from _agent_families(snap)


def _gpu_families(snap: NodeSnapshot) -> Iterator[Metric]:
    info = InfoMetricFamily("gpumon_gpu", "Static facts about each GPU.",
                            labels=["gpu", "uuid", "model", "pci_bus_id", "driver_version"])
    up = GaugeFamily("gpumon_gpu_up", "1 when the GPU answers NVML, 0 when it is lost.",
                     labels=GPU_LABELS)
    gauges = {name: GaugeFamily(metric, doc, labels=GPU_LABELS)
              for name, metric, doc in GPU_GAUGES}
    counters = {name: CounterFamily(metric, doc, labels=GPU_LABELS)
                for name, metric, doc in GPU_COUNTERS}
    clock_events = GaugeFamily(
        "gpumon_gpu_clock_event_active",
        "1 while a clock event reason (throttling, idle, power cap, ...) is active.",
        labels=[*GPU_LABELS, "reason"])
    ecc = CounterFamily("gpumon_gpu_ecc_errors", "ECC errors since driver load.",
                        labels=[*GPU_LABELS, "type"])
    process_memory = GaugeFamily("gpumon_gpu_process_memory_bytes",
                                 "Device memory used by each compute process.",
                                 labels=[*GPU_LABELS, "pid"])
    xid = CounterFamily("gpumon_gpu_xid_errors", "XID critical errors seen by the agent.",
                        labels=[*GPU_LABELS, "xid"])
    driver = snap.nvml.driver_version or ""
    statics = {g.index: g for g in snap.gpus}
    for gpu in snap.gpus:
        labels = [str(gpu.index), gpu.uuid, gpu.name]
        info.add_metric([str(gpu.index), gpu.uuid, gpu.name, gpu.pci_bus_id, driver], {})
        sample = snap.latest.get(gpu.index)
        up.add_metric(labels, 0.0 if sample is not None and not sample.up else 1.0)
        if sample is None or not sample.up:
            continue
        for name, family in gauges.items():
            value = getattr(sample, name)
            if value is not None:
                family.add_metric(labels, float(value))
        for name, counter in counters.items():
            value = getattr(sample, name)
            if value is not None:
                counter.add_metric(labels, float(value))
        for reason, active in sorted((sample.clock_event_reasons or {}).items()):
            clock_events.add_metric([*labels, reason], 1.0 if active else 0.0)
        for kind, count in sorted((sample.ecc_errors_total or {}).items()):
            ecc.add_metric([*labels, kind], float(count))
        for pid, used in sorted((sample.process_memory_bytes or {}).items()):
            process_memory.add_metric([*labels, str(pid)], float(used))
    for (index, code), count in sorted(snap.xid_counts.items()):
        static = statics.get(index)
        labels = [str(index), static.uuid, static.name] if static else [str(index), "", ""]
        xid.add_metric([*labels, str(code)], float(count))
    yield info
    yield up
    yield from gauges.values()
    yield from counters.values()
    yield from (clock_events, ecc, process_memory, xid)


def _host_families(snap: NodeSnapshot) -> Iterator[Metric]:
    if snap.host is None:
        return
    yield GaugeFamily("gpumon_host_cpu_utilization_ratio",
                      "Fraction of the node's CPU time in use.",
                      value=snap.host.cpu_utilization_ratio)
    yield GaugeFamily("gpumon_host_memory_used_bytes", "Host memory in use.",
                      value=float(snap.host.memory_used_bytes))
    yield GaugeFamily("gpumon_host_memory_total_bytes", "Host memory in total.",
                      value=float(snap.host.memory_total_bytes))


def _agent_families(snap: NodeSnapshot) -> Iterator[Metric]:
    yield InfoMetricFamily("gpumon_agent", "The gpumon agent.", value={"version": __version__})
    yield GaugeFamily("gpumon_nvml_up", "1 when NVML (or the simulator) is usable.",
                      value=1.0 if snap.nvml.up else 0.0)
    duration = GaugeFamily("gpumon_collector_duration_seconds",
                           "Duration of the collector's last cycle.", labels=["collector"])
    last_success = GaugeFamily(
        "gpumon_collector_last_success_timestamp_seconds",
        "Unix time of the collector's last successful cycle; a stale value means it is stuck.",
        labels=["collector"])
    errors = CounterFamily("gpumon_collector_errors", "Collector errors by kind.",
                           labels=["collector", "error"])
    for name, stats in sorted(snap.collectors.items()):
        if stats.last_duration_s is not None:
            duration.add_metric([name], stats.last_duration_s)
        if stats.last_success_t is not None:
            last_success.add_metric([name], stats.last_success_t)
        for error, count in sorted(stats.errors.items()):
            errors.add_metric([name, error], float(count))
    yield from (duration, last_success, errors)


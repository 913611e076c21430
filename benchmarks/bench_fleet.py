"""Numbers to plan a fleet with (docs/scaling.md): what one node costs the pipeline, a load run
of many agents through the sharded pipeline of deploy/fleet/, and how the run-level rules'
evaluation grows with the ranks of one run.

    .venv/bin/python benchmarks/bench_fleet.py            # ~16 minutes on 2 cores
    .venv/bin/python benchmarks/bench_fleet.py --quick    # a tiny run of every part

1. **One node**: an agent on 8 simulated GPUs with 8 ranks of one run reporting to it (the
   comm field and the memory breakdown on): series and bytes of one scrape, samples per
   second at a 15 s scrape, and of them the owner series (``gpumon_rank_info``, one a rank,
   and ``gpumon_gpu_owner_info``, one a GPU holder: none here, simulated GPUs list no process).
2. **Load run**: ``--nodes`` agents (``gpumon agent --simulate 8``, polling every
   ``--interval`` s), one simulated run over all of them (gpumon.sim.fleet, 8 ranks a node, one
   straggler), two shards (a Prometheus server with the node-level alerts, a vmagent)
   scraping every ``--scrape-s`` s and remote-writing to one VictoriaMetrics, vmalert
   evaluating alerts/gpumon.rules.yml every ``--eval-s`` s: the store's ingest rate, series,
   memory and bytes per sample; vmalert's time per group; the agents' CPU.
3. **Ranks per run**: for runs of ``--run-ranks`` ranks (8 a node), the four counters per rank
   that the run-level straggler and step-time rules read, imported into a fresh
   VictoriaMetrics (four points in the last five minutes); each rule of that chain timed as
   an instant query (median of three) and its result written back, as vmalert does, for the
   next one: first the shard's per-rank rules and per-node reductions (here one shard holds
   the whole run: an upper bound for any shard), then the centre's run-level rules over them.
   Then **all central rules** at ``--central-nodes`` nodes: one real agent's scrape (8
   simulated GPUs, 8 ranks) copied to that many nodes of one run, the shard's group
   evaluated over it, then every central group, recording rules and alerts alike, as
   vmalert would: the time of one evaluation of each.
4. **Disk**: one node (8 GPUs, 8 ranks) scraped by VictoriaMetrics itself every second for
   ``--disk-s`` s, its buffers flushed and its parts merged: bytes a sample and index bytes
   a series.

Prints tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import cpu_seconds, print_table  # noqa: E402
from gpumon.sim.fleet import FleetRun, FleetSender  # noqa: E402
from gpumon.testing import AgentProcess, start_agent, wait_for  # noqa: E402
from gpumon.testing.pipeline import (  # noqa: E402
    Service,
    start_alertmanager,
    start_prometheus_shard,
    start_victoria_metrics,
    start_vmagent_shard,
    start_vmalert,
)

ROOT = Path(__file__).resolve().parent.parent
FLEET = ROOT / "deploy" / "fleet"
RULE_FILE = ROOT / "alerts" / "gpumon.rules.yml"
SHARD_RULES = FLEET / "rules" / "gpumon-shard.rules.yml"
CENTRAL_RULES = FLEET / "rules" / "gpumon-central.rules.yml"
GPUS, RANKS = 8, 8
SHARD_CHAIN = ("run_rank:gpumon_rank_parallel_info",
               "run_rank:gpumon_steps:rate5m",
               "run_rank:gpumon_step_own_seconds:mean1m",
               "run_node:gpumon_step_own_seconds:sum1m",
               "run_node:gpumon_step_own_seconds:count1m",
               "run_node:gpumon_step_own_seconds:max1m",
               "run_node:gpumon_step_seconds:slowest_mean1m",
               "run_node:gpumon_step_duration_seconds_sum:rate5m",
               "run_node:gpumon_step_duration_seconds_count:rate5m",
               "run_node:gpumon_steps:max_rate5m")
"""The shard's rules that the run-level straggler and step-time rules read: each rank's layout
(by which a rank's peers are its replicas), per rank, then reduced per node and run."""
CHAIN = ("run:gpumon_step_own_seconds:sum1m",
         "run:gpumon_step_own_seconds:count1m",
         "run_rank:gpumon_step_own_seconds:peers_mean1m",
         "run_rank:gpumon_rank_straggler_score:ratio1m",
         "run_rank:gpumon_step_straggler_extra_share:ratio1m",
         "run:gpumon_step_duration_seconds:mean5m", "run:gpumon_steps:rate5m")
"""The centre's run-level straggler and step-time rules, over the shard's reductions."""


def _metrics(service_url: str) -> dict[str, float]:
    """A service's own /metrics, summed by name plus labels as written."""
    with urllib.request.urlopen(service_url + "/metrics", timeout=120) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                continue
    return out


def _total(metrics: dict[str, float], name: str) -> float:
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


def _start_agents(tmp: Path, count: int, interval: float) -> list[AgentProcess]:
    tmp.mkdir(parents=True, exist_ok=True)
    agents = [start_agent(tmp, "--simulate", str(GPUS), "--interval", str(interval),
                          "--log-level", "warning", wait_ready=False) for _ in range(count)]
    for agent in agents:
        wait_for(lambda agent=agent: agent.json("/readyz")[0] == 200, timeout=300,
                 what=f"agent on {agent.port}")
    return agents


def _gpus(agent: AgentProcess) -> list[str]:
    _, snapshot = agent.json("/api/v1/snapshot")
    return [gpu["uuid"] for gpu in snapshot["gpus"]]


def _node_scrape(tmp: Path) -> str:
    """One 8-GPU node's scrape with 8 ranks of one run reporting, past the first verdict
    window and memory breakdowns."""
    (agent,) = _start_agents(tmp, 1, 1.0)
    run = FleetRun("node", nodes=1, ranks_per_node=RANKS, compute_s=0.2, allreduce_s=0.05)
    sender = FleetSender(run, [str(agent.socket_path)], [_gpus(agent)])
    try:
        sender.start()
        time.sleep(max(3.0, 12 * run.step_s))
        return agent.scrape()
    finally:
        sender.stop()
        agent.stop()


def one_node(body: str) -> dict[str, Any]:
    """Series and bytes of one 8-GPU, 8-rank node's scrape (``_node_scrape``)."""
    lines = [line for line in body.splitlines() if line and not line.startswith("#")]
    names = [line.split("{")[0].split(" ")[0] for line in lines]
    per_rank = sum('rank="' in line for line in lines)
    comm = sum(n.startswith("gpumon_comm_") for n in names)
    memory = sum(n.startswith(("gpumon_oom_", "gpumon_torch_", "gpumon_memory_")) for n in names)
    holders = names.count("gpumon_gpu_owner_info")  # carries run and rank labels, often empty
    per_rank -= holders
    gpu = sum('gpu="' in line and 'rank="' not in line for line in lines) + holders
    owners = names.count("gpumon_rank_info") + holders
    result = {"series": len(lines), "rank_series": per_rank, "gpu_series": gpu,
              "owner_series": owners, "gpu_owner_series": holders,
              "comm_series": comm, "memory_series": memory,
              "other_series": len(lines) - per_rank - gpu,
              "scrape_bytes": len(body.encode()), "scrape_gzip_bytes": len(gzip.compress(body.encode())),
              "samples_per_s_at_15s": len(lines) / 15}
    print_table(["one node (8 GPUs, 8 ranks)", "value"], [
        ["series", f"{result['series']}"],
        ["  of which per-rank (run, rank labels)", f"{per_rank} ({per_rank / RANKS:.0f} a rank)"],
        ["  of which per-GPU", f"{gpu} ({gpu / GPUS:.0f} a GPU)"],
        ["  communication / memory breakdown", f"{comm} / {memory}"],
        ["  whose (gpumon_rank_info + gpumon_gpu_owner_info)", f"{owners - holders} + {holders}"],
        ["scrape body", f"{result['scrape_bytes'] / 1024:.1f} KiB "
                        f"({result['scrape_gzip_bytes'] / 1024:.1f} KiB gzipped)"],
        ["samples/s at a 15 s scrape", f"{result['samples_per_s_at_15s']:.1f}"],
    ])
    return result


def load_run(tmp: Path, nodes: int, interval: float, scrape_s: int, eval_s: int,
             seconds: float) -> dict[str, Any]:
    """``nodes`` agents through two shards into one store, one run over all of them."""
    services: list[Service] = []
    agents: list[AgentProcess] = []
    sender: FleetSender | None = None
    try:
        started = time.monotonic()
        agents = _start_agents(tmp / "agents", nodes, interval)
        print(f"{nodes} agents ready in {time.monotonic() - started:.0f} s", flush=True)
        store = start_victoria_metrics(tmp / "store")
        alertmanager = start_alertmanager(tmp / "am")
        services += [store, alertmanager]
        half = (nodes + 1) // 2
        scrape = f"{scrape_s}s"
        targets = [f"127.0.0.1:{a.port}" for a in agents]
        services.append(start_prometheus_shard(
            tmp / "shard-a", "shard-a", yaml.safe_load((FLEET / "compose" / "shard-a.yml").read_text()),
            targets[:half], store, [SHARD_RULES], alertmanager, scrape))
        services.append(start_vmagent_shard(
            tmp / "shard-b", "shard-b", yaml.safe_load((FLEET / "compose" / "shard-b.yml").read_text()),
            targets[half:], store, scrape))
        compose = yaml.safe_load((FLEET / "compose" / "docker-compose.yml").read_text())
        shard_b_rules = start_vmalert(tmp / "shard-b-rules", compose["services"]["shard-b-rules"]["command"],
                                      [SHARD_RULES], store, alertmanager, f"{eval_s}s",
                                      name="shard-b-rules")
        services.append(shard_b_rules)
        vmalert = start_vmalert(tmp / "vmalert", compose["services"]["vmalert"]["command"],
                                [CENTRAL_RULES], store, alertmanager, f"{eval_s}s")
        services.append(vmalert)
        straggler = nodes * RANKS - 3
        run = FleetRun("fleet", nodes=nodes, ranks_per_node=RANKS, straggler=straggler)
        sender = FleetSender(run, [str(a.socket_path) for a in agents], [_gpus(a) for a in agents])
        sender.start()
        cpu0 = {a.process.pid: cpu_seconds(a.process.pid) for a in agents}
        t0 = time.monotonic()
        time.sleep(seconds / 2)  # every series born, a few scrapes and evaluations done
        shard_a, shard_b = services[2], services[3]
        sent1 = (_total(_metrics(shard_a.url), "prometheus_remote_storage_bytes_total"),
                 _total(_metrics(shard_b.url), "vmagent_remotewrite_bytes_sent_total"))
        m1, t1 = _metrics(store.url), time.monotonic()
        time.sleep(seconds / 2)
        m2, t2 = _metrics(store.url), time.monotonic()
        sent2 = (_total(_metrics(shard_a.url), "prometheus_remote_storage_bytes_total"),
                 _total(_metrics(shard_b.url), "vmagent_remotewrite_bytes_sent_total"))
        sizes = (half, nodes - half)
        wire = [(b - a) / (t2 - t1) / n for a, b, n in zip(sent1, sent2, sizes, strict=True)]
        agent_cpu = sum(cpu_seconds(a.process.pid) - c for a, c in
                        ((a, cpu0[a.process.pid]) for a in agents)) / (t2 - t0)
        rows = _total(m2, "vm_rows_inserted_total") - _total(m1, "vm_rows_inserted_total")
        ingest = rows / (t2 - t1)
        # Counts over every series: past ten seconds on a store of 256 nodes sharing two cores.
        series = float(store.query('count({__name__=~".+"})', timeout=300)[0]["value"][1])
        raw = float(store.query('count({__name__=~"gpumon_.*|up|scrape_.*"})',
                                timeout=300)[0]["value"][1])
        score = {int(r["metric"]["rank"]): float(r["value"][1]) for r in store.query(
            'run_rank:gpumon_rank_straggler_score:ratio1m{run="fleet"}', timeout=300)}
        groups = {}
        for ruler, where in ((vmalert, "centre"), (shard_b_rules, "shard B")):
            vm_metrics = _metrics(ruler.url)
            for key, value in vm_metrics.items():
                if key.startswith("vmalert_iteration_duration_seconds_sum{"):
                    group = key.split('group="')[1].split('"')[0]
                    count = vm_metrics[key.replace("_sum{", "_count{")]
                    groups[f"{group} ({where})"] = value / count if count else float("nan")
        result = {
            "nodes": nodes, "ranks": run.world, "interval_s": interval, "scrape_s": scrape_s,
            "eval_s": eval_s, "seconds": t2 - t0,
            "ingest_samples_per_s": ingest, "series": series, "raw_series": raw,
            "store_rss_bytes": _total(m2, "process_resident_memory_bytes"),
            "remote_write_bytes_per_s_per_node": {"prometheus": wire[0], "vmagent": wire[1]},
            "store_data_bytes": _total(m2, "vm_data_size_bytes"),
            "store_rows": _total(m2, "vm_rows"),
            "vmalert_group_s": groups,
            "agents_cpu_cores": agent_cpu, "records_sent": sender.sent, "records_failed": sender.failed,
            "straggler_score": score.get(straggler), "ranks_scored": len(score),
            "peer_score_min": min((v for r, v in score.items() if r != straggler), default=None),
        }
    finally:
        if sender is not None:
            sender.stop()
        for service in reversed(services):
            service.stop()
        for agent in agents:
            agent.stop()
    print_table(["load run", "value"], [
        ["nodes / ranks of one run", f"{nodes} / {result['ranks']}"],
        ["scrape / evaluation / agent polling", f"{scrape_s} s / {eval_s} s / {interval} s"],
        ["store ingest", f"{ingest:,.0f} samples/s ({ingest / nodes:.1f} per node)"],
        ["store series (raw scrape series)", f"{series:,.0f} ({raw:,.0f})"],
        ["store RSS", f"{result['store_rss_bytes'] / 2**20:.0f} MiB"],
        ["remote write per node (Prometheus / vmagent shard)",
         f"{wire[0]:,.0f} / {wire[1]:,.0f} bytes/s"],
        ["store bytes per sample (so far)",
         f"{result['store_data_bytes'] / max(result['store_rows'], 1):.2f}"],
        *[[f"vmalert group {g}", f"{s * 1e3:.1f} ms"] for g, s in sorted(groups.items())],
        ["agents' CPU, all together",
         f"{agent_cpu:.2f} cores ({agent_cpu / nodes * 100:.2f} % of a core each)"],
        ["straggler score (rank, peers' min)", f"{result['straggler_score']} / {result['peer_score_min']} "
                                               f"over {len(score)} ranks"],
    ])
    return result


def disk(tmp: Path, seconds: float, scrape_s: int) -> dict[str, Any]:
    """The store's bytes per sample and per series of one node after a merge: one agent (8
    GPUs, 8 ranks stepping) scraped by VictoriaMetrics itself every ``scrape_s`` s for
    ``seconds``; the store stopped (which flushes it) and started again without scraping, its
    month's parts merged into one."""
    (agent,) = _start_agents(tmp / "disk-node", 1, 1.0)
    run = FleetRun("disk", nodes=1, ranks_per_node=RANKS, compute_s=0.2, allreduce_s=0.05)
    sender = FleetSender(run, [str(agent.socket_path)], [_gpus(agent)])
    config = tmp / "disk-scrape.yml"
    config.write_text(json.dumps({"scrape_configs": [{
        "job_name": "gpumon", "scrape_interval": f"{scrape_s}s",
        "static_configs": [{"targets": [f"127.0.0.1:{agent.port}"]}]}]}))
    state = tmp / "disk-store"
    try:
        sender.start()
        scraper = start_victoria_metrics(state, f"-promscrape.config={config}")
        time.sleep(seconds)
        scraper.stop()
    finally:
        sender.stop()
        agent.stop()
    store = start_victoria_metrics(state)
    try:
        month = time.strftime("%Y_%m", time.gmtime())
        with urllib.request.urlopen(f"{store.url}/internal/force_merge?partition_prefix={month}",
                                    timeout=60):
            pass

        def merged() -> bool:
            m = _metrics(store.url)
            parts = sum(v for k, v in m.items() if k.startswith('vm_parts{type="storage/'))
            return _total(m, "vm_active_merges") == 0 and parts == 1

        wait_for(merged, timeout=120, what="the store's parts merged into one")
        m = _metrics(store.url)
        series = float(store.query('count({__name__=~".+"})')[0]["value"][1])
    finally:
        store.stop()

    def by_type(name: str, prefix: str) -> float:
        return sum(v for k, v in m.items() if k.startswith(f'{name}{{type="{prefix}'))

    rows = by_type("vm_rows", "storage/")
    result = {"seconds": seconds, "scrape_s": scrape_s, "samples": rows, "series": series,
              "samples_per_series": rows / max(series, 1),
              "data_bytes": by_type("vm_data_size_bytes", "storage/"),
              "index_bytes": by_type("vm_data_size_bytes", "indexdb"),
              }
    result["bytes_per_sample"] = result["data_bytes"] / max(rows, 1)
    result["index_bytes_per_series"] = result["index_bytes"] / max(series, 1)
    print_table(["store disk, one node merged", "value"], [
        ["scraped", f"every {scrape_s} s for {seconds:.0f} s: {rows:,.0f} samples of "
                    f"{series:,.0f} series ({result['samples_per_series']:.0f} a series)"],
        ["samples on disk", f"{result['data_bytes'] / 1024:,.0f} KiB: "
                            f"{result['bytes_per_sample']:.2f} bytes a sample"],
        ["index on disk", f"{result['index_bytes'] / 1024:,.0f} KiB: "
                          f"{result['index_bytes_per_series']:.0f} bytes a series"],
    ])
    return result


def _import_counters(store: Service, run: str, ranks: int, now_ms: int) -> None:
    """Four points (now - 4 min, - 2 min, - 35 s, - 5 s: two in the straggler chain's last
    minute) of the four counters a rank's straggler and step-time rules read, for ``ranks``
    ranks of ``run``; rank ranks-1 is slower."""
    times = [now_ms - 240_000, now_ms - 120_000, now_ms - 35_000, now_ms - 5_000]
    chunk: list[str] = []

    def flush() -> None:
        _import(store, "".join(chunk))
        chunk.clear()

    for rank in range(ranks):
        node = rank // RANKS
        labels = f'job="gpumon",instance="node-{node}:9403",run="{run}",rank="{rank}"'
        slow = 1.5 if rank == ranks - 1 else 1.0
        for i, t in enumerate(times):
            steps = 100 + i * 120
            chunk.append(f"gpumon_steps_total{{{labels}}} {steps} {t}\n"
                         f"gpumon_step_duration_seconds_count{{{labels}}} {steps} {t}\n"
                         f"gpumon_step_duration_seconds_sum{{{labels}}} {steps * 1.0} {t}\n"
                         f"gpumon_comm_exposed_seconds_total{{{labels}}} "
                         f"{steps * (1.0 - 0.6 * slow)} {t}\n")
        if len(chunk) >= 30_000:
            flush()
    if chunk:
        flush()


def _timed_chain(store: Service, rules: dict[str, str], chain: tuple[str, ...],
                 run: str) -> dict[str, float]:
    """Each rule of ``chain`` as an instant query limited to ``run`` (median of three), its
    result written back for the next, as vmalert does."""
    times = {}
    for name in chain:
        expr = _only_run(rules[name], run)
        samples = []
        for _ in range(3):
            t = time.perf_counter()
            result = store.query(expr, timeout=600)
            samples.append(time.perf_counter() - t)
        times[name] = statistics.median(samples)
        _write_back(store, name, result)
    return times


def _recording_rules() -> dict[str, str]:
    return {r["record"]: r["expr"] for g in yaml.safe_load(RULE_FILE.read_text())["groups"]
            for r in g["rules"] if "record" in r}


def ranks_per_run(tmp: Path, sizes: list[int]) -> list[dict[str, Any]]:
    """Instant-query time of the shard's reductions and the centre's run-level chain, by ranks
    in the run."""
    rules = _recording_rules()
    rows = []
    store = start_victoria_metrics(tmp / "synthetic")
    try:
        for size in sizes:
            run = f"r{size}"
            now_ms = int(time.time() * 1000)
            started = time.monotonic()
            _import_counters(store, run, size, now_ms)
            wait_for(lambda run=run, size=size: _count(store, f'gpumon_steps_total{{run="{run}"}}') == size,
                     timeout=300, interval=1, what=f"{size} ranks imported")
            imported_s = time.monotonic() - started
            shard = _timed_chain(store, rules, SHARD_CHAIN, run)
            central = _timed_chain(store, rules, CHAIN, run)
            check = store.query('run_rank:gpumon_rank_straggler_score:ratio1m'
                                f'{{run="{run}",rank="{size - 1}"}}')
            rows.append({"ranks": size, "nodes": -(-size // RANKS), "import_s": imported_s,
                         "shard_rule_s": shard, "shard_s": sum(shard.values()),
                         "rule_s": central, "chain_s": sum(central.values()),
                         "straggler_score": float(check[0]["value"][1]) if check else None})
            print(f"{size} ranks: imported in {imported_s:.0f} s, shard {sum(shard.values()) * 1e3:.0f} ms, "
                  f"central chain {sum(central.values()) * 1e3:.0f} ms", flush=True)
    finally:
        store.stop()
    print_table(["ranks in the run", *[n.split(":", 1)[1] for n in CHAIN], "central chain",
                 "shard (one shard, the whole run)", "straggler score"],
                [[f"{r['ranks']:,}", *[f"{r['rule_s'][n] * 1e3:.0f} ms" for n in CHAIN],
                  f"{r['chain_s'] * 1e3:.0f} ms", f"{r['shard_s'] * 1e3:.0f} ms",
                  "none" if r["straggler_score"] is None else f"{r['straggler_score']:.2f}"]
                 for r in rows])
    return rows


def _copies(body: str, nodes: int, run: str, now_ms: int) -> Iterator[str]:
    """One node's scrape as ``nodes`` nodes of one run, four points in five minutes (two in the
    last minute, which the straggler chain reads): counters growing (a quarter of their value
    a point), gauges as they are."""
    times = [now_ms - 240_000, now_ms - 120_000, now_ms - 35_000, now_ms - 5_000]
    samples = []
    for line in body.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, text = line.rpartition(" ")
        name, _, labels = series.partition("{")
        counter = name.endswith(("_total", "_sum", "_count", "_bucket"))
        samples.append((name, labels.rstrip("}"), float(text), counter))
    for node in range(nodes):
        chunk = []
        offset = node * RANKS
        for name, labels, value, counter in samples:
            relabelled = re.sub(r'rank="(\d+)"', lambda m, o=offset: f'rank="{int(m[1]) + o}"', labels)
            relabelled = re.sub(r'run="[^"]*"', f'run="{run}"', relabelled)
            extra = f",{relabelled}" if relabelled else ""
            full = f'{name}{{job="gpumon",instance="node-{node}:9403"{extra}}}'
            for i, t in enumerate(times):
                v = value * (i + 1) / len(times) if counter else value
                chunk.append(f"{full} {v} {t}\n")
        yield "".join(chunk)


def central_rules(tmp: Path, nodes: int, body: str) -> dict[str, Any]:
    """One evaluation of every central group at ``nodes`` nodes of one run (8 ranks each),
    after the shard's group over the same nodes: one node's scrape (``body``) copied."""
    # A store that answers for 1,000 nodes holds ~900,000 series: past the 300,000 a query may
    # touch by default, which a central store of that size raises.
    store = start_victoria_metrics(tmp / "central", "-search.maxUniqueTimeseries=5000000")
    run = "fleet"
    try:
        started = time.monotonic()
        batch: list[str] = []
        for text in _copies(body, nodes, run, int(time.time() * 1000)):
            batch.append(text)
            if len(batch) >= 20:
                _import(store, "".join(batch))
                batch.clear()
        if batch:
            _import(store, "".join(batch))
        wait_for(lambda: _count(store, f'gpumon_steps_total{{run="{run}"}}') == nodes * RANKS,
                 timeout=600, interval=1, what=f"{nodes} nodes imported")
        series = _count(store, '{__name__=~"gpumon_.*"}')
        imported_s = time.monotonic() - started
        groups: dict[str, float] = {}
        for path, where in ((SHARD_RULES, "shard"), (CENTRAL_RULES, "centre")):
            for group in yaml.safe_load(path.read_text())["groups"]:
                spent = 0.0
                for rule in group["rules"]:
                    t = time.perf_counter()
                    answer = store.query(rule["expr"], timeout=600)
                    spent += time.perf_counter() - t
                    if "record" in rule and answer:
                        _write_back(store, rule["record"], answer)
                groups[f"{group['name']} ({where})"] = spent
    finally:
        store.stop()
    central = sum(v for k, v in groups.items() if k.endswith("(centre)"))
    result = {"nodes": nodes, "ranks": nodes * RANKS, "series": series, "import_s": imported_s,
              "group_s": groups, "central_s": central}
    print_table([f"{nodes:,} nodes, {nodes * RANKS:,} ranks of one run ({series:,.0f} series)",
                 "one evaluation"],
                [*[[g, f"{s * 1e3:.0f} ms"] for g, s in groups.items()],
                 ["every central group", f"{central * 1e3:.0f} ms"]])
    return result


def _import(store: Service, text: str) -> None:
    request = urllib.request.Request(store.url + "/api/v1/import/prometheus", data=text.encode(),
                                     method="POST")
    with urllib.request.urlopen(request, timeout=600):
        pass
    _flush(store)


def _flush(store: Service) -> None:
    """Make what was imported searchable now: VictoriaMetrics otherwise registers new series
    for search some seconds later, and every rule whose result is written back for the next
    would wait those seconds."""
    with urllib.request.urlopen(store.url + "/internal/force_flush", timeout=600):
        pass


def _count(store: Service, selector: str) -> float:
    result = store.query(f"count({selector})", timeout=600)
    return float(result[0]["value"][1]) if result else 0.0


def _only_run(expr: str, run: str) -> str:
    """``expr`` with every selector of a gpumon or recorded series limited to ``run`` (the
    other runs in the store would otherwise count too)."""

    def limit(match: re.Match[str]) -> str:
        name, labels = match[1], match[2]
        inner = labels[1:-1] if labels else ""
        return f'{name}{{run="{run}"{"," + inner if inner else ""}}}'

    return re.sub(r"\b((?:run_rank|run_node|run):gpumon_[a-z_:0-9]+|gpumon_[a-z_0-9]+)(\{[^}]*\})?",
                  limit, expr)


def _write_back(store: Service, name: str, result: list[dict[str, Any]]) -> None:
    """Store a rule's result under its record name, now (what vmalert's remote write does)."""
    now_ms = int(time.time() * 1000)
    lines = []
    for sample in result:
        labels = ",".join(f'{k}="{v}"' for k, v in sample["metric"].items() if k != "__name__")
        lines.append(f"{name}{{{labels}}} {sample['value'][1]} {now_ms}\n")
    _import(store, "".join(lines))
    runs = {sample["metric"].get("run", "") for sample in result}
    selector = f'{name}{{run=~"{"|".join(sorted(runs))}"}}' if all(runs) else name
    wait_for(lambda: len(store.query(selector, timeout=600)) >= len(result),
             timeout=300, interval=0.05, what=f"{name} written back")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--interval", type=float, default=5.0, help="agents' GPU polling, seconds")
    parser.add_argument("--scrape-s", type=int, default=15)
    parser.add_argument("--eval-s", type=int, default=15)
    parser.add_argument("--seconds", type=float, default=150.0, help="load run's measured span")
    parser.add_argument("--run-ranks", default="512,8000,80000",
                        help="ranks per run for the rule timing, comma-separated")
    parser.add_argument("--central-nodes", type=int, default=1000,
                        help="nodes for the timing of every central rule")
    parser.add_argument("--disk-s", type=float, default=600.0,
                        help="disk part: seconds of one node scraped every second")
    parser.add_argument("--parts", default="node,load,rules,central,disk",
                        help="which parts to run, comma-separated (node, load, rules, central, disk)")
    parser.add_argument("--quick", action="store_true", help="a tiny run of every part")
    args = parser.parse_args()
    if args.quick:
        args.nodes, args.scrape_s, args.eval_s, args.seconds, args.run_ranks = 4, 2, 2, 12.0, "64"
        args.disk_s, args.central_nodes = 10.0, 4
    with TemporaryDirectory(prefix="bench-fleet-") as tmp:
        parts = set(args.parts.split(","))
        body = _node_scrape(Path(tmp) / "node") if parts & {"node", "central"} else ""
        node = one_node(body) if "node" in parts else None
        load = (load_run(Path(tmp), args.nodes, args.interval, args.scrape_s, args.eval_s,
                         args.seconds) if "load" in parts else None)
        rules = (ranks_per_run(Path(tmp), [int(x) for x in args.run_ranks.split(",")])
                 if "rules" in parts else None)
        central = central_rules(Path(tmp), args.central_nodes, body) if "central" in parts else None
        stored = disk(Path(tmp), args.disk_s, 1) if "disk" in parts else None
    print(json.dumps({"node": node, "load": load, "ranks_per_run": rules, "central": central,
                      "disk": stored}))


if __name__ == "__main__":
    main()

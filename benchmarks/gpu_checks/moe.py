"""Each MoE layer's expert load on a GPU: counted on the device, copied without a wait, read by
the sender once the GPU has passed the copy's event (docs/moe.md), which CPU tests cannot reach.

Two parts, each under torch's CUDA sync debug mode set to ``error`` (any synchronising call —
``cudaStreamSynchronize``, ``.item()``, a blocking copy, ``nonzero`` — raises):

1. The hook's own work on CUDA tensors: ``count_indices`` of a forward's top-k choices
   (``index_add_``, not ``bincount``, which reads a size back) for several layers, then the
   step's end (the concatenation, the ``non_blocking`` copy into pinned memory, the event, the
   zeroing). Only gpumon's calls run in the mode: the checks name what synchronised, if
   anything did.
2. A dense MoE layer written to synchronise nothing (every expert computes every token, weighted
   by the router's top-2 mask), trained in ``mon.step()`` with SGD, its counts reported with
   ``mon.expert_load(layer, counts_on_gpu)``: whole steps in the mode. The counts arrive
   (``gpumon_moe_expert_load_max_ratio`` in the agent's /metrics equals the ratio the job
   computes from its own device counts, read after the loop) and no step's field was missed.

On a CPU (dry run) both parts run without the mode (it is CUDA's) and check only the arrival.
"""

from __future__ import annotations

import time
from typing import Any

from gpumon.testing import AgentProcess, parse_metrics

from .report import Report

MOE_RUN = "gpu-node-check-moe"
EXPERTS, TOP_K, WIDTH, TOKENS, LAYERS = 8, 2, 256, 512, 2


class _sync_errors:
    """torch.cuda's sync debug mode set to ``error`` while inside (on CUDA only)."""

    def __init__(self, torch: Any, cuda: bool) -> None:
        self.torch, self.cuda = torch, cuda

    def __enter__(self) -> None:
        if self.cuda:
            self.torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            self.torch.cuda.set_sync_debug_mode("default")


def section_moe(report: Report, result: dict[str, Any], torch: Any, agent: AgentProcess,
                device: str) -> None:
    from gpumon.client import StepMonitor
    from gpumon.client.watchers.expert_load import ExpertLoadWatch

    cuda = device == "cuda"
    result.update(device=device, sync_debug_mode="error" if cuda else "not available on the CPU")

    # 1. The hook and the step's end alone.
    watch = ExpertLoadWatch()
    chosen = torch.randint(0, EXPERTS, (TOKENS, TOP_K), device=device)
    fields: dict[str, Any] = {}
    try:
        with _sync_errors(torch, cuda):
            for layer in range(4):
                watch.count_indices(str(layer), EXPERTS, chosen)
            watch.step_end(fields)
        report.check("moe.hook_no_sync", True, "count_indices x4 and step_end under sync debug mode")
    except RuntimeError as exc:
        report.check("moe.hook_no_sync", False, f"synchronised: {exc}")
        raise
    deferred = fields["moe"]
    deadline = time.monotonic() + 5
    while not deferred.ready() and time.monotonic() < deadline:
        time.sleep(0.01)
    summary = deferred.value()
    expected = torch.bincount(chosen.reshape(-1).cpu(), minlength=EXPERTS).tolist()
    got = summary["layers"]["0"] if summary else None
    report.check("moe.hook_counts", got is not None and got[1] == sum(expected),
                 {"summary": got, "counts": expected})

    # 2. Whole steps of a layer that synchronises nothing, reported with mon.expert_load.
    torch.manual_seed(0)
    router = torch.nn.Linear(WIDTH, EXPERTS, device=device)
    with torch.no_grad():
        router.weight[0] *= 4.0  # skewed towards expert 0
    experts = torch.nn.Parameter(torch.randn(EXPERTS, WIDTH, WIDTH, device=device) / WIDTH ** 0.5)
    optimizer = torch.optim.SGD([*router.parameters(), experts], lr=1e-3)
    totals = [torch.zeros(EXPERTS, dtype=torch.int64, device=device) for _ in range(LAYERS)]
    steps = 12 if report.quick else 40  # within the window: the agent's figure is all steps
    mon = StepMonitor(run=MOE_RUN, socket_path=str(agent.socket_path), rank=0, world=1)
    try:
        with _sync_errors(torch, cuda):
            for _ in range(steps):
                with mon.step():
                    x = torch.randn(TOKENS, WIDTH, device=device)
                    for layer in range(LAYERS):
                        probs = torch.softmax(router(x), dim=-1)
                        top = torch.topk(probs, TOP_K, dim=-1)
                        mask = torch.zeros_like(probs).scatter(1, top.indices, top.values)
                        chosen = top.indices.reshape(-1)
                        counts = torch.zeros(EXPERTS, dtype=torch.int64, device=device).scatter_add_(
                            0, chosen, torch.ones_like(chosen))
                        mon.expert_load(layer, counts)
                        totals[layer] += counts
                        x = x + torch.einsum("te,eij,tj->ti", mask, experts, x)
                    x.pow(2).mean().backward()
                    optimizer.step()
                    optimizer.zero_grad()
        report.check("moe.steps_no_sync", True, f"{steps} steps under sync debug mode")
    except RuntimeError as exc:
        report.check("moe.steps_no_sync", False, f"synchronised: {exc}")
        raise
    finally:
        mon.close()
    stats = mon.stats
    result.update(steps=steps, gpu_fields_missed=stats.gpu_fields_missed,
                  extension_errors=stats.extension_errors)
    report.check("moe.no_field_missed", stats.gpu_fields_missed == 0 and stats.extension_errors == 0,
                 {"gpu_fields_missed": stats.gpu_fields_missed, "extension_errors": stats.extension_errors})
    own = []
    for layer in range(LAYERS):  # the job's own figure, read after the loop (a sync is fine now)
        layer_counts = totals[layer].cpu().tolist()
        own.append(max(layer_counts) / (sum(layer_counts) / EXPERTS))
    # Every step was counted and the window holds min(steps, 50) of them; the totals above hold
    # all steps, so compare over a run no longer than the window.
    window = min(steps, 50)
    deadline = time.monotonic() + 10
    read: dict[str, float] = {}
    while time.monotonic() < deadline:
        metrics = parse_metrics(agent.scrape())
        read = {dict(labels)["layer"]: v for (name, labels), v in metrics.items()
                if name == "gpumon_moe_expert_load_max_ratio" and dict(labels).get("run") == MOE_RUN}
        if len(read) == LAYERS:
            break
        time.sleep(0.5)
    result.update(agent_max_ratio=read, own_max_ratio_all_steps=own, window=window)
    if steps <= window:
        ok = len(read) == LAYERS and all(abs(read[str(i)] - own[i]) <= 0.02 * own[i] for i in range(LAYERS))
    else:
        ok = len(read) == LAYERS and all(r >= 1.0 for r in read.values())
    report.check("moe.agent_reads_the_counts", ok, {"agent": read, "job_all_steps": own})

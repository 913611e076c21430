"""`gpumon estimate`: the memory estimate as a table or JSON, with advice in words.

The numbers come from ``gpumon.analysis.estimate``; this module only says them: the table
laid out like the classic 7B case, the decision path of docs/architecture.md §1 as advice
(fits and slow ⇒ data parallel + mixed precision; does not fit ⇒ ZeRO sharding or model
parallelism; scales badly ⇒ communication and batch size), and notes on what was counted.
"""

from __future__ import annotations

import json
from typing import Any

from gpumon.analysis.estimate import (
    DEFAULT_BUFFERS_BYTES,
    GB,
    MemoryEstimate,
    estimate_memory,
    parse_bytes,
    parse_count,
)
from gpumon.analysis.memory import OPTIMIZER_STATE_BYTES

_MIXED = "mixed precision (bf16 halves parameter and gradient memory and uses tensor cores)"


EXIT_DOES_NOT_FIT = 3
"""The exit status when the setup does not fit the given GPU memory (0: it fits, or no
memory was given; 2: bad input), so that scripts can test it."""


def estimate_command(params: str, *, buffers: str | None, gpu_memory: str | None,
                     json_output: bool, **setup: Any) -> tuple[str, int]:
    """The command's output and exit status for its flags; raises ``ValueError`` with the
    message for bad input."""
    result = estimate_memory(
        parse_count(params),
        buffers_bytes=_size("--buffers", buffers) if buffers else None,
        gpu_memory_bytes=_size("--gpu-memory", gpu_memory) if gpu_memory else None,
        **setup,
    )
    text = json.dumps(to_json_dict(result)) if json_output else render_table(result)
    return text, EXIT_DOES_NOT_FIT if result.fits() is False else 0


def _size(flag: str, text: str) -> int:
    """A size with its unit: ``80`` alone would be 80 bytes, never what was meant."""
    stripped = text.strip()
    if stripped[-1:].isdigit() or stripped.endswith("."):
        raise ValueError(f"{flag} {text}: give a unit, e.g. {stripped}GB or {stripped}GiB")
    return parse_bytes(text)


def advice_lines(e: MemoryEstimate) -> list[str]:
    """What to do, in the order of the decision path."""
    plan = e.plan
    if plan is None:
        return ["no GPU memory given: cannot say whether it fits"]
    memory = plan.memory_bytes
    if plan.fits:
        advice = [
            f"fits: {_gb(e.total_bytes)} of {_gb(memory)} per GPU "
            f"({_gb(memory - e.total_bytes)} spare)",
            "if it is too slow: data parallelism over more GPUs"
            + (f", and {_MIXED}" if e.precision == "fp32" else ", keeping mixed precision"),
        ]
        if e.gpus > 1:
            advice.append("if multi-GPU scaling is poor: check communication (exposed all-reduce "
                          "time) and the per-GPU batch size")
        return advice
    advice = [f"does not fit: {_gb(e.total_bytes)} per GPU against {_gb(memory)} "
              f"(short by {_gb(e.total_bytes - memory)})"]
    if plan.zero_here is not None and plan.zero_here.per_gpu_bytes is not None:
        advice.append(f"ZeRO stage {plan.zero_here.stage} over the {e.gpus} GPUs fits "
                      f"({_gb(plan.zero_here.per_gpu_bytes)} per GPU)")
    else:
        needs = ", ".join(f"ZeRO-{o.stage} from {o.gpus} GPUs" for o in plan.zero_from)
        advice.append("ZeRO sharding fits with " + needs if needs
                      else "no ZeRO stage fits: activations and buffers alone fill the GPU")
        advice.append("or model parallelism (tensor/pipeline), which also splits activations")
    activations = e.activations_bytes or 0
    if activations and e.recompute != "full":
        lighter = ("full recomputation" if e.recompute == "selective" or e.flash_attention
                   else "FlashAttention or selective/full recomputation")
        advice.append(f"activations are {_gb(activations)}: {lighter} shrinks them")
    here = _gb(activations) if e.activations_bytes is not None else "not estimated"
    advice.append(f"a smaller batch shrinks only activations ({here}), never parameters, "
                  f"gradients and optimizer states ({_gb(e.model_states_bytes)})")
    if e.precision == "fp32":
        advice.append(_MIXED)
    return advice


def note_lines(e: MemoryEstimate) -> list[str]:
    """What was counted and how: master weights, activations, buffers, ZeRO on one GPU."""
    notes: list[str] = []
    states = OPTIMIZER_STATE_BYTES[e.optimizer]
    if e.precision == "fp32":
        notes.append("fp32 training: the parameters are the fp32 copy, no separate master weights")
    elif e.master_weights:
        notes.append(f"master weights counted: fp32 copy 4 B/param + optimizer {states} B/param "
                     f"(the ZeRO paper's K = {4 + states})")
    else:
        notes.append(f"master weights omitted, as the common count does: optimizer {states} "
                     "B/param; mixed-precision training normally also keeps an fp32 copy "
                     "(+4 B/param)")
    if e.activations_bytes is None:
        notes.append("activations not estimated: give layers, hidden, heads, seq and batch")
    if e.buffers_default:
        notes.append(f"buffers: default {_gb(DEFAULT_BUFFERS_BYTES)} (the usual 2–4 GB: "
                     "communication buckets, workspaces, CUDA context)")
    if e.zero_stage and e.gpus // e.tensor_parallel == 1:
        notes.append("ZeRO shards over data-parallel GPUs: with one, it changes nothing")
    return notes


def render_table(estimate: MemoryEstimate) -> str:
    """A plain-text table like the classic 7B case (GB = 10⁹ bytes, one decimal), with advice."""
    e = estimate
    rows = [
        (f"parameters ({e.precision})", _gb(e.params_bytes), ""),
        (f"gradients ({e.precision})", _gb(e.grads_bytes), ""),
        ("optimizer states (fp32)", _gb(e.optimizer_states_bytes), e.optimizer),
        ("master weights (fp32)", _gb(e.master_weights_bytes), _master_remark(e)),
        ("activations",
         _gb(e.activations_bytes) if e.activations_bytes is not None else "—",
         "" if e.activations_bytes is not None else "not estimated"),
        ("buffers", _gb(e.buffers_bytes), "default" if e.buffers_default else ""),
        ("total", _gb(e.total_bytes), ""),
    ]
    if e.gpu_memory_bytes is not None:
        rows.append(("GPU memory", _gb(e.gpu_memory_bytes), "fits" if e.fits() else "does not fit"))
    title = (
        f"{_count(e.params)} parameters, {e.precision}, {e.optimizer}, "
        f"master weights {'on' if e.master_weights else 'off'}, ZeRO stage {e.zero_stage}, "
        f"{e.gpus} GPU{'s' if e.gpus > 1 else ''}"
        + (f", tensor parallel {e.tensor_parallel}" if e.tensor_parallel > 1 else "")
    )
    width = max(len(r[0]) for r in rows)
    value_width = max(len(r[1]) for r in rows)
    lines = [title, f"{'item':<{width}}  {'per GPU':>{value_width}}"]
    for item, value, remark in rows:
        lines.append(f"{item:<{width}}  {value:>{value_width}}  {remark}".rstrip())
    lines += ["", "advice:"] + [f"  - {a}" for a in advice_lines(e)]
    lines += ["notes:"] + [f"  - {n}" for n in note_lines(e)]
    return "\n".join(lines) + "\n"


def to_json_dict(estimate: MemoryEstimate) -> dict[str, object]:
    """Bytes per GPU under ``params, grads, optimizer_states, master_weights, activations,
    buffers, total`` (ints; activations 0 when not estimated), plus ``fits`` (``None`` without
    GPU memory) and ``advice`` (advice lines, then notes)."""
    e = estimate
    return {
        "params": e.params_bytes,
        "grads": e.grads_bytes,
        "optimizer_states": e.optimizer_states_bytes,
        "master_weights": e.master_weights_bytes,
        "activations": e.activations_bytes or 0,
        "buffers": e.buffers_bytes,
        "total": e.total_bytes,
        "fits": e.fits(),
        "advice": advice_lines(e) + note_lines(e),
    }


def _master_remark(e: MemoryEstimate) -> str:
    if e.precision == "fp32":
        return "the fp32 parameters themselves"
    return "" if e.master_weights else "not counted (common 8 B/param count)"


def _gb(n: int) -> str:
    return f"{n / GB:.1f} GB"


def _count(n: int) -> str:
    for scale, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= scale:
            return f"{n / scale:g}{suffix}"
    return str(n)

"""Command line: parses flags and delegates each command to its module in gpumon.commands."""

from __future__ import annotations

import sys

from gpumon.agent.run import SignalInbox

_signals = SignalInbox()
if sys.argv[1:2] == ["agent"]:
    _signals.catch()

from enum import Enum  # noqa: E402
from pathlib import Path  # noqa: E402 (after the signal handlers, on purpose)
from typing import Annotated, Any, Literal, NoReturn  # noqa: E402

import typer  # noqa: E402

from gpumon import __version__  # noqa: E402
from gpumon.agent.collectors import flag_help as collector_flag_help  # noqa: E402
from gpumon.agent.config import COLLECTORS, DEFAULT_PORT  # noqa: E402

app = typer.Typer(
    name="gpumon",
    help="GPU training monitor: NVML and training-step telemetry for Prometheus.",
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# The choices, here so that help can list them without importing the modules that use them
# (tests/test_cli.py checks that they match).
Precision = Literal["fp16", "bf16", "fp32"]
Optimizer = Literal["adam", "adamw", "sgd", "sgd_momentum"]
Recompute = Literal["none", "selective", "full"]
LogLevel = Literal["debug", "info", "warning", "error"]
Collector = Enum("Collector", {name: name for name in COLLECTORS}, type=str)  # type: ignore[misc]


def _fail(message: str, code: int = 1) -> NoReturn:
    typer.echo(f"gpumon: error: {message}", err=True)
    raise typer.Exit(code)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"gpumon {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """GPU training monitor: NVML and training-step telemetry for Prometheus."""


@app.command()
def agent(
    address: Annotated[str | None, typer.Option(metavar="ADDRESS", help="IPv4 or IPv6 address to serve HTTP on; :: serves both [default: 0.0.0.0; env GPUMON_ADDRESS].")] = None,
    port: Annotated[int | None, typer.Option(metavar="PORT", help=f"HTTP port [default: {DEFAULT_PORT}; env GPUMON_PORT].")] = None,
    socket: Annotated[str | None, typer.Option(metavar="PATH", help="Unix socket the training jobs send their steps to [default: /run/gpumon/ingest.sock; env GPUMON_SOCKET].")] = None,
    socket_group: Annotated[str | None, typer.Option(metavar="GROUP", help="Group allowed to send to the socket (mode 0660), by name or gid [default: gpumon, when that group exists; env GPUMON_SOCKET_GROUP].")] = None,
    interval: Annotated[float | None, typer.Option(metavar="SECONDS", help="GPU polling interval [default: 1.0; env GPUMON_INTERVAL].")] = None,
    simulate: Annotated[int | None, typer.Option(metavar="N", help="Simulate N GPUs instead of using NVML [env GPUMON_SIMULATE].")] = None,
    record: Annotated[str | None, typer.Option(metavar="PATH", help="Append every step and GPU sample to this JSONL file [env GPUMON_RECORD].")] = None,
    config: Annotated[str | None, typer.Option(metavar="PATH", help="TOML config file ([agent] and [thresholds] tables) [env GPUMON_CONFIG].")] = None,
    collector: Annotated[list[Collector] | None, typer.Option(metavar="|".join(COLLECTORS), help=collector_flag_help())] = None,
    log_level: Annotated[LogLevel | None, typer.Option(help="How much to log [default: info; env GPUMON_LOG_LEVEL].")] = None,
    web_config: Annotated[str | None, typer.Option(metavar="PATH", help="TLS and basic-auth file in the Prometheus exporters' web config format [env GPUMON_WEB_CONFIG].")] = None,
) -> None:
    """Run the node agent: collect, classify and serve /metrics until SIGTERM/SIGINT."""
    from gpumon.agent.run import AgentCommandError, exec_agent, run_agent

    flags: dict[str, Any] = {
        "address": address, "port": port, "socket": socket, "socket_group": socket_group,
        "interval": interval,
        "simulate": simulate, "record": record, "config": config,
        "collectors": [c.value for c in collector] if collector else None,
        "log_level": log_level, "web_config": web_config,
    }
    exec_agent(flags, _signals)  # returns only when the agent's own entry could not start
    try:
        run_agent(flags, _signals)
    except AgentCommandError as exc:
        _fail(str(exc), exc.exit_code)


@app.command()
def doctor(
    port: Annotated[int, typer.Option(metavar="PORT", help="Port the agent would serve on.")] = DEFAULT_PORT,
    socket: Annotated[str, typer.Option(metavar="PATH", help="Socket path the agent would receive training steps on.")] = "/run/gpumon/ingest.sock",
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Report what this node supports: driver, NVML, per-GPU metric groups, socket, port."""
    from gpumon.commands.doctor import run_doctor

    run_doctor(port=port, socket_path=Path(socket), json_output=json_output)


@app.command()
def estimate(
    params: Annotated[str | None, typer.Option(metavar="COUNT", help="Parameter count, e.g. 7B, 175M, 1.3e9 (or --from-run).")] = None,
    precision: Annotated[Precision, typer.Option(help="Training precision (fp16 and bf16: mixed precision).")] = "bf16",
    optimizer: Annotated[Optimizer, typer.Option(help="Optimizer, for its state per parameter.")] = "adamw",
    master_weights: Annotated[bool, typer.Option("--master-weights/--no-master-weights", help="Count the fp32 master copy of mixed precision (the ZeRO paper's K=12 counts it; the common 8 B/param Adam figure does not).")] = True,
    zero_stage: Annotated[int, typer.Option(min=0, max=3, metavar="STAGE", help="ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also parameters.")] = 0,
    gpus: Annotated[int, typer.Option(min=1, metavar="N", help="Data-parallel GPUs the states are sharded over.")] = 1,
    layers: Annotated[int | None, typer.Option(metavar="N", help="Transformer layers (for activations).")] = None,
    hidden: Annotated[int | None, typer.Option(metavar="N", help="Hidden size.")] = None,
    heads: Annotated[int | None, typer.Option(metavar="N", help="Attention heads.")] = None,
    seq: Annotated[int | None, typer.Option(metavar="TOKENS", help="Sequence length.")] = None,
    batch: Annotated[int | None, typer.Option(metavar="N", help="Micro-batch per GPU.")] = None,
    flash_attention: Annotated[bool, typer.Option("--flash-attention", help="FlashAttention: the attention scores are not kept for the backward pass.")] = False,
    recompute: Annotated[Recompute, typer.Option(help="Activation recomputation (checkpointing).")] = "none",
    tensor_parallel: Annotated[int, typer.Option(min=1, metavar="N", help="Tensor-parallel degree.")] = 1,
    buffers: Annotated[str | None, typer.Option(metavar="SIZE", help="Temporary buffers per GPU, e.g. 3GB [default: 2GB].")] = None,
    gpu_memory: Annotated[str | None, typer.Option(metavar="SIZE", help="Device memory to check against, with its unit: 80GB, 141GiB. Exit status 3 when it does not fit.")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON (bytes per GPU).")] = False,
    from_run: Annotated[str | None, typer.Option("--from-run", metavar="RUN", help="Measure instead: the memory breakdown a running job's ranks report to the agent at --url, beside its ZeRO projections.")] = None,
    url: Annotated[str, typer.Option(metavar="URL", help="The agent's base URL, for --from-run.")] = f"http://127.0.0.1:{DEFAULT_PORT}",
) -> None:
    """Estimate per-GPU training memory: params, grads, optimizer states, activations, buffers.

    Exit status: 0 when it fits (or no --gpu-memory is given), 3 when it does not fit,
    2 for bad input.
    """
    from gpumon.commands.estimate import estimate_command

    if from_run is not None:
        _estimate_from_run(from_run, url, params, gpu_memory, json_output)
        return
    if params is None:
        _fail("give --params (e.g. --params 7B), or --from-run RUN to measure a running job", 2)
    try:
        text, code = estimate_command(
            params, precision=precision, optimizer=optimizer, master_weights=master_weights,
            zero_stage=zero_stage, gpus=gpus, layers=layers, hidden=hidden, heads=heads,
            seq=seq, batch=batch, flash_attention=flash_attention, recompute=recompute,
            tensor_parallel=tensor_parallel, buffers=buffers, gpu_memory=gpu_memory,
            json_output=json_output)
    except ValueError as exc:
        _fail(str(exc), 2)
    typer.echo(text)
    raise typer.Exit(code)


def _estimate_from_run(run: str, url: str, params: str | None, gpu_memory: str | None,
                       json_output: bool) -> None:
    from gpumon.analysis.estimate import parse_bytes
    from gpumon.commands.estimate_run import from_run_command

    if params is not None:
        _fail("--from-run measures the model: leave out --params", 2)
    try:
        text = from_run_command(run, url, json_output=json_output,
                                gpu_memory_bytes=parse_bytes(gpu_memory) if gpu_memory else None)
    except ValueError as exc:
        _fail(str(exc), 2)
    except OSError as exc:
        _fail(f"cannot read {url}: {getattr(exc, 'reason', None) or exc}", 1)
    typer.echo(text)


@app.command()
def classify(
    recording: Annotated[Path, typer.Argument(metavar="RECORDING", help="A JSONL recording made with `gpumon agent --record`.")],
    json_output: Annotated[bool, typer.Option("--json", help="One JSON line per step, then a summary line.")] = False,
) -> None:
    """Replay a recording through the bottleneck classifier and explain each step."""
    from gpumon.commands.classify import output_lines

    try:
        lines = output_lines(recording, json_output=json_output,
                             warn=lambda message: typer.echo(message, err=True))
    except OSError as exc:
        _fail(f"cannot read {recording}: {exc.strerror or exc}", 2)
    for line in lines:
        typer.echo(line)


@app.command()
def report(
    recording: Annotated[Path | None, typer.Argument(metavar="[RECORDING]", help="A JSONL recording made with `gpumon agent --record` (or by `gpumon demo`).")] = None,
    prometheus: Annotated[str | None, typer.Option(metavar="URL", help="Read the run from this Prometheus-compatible server (Prometheus, VictoriaMetrics) instead.")] = None,
    run_name: Annotated[str | None, typer.Option("--run", metavar="RUN", help="The run to report [default: a recording's only run].")] = None,
    since: Annotated[str, typer.Option(metavar="DURATION", help="With --prometheus: how far back, e.g. 30m, 6h, 2d.")] = "6h",
    timeout: Annotated[float, typer.Option(min=0.1, metavar="SECONDS", help="With --prometheus: give up on a query after this long.")] = 30.0,
    output: Annotated[Path, typer.Option("--output", "-o", metavar="PATH", help="The HTML file to write.")] = Path("report.html"),
) -> None:
    """Write one self-contained HTML page of a run in pictures, from a recording or Prometheus."""
    from gpumon.report.make import ReportError, make_report

    if (recording is None) == (prometheus is None):
        _fail("give a RECORDING or --prometheus URL --run RUN (one of them)", 2)
    try:
        message = make_report(output, recording=recording, prometheus=prometheus, run=run_name,
                              since=since, timeout_s=timeout,
                              warn=lambda line: typer.echo(line, err=True))
    except ReportError as exc:
        _fail(str(exc), exc.exit_code)
    typer.echo(message)


@app.command()
def demo(
    gpus: Annotated[int, typer.Option(min=1, max=64, metavar="N", help="Simulated GPUs.")] = 8,
    ranks: Annotated[int, typer.Option(min=1, max=64, metavar="N", help="Ranks of the simulated data-parallel job, one per GPU.")] = 8,
    port: Annotated[int, typer.Option(min=0, max=65535, metavar="PORT", help="HTTP port of the agent (0: any free port), on 127.0.0.1.")] = DEFAULT_PORT,
    socket: Annotated[str | None, typer.Option(metavar="PATH", help="Socket the simulated job sends its steps to [default: demo-<pid>.sock in $XDG_RUNTIME_DIR/gpumon, else in the temp directory].")] = None,
    schedule: Annotated[str, typer.Option(metavar="SCHEDULE", help="Phases to run: a TOML schedule file, or the built-in 'default' or 'short'.")] = "default",
    duration: Annotated[float | None, typer.Option(min=0.1, metavar="SECONDS", help="Stop after this long [default: run until Ctrl-C].")] = None,
    ui: Annotated[bool, typer.Option("--ui/--no-ui", help="Live view; without it (or when stdout is not a terminal) one line per phase change.")] = True,
    interval: Annotated[float, typer.Option(min=0.05, max=60.0, metavar="SECONDS", help="Agent polling interval.")] = 1.0,
    gpu_model: Annotated[str, typer.Option(metavar="MODEL", help="Simulated GPU model: h100-sxm or h200-sxm.")] = "h100-sxm",
) -> None:
    """Run an agent, a simulated GPU node and a synthetic multi-rank training job, with a live view."""
    from gpumon.commands.demo import DemoError, DemoOptions, run_demo
    from gpumon.report.make import demo_report
    from gpumon.sim.schedule import load_schedule

    try:
        options = DemoOptions(schedule=load_schedule(schedule), gpus=gpus, ranks=ranks, port=port,
                              socket=socket, duration_s=duration, ui=ui, interval_s=interval,
                              model=gpu_model, report=demo_report)
    except ValueError as exc:  # ScheduleError too
        _fail(str(exc), 2)
    try:
        code = run_demo(options)
    except DemoError as exc:
        _fail(str(exc))
    raise typer.Exit(code)


@app.command()
def top(
    url: Annotated[str, typer.Option(metavar="URL", help="The agent's base URL.")] = f"http://127.0.0.1:{DEFAULT_PORT}",
    interval: Annotated[float, typer.Option(min=0.1, max=60.0, metavar="SECONDS", help="Time between redraws.")] = 1.0,
    once: Annotated[bool, typer.Option("--once", help="Print one frame and exit: status 0 when the agent answered, 1 when not (for scripts).")] = False,
    rank: Annotated[str | None, typer.Option(metavar="RUN:RANK", help="Show this rank's memory breakdown: RUN:RANK or RANK [default: the one with the highest OOM risk].")] = None,
) -> None:
    """Live terminal view of a running agent: GPUs, ranks, verdicts and OOM risk; q quits."""
    from gpumon.commands.memory_view import parse_rank
    from gpumon.commands.top import run_top, snapshot_url

    try:
        snapshot_url(url)
        if rank is not None:
            parse_rank(rank)
    except ValueError as exc:
        _fail(str(exc), 2)
    raise typer.Exit(run_top(url, interval, once=once, rank=rank))


@app.command()
def stacks(
    url: Annotated[str, typer.Option(metavar="URL", help="The agent's base URL.")] = f"http://127.0.0.1:{DEFAULT_PORT}",
    run_name: Annotated[str | None, typer.Option("--run", metavar="RUN", help="Only this run [default: every run].")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON document instead of text.")] = False,
) -> None:
    """Where every rank of a run is: state, phase, collective, whom it waits on, and its stack."""
    from gpumon.commands.stacks import run_stacks
    from gpumon.commands.top import snapshot_url

    try:
        snapshot_url(url)
    except ValueError as exc:
        _fail(str(exc), 2)
    code, text = run_stacks(url, run_name, as_json)
    (sys.stdout if code == 0 else sys.stderr).write(text)
    raise typer.Exit(code)


@app.command()
def trace(
    url: Annotated[str, typer.Option(metavar="URL", help="The agent's base URL (credentials, if it has auth: http://user:password@host:port).")] = f"http://127.0.0.1:{DEFAULT_PORT}",
    run_name: Annotated[str | None, typer.Option("--run", metavar="RUN", help="The run to trace.")] = None,
    rank: Annotated[int | None, typer.Option(min=0, metavar="N", help="The rank to trace.")] = None,
    all_ranks: Annotated[bool, typer.Option("--all-ranks", help="Trace every rank of the run on the agent's node.")] = False,
    steps: Annotated[int, typer.Option(min=1, max=50, metavar="K", help="Whole steps to profile.")] = 3,
    wait: Annotated[bool, typer.Option("--wait", help="Wait for the traces and print their paths.")] = False,
    list_only: Annotated[bool, typer.Option("--list", help="List the traces on the agent's node (of --run, if given).")] = False,
) -> None:
    """Profile a rank's next steps with torch.profiler, without restarting the job; --list lists traces."""
    from gpumon.commands.trace import TraceCommandError, list_traces, request_traces

    try:
        if list_only:
            lines = list_traces(url, run_name)
        elif run_name is None or (rank is not None) == all_ranks:
            raise TraceCommandError("give --run and either --rank N or --all-ranks (or --list)", 2)
        else:
            lines = request_traces(url, run_name, None if all_ranks else rank, steps, wait)
    except TraceCommandError as exc:
        _fail(str(exc), exc.exit_code)
    for line in lines:
        typer.echo(line)


@app.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
def run(
    command: Annotated[list[str] | None, typer.Argument(metavar="COMMAND", help="The training command, unchanged: python train.py, torchrun ..., deepspeed ..., accelerate launch ...")] = None,
    run_name: Annotated[str | None, typer.Option("--run", metavar="NAME", help="The run's name [default: $GPUMON_RUN, else its job's (Slurm, Kubernetes, torchrun --rdzv-id), else the script's name].")] = None,
    socket: Annotated[str | None, typer.Option(metavar="PATH", help="The agent's socket [default: $GPUMON_SOCKET, else /run/gpumon/ingest.sock].")] = None,
) -> None:
    """Run an unmodified training command, its steps watched: gpumon run -- python train.py."""
    from gpumon.commands.run import RunError, run_command

    try:
        run_command(command or [], run=run_name, socket=socket)
    except RunError as exc:
        _fail(str(exc), exc.exit_code)


def main() -> None:
    """Console-script entry point."""
    app(prog_name="gpumon")


if __name__ == "__main__":
    main()

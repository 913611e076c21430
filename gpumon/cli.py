"""Command line: parses flags and delegates each command to its module in gpumon.commands."""

from __future__ import annotations

import signal
import sys

from gpumon.commands.agent import SignalInbox

_signals = SignalInbox()
if sys.argv[1:2] == ["agent"]:
    _signals.catch(signal.SIGHUP)

from pathlib import Path  # noqa: E402 (after the signal handlers, on purpose)
from typing import Annotated, Any, NoReturn  # noqa: E402

import typer  # noqa: E402

from gpumon import __version__  # noqa: E402
from gpumon.agent.config import DEFAULT_PORT  # noqa: E402

app = typer.Typer(
    name="gpumon",
    help="GPU training monitor: NVML and training-step telemetry for Prometheus.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


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
    address: Annotated[str | None, typer.Option(help="Address to serve HTTP on [default: 0.0.0.0; env GPUMON_ADDRESS].")] = None,
    port: Annotated[int | None, typer.Option(help=f"HTTP port [default: {DEFAULT_PORT}; env GPUMON_PORT].")] = None,
    socket: Annotated[str | None, typer.Option(help="Unix datagram socket for training-step records [default: /run/gpumon/ingest.sock; env GPUMON_SOCKET].")] = None,
    interval: Annotated[float | None, typer.Option(help="GPU polling interval in seconds [default: 1.0; env GPUMON_INTERVAL].")] = None,
    simulate: Annotated[int | None, typer.Option(help="Simulate N GPUs instead of using NVML [env GPUMON_SIMULATE].")] = None,
    record: Annotated[str | None, typer.Option(help="Append every step record and GPU sample to this JSONL file [env GPUMON_RECORD].")] = None,
    config: Annotated[str | None, typer.Option(help="TOML config file ([agent] table) [env GPUMON_CONFIG].")] = None,
    collector: Annotated[list[str] | None, typer.Option(help="Enable only these collectors (repeatable): nvml, host, ingest [env GPUMON_COLLECTORS].")] = None,
    log_level: Annotated[str | None, typer.Option(help="debug, info, warning or error [env GPUMON_LOG_LEVEL].")] = None,
    web_config: Annotated[str | None, typer.Option(help="TLS and basic-auth file in the Prometheus exporters' web config format [env GPUMON_WEB_CONFIG].")] = None,
) -> None:
    """Run the node agent: collect, classify and serve /metrics until SIGTERM/SIGINT."""
    from gpumon.commands.agent import AgentCommandError, run_agent

    flags: dict[str, Any] = {
        "address": address, "port": port, "socket": socket, "interval": interval,
        "simulate": simulate, "record": record, "config": config,
        "collectors": collector or None, "log_level": log_level, "web_config": web_config,
    }
    try:
        run_agent(flags, _signals)
    except AgentCommandError as exc:
        _fail(str(exc), exc.exit_code)


@app.command()
def doctor(
    port: Annotated[int, typer.Option(help="Port the agent would serve on.")] = DEFAULT_PORT,
    socket: Annotated[str, typer.Option(help="Ingest socket path the agent would use.")] = "/run/gpumon/ingest.sock",
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Report what this node supports: driver, NVML, per-GPU metric groups, socket, port."""
    from gpumon.commands.doctor import run_doctor

    run_doctor(port=port, socket_path=Path(socket), json_output=json_output)


@app.command()
def estimate(
    params: Annotated[str | None, typer.Option(help="Parameter count, e.g. 7B, 175M, 1.3e9 (or --from-run).")] = None,
    precision: Annotated[str, typer.Option(help="fp16, bf16 or fp32.")] = "bf16",
    optimizer: Annotated[str, typer.Option(help="adam, adamw, sgd or sgd_momentum.")] = "adamw",
    master_weights: Annotated[bool, typer.Option("--master-weights/--no-master-weights", help="Count the fp32 master copy of mixed precision (the ZeRO paper's K=12 counts it; the common 8 B/param Adam figure does not).")] = True,
    zero_stage: Annotated[int, typer.Option(min=0, max=3, help="ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also parameters.")] = 0,
    gpus: Annotated[int, typer.Option(min=1, help="Data-parallel GPUs the states are sharded over.")] = 1,
    layers: Annotated[int | None, typer.Option(help="Transformer layers (for activations).")] = None,
    hidden: Annotated[int | None, typer.Option(help="Hidden size.")] = None,
    heads: Annotated[int | None, typer.Option(help="Attention heads.")] = None,
    seq: Annotated[int | None, typer.Option(help="Sequence length.")] = None,
    batch: Annotated[int | None, typer.Option(help="Micro-batch per GPU.")] = None,
    flash_attention: Annotated[bool, typer.Option("--flash-attention", help="Attention scores are not stored (drops the 5as/h term).")] = False,
    recompute: Annotated[str, typer.Option(help="none, selective or full activation recomputation.")] = "none",
    tensor_parallel: Annotated[int, typer.Option(min=1, help="Tensor-parallel degree.")] = 1,
    buffers: Annotated[str | None, typer.Option(help="Temporary buffers per GPU, e.g. 3GB [default: 2GB].")] = None,
    gpu_memory: Annotated[str | None, typer.Option(help="Device memory to check against, e.g. 80GB or 141GiB.")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON (bytes per GPU).")] = False,
    from_run: Annotated[str | None, typer.Option("--from-run", metavar="RUN", help="Measure instead: the memory breakdown a running job's ranks report to the agent at --url, beside its ZeRO projections.")] = None,
    url: Annotated[str, typer.Option(help="The agent's base URL, for --from-run.")] = f"http://127.0.0.1:{DEFAULT_PORT}",
) -> None:
    """Estimate per-GPU training memory: params, grads, optimizer states, activations, buffers."""
    from gpumon.commands.estimate import estimate_command

    if from_run is not None:
        _estimate_from_run(from_run, url, params, gpu_memory, json_output)
        return
    if params is None:
        _fail("give --params (e.g. --params 7B), or --from-run RUN to measure a running job", 2)
    try:
        text = estimate_command(
            params, precision=precision, optimizer=optimizer, master_weights=master_weights,
            zero_stage=zero_stage, gpus=gpus, layers=layers, hidden=hidden, heads=heads,
            seq=seq, batch=batch, flash_attention=flash_attention, recompute=recompute,
            tensor_parallel=tensor_parallel, buffers=buffers, gpu_memory=gpu_memory,
            json_output=json_output)
    except ValueError as exc:
        _fail(str(exc), 2)
    typer.echo(text)


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
    recording: Annotated[Path, typer.Argument(help="A JSONL recording made with `gpumon agent --record`.")],
    json_output: Annotated[bool, typer.Option("--json", help="One JSON line per step, then a summary line.")] = False,
) -> None:
    """Replay a recording through the bottleneck classifier and explain each step."""
    from gpumon.commands.classify import output_lines

    try:
        lines = output_lines(recording, json_output=json_output)
    except OSError as exc:
        _fail(f"cannot read {recording}: {exc.strerror or exc}", 2)
    for line in lines:
        typer.echo(line)


@app.command()
def demo(
    gpus: Annotated[int, typer.Option(min=1, max=64, help="Simulated GPUs.")] = 8,
    ranks: Annotated[int, typer.Option(min=1, max=64, help="Ranks of the synthetic data-parallel job, one per GPU.")] = 8,
    port: Annotated[int, typer.Option(min=0, max=65535, help="HTTP port of the agent (0: any free port), on 127.0.0.1.")] = DEFAULT_PORT,
    socket: Annotated[str | None, typer.Option(help="Ingest socket [default: demo-<pid>.sock in $XDG_RUNTIME_DIR/gpumon, else in the temp directory].")] = None,
    schedule: Annotated[str, typer.Option(help="Phases to run: a TOML schedule file, or the built-in 'default' or 'short'.")] = "default",
    duration: Annotated[float | None, typer.Option(min=0.1, help="Stop after this many seconds [default: run until Ctrl-C].")] = None,
    ui: Annotated[bool, typer.Option("--ui/--no-ui", help="Live view; without it (or when stdout is not a terminal) one line per phase change.")] = True,
    interval: Annotated[float, typer.Option(min=0.05, max=60.0, help="Agent polling interval in seconds.")] = 1.0,
    gpu_model: Annotated[str, typer.Option(help="Simulated GPU model: h100-sxm or h200-sxm.")] = "h100-sxm",
) -> None:
    """Run an agent, a simulated GPU node and a synthetic multi-rank training job, with a live view."""
    from gpumon.commands.demo import DemoError, DemoOptions, run_demo
    from gpumon.sim.schedule import load_schedule

    try:
        options = DemoOptions(schedule=load_schedule(schedule), gpus=gpus, ranks=ranks, port=port,
                              socket=socket, duration_s=duration, ui=ui, interval_s=interval,
                              model=gpu_model)
    except ValueError as exc:  # ScheduleError too
        _fail(str(exc), 2)
    try:
        code = run_demo(options)
    except DemoError as exc:
        _fail(str(exc))
    raise typer.Exit(code)


@app.command()
def top(
    url: Annotated[str, typer.Option(help="The agent's base URL.")] = f"http://127.0.0.1:{DEFAULT_PORT}",
    interval: Annotated[float, typer.Option(min=0.1, max=60.0, help="Seconds between redraws.")] = 1.0,
    rank: Annotated[str | None, typer.Option(help="Show this rank's memory breakdown: RUN:RANK or RANK [default: the one with the highest OOM risk].")] = None,
) -> None:
    """Live terminal view of a running agent: GPUs, ranks, verdicts and OOM risk."""
    from gpumon.commands.memory_view import parse_rank
    from gpumon.commands.top import run_top, snapshot_url

    try:
        snapshot_url(url)
        if rank is not None:
            parse_rank(rank)
    except ValueError as exc:
        _fail(str(exc), 2)
    raise typer.Exit(run_top(url, interval, rank=rank))


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()

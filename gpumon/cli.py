"""Command line: parses flags and delegates; the work lives in the library modules."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from gpumon import __version__
from gpumon.config import DEFAULT_PORT, ConfigError, load_config

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
) -> None:
    """Run the node agent: collect, classify and serve /metrics until SIGTERM/SIGINT."""
    from gpumon.agent import Agent, AgentError
    from gpumon.export.server import ServeError

    flags: dict[str, Any] = {
        "address": address, "port": port, "socket": socket, "interval": interval,
        "simulate": simulate, "record": record, "config": config,
        "collectors": collector or None, "log_level": log_level,
    }
    try:
        cfg = load_config(flags)
    except ConfigError as exc:
        _fail(str(exc), 2)
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    node = Agent(cfg)
    try:
        node.start()
    except (ServeError, AgentError) as exc:
        node.stop()
        _fail(str(exc))
    stop = threading.Event()

    def _on_signal(signum: int, _frame: Any) -> None:
        logging.getLogger("gpumon").info("received %s, shutting down",
                                         signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        node.stop()


@app.command()
def doctor(
    port: Annotated[int, typer.Option(help="Port the agent would serve on.")] = DEFAULT_PORT,
    socket: Annotated[str, typer.Option(help="Ingest socket path the agent would use.")] = "/run/gpumon/ingest.sock",
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Report what this node supports: driver, NVML, per-GPU metric groups, socket, port."""
    from gpumon.doctor import diagnose, render

    report = diagnose(port=port, socket_path=Path(socket))
    if json_output:
        import json

        typer.echo(json.dumps(report, indent=2))
    else:
        render(report)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()

"""The device script's report: every section timed and wrapped, every check and finding kept,
``summary.json`` rewritten after each section, ``summary.md`` at the end, and a watchdog that
writes what there is and exits before the budget runs out (a lent GPU node's time is short and
a hung CUDA call must not cost the whole run)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpumon.testing.processes import kill_tree

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30

Markdown = Callable[[dict[str, Any]], list[str]]
"""A section's part of summary.md: lines from the report's JSON data."""


def now() -> float:
    return time.monotonic()


def tb() -> str:
    return traceback.format_exc(limit=12)


def jsonable(value: Any, depth: int = 0) -> Any:
    """Plain JSON data from NVML structs, dataclasses, bytes, ... (bounded)."""
    if depth > 16:
        return repr(value)[:200]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else repr(value)
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, dict):
        # (the report's own checks, one key each, are more than 64 by now)
        return {str(k): jsonable(v, depth + 1) for k, v in list(value.items())[:256]}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v, depth + 1) for v in list(value)[:64]]
    if hasattr(value, "_fields_"):  # ctypes struct
        return {name: jsonable(getattr(value, name, None), depth + 1)
                for name, *_ in value._fields_ if not name.startswith("_")}
    if isinstance(value, ctypes.Array):
        return [jsonable(v, depth + 1) for v in list(value)[:16]]
    if hasattr(value, "__dataclass_fields__"):
        return {k: jsonable(getattr(value, k), depth + 1) for k in value.__dataclass_fields__}
    if hasattr(value, "__dict__"):
        return {k: jsonable(v, depth + 1) for k, v in vars(value).items() if not k.startswith("_")}
    return repr(value)[:200]



def gib(value: float | None) -> float | None:
    return None if value is None else round(value / GIB, 2)


def run_cmd(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a command with a timeout; never raises."""
    start = now()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=ROOT, stdin=subprocess.DEVNULL)
        return {"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr,
                "seconds": round(now() - start, 3)}
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
        return {"rc": None, "timeout": True, "stdout": out or "", "stderr": err or "",
                "seconds": round(now() - start, 3)}
    except OSError as exc:
        return {"rc": None, "error": f"{type(exc).__name__}: {exc}", "stdout": "", "stderr": "",
                "seconds": round(now() - start, 3)}



class Report:
    """Sections, checks and findings of one run, written to ``out`` as they come."""

    def __init__(self, out: Path, budget_s: float, markdown: list[Markdown] | None = None,
                 quick: bool = False) -> None:
        self.out = out
        self.markdown = list(markdown or [])
        self.quick = quick  # short loops: the test suite's dry run
        self.t0 = now()
        self.deadline = self.t0 + budget_s
        self.data: dict[str, Any] = {
            "script": "benchmarks/gpu_node_check.py",
            "started_unix": time.time(),
            "budget_s": budget_s,
            "sections": {},
            "checks": {},
            "findings": [],
        }
        self.lock = threading.RLock()
        self.children: list[subprocess.Popen[bytes]] = []

    def remaining(self) -> float:
        return self.deadline - now()

    def check(self, name: str, ok: bool | None, detail: Any = None) -> None:
        """ok: True passed, False failed, None informational."""
        with self.lock:
            self.data["checks"][name] = {"ok": ok, "detail": jsonable(detail)}
        mark = {True: "PASS", False: "FAIL", None: "info"}[ok]
        text = json.dumps(jsonable(detail), default=str)
        print(f"  [{mark}] {name}: {text[:300]}", flush=True)

    def finding(self, text: str) -> None:
        with self.lock:
            self.data["findings"].append(text)
        print(f"  finding: {text}", flush=True)

    def run(self, name: str, fn: Callable[[dict[str, Any]], Any], need_s: float = 0.0) -> Any:
        """Run one section: timed, its failure recorded (with traceback) and not raised."""
        result: dict[str, Any] = {}
        with self.lock:
            self.data["sections"][name] = result
        left = self.remaining()
        print(f"== {name} ({left:.0f} s of budget left)", flush=True)
        if left < need_s:
            result["status"] = f"skipped: {left:.0f} s left, needs {need_s:.0f} s"
            print(f"  {result['status']}", flush=True)
            self.write()
            return None
        start = now()
        value = None
        try:
            value = fn(result)
        except SkipSection as exc:
            result["status"] = f"skipped: {exc}"
            print(f"  {result['status']}", flush=True)
        except Exception as exc:
            result["status"] = "error"
            result["error"] = f"{type(exc).__name__}: {exc}"
            result["traceback"] = tb()
            print(f"  ERROR {result['error']}\n{result['traceback']}", flush=True)
        else:
            result.setdefault("status", "ok")
        finally:
            result["seconds"] = round(now() - start, 2)
            self.write()
        return value

    def document(self) -> dict[str, Any]:
        """The report as plain JSON data."""
        with self.lock:
            return {key: ({name: jsonable(item, 1) for name, item in value.items()}
                          if key in ("sections", "checks") else jsonable(value, 1))
                    for key, value in self.data.items()}

    def write(self) -> None:
        with self.lock:
            self.data["elapsed_s"] = round(now() - self.t0, 2)
            tmp = self.out / ".summary.json.tmp"
            # The report's own sections and checks are written whole: jsonable bounds a dict to
            # 64 items, which is for what NVML and the agent hand back, not for this table.
            doc = self.document()
            tmp.write_text(json.dumps(doc, indent=1, default=str))
            os.replace(tmp, self.out / "summary.json")

    def start_watchdog(self) -> None:
        def watch() -> None:
            while self.remaining() > 0:
                time.sleep(0.5)
            stacks = {str(tid): "".join(traceback.format_stack(frame, limit=15))
                      for tid, frame in sys._current_frames().items()}
            with self.lock:
                self.data["watchdog"] = {"fired_at_s": round(now() - self.t0, 1), "stacks": stacks}
            print("WATCHDOG: budget exhausted, writing what there is and exiting", flush=True)
            for child in self.children:
                with contextlib.suppress(Exception):
                    kill_tree(child.pid)
            with contextlib.suppress(Exception):
                self.write()
                self.write_markdown()
            os._exit(3)

        threading.Thread(target=watch, name="watchdog", daemon=True).start()


    def write_markdown(self) -> None:
        """summary.md: the run, sections and checks, then each section's own part."""
        d = self.document()
        lines = ["# gpumon GPU node check", ""]
        env = d["sections"].get("environment", {})
        smi = env.get("nvidia_smi")
        torch_info = env.get("torch", {})
        lines += [f"- NVML mode: **{d.get('nvml_mode')}**; elapsed {d.get('elapsed_s')} s "
                  f"of a {d.get('budget_s')} s budget",
                  f"- nvidia-smi: {json.dumps(smi.get('excerpt') if isinstance(smi, dict) else smi)}",
                  f"- torch: {json.dumps(torch_info)}",
                  f"- packages: {json.dumps(env.get('packages'))}", ""]
        if d.get("watchdog"):
            lines += [f"**WATCHDOG fired at {d['watchdog']['fired_at_s']} s** (stacks in summary.json)",
                      ""]
        lines += ["## Sections", "", "| section | status | seconds |", "|---|---|---|"]
        for name, sec in d["sections"].items():
            lines.append(f"| {name} | {sec.get('status', 'running?')} | {sec.get('seconds', '')} |")
        lines += ["", "## Checks", "", "| check | result | detail |", "|---|---|---|"]
        for name, c in d["checks"].items():
            mark = {True: "PASS", False: "**FAIL**", None: "info"}[c["ok"]]
            detail = json.dumps(c["detail"], default=str).replace("|", "\\|")
            lines.append(f"| {name} | {mark} | {detail[:600]} |")
        if d["findings"]:
            lines += ["", "## Findings", ""] + [f"- {f}" for f in d["findings"]]
        for name, sec in d["sections"].items():
            if sec.get("traceback"):
                lines += ["", f"## Traceback in {name}", "", "```", sec["traceback"], "```"]
        for part in self.markdown:
            try:
                lines += part(d)
            except Exception:  # one part's bad data costs that part, not the file
                lines += ["", f"## {getattr(part, '__module__', part)}: failed", "", "```", tb(), "```"]
        (self.out / "summary.md").write_text("\n".join(lines) + "\n")


class SkipSection(Exception):
    """Raised by a section that cannot run here (no CUDA, no monitor): recorded as skipped."""

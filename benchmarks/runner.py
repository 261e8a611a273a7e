"""What every benchmark script shares: one configuration per fresh subprocess (time limit, whole process tree
killed, OOM detected), JSON lines, markdown tables, sequence-length labels."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def seq_label(n: int) -> str:
    """131072 -> '128K', 1048576 -> '1M', 100 -> '100'."""
    return f"{n // (1 << 20)}M" if n % (1 << 20) == 0 else f"{n // 1024}K" if n % 1024 == 0 else str(n)


def parse_seq(s: str) -> int:
    """'128K' -> 131072, '1M' -> 1048576, '4096' -> 4096."""
    n = s.strip().upper()
    mult = 1 << 20 if n.endswith("M") else 1024 if n.endswith("K") else 1
    return int(n.rstrip("MK")) * mult


def is_oom(exc: BaseException) -> bool:
    """An out-of-memory error: torch's OutOfMemoryError or a cuDNN allocation failure."""
    import torch

    types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None))
                  if t is not None)
    return isinstance(exc, types) or is_oom_text(str(exc))


def is_oom_text(text: str) -> bool:
    """The output of a process that ran out of memory."""
    low = text.lower()
    return "out of memory" in low or "alloc_failed" in low or "outofmemoryerror" in low


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def last_error_line(text: str) -> str:
    """The most telling line of a failed run: the last 'SomethingError: ...' line (a worker's exception, not
    torchrun's summary), else the last line mentioning an error, else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    exc = re.compile(r"^(\[rank\d+\]:\s*)?[\w.]*(Error|Exception|Interrupt)\b(: .*)?$")
    skip = ("ChildFailedError", "error_file")
    for ln in reversed(lines):
        if exc.match(ln) and not any(k in ln for k in skip):
            return ln[:300]
    for ln in reversed(lines):
        if "error" in ln.lower() and not any(k in ln for k in skip) and not ln.startswith("File "):
            return ln[:300]
    return lines[-1][:300] if lines else ""


def run(cmd: list[str], timeout: float, env: dict | None = None,
        log_stem: Path | None = None) -> tuple[int | None, str]:
    """Run ``cmd`` from the repository root in its own session; past ``timeout`` its whole process tree is killed.
    Returns (exit code, or None on timeout; stderr + stdout). Output also goes to ``log_stem``.err/.out if given."""
    with tempfile.TemporaryDirectory() as tmp:
        stem = log_stem or Path(tmp) / "run"
        out_f, err_f = stem.with_suffix(".out"), stem.with_suffix(".err")
        with open(out_f, "w") as fo, open(err_f, "w") as fe:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fo, stderr=fe, start_new_session=True)
            try:
                rc = proc.wait(timeout=max(timeout, 1.0))
            except subprocess.TimeoutExpired:
                _kill_tree(proc)
                rc = None
        return rc, err_f.read_text(errors="replace") + "\n" + out_f.read_text(errors="replace")


def _kill_tree(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=15)
            return
        except subprocess.TimeoutExpired:
            continue


def run_config(module: str, argv: list[str], timeout: float, env: dict | None = None,
               log_stem: Path | None = None) -> dict:
    """One configuration in a fresh ``python -m <module> <argv> --json-out FILE``; the child writes its row to FILE.
    Returns that row, or {status: OOM | timeout | error, error: ...} when there is none; ``wall_s`` in both."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        t0 = time.perf_counter()
        rc, text = run([sys.executable, "-m", module, *argv, "--json-out", str(out)], timeout, env, log_stem)
        if rc == 0 and out.exists():
            row = json.loads(out.read_text())
        elif rc is None:
            row = {"status": "timeout", "error": f"no result within {timeout:.0f} s"}
        else:
            row = {"status": "OOM" if is_oom_text(text) else "error",
                   "error": f"exit code {rc}: {last_error_line(text)}"}
        row["wall_s"] = time.perf_counter() - t0
        return row


def write_json(path, obj) -> None:
    """Write atomically: a reader never sees half a file."""
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def append_jsonl(rows: list[dict], path) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


def jsonl_path(out, jsonl):
    """--jsonl, else --out with the suffix .jsonl, else None."""
    return jsonl or (str(Path(out).with_suffix(".jsonl")) if out else None)


def write_text(path, text: str) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")


def fmt(v, spec: str, none: str = "n/a") -> str:
    return none if v is None else format(v, spec)


def md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


class Deadline:
    """A sweep's time box: ``left()`` seconds remain; ``limit(t)`` caps one subprocess's limit by them (30 s
    at least)."""

    def __init__(self, seconds: float | None):
        self.t0, self.seconds = time.perf_counter(), seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - self.elapsed()

    def limit(self, timeout: float) -> float:
        return min(timeout, max(self.left(), 30.0))

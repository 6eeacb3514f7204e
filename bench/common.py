"""What every bench shares: the --device flag, timing, the table, the JSON result file.

A bench is one script, `python -m bench.NAME [flags]` (tyro: a dataclass with a docstring per
field becomes the flags), that measures the alternatives side by side in one run, prints one
table with the ratios and writes `bench/results/NAME.json` (or `--out`). The JSON starts with
`date`, `commit`, `gpu` and the exact `command`, so every committed result says how to reproduce it;
docs/benchmarks.md has the current figure of every question.

    elapsed = timed(step, device="cuda", repeats=5)          # seconds per call, CUDA events on GPU
    print(table("packed vs padded", ["mode", "s", "x"], rows))
    write_result(result, out)
"""

from __future__ import annotations

import datetime as _dt
import io
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

Device = Literal["cpu", "cuda"]
"""Where a bench runs: the type of every bench's `device` field."""

RESULTS = Path("bench/results")
"""Where results go by default: bench/results/<question>.json."""

ROOT = Path(__file__).resolve().parents[1]
"""The repository root (where `git` finds the commit a result was measured at)."""

MODELS = {"tiny": "tiny-fullvocab", "3b": "qwen2.5-vl-3b", "7b": "qwen2.5-vl-7b"}
"""The benches' short model names and the policy/presets.py preset each stands for."""


def preset_name(model: str) -> str:
    """The preset of a bench's model name ("3b"), or the name itself if it is a preset already."""
    from policy.presets import get_preset

    name = MODELS.get(model, model)
    get_preset(name)
    return name


def param_counts(model) -> dict[str, int]:
    """Parameter counts: N_LM as the learner's MFU uses it (no input embedding), the whole model, vision."""
    from learner.metrics import lm_param_count

    return {
        "n_lm": lm_param_count(model),
        "n_total": sum(p.numel() for p in model.parameters()),
        "n_vision": sum(p.numel() for p in model.model.visual.parameters()),
    }


def exit_on_sigterm() -> None:
    """SIGTERM (a `timeout`) unwinds like an exception, so engines and child processes get closed."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def images(count: int, side: int, seed: int = 0) -> list[tuple[bytes, object]]:
    """`count` distinct side x side images of a few random circles: (PNG bytes, PIL image) each."""
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    out = []
    for _ in range(count):
        image = Image.new("RGB", (side, side), tuple(rng.randrange(256) for _ in range(3)))
        draw = ImageDraw.Draw(image)
        for _ in range(rng.randint(1, 5)):
            x, y, r = rng.randrange(side), rng.randrange(side), rng.randint(side // 16, side // 4)
            draw.ellipse((x - r, y - r, x + r, y + r), fill=tuple(rng.randrange(256) for _ in range(3)))
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        out.append((buf.getvalue(), image))
    return out


def check_device(device: str) -> str:
    """`device` if it can run here; a clear error for cuda without a GPU or an unknown name."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, not {device!r}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: no CUDA GPU is visible here; run with --device cpu")
    return device


def timed(fn: Callable[[], Any], device: str = "cpu", repeats: int = 5, warmup: int = 1) -> list[float]:
    """Seconds per call of `fn`, `repeats` times after `warmup` calls.

    On cuda each call is bracketed by CUDA events (the GPU's own clock, queued work included);
    on cpu by time.perf_counter.
    """
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        import torch

        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def median(values: Sequence[float]) -> float:
    """The median of `values` (what every bench reports over repeats)."""
    return float(statistics.median(values))


def ratio(a: float, b: float) -> float | None:
    """a / b, or None when b is zero (a bench never divides by zero in a table)."""
    return a / b if b else None


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    return str(value)


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any] | dict]) -> str:
    """The bench table as text (rich); rows are sequences or dicts keyed by column name."""
    from rich.console import Console
    from rich.table import Table

    t = Table()
    for i, name in enumerate(columns):
        t.add_column(name, justify="left" if i == 0 else "right")
    for row in rows:
        values = [row.get(c) for c in columns] if isinstance(row, dict) else list(row)
        t.add_row(*(_cell(v) for v in values))
    buffer = io.StringIO()
    Console(file=buffer, width=200, force_terminal=False, color_system=None).print(t)
    return title + "\n" + buffer.getvalue().rstrip()


def result_path(*parts: str) -> Path:
    """The default result file of a question: bench/results/<parts joined by _>.json, each part cut to
    lower-case letters, digits and "_" ("learner_step", "qwen3-vl-8b" -> learner_step_qwen3_vl_8b.json)."""
    name = "_".join(re.sub(r"[^a-z0-9]+", "_", Path(p).name.lower()).strip("_") for p in parts if p)
    return RESULTS / f"{name}.json"


def machine() -> dict:
    """Where the numbers come from: host, CPUs, Python, torch and the GPU if any."""
    info = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def gpu_name(info: dict | None = None) -> str:
    """The GPU model the numbers come from, or "CPU: N-core <arch>" where none was used."""
    info = machine() if info is None else info
    return info.get("gpu") or f"CPU: {info.get('cpus') or os.cpu_count()}-core {platform.machine()}"


def git_commit() -> str | None:
    """The checkout's commit (short hash, "-dirty" with uncommitted changes to tracked files), or None
    outside a git checkout."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return None
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def provenance(command: str | list[str], info: dict | None = None, date: str | None = None) -> dict:
    """The four keys a result file starts with: `date` (ISO 8601, UTC), `commit`, `gpu` and the exact
    `command` (a list where several commands made one file, e.g. runs merged)."""
    return {
        "date": date or _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "gpu": gpu_name(info),
        "command": command,
    }


def write_result(result: dict, out: str | Path) -> Path:
    """Write `result` as JSON to `out` after its provenance: date, commit, GPU, command, machine."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    info = machine()
    command = shlex.join(["python", "-m", _module_name(), *sys.argv[1:]])
    record = {**provenance(command, info), "machine": info, **result}
    out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"wrote {out}")
    return out


def _module_name() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None and spec.name else Path(sys.argv[0]).stem

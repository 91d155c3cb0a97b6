"""The machine and software a run measured: device choice and name, versions, git commit."""

from __future__ import annotations

import datetime
import importlib
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def pick_device(name: str = "auto") -> torch.device:
    """``auto``: CUDA when present, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} ({os.cpu_count()} cpus, {platform.machine()})"


def results_slug(device: torch.device) -> str:
    """Folder name under ``bench/results/`` for this machine type, e.g. ``cpu-x86_64-2core``."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu-{platform.machine()}-{os.cpu_count()}core"
    return re.sub(r"[^a-z0-9_]+", "-", name.lower()).strip("-")


def _version(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except Exception:  # noqa: BLE001 - an optional package that fails to import is just absent
        return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], capture_output=True, text=True, cwd=REPO, check=True, timeout=10
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def write_json(doc: dict, name: str, out) -> Path:
    """Write ``doc`` as ``<out>/<name>.json`` (``out`` made if missing); returns the path."""
    path = Path(out) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    print(f"# wrote {path}")
    return path


def write_results(doc: dict, name: str, out, save_results: bool, plot) -> Path:
    """Write ``doc`` as ``<name>.json`` and ``plot(doc, path)`` as ``<name>.png`` under ``out``,
    or under ``bench/results/<device>/`` with ``save_results``; returns the folder."""
    folder = Path(out)
    if save_results:
        folder = Path(__file__).parent / "results" / doc["env"]["results_slug"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(doc, indent=1))
    plot(doc, folder / f"{name}.png")
    print(f"# wrote {folder / (name + '.json')} and {name}.png")
    return folder


def environment(device: torch.device) -> dict:
    """Device name, versions and commit, recorded in every JSON a run writes."""
    dirty = _git("status", "--porcelain", "--", "rfattn", "kernels", "bench")
    return {
        "device": device_name(device),
        "device_type": device.type,
        "results_slug": results_slug(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "flash_attn": _version("flash_attn"),
        "performer_pytorch": _version("performer_pytorch"),
        "rfattn": _version("rfattn"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(dirty) if dirty is not None else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }

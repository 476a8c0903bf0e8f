"""Metrics out: JSON Lines in the run directory, a console line per step, optional TensorBoard.

Every record is one JSON object: {"kind": "sft" | "train" | "eval", "step": n, "time": unix
seconds, <metric name>: value, ...}. Train metrics keep the components' names (`rollout/...`,
`batch/...`, `dynamic_sampling/...`, `episodes/...`, `credit/...`, `distill/...` from the rollouts, `train/...` from the
trainer, `time/...` and `memory/...` from the loop); eval metrics are `eval/...`; SFT metrics `sft/...`. Console
lines go through `tqdm.write` so they do not fight the progress bar.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch
from tqdm import tqdm

from ..rollouts.metrics import RewardComponentSeries

METRICS_FILE = "metrics.jsonl"  # in a run directory


class LoggingConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Where a run's metrics go ([logging] in a config)."""

    console: bool = True  # a metrics line per `every_steps` steps
    # Metrics the env reports (its info["metrics"]) shown on the console lines, the progress bar and the
    # before/after summary, in this order; every metric is logged and plotted either way.
    headline_metrics: list[str] = msgspec.field(default_factory=lambda: ["accuracy"])
    every_steps: int = 1
    progress_bar: bool = True
    jsonl: bool = True  # metrics.jsonl in the run dir
    tensorboard: bool = False  # needs the tensorboard package
    record_training: bool = False  # write every training episode under trajectories/

    def __post_init__(self) -> None:
        if self.every_steps < 1:
            raise ValueError(f"logging.every_steps must be >= 1, got {self.every_steps}")


class MetricsWarning(UserWarning):
    """Lines of a metrics.jsonl that are not records were skipped."""


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every whole record of a metrics.jsonl: a JSON object with an integer "step". A torn last
    line (a crash mid-write) is skipped silently; any other line that is not a record is skipped
    with one MetricsWarning naming the lines (plot and --resume index records by step)."""
    records: list[dict[str, Any]] = []
    path = Path(path)
    if not path.is_file():
        return records
    lines = path.read_text().splitlines()
    skipped = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if lineno < len(lines):
                skipped.append(lineno)
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, int) and not isinstance(step, bool):
            records.append(record)
        else:
            skipped.append(lineno)
    if skipped:
        warnings.warn(
            f"{path}: skipped line{'s' if len(skipped) > 1 else ''} {', '.join(map(str, skipped))}: "
            'not a metrics record (a JSON object with an integer "step")',
            MetricsWarning,
            stacklevel=2,
        )
    return records


def truncate_metrics(path: Path, last_step: int, keep_sft: bool = True) -> None:
    """Drop train/eval records after `last_step` (steps a resumed run will redo), and the SFT
    records unless `keep_sft` (an SFT phase that will be redone)."""
    kept = [
        r
        for r in read_metrics(path)
        if (keep_sft if r.get("kind") == "sft" else int(r.get("step", 0)) <= last_step)
    ]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    tmp.replace(path)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no nan/inf; keep them visible as strings
    return value


class MetricsLog:
    """Writes records (rank 0 only: other ranks pass enabled=False and everything is a no-op)."""

    def __init__(
        self, config: LoggingConfig, metrics_file: Path, tensorboard_dir: Path, enabled: bool = True
    ):
        self.config = config
        self.enabled = enabled
        self._file = metrics_file.open("a") if enabled and config.jsonl else None
        # per kind of record: its reward components so far, each record gets them all (a resumed
        # run's from the records it keeps)
        self._components: dict[str, RewardComponentSeries] = {}
        if enabled and metrics_file.is_file():
            for record in read_metrics(metrics_file):
                self._series(str(record.get("kind"))).fill(record)
        self._tensorboard = None
        if enabled and config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # checked at startup (load.py)

            self._tensorboard = SummaryWriter(str(tensorboard_dir))

    def _series(self, kind: str) -> RewardComponentSeries:
        return self._components.setdefault(kind, RewardComponentSeries())

    def log(self, kind: str, step: int, metrics: Mapping[str, Any]) -> None:
        """One record; a reward component an earlier record of this kind had is 0.0 here when
        the batch lacks it (`RewardComponentSeries`)."""
        if not self.enabled:
            return
        metrics = self._series(kind).fill(metrics)
        if self._file is not None:
            record = {"kind": kind, "step": step, "time": time.time(), **metrics}
            self._file.write(json.dumps({k: _finite(v) for k, v in record.items()}) + "\n")
            self._file.flush()
        if self._tensorboard is not None:
            for name, value in metrics.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    tag = name if "/" in name else f"{kind}/{name}"
                    self._tensorboard.add_scalar(tag, value, step)
            self._tensorboard.flush()

    def print(self, line: str) -> None:
        if self.enabled and self.config.console:
            tqdm.write(line)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None


def peak_memory_metrics(device: torch.device) -> dict[str, float]:
    """The process's memory high-water marks so far, in GiB: `memory/host_peak_gib` (the peak
    resident set, VmHWM; Linux only) and, on a CUDA device, `memory/device_peak_gib` (the most
    torch has had allocated on it, `torch.cuda.max_memory_allocated`)."""
    out: dict[str, float] = {}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    out["memory/host_peak_gib"] = int(line.split()[1]) / 2**20  # kB
    except OSError:
        pass
    if device.type == "cuda":
        out["memory/device_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def format_metric(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _tokens(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / 1000:.1f}k" if n >= 1000 else f"{n:.0f}"


def display_name(metric: str) -> str:
    """`tool_calls` -> `tool calls`: how the console lines name a metric."""
    return metric.replace("_", " ")


def _headline(m: Mapping[str, float], prefix: str, names: Sequence[str], spec: str) -> str:
    return "".join(f" {display_name(n)} {format_metric(m.get(prefix + n), spec)}" for n in names)


def train_line(step: int, total: int, m: Mapping[str, float], headline: Sequence[str] = ()) -> str:
    """step, reward, the `headline` env metrics, loss, entropy, clip fractions, KL to the sampler,
    grad norm, tokens, and the time split rollout/train/sync."""
    g = m.get
    skipped = "  SKIPPED (non-finite)" if g("train/skipped") else ""
    return (
        f"step {step:>{len(str(total))}}/{total}"
        f"  reward {format_metric(g('rollout/reward_mean'), '.3f')}{_headline(m, 'rollout/', headline, '.2f')}"
        f" | loss {format_metric(g('train/loss'), '+.4f')} ent {format_metric(g('train/entropy'), '.3f')}"
        f" clip {format_metric(g('train/clip_frac_low'), '.3f')}/{format_metric(g('train/clip_frac_high'), '.3f')}"
        f" kl {format_metric(g('train/sampler_kl_k3'), '.1e')} gnorm {format_metric(g('train/grad_norm'), '.2f')}"
        f" | tok {_tokens(g('batch/tokens'))} groups {format_metric(g('batch/groups'), '.0f')}"
        f" | rollout {format_metric(g('time/rollout_s'), '.1f')}s train {format_metric(g('time/train_s'), '.1f')}s"
        f" sync {format_metric(g('time/sync_s'), '.2f')}s{skipped}"
    )


def eval_line(label: str, m: Mapping[str, float], headline: Sequence[str] = ()) -> str:
    """The `headline` env metrics, reward, turns, episodes and time of one eval."""
    g = m.get
    return (
        f"eval {label}:{_headline(m, 'eval/', headline, '.3f')}"
        f" reward {format_metric(g('eval/reward_mean'), '.3f')} turns {format_metric(g('eval/turns_mean'), '.2f')}"
        f" ({format_metric(g('eval/episodes'), '.0f')} episodes, {format_metric(g('eval/time_s'), '.1f')}s)"
    )


def sft_line(step: int, total: int, m: Mapping[str, float]) -> str:
    g = m.get
    return (
        f"sft {step:>{len(str(total))}}/{total}  loss {format_metric(g('sft/loss'), '.4f')}"
        f" token acc {format_metric(g('sft/token_accuracy'), '.3f')} gnorm {format_metric(g('sft/grad_norm'), '.2f')}"
        f" lr {format_metric(g('sft/lr'), '.1e')} ({format_metric(g('sft/step_time_s'), '.2f')}s)"
    )

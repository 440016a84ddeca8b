"""A run directory: config, metrics JSONL, TensorBoard events (W&B too: furlong.metrics.wandb_log),
checkpoints and the phase record.

Everything a killed run needs to continue is here: `state.json` says which phases finished (with
their results) and which checkpoint is the last complete one. Files are replaced atomically.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

import yaml


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class MetricsSink(Protocol):
    def log(self, phase: str, step: int, metrics: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def metrics_row(*parts: dict) -> dict:
    """One metrics row from the parts each stage reports; a key two parts both write is an error, not a
    silent overwrite (the row would hold whichever came last)."""
    row: dict = {}
    for part in parts:
        twice = row.keys() & part.keys()
        if twice:
            raise ValueError(f"metrics row: {sorted(twice)} written by two parts")
        row.update(part)
    return row


class RunDir:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.ckpt_root = self.path / "checkpoints"
        self._tb = None
        self.sinks: list[MetricsSink] = []  # more places each metrics row goes (W&B)

    @classmethod
    def create(cls, path: Path, config: dict, checkout: Path | None = None) -> RunDir:
        """`checkout` is the furlong checkout the run is made from: paths inside it (the bundled tasks,
        recipes) are found again under a moved or fresh clone when the run is resumed there."""
        if (path / "state.json").exists():
            raise FileExistsError(f"{path} already holds a run; continue it with --resume {path}")
        path.mkdir(parents=True, exist_ok=True)
        run = cls(path)
        atomic_write(path / "config.yaml", yaml.safe_dump(config, sort_keys=False))
        state: dict[str, Any] = {"phases": {}, "last_checkpoint": None, "created": time.time()}
        if checkout is not None:
            state["checkout"] = str(checkout)
        run.save_state(state)
        return run

    @classmethod
    def open(cls, path: Path) -> RunDir:
        if not (path / "state.json").exists():
            raise FileNotFoundError(f"{path} is not a furlong run directory (no state.json)")
        return cls(path)

    def config(self) -> dict:
        return yaml.safe_load((self.path / "config.yaml").read_text())

    def relocated_config(self, checkout: Path) -> tuple[dict, list[str]]:
        """The config with every path that lay inside the checkout the run was made from, and is gone
        now, moved to the same place under `checkout` (where it exists there); with the keys moved.
        A path outside that checkout is kept as it is: it names the user's own files."""
        config, moved = self.config(), list[str]()
        old = self.state().get("checkout")
        if old and Path(old) != checkout:
            _relocate(config, Path(old), checkout, "", moved)
        return config, moved

    def state(self) -> dict:
        return json.loads((self.path / "state.json").read_text())

    def save_state(self, state: dict) -> None:
        atomic_write(self.path / "state.json", json.dumps(state, indent=1))

    def phase(self, name: str) -> Any | None:
        return self.state()["phases"].get(name)

    def finish_phase(self, name: str, result: Any) -> None:
        state = self.state()
        state["phases"][name] = result
        self.save_state(state)

    # -- metrics --------------------------------------------------------------------------------
    def log(self, phase: str, step: int, metrics: dict[str, float]) -> None:
        row = {"phase": phase, "step": step, "time": time.time(), **metrics}
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        tb = self._writer()
        if tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    tb.add_scalar(f"{phase}/{key}", value, step)
            tb.flush()
        for sink in self.sinks:
            sink.log(phase, step, metrics)

    def _writer(self):
        if self._tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # TensorBoard is optional; the JSONL has everything
                self._tb = False
                return None
            self._tb = SummaryWriter(str(self.path / "tb"))
        return self._tb or None

    def drop_metrics_after(self, phase: str, step: int) -> None:
        """On resume: rows the killed run logged after its last checkpoint are redone, so drop them."""
        path = self.path / "metrics.jsonl"
        if not path.exists():
            return
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        keep = [r for r in rows if not (r["phase"] == phase and r["step"] > step)]
        atomic_write(path, "".join(json.dumps(r) + "\n" for r in keep))

    def metrics(self, phase: str | None = None) -> list[dict]:
        path = self.path / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return [r for r in rows if phase is None or r["phase"] == phase]

    # -- checkpoints ----------------------------------------------------------------------------
    def checkpoint_dir(self, name: str) -> Path:
        return self.ckpt_root / name

    def record_checkpoint(self, name: str, step: int) -> None:
        """Marks `name` (already written atomically) as the newest complete checkpoint, and drops the older one."""
        state = self.state()
        previous = state["last_checkpoint"]
        state["last_checkpoint"] = {"name": name, "step": step}
        self.save_state(state)
        if previous and previous["name"] != name:
            shutil.rmtree(self.checkpoint_dir(previous["name"]), ignore_errors=True)

    def close(self) -> None:
        if self._tb:
            self._tb.close()
        for sink in self.sinks:
            sink.close()


def _relocate(node: dict, old: Path, new: Path, prefix: str, moved: list[str]) -> None:
    for key, value in node.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            _relocate(value, old, new, f"{name}.", moved)
        elif isinstance(value, str) and value.startswith(f"{old}/") and not Path(value).exists():
            there = new / Path(value).relative_to(old)
            if there.exists():
                node[key] = str(there)
                moved.append(f"{name}: {value} -> {there}")

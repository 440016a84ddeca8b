"""Weights & Biases beside metrics.jsonl and TensorBoard (`train.log.wandb`): every row a run logs, each
numeric key as `<phase>/<key>` (TensorBoard's tag; `rl/reward_mean` is the reward_mean of a metrics.jsonl
row of phase rl), against the phase's own step axis `<phase>/step`.

wandb is imported only when this is built, i.e. only when enabled. The W&B run's id is kept in the run
directory, so `--resume` continues the same W&B run; the rows a killed run logged after its last
checkpoint are logged again when redone (metrics.jsonl drops the first copy; W&B keeps both).
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any, Literal

ID_FILE = "wandb-run-id"  # in the run directory


class WandbLog:
    def __init__(
        self, run_path: Path, project: str, mode: Literal["offline", "online"], directory: Path | None, config: dict
    ):
        import wandb  # only when enabled: a run without W&B never pays its import (~2 s)

        id_file = Path(run_path) / ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(6)
        id_file.write_text(run_id)
        root = Path(directory or run_path)
        root.mkdir(parents=True, exist_ok=True)
        # console off: wandb must not wrap stdout, whose last line is the run's summary JSON
        settings = wandb.Settings(console="off", silent=True, disable_git=True, save_code=False, x_disable_stats=True)
        self.run = wandb.init(
            project=project,
            mode=mode,
            dir=str(root),
            id=run_id,
            resume="allow",
            name=Path(run_path).name,
            config=config,
            settings=settings,
        )
        self._phases: set[str] = set()

    def log(self, phase: str, step: int, metrics: dict[str, Any]) -> None:
        if phase not in self._phases:
            self._phases.add(phase)
            self.run.define_metric(f"{phase}/step", hidden=True)
            self.run.define_metric(f"{phase}/*", step_metric=f"{phase}/step")
        row = {f"{phase}/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}
        self.run.log({**row, f"{phase}/step": step})

    @property
    def files(self) -> Path:
        """The W&B run's own directory (offline: `offline-run-*`, holding its `.wandb` file)."""
        return Path(self.run.dir).parent

    def close(self) -> None:
        self.run.finish()

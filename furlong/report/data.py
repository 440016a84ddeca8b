"""What a report reads from a run directory, finished or still running."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from furlong.metrics.episodes import FILENAME, read_jsonl


@dataclass(frozen=True)
class RunData:
    path: Path
    config: dict
    state: dict
    summary: dict | None  # None while the run is in progress (or was killed)
    rl_rows: list[dict]  # one metrics row per RL step, in step order
    episodes: list[dict]  # every record of episodes.jsonl ([] for runs from before it existed)

    @property
    def name(self) -> str:
        return self.path.name

    def phase_episodes(self, phase: str | None = None) -> list[dict]:
        return [e for e in self.episodes if phase is None or e.get("phase") == phase]

    def batch_episodes(self) -> list[dict]:
        """RL episodes of the batches trained: a record's `step` is the step that settled it (in async mode
        often later than `plan_step`); groups dropped as stale at that step (`in_batch` false) left out."""
        return [e for e in self.phase_episodes("rl") if e.get("in_batch", True)]

    def trained_version(self, step: int) -> int | None:
        """The version a step's episodes were trained at (their lag is measured against it)."""
        row = self.rows_by_step().get(step)
        return None if row is None or "version" not in row else int(row["version"]) - int(bool(row.get("updated")))

    def rows_by_step(self) -> dict[int, dict]:
        return {int(r["step"]): r for r in self.rl_rows}


def load_run(path: Path) -> RunData:
    """Raises FileNotFoundError (one line) for a directory that is not a furlong run."""
    path = Path(path)
    state_file = path / "state.json"
    if not state_file.is_file():
        raise FileNotFoundError(f"{path} is not a furlong run directory (no state.json)")
    try:
        state = json.loads(state_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{state_file} is not valid JSON ({exc.msg}): not a readable furlong run") from exc
    config_file, summary_file = path / "config.yaml", path / "summary.json"
    config = yaml.safe_load(config_file.read_text()) if config_file.exists() else {}
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else None
    rows: dict[int, dict] = {}
    for row in read_jsonl(path / "metrics.jsonl"):
        if row.get("phase") == "rl" and isinstance(row.get("step"), int):
            rows[row["step"]] = row  # a step logged twice (an older resume) counts once, the last time
    return RunData(
        path=path,
        config=config or {},
        state=state,
        summary=summary,
        rl_rows=[rows[s] for s in sorted(rows)],
        episodes=read_jsonl(path / FILENAME),
    )

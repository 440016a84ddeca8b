"""`RUN_DIR/episodes.jsonl`: one line per finished episode (RL steps and held-out evals alike).

Eval lines are appended and flushed as episodes finish; RL lines when their group settles (is trained,
filtered or dropped as stale), with the step that settled it, since in async mode that is only known then.
A killed run keeps what it wrote; on resume the lines of steps (or evals) that are redone are dropped
first, so no episode is recorded twice.
Readers skip a torn last line (a run killed, or still running, mid-write).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from furlong.timing import PARTS

if TYPE_CHECKING:  # the report reads records without importing the agent (and its model stack)
    from furlong.agent.episode import Episode

FILENAME = "episodes.jsonl"
COMPONENTS = (*PARTS, "other")  # the timing breakdown, in the order plots stack it


def episode_record(e: Episode, phase: str, step: int | None) -> dict:
    """`step`: the step the record belongs to (for RL, the one that settled the episode)."""
    t = e.timing
    # version_first/last: the oldest and newest weight version among its sampled tokens (sample lag is
    # measured from the oldest)
    last = max((v for v, m in zip(e.token_weight_versions, e.loss_mask) if m), default=None)
    return {
        "phase": phase,
        "step": step,
        "task": e.task_id,
        "family": e.family,
        "group": e.group_id,
        "attempt": e.attempt,
        "sample": e.sample_id,
        "status": e.status,
        "reward": e.reward,
        "turns": e.turns,
        "version_first": e.oldest_version,
        "version_last": last,
        "tokens_prompt": e.prompt_len,
        "tokens_response": e.response_len,
        "tokens_total": len(e.tokens),
        "response_sha": e.response_sha,
        "time": {k: getattr(t, k) for k in COMPONENTS},
        "seconds": t.total,
        "start": t.started_at,
        "end": t.ended_at,
        "error": e.error,  # what went wrong: for an infra_error (never scored) the only trace of why
        "traceback": e.traceback,  # where an exception decided the outcome: where it was raised, with its causes
        "tampered_paths": list(e.tampered_paths),  # furlong.tasks.integrity: what the agent changed that tests run
        "integrity_checked": e.integrity_checked,  # false: its reward was not checked against tampering (Guarantees)
        "rewards": dict(e.rewards),  # the reward's parts: the tests' (or a Python environment's steps') and
        # each reward function's (train.env.rewards)
        "steps": [s.to_json() for s in e.steps],  # a multi-step task's steps that ran (Harbor's [[steps]])
        "receipts": [r.to_json() for r in e.receipts],  # what its reward was computed from (furlong.tasks.receipt)
        "gateway": None if e.gateway is None else asdict(e.gateway),  # a harness's requests, tito, rewrites
        "distill": None if e.distill is None else e.distill.to_json(),  # train.distill: what the teacher made of it
        "routes": _routes_summary(e),  # MoE routing replay: the engine's recorded experts (the tensor stays in memory)
    }


def _routes_summary(e: Episode) -> dict | None:
    if e.routes is None:
        return None
    _, layers, top_k = e.routes.shape
    return {"layers": layers, "top_k": top_k, "tokens": int((e.routes >= 0).all(-1).all(-1).sum())}


class EpisodeLog:
    """Appends one record per finished episode of a phase, under the step the episode was planned for."""

    def __init__(self, run_path: Path, phase: str):
        self.path, self.phase = Path(run_path) / FILENAME, phase

    def __call__(self, episode: Episode) -> None:
        self.write([episode_record(episode, self.phase, episode.step)])

    def write(self, records: list[dict]) -> None:
        with open(self.path, "a") as f:  # one write: a kill leaves at most one torn last line
            f.write("".join(json.dumps(r) + "\n" for r in records))
            f.flush()


def read_jsonl(path: Path) -> list[dict]:
    """Every complete line; a torn or garbled line (a write cut by a kill) is skipped, not fatal."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def drop_episodes_after(run_path: Path, phase: str, step: int) -> None:
    """On resume: the records of `phase` past `step` (all of them for step -1, or an eval phase that
    restarts) belong to episodes that will run again."""
    path = Path(run_path) / FILENAME
    if not path.exists():
        return
    keep = [
        r for r in read_jsonl(path) if not (r.get("phase") == phase and (r.get("step") is None or r["step"] > step))
    ]
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
    os.replace(tmp, path)

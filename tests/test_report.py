"""Per-episode records, per-step diagnostics and `furlong report`, on one short real run (smoke recipe,
4 RL steps: conftest's smoke_run, shared with other modules), plus unit tests of the statistics and the
diagnostics formulas."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from furlong.agent.episode import Episode
from furlong.metrics.diagnostics import group_wait, kv_held_tool_wait, sample_lag
from furlong.metrics.episodes import EpisodeLog, drop_episodes_after, read_jsonl
from furlong.metrics.stats import bootstrap_diff, bootstrap_mean, bootstrap_ratio
from furlong.timing import EpisodeTiming

ROOT = Path(__file__).resolve().parents[1]
STEPS, TASKS, GROUP, HELDOUT = 4, 2, 2, 2  # the smoke recipe's run (conftest's smoke_run, shared)
SECTIONS = ("Receipts", "Reward and pass rate per step", "Per-family pass rate", "Episode time breakdown", "Sample lag",
            "Group wait, KV held", "Projection: faster inference")
PLOTS = ("reward_per_step.png", "family_pass_rate.png", "time_breakdown.png", "sample_lag_hist.png",
         "lag_by_length.png", "fractions.png")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "furlong.cli", *args], capture_output=True, text=True,
                          timeout=900, cwd=ROOT)


@pytest.fixture(scope="module")
def run_dir(smoke_run: Path) -> Path:
    return smoke_run


def _rl_rows(run: Path) -> list[dict]:
    return [r for r in read_jsonl(run / "metrics.jsonl") if r["phase"] == "rl"]


def test_every_episode_is_recorded_once_with_its_step_and_timing(run_dir: Path):
    records = read_jsonl(run_dir / "episodes.jsonl")
    by_phase = Counter(r["phase"] for r in records)
    assert by_phase == {"rl": STEPS * TASKS * GROUP, "eval_before": 2 * HELDOUT, "eval_after": 2 * HELDOUT}
    rl = [r for r in records if r["phase"] == "rl"]
    assert len({(r["step"], r["group"], r["sample"]) for r in rl}) == len(rl)
    assert Counter(r["step"] for r in rl) == {s: TASKS * GROUP for s in range(STEPS)}
    summary = json.loads((run_dir / "summary.json").read_text())
    for phase in by_phase:  # statuses add up to what the phase itself counted
        counted = Counter(r["status"] for r in records if r["phase"] == phase)
        assert {k: v for k, v in summary["status"][phase].items() if v} == dict(counted), phase
    for r in records:  # every scored episode has its receipt: one run of one task's tests, in a bwrap sandbox
        assert r["reward"] is None or [(x["backend"], x["tamper_checked"]) for x in r["receipts"]] == [("bwrap", True)]
        assert r["family"] in ("count-in-file", "number-stats") and r["task"]
        assert 0 < r["start"] <= r["end"] and abs((r["end"] - r["start"]) - r["seconds"]) < 0.05
        assert r["seconds"] == pytest.approx(sum(r["time"].values()))
        assert r["tokens_total"] >= r["tokens_prompt"] + r["tokens_response"] and r["tokens_response"] > 0
        assert r["version_first"] <= r["version_last"]
    metrics = {r["step"]: r for r in _rl_rows(run_dir)}
    for s in range(STEPS):  # the records of a step are the episodes its metrics describe
        assert metrics[s]["episodes"] == sum(r["step"] == s for r in rl)


def test_step_diagnostics_are_logged_in_range(run_dir: Path):
    rows = _rl_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(STEPS))
    for row in rows:
        for key in ("group_wait_frac", "kv_held_tool_wait_frac", "engine_idle_frac", "trainer_idle_frac"):
            assert 0.0 <= row[key] <= 1.0, (key, row[key])
        assert 0 <= row["sample_lag_mean"] <= row["sample_lag_max"]
        assert all(row[f"sample_lag_mean_q{q}"] >= 0 for q in range(1, 5))
        fams = [k for k in row if k.startswith("pass_rate/")]
        assert fams and all(0.0 <= row[k] <= 1.0 for k in fams)
        # engine busy time is real: generation took part of the step, but not all of it
        assert row["engine_idle_frac"] < 1.0 and row["time_model_wait"] > 0


def _check_report(out: Path, plots: tuple[str, ...] = PLOTS) -> str:
    from matplotlib.image import imread

    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    for name in plots:
        image = imread(out / name)  # decodes: a real PNG
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, name
        assert f"({name})" in md
    assert page.count("data:image/png;base64,") == len(plots) and "src=\"http" not in page
    return md


def test_report_writes_every_plot_and_table(run_dir: Path, tmp_path: Path):
    began = time.perf_counter()
    res = _cli("report", str(run_dir), "--out", str(tmp_path), "--project-inference-speedup", "8,32")
    seconds = time.perf_counter() - began
    assert res.returncode == 0, res.stderr
    md = _check_report(tmp_path)
    for section in SECTIONS:
        assert section in md, section
    assert "Not in this report" not in md  # a run with records and diagnostics supports every section
    assert "inference k x faster" in md and "Assumption:" in md and "| 32 |" in md
    assert seconds < 30, seconds


def test_report_on_a_run_cut_mid_line(run_dir: Path, tmp_path: Path):
    cut = tmp_path / "cut"
    shutil.copytree(run_dir, cut, ignore=shutil.ignore_patterns("checkpoints", "tb", "report"))
    (cut / "summary.json").unlink()  # as if still running
    for name in ("episodes.jsonl", "metrics.jsonl"):
        text = (cut / name).read_text()
        (cut / name).write_text(text[: len(text) - 40])  # the last line torn
    res = _cli("report", str(cut))
    assert res.returncode == 0, res.stderr
    md = _check_report(cut / "report")  # the last step's metrics row is torn: lags come from the others' episodes
    assert "in progress" in md and f"RL steps logged: {STEPS - 1} of {STEPS}" in md
    n_full = len(read_jsonl(run_dir / "episodes.jsonl"))
    assert len(read_jsonl(cut / "episodes.jsonl")) == n_full - 1  # the torn line is skipped, the rest kept


def test_report_on_a_directory_that_is_not_a_run(tmp_path: Path):
    res = _cli("report", str(tmp_path))
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "not a furlong run directory" in res.stderr


def test_compare_a_run_with_itself(run_dir: Path, tmp_path: Path):
    res = _cli("report", "--compare", str(run_dir), str(run_dir), "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr
    md = (tmp_path / "report.md").read_text()
    m = re.search(r"Mean episode time A / B: ([\d.]+) \[([\d.]+), ([\d.]+)\]", md)
    assert m, md
    ratio, lo, hi = map(float, m.groups())
    assert ratio == 1.0 and lo < 1.0 < hi
    diffs = re.findall(r"^\| (\w+) \|.*\| (\S+) \[[^]]*\] \|$", md, re.M)
    assert [d for d, _ in diffs] == ["sandbox_start", "model_wait", "agent_commands", "verifier", "other", "total"]
    assert all(float(v) == 0 for _, v in diffs)  # every component's difference is 0, with its interval


def test_bootstrap_matches_the_normal_approximation_on_a_known_case():
    x = [0.0] * 50 + [1.0] * 50  # mean 0.5, standard error 0.05: 90% interval ~ 0.5 -/+ 1.645 * 0.05
    e = bootstrap_mean(x)
    assert e.value == 0.5 and e.n == 100
    assert abs(e.lo - 0.4178) < 0.015 and abs(e.hi - 0.5822) < 0.015
    assert bootstrap_mean(x) == e  # fixed seed: reproducible
    c = bootstrap_mean([2.0] * 7)
    assert (c.value, c.lo, c.hi) == (2.0, 2.0, 2.0)
    assert bootstrap_mean([]).text() == "n/a"
    r = bootstrap_ratio([2.0] * 5, [1.0] * 5)
    assert (r.value, r.lo, r.hi) == (2.0, 2.0, 2.0)
    d = bootstrap_diff(np.arange(100.0), np.arange(100.0) + 10)
    assert d.value == -10 and d.lo < -10 < d.hi


def _episode(group: int, start: float, end: float, tokens: int, tool_s: float, versions: list[int],
             sample: int = 0, step: int | None = None) -> Episode:
    mask = [0, *[1] * len(versions)]
    return Episode(task_id="t", group_id=group, step=step, sample_id=sample, prompt_len=1, tokens=tuple(range(tokens)),
                   loss_mask=tuple(mask + [0] * (tokens - len(mask))), rollout_logprobs=(0.0,) * tokens,
                   token_weight_versions=tuple([-1, *versions] + [-1] * (tokens - len(mask))), reward=1.0,
                   status="ok", timing=EpisodeTiming(agent_commands=tool_s, other=end - start - tool_s,
                                                     started_at=start, ended_at=end),
                   turns=1, family="f")


def test_diagnostics_formulas_on_known_episodes():
    a = _episode(1, 0.0, 10.0, 100, 5.0, [3, 4])
    b = _episode(1, 0.0, 4.0, 300, 0.0, [4], sample=1)
    assert group_wait([a, b]) == pytest.approx(6 / 20)  # b waits 6 s of the group's 2 x 10 s
    assert kv_held_tool_wait([a, b]) == pytest.approx(100 * 5 / (100 * 10 + 300 * 4))
    lag = sample_lag([a, b], trained_version=5)
    assert (lag["sample_lag_mean"], lag["sample_lag_max"]) == (1.5, 2.0)
    assert lag["sample_lag_mean_q1"] == 1.0  # b, the shorter episode, is the first quartile


def test_records_of_redone_steps_are_dropped_and_a_torn_line_is_skipped(tmp_path: Path):
    log = EpisodeLog(tmp_path, "rl")
    for step in range(3):
        log(_episode(step, 0.0, 1.0, 10, 0.0, [step], step=step))
    EpisodeLog(tmp_path, "eval_before")(_episode(0, 0.0, 1.0, 10, 0.0, [0]))
    with open(tmp_path / "episodes.jsonl", "a") as f:
        f.write('{"phase": "rl", "st')  # a kill mid-write
    assert [r.get("step") for r in read_jsonl(tmp_path / "episodes.jsonl")] == [0, 1, 2, None]
    drop_episodes_after(tmp_path, "rl", 0)  # resuming after the checkpoint of step 0
    assert [(r["phase"], r["step"]) for r in read_jsonl(tmp_path / "episodes.jsonl")] == [("rl", 0), ("eval_before", None)]
    drop_episodes_after(tmp_path, "eval_before", -1)  # an eval that restarts
    assert [r["phase"] for r in read_jsonl(tmp_path / "episodes.jsonl")] == ["rl"]

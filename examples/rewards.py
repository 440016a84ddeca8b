"""Reward functions, weighed in beside a task's tests or a Python environment's own reward.

    train:
      env:
        tests_weight: 0.8
        rewards:
          few_guesses: {python: "examples.rewards:few_guesses", weight: 0.2}
          concise: {python: "examples.rewards:within_budget", weight: 0.1, params: {budget: 64}}
          quick_pass: {python: "examples.rewards:passed_in_turns", weight: 0.1, params: {turns: 3}}
          report_written: {python: "examples.rewards:report_written", weight: 0.2}
          no_tmp_litter: {command: "test -z \\"$(ls -A /tmp)\\" && echo 1 || echo 0", weight: 0.1}

Each gets the finished episode (furlong.envs.rewards.EpisodeView) and returns a number; it must score an
episode where the agent did nothing (the failure rule: docs/environments.md). It also sees the tests' result
(`episode.tests`, `episode.passed`), the agent's tokens and turns (`episode.usage`) and its own entry's
`params`: one function serves several budgets.
"""

from __future__ import annotations

from furlong.envs.rewards import EpisodeView


def few_guesses(episode: EpisodeView) -> float:
    """For examples/guess_number.py: up to 1 for finding the number in few guesses (0 if not found)."""
    guesses = [s for s in episode.steps if s.tool == "guess"]
    if not guesses or guesses[-1].observation != "correct":
        return 0.0
    return 1.0 / len(guesses)


async def report_written(episode: EpisodeView) -> float:
    """For a Harbor task: 1 if the agent left a non-empty /app/report.txt. Async, as it reads the sandbox
    (as the verifier: the agent cannot reach what a reward function runs)."""
    res = await episode.sandbox.exec("test -s /app/report.txt", timeout_s=10)
    return 1.0 if res.exit_code == 0 else 0.0


def within_budget(episode: EpisodeView) -> float:
    """A length penalty: 1 within `params.budget` generated tokens, falling linearly to 0 at twice the budget."""
    budget = float(episode.params["budget"])
    over = max(0.0, episode.usage.generated_tokens - budget)
    return max(0.0, 1.0 - over / budget)


def passed_in_turns(episode: EpisodeView) -> float:
    """Only where the tests passed (`episode.passed`): 1 within `params.turns` model turns, less for more."""
    if not episode.passed:
        return 0.0
    return min(1.0, float(episode.params["turns"]) / max(1, episode.usage.turns))

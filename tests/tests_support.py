"""Small builders shared by tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from leftovers_probe import mounts

from furlong.agent.episode import AgentParams
from furlong.config import AgentConfig, RLConfig
from furlong.engine.base import Generation, SamplingParams
from furlong.model import TinySpec
from furlong.sandbox.runtime.cgroups import owner_pid
from furlong.tasks.loader import load_task
from furlong.tasks.model import Task
from furlong.train.trainer import GRPOConfig

# A model small enough that 40 GRPO steps with real sampling take seconds on two CPU cores (conftest's
# small_dir builds it once per module).
SMALL = TinySpec(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 intermediate_size=128, corpus_samples=500, stdlib_bytes=100_000)


def make_task(root: Path, name: str, instruction: str, test: str, solve: str = "true",
              agent_timeout: float = 60, verifier_timeout: float = 30) -> Task:
    d = root / name
    (d / "tests").mkdir(parents=True)
    (d / "solution").mkdir()
    (d / "task.toml").write_text(f"[agent]\ntimeout_sec = {agent_timeout}\n[verifier]\ntimeout_sec = {verifier_timeout}\n")
    (d / "instruction.md").write_text(instruction)
    (d / "tests" / "test.sh").write_text(test + "\n")
    (d / "solution" / "solve.sh").write_text(solve + "\n")
    return load_task(d)


# Plain GRPO, as the trainer tests measure it: no KL reference, no demonstration anchor, a constant lr,
# std-normalized advantages with negatives at full weight. Each test sets the train.rl keys it checks.
PLAIN_GRPO = {"lr": 1e-5, "kl_coef": 0.0, "sft_coef": 0.0, "lr_decay": "constant", "warmup_steps": 0,
              "normalize_std": True, "negative_weight": 1.0, "micro_batch_size": 8}


def grpo(seed: int = 0, **rl) -> GRPOConfig:
    """The trainer's settings from a train.rl node: PLAIN_GRPO with `rl`'s keys over it."""
    return GRPOConfig.of(RLConfig(**{**PLAIN_GRPO, **rl}), seed=seed)


def agent_params(**agent) -> AgentParams:
    """The agent loop's settings from a train.agent node with `agent`'s keys set."""
    return AgentParams.of(AgentConfig(**agent))


def subtree(pid: int) -> set[int]:
    """`pid` and every process below it, now (one that exits meanwhile is skipped)."""
    found, frontier = {pid}, [pid]
    while frontier:
        for children in Path(f"/proc/{frontier.pop()}/task").glob("*/children"):
            try:
                kids = {int(k) for k in children.read_text().split()}
            except OSError:
                continue
            frontier += list(kids - found)
            found |= kids
    return found


def alive(pid: int) -> bool:
    """Running and not a zombie (the container's init may reap orphans late)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def census() -> dict[str, set]:
    """What this process holds on the host, to compare before and after a test: its child processes, its
    fds, the sandbox cgroups it made (named for it: furlong.sandbox.runtime.cgroups.owner_tag), the mount table."""
    me = os.getpid()
    return {"processes": subtree(me) - {me}, "fds": set(os.listdir("/proc/self/fd")), "mounts": mounts(),
            "cgroups": {d for d, _, _ in os.walk("/sys/fs/cgroup") if owner_pid(Path(d).name) == me}}


def grown(before: dict[str, set], wait_s: float = 10.0) -> dict[str, set]:
    """What `census()` holds that `before` did not, once that is nothing or `wait_s` passed (a closed
    sandbox's processes and a closed connection's socket take a moment to go)."""
    deadline = time.monotonic() + wait_s
    while True:
        new = {k: v - before[k] for k, v in census().items()}
        if not any(new.values()) or time.monotonic() > deadline:
            return {k: v for k, v in new.items() if v}
        time.sleep(0.1)


def moved_weights(model_dir: Path, scale: float, seed: int) -> dict:
    """The model's weights with every tensor moved by noise (tied tensors stay one tensor)."""
    import torch

    from furlong.model.loading import load_model

    model = load_model(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model.state_dict()


def gpt2_teacher(out: Path, student_dir: Path, context: int) -> Path:
    """A GPT-2 teacher with the student's tokenizer and a `context`-position window: an episode longer than that
    makes its forward raise (IndexError in the position embedding), a real teacher failure."""
    import shutil

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=SMALL.vocab_size + 64, n_positions=context, n_embd=32, n_layer=1, n_head=2)
    torch.manual_seed(0)
    GPT2LMHeadModel(cfg).save_pretrained(out)
    for f in student_dir.iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            shutil.copy(f, out / f.name)
    return out


async def reference_generation(model_dir: Path, weights: dict, prompt: list[int], sampling):
    """What an in-process hf engine holding `weights` generates for `prompt`."""
    from furlong.engine.hf import HFEngine
    from furlong.model.loading import load_model

    engine = HFEngine(load_model(model_dir), eos_token_ids=())
    await engine.update_weights(weights, 0)
    try:
        return await engine.generate(prompt, sampling)
    finally:
        await engine.close()


class Background:
    """A `python -m furlong.cli` run started now and checked later, beside the tests that run meanwhile: CI's
    suite keeps about one of its two cores busy, and a run that mostly waits on one process (a vLLM start, a
    tiny model's steps) uses the other. stdout and stderr go to files beside `log` (a pipe that nobody reads
    could fill and stall the run)."""

    def __init__(self, log: Path, *args: str) -> None:
        self.args, self.log = [sys.executable, "-m", "furlong.cli", *args], log
        with log.with_suffix(".stdout").open("w") as out, log.with_suffix(".stderr").open("w") as err:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=err, start_new_session=True)

    def result(self, timeout_s: float = 1500) -> subprocess.CompletedProcess:
        """Waits for the run (killing it past `timeout_s`, as subprocess.run's timeout would)."""
        try:
            code = self.proc.wait(timeout=timeout_s)
        finally:
            self.stop()
        out, err = (self.log.with_suffix(s).read_text() for s in (".stdout", ".stderr"))
        return subprocess.CompletedProcess(self.args, code, out, err)

    def stop(self) -> None:
        """Kills the run and whatever it started (its own session), if it is still going."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class ScriptedTurns:
    """Test double for the *policy*: answers each turn with fixed sampled ids, recording its prompts."""

    def __init__(self, turns: list[list[int]]):
        self.turns, self.prompts = turns, []

    async def generate(self, input_ids, sampling: SamplingParams) -> Generation:
        self.prompts.append(list(input_ids))
        ids = tuple(self.turns[len(self.prompts) - 1])
        return Generation(output_ids=ids, logprobs=tuple(-0.5 for _ in ids), finish_reason="stop", weight_version=1,
                          token_weight_versions=tuple(1 for _ in ids), prompt_len=len(input_ids))


def routed_episodes(model, prompts: list[list[int]], samples: int, tokens: int) -> list:
    """`samples` single-turn episodes of each prompt from an hf engine over `model` that records MoE routes
    (Episode.routes), rewarded 1 / 0 alternately so every group has an advantage."""
    import asyncio

    from furlong.agent.episode import Episode, EpisodeTiming
    from furlong.engine.hf import HFEngine
    from furlong.model.moe import merge_routes

    async def main() -> list:
        async with HFEngine(model, record_routes=True, seed=0) as engine:
            return list(await asyncio.gather(*(
                engine.generate(p, SamplingParams(temperature=1.0, max_new_tokens=tokens, seed=1000 * g + i))
                for g, p in enumerate(prompts) for i in range(samples))))

    out = []
    for k, gen in enumerate(asyncio.run(main())):
        p, n = prompts[k // samples], len(gen.output_ids)
        out.append(Episode(
            task_id="t", group_id=k // samples, sample_id=k % samples, prompt_len=len(p), tokens=(*p, *gen.output_ids),
            loss_mask=(0,) * len(p) + (1,) * n, rollout_logprobs=(0.0,) * len(p) + gen.logprobs,
            token_weight_versions=(-1,) * len(p) + gen.token_weight_versions, reward=float(k % 2), status="ok",
            timing=EpisodeTiming(), turns=1, routes=merge_routes(None, gen.routes, len(p) + n)))
    return out

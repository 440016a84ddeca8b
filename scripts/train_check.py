"""`furlong train` on a device, end to end, one PASS/FAIL line per variant (run by scripts/gpu_check.sh).

    python -m scripts.train_check --model DIR [--device cuda|cpu] [--variants local,delta,ray,ray-shared,ray-join] [--work DIR]

Each variant trains scripts/gpu_env.py for three RL steps (scripts/train_check.yaml: no sandbox, a graded
reward, so every step trains) from the model taught first, in a few SFT steps on the device, to answer with
one of the environment's words and end its turn (an untrained model may never end one within the token
limit, and a cut-off reply scores 0 for every member of a group), and passes when the run finishes with no infra_error, every step updated the
weights (versions 1, 2, 3), the engine took each version (a sync time per step), and episodes were trained:

- local: the trainer (train.device) and the in-process hf engine (train.hf.device) on the device, weights
  copied tensor to tensor (train.sync.transport=direct);
- delta: the same, through the publisher's full/delta updates over HTTP to the engine's relay;
- ray: train.cluster=ray, colocated: one trainer actor and one engine actor sharing one GPU (0.5 each), on
  a local cluster the run starts;
- ray-shared: the same, the trainer actor handing its weights to the engine actor in place
  (train.sync.transport=shared: on a GPU, by CUDA IPC handle);
- ray-join: the same as ray on a cluster started first by `ray start --head` (scripts/ray_head.py), which the run
  joins (train.ray.address) and leaves up.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.ray_head import ray_head

ROOT = Path(__file__).resolve().parent.parent
STEPS = 3


def overrides(variant: str, device: str) -> list[str]:
    on_device = [f"train.device={device}", f"train.hf.device={device}"]
    if variant == "local":
        return on_device
    if variant == "delta":
        return [*on_device, "train.sync.transport=http", "train.sync.full_every=2"]
    if variant in ("ray", "ray-shared", "ray-join"):
        gpus = ["train.ray.trainer_gpus=0.5", "train.ray.engine_gpus=0.5"] if device == "cuda" else []
        shared = ["train.sync.transport=shared"] if variant == "ray-shared" else []
        return ["train.cluster=ray", f"train.device={device}", "train.ray.trainer_cpus=1",
                "train.ray.engine_cpus=1", *gpus, *shared]
    raise ValueError(f"unknown variant {variant!r} (expected local, delta, ray, ray-shared or ray-join)")


def teach(model_dir: Path, out: Path, device: str) -> Path:
    """`model_dir` after a few SFT steps on replies of one word of the environment, then end of turn."""
    from furlong.agent.episode import AgentParams
    from furlong.config import Config
    from furlong.model.chat import Message, assistant_ids, render_prompt_ids
    from furlong.model.loading import load_model, load_tokenizer
    from furlong.train.export import write_hf
    from furlong.train.sft import Demo, sft_train
    from scripts.gpu_env import WORDS

    tokenizer = load_tokenizer(model_dir)
    system = AgentParams.of(Config().train.agent).system_prompt
    demos = []
    for i, word in enumerate(WORDS):
        prompt = render_prompt_ids(tokenizer, [Message("system", system),
                                               Message("user", f"Reply with the single word {word}.")])
        answer = assistant_ids(tokenizer, Message("assistant", WORDS[(i * 3) % len(WORDS)]))  # not always right
        demos.append(Demo(word, tuple(prompt + answer), (0,) * len(prompt) + (1,) * len(answer)))
    model = load_model(model_dir).to(device)
    sft_train(model, demos * 4, epochs=4, lr=1e-3, batch_size=8, seed=0, pad_id=tokenizer.pad_token_id)
    return write_hf(model.cpu(), tokenizer, out)


def check(variant: str, model: Path, device: str, work: Path) -> str:
    if variant != "ray-join":
        return run_check(variant, model, device, work)
    with ray_head(num_cpus=2, num_gpus=int(device == "cuda")) as head:
        got = run_check(variant, model, device, work, (f"train.ray.address={head.address}",))
        if not head.up():
            raise RuntimeError("the run stopped the cluster it joined")
        return got


def run_check(variant: str, model: Path, device: str, work: Path, extra: tuple[str, ...] = ()) -> str:
    run_dir = work / f"run-{variant}"
    cmd = [sys.executable, "-m", "furlong.cli", "train", "--config", str(ROOT / "scripts/train_check.yaml"),
           f"train.model.path={model}", f"train.run_dir={run_dir}", *overrides(variant, device), *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise RuntimeError(f"furlong train exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("phase") == "rl"]
    errors = {phase: s["infra_error"] for phase, s in summary["status"].items() if s["infra_error"]}
    assert not errors, f"infra errors: {errors}"
    got = [r["version"] for r in rl]
    assert got == list(range(1, STEPS + 1)), (f"versions {got}; rl episodes {summary['rl_episodes']}, statuses "
                                              f"{summary['status']['rl']}, rewards {[r['reward_mean'] for r in rl]}")
    assert all(r["updated"] and r.get("sync_seconds", 0) > 0 for r in rl), "a step did not update or sync"
    trained = summary["rl_episodes"]["trained"]
    assert trained > 0, f"no episode trained: {summary['rl_episodes']}"
    sync = sum(r["sync_seconds"] for r in rl)
    return (f"{STEPS} steps, {trained} episodes trained, weights synced in {sync:.2f} s total, "
            f"run {seconds:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--variants", default="local,delta,ray,ray-shared,ray-join")
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="furlong-train-check-"))
    model = teach(args.model, work / "taught", args.device)
    failed = 0
    for variant in args.variants.split(","):
        name = f"train-{variant} furlong train ({variant}) on {args.device.upper()}"
        try:
            print(f"PASS {name}: {check(variant, model, args.device, work)}", flush=True)
        except Exception as exc:  # noqa: BLE001  # one FAIL line per variant, the details on stderr
            print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
            failed = 1
    return failed


if __name__ == "__main__":
    sys.exit(main())

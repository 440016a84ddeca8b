"""The control arm's reward for bench/prompts_rl.py: 0 for every completion, so GRPO's advantages are all 0
and an RL step trains only its KL penalty and its demonstration anchor (train.rl.sft_coef)."""


def no_signal(completion: str, row: dict) -> float:
    return 0.0

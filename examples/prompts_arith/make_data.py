"""Writes arith.jsonl, the bundled prompt dataset (docs/prompts.md): single-digit sums asked two ways.

    python examples/prompts_arith/make_data.py

Every pair (a, b) of 0..9 is asked as "What is a + b?" (kind `symbols`, with its `answer`: SFT shows it)
and as "What is a plus b?" (kind `words`, no answer: only the reward can teach it). The held-out split is
the `words` rows of 40 pairs drawn with a fixed seed; the other `words` rows are train rows RL learns from.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).with_name("arith.jsonl")
HELDOUT_PAIRS = 40


def rows() -> list[dict]:
    pairs = [(a, b) for a in range(10) for b in range(10)]
    held = set(random.Random(0).sample(pairs, HELDOUT_PAIRS))
    out = []
    for a, b in pairs:
        out.append({"prompt": f"What is {a} + {b}?", "a": a, "b": b, "kind": "symbols", "answer": str(a + b),
                    "split": "train"})
        out.append({"prompt": f"What is {a} plus {b}?", "a": a, "b": b, "kind": "words",
                    "split": "heldout" if (a, b) in held else "train"})
    return out


if __name__ == "__main__":
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    print(f"wrote {OUT}")

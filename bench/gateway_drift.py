"""Re-tokenization drift through the gateway: token-in/token-out (what the gateway records) against what a naive
proxy would train on (the final conversation rendered from text and tokenized again).

For every bundled task family (tasks/*/family.toml, its first train instance's instruction) and each tool-call
format (Hermes, Qwen3-Coder XML, Llama 3 JSON, harmony, Gemma 3's pythonic, GLM-4.5's, DeepSeek-V3.1's: the real
templates of furlong/model/templates/, on the tiny model with the format's control tokens added), one episode is driven
through the gateway's `/v1/chat/completions` by the real `openai` SDK, as a harness does: a first turn in which the
model writes a bash call in its format (the template's own rendering of the call, teacher-forced; its logprobs are
the model's), the tool result, then two turns the model samples (temperature 1, up to `--tokens` tokens each),
with a user turn between them. The same again on each model family that has a tool-call format
(furlong/model/families.py: its own tiny checkpoint and template), under `model_families`.

Per episode it records the gateway's `tito_mismatch_tokens` (must be 0) and, for a naive proxy (the conversation
as the harness resent it, rendered through the template in one piece and tokenized; each assistant turn is the
text its render adds):
  - the tokens of the re-tokenized sequence that differ from the stored ones, and the sampled turns whose
    tokens change;
  - the logprob error that would have entered the loss: the re-tokenized sequence scored with the model (as a
    trainer scores it), its tokens on each sampled turn's text against the rollout logprobs of what was sampled
    there: per turn, |sum of the re-tokenized turn's logprobs - sum of the sampled turn's|, and per token, on the
    tokens both share (aligned with difflib), |logprob difference|; the sampled tokens the re-tokenized turn does
    not have are counted.
The same scoring of the stored ids gives the floor (engine vs trainer numerics) for comparison.

    python bench/gateway_drift.py            # ~1.5-2.5 min here; writes bench/results/gateway_drift.json
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

import openai
import torch
from tokenizers import AddedToken

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from host_support import serve_in_thread
from provenance import finish, provenance

from furlong.config import DEFAULT_SYSTEM_PROMPT
from furlong.engine.base import Generation, SamplingParams
from furlong.engine.hf import HFEngine
from furlong.gateway.app import make_app
from furlong.gateway.policy import Policy
from furlong.gateway.trajectory import Segment, Trajectory
from furlong.model import init_tiny
from furlong.model.chat import Message, ToolCall, assistant_ids, render_text
from furlong.model.families import DEEPSEEK, GEMMA, GLM, init_family
from furlong.model.families import FAMILIES as MODEL_FAMILIES
from furlong.model.loading import load_model, load_tokenizer
from furlong.model.toolcall import FORMATS
from furlong.tasks.family import is_family_dir, load_family
from furlong.train.logprobs import logprobs_from_logits

TOKEN = "gateway-drift-token-0123456789"
TEMPLATES = ROOT / "furlong" / "model" / "templates"
# Per format: the template and the control tokens the family's real tokenizer has as single ids (Hermes: the tiny
# model's own template and tokens), as tests/test_toolcall_formats.py sets them up.
FORMAT_SETUP = {
    "hermes": (None, ()),
    "qwen3_coder": ("qwen3_coder.jinja", ()),
    "llama3_json": ("llama3_json.jinja", ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                          "<|eot_id|>", "<|eom_id|>", "<|python_tag|>")),
    "harmony": ("gpt_oss.jinja", ("<|startoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                                  "<|constrain|>", "<|return|>", "<|call|>")),
    "pythonic": ("gemma3.jinja", GEMMA),
    "glm45": ("glm4_5.jinja", GLM),
    "deepseek_v3": ("deepseek_v3.jinja", DEEPSEEK),
}
BOS = {"llama3_json": "<|begin_of_text|>", "pythonic": "<bos>", "deepseek_v3": DEEPSEEK[0]}  # the templates start so
BASH = {"type": "function", "function": {
    "name": "bash", "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}


def format_model(base: Path, name: str):
    """The tiny model and its tokenizer with `name`'s template and control tokens (new embedding rows)."""
    tok, model = load_tokenizer(base), load_model(base)
    fixture, special = FORMAT_SETUP[name]
    if fixture:
        tok = copy.deepcopy(tok)
        tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in special])
        if name in BOS:
            tok.bos_token = BOS[name]
        tok.chat_template = (TEMPLATES / fixture).read_text()
        model.resize_token_embeddings(len(tok))
    model.eval()
    return tok, model


@torch.no_grad()
def score(model, ids: list[int]) -> list[float]:
    """Per-token logprobs of `ids` under the model (position 0: 0), as the trainer computes them."""
    tokens = torch.tensor([ids])
    return logprobs_from_logits(model(tokens).logits.float(), tokens, 1.0)[0].tolist()


class Forcing:
    """The policy's engine: the real hf engine, except for turns queued with `force` (a tool call written in
    the format), which the model is teacher-forced on: their logprobs are the model's, as if sampled."""

    def __init__(self, model) -> None:
        self.model, self.engine, self.queue = model, HFEngine(model), []

    async def generate(self, input_ids, sampling: SamplingParams) -> Generation:
        if not self.queue:
            return await self.engine.generate(input_ids, sampling)
        out = tuple(self.queue.pop(0))
        lps = score(self.model, [*input_ids, *out])[len(input_ids):]
        return Generation(out, tuple(lps), "stop", 0, (), len(input_ids))


def episode(url: str, app, engine: Forcing, tok, fmt, instruction: str, seed: int, tokens: int) -> Trajectory:
    admin = openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0, timeout=600)
    made = admin.post("/episodes", cast_to=dict, body={})
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=made["api_key"], max_retries=0, timeout=600)
    call = ToolCall("bash", {"command": f"ls /app && echo {shlex.quote(instruction[:60])}"})
    engine.queue.append(assistant_ids(tok, Message("assistant", "Let me look first.", (call,)), fmt.turn_ends))
    messages = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": instruction}]
    first = client.chat.completions.create(model="policy", messages=messages, tools=[BASH], seed=seed)
    calls = first.choices[0].message.tool_calls or []
    if [c.function.name for c in calls] != ["bash"]:
        raise SystemExit(f"{fmt.name}: the written call did not parse back: {first.choices[0].message}")
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": calls[0].id, "content": "exit code 0\nREADME  data.txt\n"}]
    for turn, follow in enumerate(("Go on.", None)):
        r = client.chat.completions.create(model="policy", messages=messages, tools=[BASH], max_tokens=tokens,
                                           seed=seed * 10 + turn)
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        if follow:
            messages.append({"role": "user", "content": follow})
    return app.state.sessions.get(made["episode_id"]).trajectory


def agree(a: str, b: str) -> int:
    """How many leading characters `a` and `b` share."""
    return len(os.path.commonprefix([a, b]))  # noqa: RUF071 -- strings, compared by character


def naive_turns(traj: Trajectory, seg: Segment, model) -> tuple[list[dict], int]:
    """Per sampled turn of `seg`: what a naive proxy trains on there (the conversation as the harness resent it,
    rendered in one piece and tokenized; each assistant turn is the text its render adds), against what was
    sampled; and how many of the stored tokens the naive sequence does not have."""
    tok, tools = traj.tokenizer, seg.tools or None
    markers = (*traj.fmt.turn_ends, *traj.fmt.stops)
    answers = [i for i, m in enumerate(seg.messages) if m["role"] == "assistant"][-len(seg.turns):]
    messages = seg.messages[: answers[-1] + 1]
    text = render_text(tok, messages, tools)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    naive, offsets = enc["input_ids"], enc["offset_mapping"]
    naive_lp = score(model, naive)
    turns = []
    for (start, stop), k in zip(seg.turns, answers, strict=True):
        a = agree(render_text(tok, messages[:k], tools, add_generation_prompt=True), text)
        through = render_text(tok, messages[: k + 1], tools)  # up to its end marker: what follows is the next turn's
        end = max(through.rfind(m) + len(m) for m in markers)
        b = agree(through[:end] if end > a else through, text)  # GLM-4.5's template writes no marker after a turn
        inside = [j for j, (s, e) in enumerate(offsets) if s < b and e > a]  # tokens touching the turn's text
        sampled, retok = seg.ids[start:stop], [naive[j] for j in inside]
        shared = []
        for op, i1, i2, j1, _ in difflib.SequenceMatcher(None, sampled, retok, autojunk=False).get_opcodes():
            if op == "equal":
                shared += [abs(naive_lp[inside[j1 + n]] - seg.logprobs[start + i1 + n]) for n in range(i2 - i1)]
        turns.append({"sampled_tokens": stop - start, "retokenized_tokens": len(retok), "changed": sampled != retok,
                      "sampled_tokens_absent": stop - start - len(shared), "shared_abs_errors": shared,
                      "turn_logprob_error": abs(sum(naive_lp[j] for j in inside) - sum(seg.logprobs[start:stop]))})
    ops = difflib.SequenceMatcher(None, seg.ids[: seg.turns[-1][1]], naive, autojunk=False).get_opcodes()
    return turns, sum(max(i2 - i1, j2 - j1) for op, i1, i2, j1, j2 in ops if op != "equal")


def floor_errors(seg: Segment, model) -> list[float]:
    """|trainer-side logprob - rollout logprob| on the stored sampled tokens: what TITO leaves (numerics)."""
    end = seg.turns[-1][1]
    lp = score(model, seg.ids[:end])
    return [abs(lp[i] - seg.logprobs[i]) for i in range(end) if seg.mask[i]]


def measure(traj: Trajectory, model) -> dict:
    record = traj.record_dict()
    naive = [naive_turns(traj, seg, model) for seg in traj.segments if seg.turns]
    floor = [e for seg in traj.segments if seg.turns for e in floor_errors(seg, model)]
    return {"tito_mismatch_tokens": record["tito_mismatch_tokens"], "naive_tokens_differ": sum(n for _, n in naive),
            "history_rewrites": record["gateway_history_rewrites"], "turns": [t for ts, _ in naive for t in ts],
            "floor": floor}


def summarize(rows: list[dict]) -> dict:
    turns = [t for r in rows for t in r["turns"]]
    shared = [e for t in turns for e in t["shared_abs_errors"]]
    turn_err = [t["turn_logprob_error"] for t in turns]
    floor = [e for r in rows for e in r["floor"]]
    sampled = sum(t["sampled_tokens"] for t in turns)
    return {
        "episodes": len(rows),
        "sampled_turns": len(turns),
        "sampled_tokens": sampled,
        "tito_mismatch_tokens": sum(r["tito_mismatch_tokens"] for r in rows),
        "history_rewrites": sum(r["history_rewrites"] for r in rows),
        "tito_logprob_abs_error_max": max(floor),
        "naive": {
            "tokens_differ": sum(r["naive_tokens_differ"] for r in rows),
            "turns_changed": sum(t["changed"] for t in turns),
            "sampled_tokens_absent": sum(t["sampled_tokens_absent"] for t in turns),
            "sampled_tokens_absent_pct": round(100 * sum(t["sampled_tokens_absent"] for t in turns) / sampled, 2),
            "shared_token_logprob_abs_error_mean": sum(shared) / len(shared),
            "shared_token_logprob_abs_error_max": max(shared),
            "turn_logprob_error_mean": sum(turn_err) / len(turn_err),
            "turn_logprob_error_max": max(turn_err),
        },
    }


def run_format(name: str, base: Path, families: list, tokens: int) -> tuple[dict, dict[str, dict]]:
    """Every task family's episode in tool-call format `name`, on the tiny model with that format's template."""
    tok, model = format_model(base, name)
    return run_policy(name, tok, model, FORMATS[name], families, tokens)


def run_model_family(name: str, families: list, tokens: int) -> dict:
    """Every task family's episode on model family `name`'s own tiny checkpoint and template."""
    path = init_family(name, Path(tempfile.mkdtemp(prefix=f"drift-{name}-")) / name)
    tok, model = load_tokenizer(path), load_model(path).eval()
    fmt = FORMATS[str(MODEL_FAMILIES[name].tool_format)]
    return run_policy(name, tok, model, fmt, families, tokens)[0]


def run_policy(label: str, tok, model, fmt, families: list, tokens: int) -> tuple[dict, dict[str, dict]]:
    engine = Forcing(model)
    policy = Policy(engine=engine, tokenizer=tok, fmt=fmt, name="policy", max_context=8192, default_max_tokens=tokens)
    app = make_app(policy, TOKEN)
    server, thread, url = serve_in_thread(app)
    rows = {}
    try:
        for seed, family in enumerate(families):
            instruction = family.instance(family.seeds["train"][0], "train").instruction
            rows[family.name] = measure(episode(url, app, engine, tok, fmt, instruction, seed, tokens), model)
            print(f"{label:12} {family.name:22} mismatch {rows[family.name]['tito_mismatch_tokens']}, "
                  f"naive differs {rows[family.name]['naive_tokens_differ']}", flush=True)
    finally:
        server.should_exit = True
        thread.join(30)
    return summarize(list(rows.values())), rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=24, help="most tokens per sampled turn (default 24)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gateway_drift.json")
    args = ap.parse_args()
    prov = provenance()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    base = init_tiny(Path(tempfile.mkdtemp(prefix="drift-")) / "tiny")
    families = [load_family(p) for p in sorted((ROOT / "tasks").iterdir()) if is_family_dir(p)]
    by_format, by_family = {}, {}
    for name in FORMAT_SETUP:
        by_format[name], rows = run_format(name, base, families, args.tokens)
        for family, row in rows.items():
            by_family.setdefault(family, []).append(row)
    total = summarize([r for rows in by_family.values() for r in rows])
    models = {name: run_model_family(name, families, args.tokens)
              for name, fam in MODEL_FAMILIES.items() if fam.tool_format}
    out = {"provenance": finish(prov), "settings": {"tokens": args.tokens, "out": str(args.out)},
           "total": total, "formats": by_format, "model_families": models,
           "families": {f: {"tito_mismatch_tokens": sum(r["tito_mismatch_tokens"] for r in rows),
                            "naive_tokens_differ": sum(r["naive_tokens_differ"] for r in rows)}
                        for f, rows in by_family.items()}}
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(total, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

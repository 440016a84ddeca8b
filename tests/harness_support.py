"""Scripted harness programs for tests/test_harness.py: each is run by furlong as an unmodified harness would be
(OPENAI_BASE_URL / OPENAI_API_KEY / FURLONG_EXEC_URL from its environment), and writes what it saw to the
file named by its second argument, for the test to compare with what furlong recorded.

    python tests/harness_support.py MODE REPORT [ARG]

modes: oracle (one model turn with logprobs, then ARG, the task's solution, through the exec route), nothing
(exits at once), crash (one model turn, then raises), linger (one model turn, then a child that keeps
calling the gateway with the key after the episode's timeout, while the program sleeps past it), abandon
(a streamed request closed after its first event, then a plain one), report (one model turn, then ARG
written as is to FURLONG_REWARD_FILE: the harness's own reward).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import openai


def client() -> openai.OpenAI:
    return openai.OpenAI(max_retries=0, timeout=120)


def ask(c: openai.OpenAI, report: dict) -> None:
    r = c.chat.completions.create(model="policy", messages=[{"role": "user", "content": os.environ["FURLONG_INSTRUCTION"]}],
                                  logprobs=True, max_tokens=6, temperature=1.0, seed=1)  # fmt: skip
    report.setdefault("logprobs", []).extend(t.logprob for t in r.choices[0].logprobs.content)


def run_command(command: str, key: str | None = None) -> dict:
    r = httpx.post(os.environ["FURLONG_EXEC_URL"], json={"command": command},
                   headers={"Authorization": f"Bearer {key or os.environ['OPENAI_API_KEY']}"}, timeout=120)  # fmt: skip
    return {"status": r.status_code, **r.json()}


def linger(report_path: str) -> None:
    """The child: polls the exec route until its key is refused (the episode ended), then calls the gateway
    and the exec route with the old key again."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and run_command("true")["status"] == 200:
        time.sleep(0.3)
    codes = []
    for _ in range(3):
        r = httpx.post(os.environ["OPENAI_BASE_URL"] + "/chat/completions", timeout=30,
                       headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"},
                       json={"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})  # fmt: skip
        codes.append(r.status_code)
        codes.append(run_command("touch /tmp/late")["status"])
    with open(report_path, "w") as f:
        json.dump({"late_codes": codes}, f)


def main(mode: str, report_path: str, arg: str = "") -> int:
    report: dict = {}
    try:
        if mode == "linger-child":
            linger(report_path)
            return 0
        if mode == "nothing":
            return 0
        c = client()
        if mode == "abandon":
            with c.chat.completions.create(model="policy", stream=True, max_tokens=6,
                                           messages=[{"role": "user", "content": "go"}]) as stream:  # fmt: skip
                next(iter(stream))  # one event, then the connection is dropped
        ask(c, report)
        if mode == "oracle":
            report["refused"] = [run_command(arg, key="fk-not-a-key")["status"], run_command(" ")["status"]]
            report["exec"] = run_command(arg)
        elif mode == "report":
            with open(os.environ["FURLONG_REWARD_FILE"], "w") as f:
                f.write(arg)
        elif mode == "crash":
            raise RuntimeError("the harness crashed")
        elif mode == "linger":
            subprocess.Popen([sys.executable, __file__, "linger-child", report_path + ".late"], start_new_session=True)
            time.sleep(600)  # past any agent timeout: furlong kills it
        return 0
    finally:
        if mode != "linger-child":
            with open(report_path, "w") as f:
                json.dump(report, f)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

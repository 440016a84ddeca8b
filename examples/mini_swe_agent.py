"""mini-swe-agent (PyPI `mini-swe-agent`, pinned 2.x in pyproject's test extra) as a furlong harness: its own
agent loop, prompts and LiteLLM model class, run unmodified; only its environment is furlong's, a
`FurlongEnvironment` (its environment protocol: execute, get_template_vars, serialize) whose commands run in
the episode's sandbox through the gateway's exec route (docs/gateway.md#training-a-harness).

    train:
      agent:
        harness: {command: [python, examples/mini_swe_agent.py]}

MSWEA_STEP_LIMIT (default 3) caps its model calls; the task's agent timeout caps the rest.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import httpx
import yaml
from minisweagent import package_dir
from minisweagent.agents.default import DefaultAgent
from minisweagent.environments.local import LocalEnvironment
from minisweagent.models.litellm_model import LitellmModel


class FurlongEnvironment(LocalEnvironment):
    """LocalEnvironment's config, template variables and submission rule; `execute` in the episode's sandbox."""

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        r = httpx.post(
            os.environ["FURLONG_EXEC_URL"],
            json={"command": action.get("command", ""), "timeout_s": timeout or self.config.timeout},
            headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"},
            timeout=600,
        )
        if r.status_code != 200:  # a refused command (an empty one) or a sandbox that broke
            return {"output": "", "returncode": -1, "exception_info": r.json()["error"]["message"]}
        result = r.json()
        # furlong's observation starts with its own "exit code N" line; mini-swe-agent shows the code itself
        head, _, body = result["output"].partition("\n")
        output = body if head.startswith("exit code") else result["output"]
        code = result["exit_code"]
        out = {"output": output, "returncode": -1 if code is None else code, "exception_info": ""}
        self._check_finished(out)
        return out


def main() -> int:
    config = yaml.safe_load((package_dir / "config" / "default.yaml").read_text())
    agent_config = {**config["agent"], "step_limit": int(os.environ.get("MSWEA_STEP_LIMIT", "3")), "cost_limit": 0}
    model = LitellmModel(
        model_name=f"openai/{os.environ.get('FURLONG_MODEL', 'policy')}",
        model_kwargs={"api_base": os.environ["OPENAI_BASE_URL"], "api_key": os.environ["OPENAI_API_KEY"]},
        cost_tracking="ignore_errors",  # a local policy has no price
    )
    agent = DefaultAgent(model, FurlongEnvironment(), **agent_config)
    result = agent.run(os.environ["FURLONG_INSTRUCTION"])
    print(result.get("exit_status"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

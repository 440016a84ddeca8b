"""`furlong audit`: scripted exploits run as the agent against each task, to find the tasks a policy can hack
before RL finds them (docs/audit.md)."""

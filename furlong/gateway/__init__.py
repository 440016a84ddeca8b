"""An OpenAI- and Anthropic-compatible gateway in front of furlong's engines: unmodified agent harnesses
talk to it, and it records every episode as one token-in/token-out trajectory for the trainer
(docs/gateway.md)."""

"""furlong: RL post-training of LLM agents in real sandboxes."""

__version__ = "0.1.0"

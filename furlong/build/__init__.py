"""Builders: the config tree in, a run's roles out (sandbox backend, image store, tasks, trainer, the
rollout engine and its weight link). Only these modules read the config for them; every class they build
takes plain arguments, so each is usable outside the CLI. `sandbox` imports no model code, `training` does."""

"""The environment seam (furlong.envs.base) and its implementations: Harbor tasks in sandboxes (harbor)."""

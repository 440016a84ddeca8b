import importlib.metadata
import os
import shutil
import subprocess

os.chdir("/")  # importable from anywhere, not only from beside its source
import textslug  # noqa: E402

assert not os.path.realpath(textslug.__file__).startswith("/app/"), f"imported from its source: {textslug.__file__}"
assert importlib.metadata.version("textslug") == "1.2.0", "textslug's distribution metadata is not installed"
assert textslug.slugify("Hello, World! 2024") == "hello-world-2024"
assert textslug.slugify("  Ünïcode & spaces  ", sep="_") == "n_code_spaces"
command = shutil.which("textslug")
assert command, "the textslug command is not on PATH"
out = subprocess.run([command, "Furlong", "RL:", "sandboxes!"], capture_output=True, text=True, timeout=30, check=True)
assert out.stdout == "furlong-rl-sandboxes\n", out.stdout
print("ok")

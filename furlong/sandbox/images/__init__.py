"""Images: what gives a sandbox its root, built or fetched once and cached by content as read-only layers.

store.py's ImageStore is the entry point (the bootstrapped Debian base, one layer per task Dockerfile, the
default layer source of every local backend). It builds Dockerfiles itself where they fit furlong's subset
(dockerfile.py, layerbuild.py, builds.py) and through buildah beyond it (buildah.py, buildah_cli.py,
heredoc.py, flatten.py, layerdiff.py); it pulls bases from registries (registry.py), imports them by hand
(imports.py, layertar.py) and stands Debian in for official images no registry serves (standins.py,
standin_recipes.py, ubuntu.py, prebuilt.py); it adds the verifier toolchain (toolchain.py, offline_shims.py,
offline_uv.py), checks what a base build needs (rootless.py) and shows layers to sandboxes through
id-mapped views (layers.py). A new image source or builder goes here. Builds run in sandboxes, so this
side imports furlong.sandbox.runtime, never the serving side (furlong.sandbox.host, .e2b, .remote).
"""

"""Sandboxes: where an agent's commands and a task's verifier run, isolated from the host and each other.

The seam every caller uses is here at the top: base.py (the backend contract and the types it hands back),
backends.py (a backend chosen by name, config sandbox.backend) and pool.py (sandboxes for episodes), with
the plain types they share (network.py, changes.py, listing.py, tarball.py). Below them, runtime/ starts
and confines sandboxes on this host (bwrap, gVisor, the init, cgroups, seccomp, the network); images/ builds,
pulls and caches the layers a sandbox's root is made of; host/, e2b/ and remote/ serve sandboxes to other
machines and reach them there. The import contracts in pyproject.toml keep them apart (docs/extending.md,
"Where things live in furlong/sandbox").
"""

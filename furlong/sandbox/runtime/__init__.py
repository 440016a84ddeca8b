"""The sandbox runtime: what starts, confines and runs a sandbox on this host, given an image's layers.

The backends themselves (bwrap.py, the default, with bwrap_argv.py and bwrap_box.py; gvisor.py), the init
each sandbox runs as pid 1 and its binary protocol (native/, protocol.py), and the confinement around them:
cgroups.py (limits), seccomp.py (system calls), idmap.py and users.py (uids), headroom.py (tmpfs sizes),
the network (netns.py, netcontrol.py, egress.py, egress_proxy.py, dns.py, indexes.py), snapshots.py,
shell.py (what a tool call runs) and hostpython.py (Python sandboxes). A new local backend goes here, and
gets its name in furlong.sandbox.backends. The runtime never imports furlong.sandbox.images (what builds
the layers) nor the serving side (furlong.sandbox.host, .e2b, .remote): a backend is given its layers
(furlong.sandbox.base.LayerSource), and the image side builds its layers through the runtime's backends.
"""

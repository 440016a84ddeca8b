"""`train.cluster: ray`: the run's roles as Ray actors in placement groups (docs/cluster.md).

* session: start a local Ray cluster for the run, or join one; the placement groups (a bundle per actor);
  a reaper that leaves no Ray process behind a driver that was killed.
* engines: an actor hosting today's engine server (furlong.engine.server's app and its relay).
* trainer: an actor hosting the RL trainer, behind the Trainer protocol.
* ranks: RayRanks, the RankGroup of furlong.train.ranks with its ranks in Ray actors.
* plan: `furlong train --plan`, a dry run of a cluster spec's placement, memory and update bytes.

The driver, scheduler, router and records are local mode's code: only where each role runs differs.
"""

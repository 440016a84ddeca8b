"""Cluster mode: placement of rollout engines, trainer ranks, weight relays and sandbox hosts."""

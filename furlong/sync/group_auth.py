"""The handshake that makes a weight-update group (furlong.sync.broadcast) answer only holders of the run's secret.

torch.distributed's TCPStore lets anyone who reaches its port join a group under any free rank, so the group
itself proves nothing. The trainer therefore draws a fresh random nonce per group and sends it, in the
`auth_nonce` field of each engine's bearer-token-guarded /init_weights_update_group body. Once the group has
formed and before any weight is broadcast, every rank all-gathers

    HMAC-SHA256(key=secret, msg="furlong-weight-group-v1" | group_name | nonce | rank | world_size)

and checks every other rank's MAC. A member that does not hold the secret (an intruder that took a rank, an
engine given the wrong token) cannot produce its rank's MAC, nor reuse another rank's or an earlier group's:
every rank then fails with RendezvousNotAuthenticated naming the ranks, and the group is destroyed. The check
is mutual, so an engine never receives from a rank 0 that is not the trainer.
"""

from __future__ import annotations

import hashlib
import hmac

MAC_BYTES = hashlib.sha256().digest_size
MIN_NONCE_CHARS = 32  # the trainer draws secrets.token_hex(16); shorter is not a fresh random nonce
LABEL = b"furlong-weight-group-v1"


class RendezvousNotAuthenticated(RuntimeError):
    """A member of a weight-update group did not prove the run's secret: the group was destroyed unused."""


def proof(secret: str, nonce: str, rank: int, group_name: str, world_size: int) -> bytes:
    """Rank `rank`'s MAC for one group; the rank and world size are in it, so one rank's MAC is no other's."""
    message = b"\0".join((LABEL, group_name.encode(), nonce.encode(), str(rank).encode(), str(world_size).encode()))
    return hmac.new(secret.encode(), message, hashlib.sha256).digest()


def unproven(macs: list[bytes], secret: str, nonce: str, group_name: str) -> list[int]:
    """The ranks whose all-gathered MAC is not theirs (compared in constant time)."""
    world = len(macs)
    return [r for r, mac in enumerate(macs) if not hmac.compare_digest(mac, proof(secret, nonce, r, group_name, world))]


def refusal(
    bad: list[int], rank: int, group_name: str, failed: BaseException | None = None
) -> RendezvousNotAuthenticated:
    """The error rank `rank` raises; an engine is told that its own token may be the wrong one (then every
    other rank looks wrong to it). `failed`: the all-gather itself failed (a member sent no MAC, or hung up)."""
    who = ", ".join(f"rank {r}" + (" (the trainer)" if r == 0 else "") for r in bad if r != rank)
    what = (
        f"the handshake failed ({failed})"
        if failed is not None
        else f"{who} did not prove the run's secret"
        + (" (or this member's own token is not the run's)" if rank != 0 else "")
    )
    return RendezvousNotAuthenticated(
        f"weight group {group_name!r}: {what}: the rendezvous was not authenticated, "
        f"so the group was destroyed before any weights were sent"
    )


def check_nonce(nonce: str | None) -> None:
    if nonce is not None and len(nonce) < MIN_NONCE_CHARS:
        raise ValueError(
            f"auth_nonce must be at least {MIN_NONCE_CHARS} characters of fresh randomness, got {len(nonce)}"
        )

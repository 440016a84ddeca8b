"""Listings (furlong.sandbox.listing: the host's /v1 files/list and E2B's ListDir and Stat) over a real bwrap
sandbox run outside the agent's shell state: a `cd` its commands made holds whatever listing runs between or
during them, and no listing moves the agent. The E2B SDK's side: tests/test_e2b_io.py."""

from __future__ import annotations

import asyncio

import pytest
from conftest import run

from furlong.sandbox import listing
from furlong.sandbox.base import SandboxError, SandboxSpec


def in_a_sandbox(backend, base_image, test):
    """`test(box)` on a fresh sandbox, in one event loop (a sandbox's channel belongs to the loop it was made in)."""

    async def main():
        box = await backend.create(SandboxSpec(image=base_image))
        try:
            await test(box)
        finally:
            await box.close()

    run(main())


async def _pwd(box) -> str:
    return (await box.exec("pwd")).stdout


def test_a_listing_between_agent_commands_leaves_their_cd(backend, base_image):
    async def main(box):
        await box.exec("mkdir -p /tmp/here/sub && cd /tmp/here")
        assert [e.name for e in await listing.list_dir(box, "/tmp/here")] == ["sub"]
        assert (await listing.stat(box, "/tmp/here/sub")).type == "dir"
        assert await _pwd(box) == "/tmp/here\n"
        # a relative path is read from / (the listing has no cwd of the agent's), not from /tmp/here
        with pytest.raises(SandboxError, match="No such file"):
            await listing.list_dir(box, "sub")

    in_a_sandbox(backend, base_image, main)


def test_a_listing_across_an_agent_commands_end_keeps_its_cd(backend, base_image):
    """The race: a listing whose shell started before an agent command doing `cd` ended, and which ends after
    it, must not save its own (older) cwd over the one that command saved. Made certain here: the agent's
    command stops the listing's find (same uid), ends, and only then is the find continued. The listing is of
    6,000 files, so its find runs long enough (tens of ms) for the command's polling to catch it."""

    async def main(box):
        await box.exec("mkdir -p /tmp/there /tmp/big/{1..60} && touch /tmp/big/{1..60}/{1..100}", cwd="/")
        agent = asyncio.create_task(
            box.exec("cd /tmp/there && until pkill -STOP -x find; do sleep 0.002; done", timeout_s=30)
        )
        await asyncio.sleep(0.05)  # the agent's command is polling before the listing starts
        listed = asyncio.create_task(listing.list_dir(box, "/tmp/big", depth=2))
        assert (await agent).exit_code == 0  # it stopped a find of the listing's, then ended
        assert not listed.done()
        await box.exec("pkill -CONT -x find", cwd="/")
        assert len(await listed) == 60 * 101
        assert await _pwd(box) == "/tmp/there\n"

    in_a_sandbox(backend, base_image, main)


def test_a_listing_too_long_for_the_output_cap_is_a_clear_error(backend, base_image):
    async def main(box):
        with pytest.raises(SandboxError, match="^/usr: too many entries"):
            await listing.list_dir(box, "/usr", depth=16)

    in_a_sandbox(backend, base_image, main)

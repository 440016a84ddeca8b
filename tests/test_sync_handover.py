"""`train.sync.transport=shared`: the trainer's weights handed to engine server processes on its host in shared
memory (SGLang's /update_weights_from_tensor shape): bit for bit, nothing but handles on the wire, the memory
freed once used, lost engines put back only at the live version, and a route that runs nothing else."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from conftest import run, spec
from furlong.build.links import weight_link
from furlong.config import load_config
from furlong.engine.base import EngineRefused, SamplingParams
from furlong.engine.remote import EngineProcess, RemoteEngine
from furlong.engine.router import Router, RouterSettings
from furlong.model.loading import load_model
from furlong.paths import arena_owner
from furlong.sync.handover import Arena, HandoverRefused, load_named_tensors, serialize_named_tensors
from furlong.train.handover import HandoverLink
from tests_support import moved_weights, reference_generation

PROMPT = [5, 17, 300, 42, 1000, 7]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)
SHARED = ["train.sync.engine=server", "train.sync.transport=shared"]
READ_BACK = """
import hashlib, sys
from furlong.sync.handover import load_named_tensors
for handle in sys.argv[1:]:
    named = load_named_tensors(handle)
    print(";".join(f"{n}:{t.dtype}:{tuple(t.shape)}:{hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()}"
                   for n, t in named))
    del named
"""

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _digest(named) -> str:
    import hashlib

    return ";".join(f"{n}:{t.dtype}:{tuple(t.shape)}:"
                    f"{hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()}"
                    for n, t in named)


def _read_elsewhere(handles: list[str]) -> list[str]:
    """Each handle opened by another process (not a child's inherited memory: a fresh interpreter)."""
    out = subprocess.run([sys.executable, "-c", "import torch\n" + READ_BACK, *handles], capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def _shm_files() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if arena_owner(f) == os.getpid()}


def test_an_arena_hands_mixed_tensors_to_another_process_bit_for_bit_then_frees_them():
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(50, 8, generator=g)
    weights = {"emb": emb, "lm_head": emb, "half": torch.randn(7, generator=g).to(torch.bfloat16),
               "ids": torch.arange(5), "transposed": torch.randn(3, 4, generator=g).t(), "empty": torch.empty(0)}
    before = _shm_files()
    arena = Arena()
    arena.fill(weights)
    assert len(_shm_files() - before) == 1  # one file for every tensor
    # tied tensors share one view: 50x8 fp32 once, each view padded to 64 bytes
    assert arena.nbytes == 1600 + 64 + 64 + 64 + 0
    expected = _digest([(n, weights[n]) for n in arena.names])
    assert _read_elsewhere(arena.handles(2)) == [expected, expected]
    moved = {k: v * 2 if v.is_floating_point() else v + 1 for k, v in weights.items()}
    moved["lm_head"] = moved["emb"]
    arena.fill(moved)  # same layout: the same buffer, refilled
    assert len(_shm_files() - before) == 1
    assert _read_elsewhere(arena.handles(1)) == [_digest([(n, moved[n]) for n in arena.names])]
    (path,) = _shm_files() - before
    assert oct(os.stat(f"/dev/shm/{path}").st_mode & 0o777) == "0o600"
    arena.close()
    assert _shm_files() == before


def test_an_arena_file_outlives_its_killed_owner_only_until_the_next_arena():
    made = subprocess.run([sys.executable, "-c", "import os, torch\nfrom furlong.sync.handover import Arena\n"
                           "a = Arena()\na.fill({'w': torch.zeros(1000)})\nprint(os.getpid(), flush=True)\n"
                           "os.kill(os.getpid(), 9)"], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parent.parent)
    dead = int(made.stdout.split()[0])
    left = [p for p in Path("/dev/shm").glob("furlong-weights-*") if arena_owner(p.name) == dead]
    assert len(left) == 1  # SIGKILLed: nothing of its own could delete it
    # the same pid in another pid namespace (a container sharing /dev/shm) is another process: left alone
    other = Path("/dev/shm") / left[0].name.replace("furlong-weights-", "furlong-weights-1", 1)
    other.write_bytes(b"")
    mine = Arena()
    mine.fill({"w": torch.zeros(10)})
    assert not left[0].exists() and len(_shm_files()) == 1  # the next arena removed it, and kept its own
    assert other.exists() and arena_owner(other.name) is None
    other.unlink()
    mine.close()


def test_an_arena_larger_than_dev_shm_fails_at_once_and_leaves_no_file():
    """Blocks are reserved when the arena is made: without that, a full /dev/shm would kill the trainer with
    a SIGBUS at its first write past the end."""
    stat = os.statvfs("/dev/shm")
    too_big = stat.f_bavail * stat.f_frsize + 2**30
    with pytest.raises(OSError, match=r"weight arena: could not reserve .* MiB in /dev/shm \(No space left"):
        Arena().fill({"w": torch.empty(too_big, dtype=torch.uint8, device="meta")})
    assert not _shm_files()


def test_an_arena_stores_floating_tensors_in_the_engines_dtype():
    arena = Arena(dtype=torch.bfloat16)
    arena.fill({"w": torch.randn(4, 4), "ids": torch.arange(3)})
    named = dict(load_named_tensors(arena.handles(1)[0]))
    assert named["w"].dtype == torch.bfloat16 and named["ids"].dtype == torch.int64
    del named
    arena.close()


class _Opens:
    """Pickles as the arena's own view opener, with arguments of the test's choosing."""

    def __init__(self, args: tuple) -> None:
        self.args = args

    def __reduce__(self):
        from furlong.sync.handover import open_view

        return open_view, self.args


class _Runs:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_unpickling_refuses_every_global_but_torchs_tensor_handles(tmp_path: Path):
    marker = tmp_path / "ran"
    hostile = [base64.b64encode(pickle.dumps(_Runs(str(marker)))).decode(),
               base64.b64encode(pickle.dumps([("w", _Runs(str(marker)))])).decode(),
               base64.b64encode(pickle.dumps([("w", eval)])).decode()]
    for body in hostile:
        with pytest.raises(HandoverRefused, match="is not part of a weight handle"):
            load_named_tensors(body)
    assert not marker.exists()
    with pytest.raises(HandoverRefused, match="not base64"):
        load_named_tensors("not base64!")
    with pytest.raises(HandoverRefused, match="list of \\(name, tensor\\) pairs"):
        load_named_tensors(base64.b64encode(pickle.dumps({"w": 1})).decode())
    # torch's own CPU sharing (what SGLang unpickles) maps files by a name the sender chooses: not served
    with pytest.raises(HandoverRefused, match="reductions.rebuild_tensor is not part of a weight handle"):
        load_named_tensors(serialize_named_tensors([("w", torch.zeros(4))]))
    arena = Arena()
    arena.fill({"w": torch.zeros(16)})
    (path,) = _shm_files()
    forged = {"a file of the sender's choice": ("/etc/passwd", 64, 0, torch.float32, (16,), (1,)),
              "another directory": (f"/tmp/{path}", 64, 0, torch.float32, (16,), (1,)),
              "past the end": (f"/dev/shm/{path}", 64, 0, torch.float32, (17,), (1,)),
              "misaligned": (f"/dev/shm/{path}", 64, 4, torch.float32, (4,), (1,)),
              "larger than the file": (f"/dev/shm/{path}", 1 << 20, 0, torch.float32, (16,), (1,))}
    for what, args in forged.items():
        body = base64.b64encode(pickle.dumps([("w", _Opens(args))])).decode()
        with pytest.raises(HandoverRefused):
            load_named_tensors(body)
    arena.close()


def test_engine_servers_load_handed_over_weights_and_refuse_bad_bodies(tiny_dir: Path, tmp_path: Path):
    """`furlong train`'s own builder: two engine server processes without a relay, behind a router."""
    cfg = load_config(None, [*SHARED, "train.sync.servers=2"])
    weights = moved_weights(tiny_dir, 2e-2, 1)

    async def main():
        link = await weight_link(cfg, tmp_path, tiny_dir)
        try:
            assert isinstance(link, HandoverLink) and isinstance(link.engine, Router)
            logged = await link.push(weights, 1)
            again = await link.push(weights, 1)
            gens = [await i.engine.generate(PROMPT, GREEDY) for i in link.engine.instances]
            refused = await _refusals(link.engine.instances[0].engine, tiny_dir, tmp_path)
        finally:
            await link.close()
        return logged, again, gens, await reference_generation(tiny_dir, weights, PROMPT, GREEDY), refused

    logged, again, gens, reference, (answers, stranger, versions) = run(main())
    assert again["sync_seconds"] == 0.0 and "sync_shared_bytes" not in again  # an unchanged version: no push
    assert logged["sync_engines_live"] == 2 and logged["sync_full"] == 1.0
    # the weights stayed in shared memory: a handle of a few hundred bytes a tensor went to each engine
    assert logged["sync_shared_bytes"] >= 4 * 4_000_000 and logged["sync_payload_bytes"] < 40_000
    for gen in gens:
        assert gen.weight_version == 1
        assert gen.output_ids == reference.output_ids and gen.logprobs == reference.logprobs
    assert answers["hostile pickle"] == (400, "serialized_named_tensors: posix.system is not part of a weight handle")
    assert answers["unknown tensor"][0] == 400 and "unknown tensors ['not.a.weight']" in answers["unknown tensor"][1]
    for what in ("no version", "negative version"):
        assert answers[what][0] == 400 and answers[what][1].startswith("weight_version: expected a non-negative")
    assert answers["two entries"][0] == 400 and "expected one entry" in answers["two entries"][1]
    assert answers["load_format"][0] == 400 and "only null" in answers["load_format"][1]
    assert stranger == 401 and versions == (1, 1) and not (tmp_path / "ran").exists()


async def _refusals(engine: RemoteEngine, tiny_dir: Path, tmp_path: Path):
    """Bad bodies posted with the run's token, and a good one without it: (status, message) by case, the
    stranger's status, and the engine's version before and after."""
    wrong, good = Arena(), Arena()
    wrong.fill({"not.a.weight": torch.zeros(3)})
    good.fill(moved_weights(tiny_dir, 2e-2, 9))
    hostile = base64.b64encode(pickle.dumps([("w", _Runs(str(tmp_path / "ran")))])).decode()
    cases = {
        "hostile pickle": {"serialized_named_tensors": [hostile], "weight_version": "7"},
        "unknown tensor": {"serialized_named_tensors": wrong.handles(1), "weight_version": "7"},
        "no version": {"serialized_named_tensors": good.handles(1)},
        "negative version": {"serialized_named_tensors": good.handles(1), "weight_version": "-1"},
        "two entries": {"serialized_named_tensors": good.handles(2), "weight_version": "7"},
        "load_format": {"serialized_named_tensors": good.handles(1), "weight_version": "7",
                        "load_format": "flattened_bucket"},
    }
    before = (await engine.health())["weight_version"]
    answers = {}
    try:
        for what, body in cases.items():
            try:
                await engine.update_weights_from_tensor(body)
                answers[what] = (200, "")
            except EngineRefused as e:
                status, message = str(e).split("HTTP ", 1)[1].split(": ", 1)
                answers[what] = (int(status), json.loads(message)["message"])
        async with httpx.AsyncClient(base_url=engine.url, trust_env=False) as client:
            stranger = await client.post("/update_weights_from_tensor",
                                         json={"serialized_named_tensors": good.handles(1), "weight_version": "7"})
    finally:
        wrong.close()
        good.close()
    return answers, stranger.status_code, (before, (await engine.health())["weight_version"])


def test_a_killed_engine_is_handed_the_live_weights_before_it_serves_again(tiny_dir: Path, tmp_path: Path):
    token = "handover-test-token"
    procs = [EngineProcess(tiny_dir, updates=None, log=tmp_path / f"engine-{i}.log", engine_token=token,
                           prefix_cache_mb=16) for i in range(2)]
    weights = [moved_weights(tiny_dir, 2e-2, s) for s in range(4)]

    async def main():
        members = [RemoteEngine(p.url, token=token) for p in procs]
        router = Router(members, RouterSettings(readmit_after=0))
        link = HandoverLink(router, members, arena=Arena(), cleanup=router.close)
        try:
            await link.push(weights[1], 1)
            procs[0]._proc.send_signal(signal.SIGKILL)
            procs[0]._proc.wait()
            lost = await link.push(weights[2], 2)  # the survivor takes it; the dead one is out of the router
            out_while = not router.is_live(members[0]) and members[0].url in link._lost()
            assert (await members[1].health())["weight_version"] == 2
            port = int(procs[0].url.rsplit(":", 1)[1])
            procs[0] = await asyncio.to_thread(EngineProcess, tiny_dir, updates=None, log=tmp_path / "engine-0b.log",
                                               engine_token=token, prefix_cache_mb=16, port=port)
            restarted = (await members[0].health())["weight_version"], router.is_live(members[0])
            back = await link.push(weights[3], 3)  # it answers again: loaded at v3, then put back
            gen = await members[0].generate(PROMPT, GREEDY)
            return lost, out_while, restarted, back, router.is_live(members[0]), link._lost(), gen
        finally:
            await link.close()

    try:
        lost, out_while, restarted, back, live, reasons, gen = run(main())
    finally:
        for p in procs:
            p.stop()
    assert lost["sync_engines_live"] == 1 and out_while
    assert restarted == (0, False)  # the restarted server holds its start weights, and is not served yet
    assert back["sync_engines_live"] == 2 and live and reasons == ""
    reference = run(reference_generation(tiny_dir, weights[3], PROMPT, GREEDY))
    assert gen.weight_version == 3 and gen.output_ids == reference.output_ids


def test_every_engine_lost_stops_the_push_with_the_reasons(tiny_dir: Path):
    # an engine's address where nothing answers (a port bound but not listening refuses connections): what a
    # stopped server leaves, without spending an engine start on one only to stop it
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"

        async def main():
            member = RemoteEngine(url, token="t")
            link = HandoverLink(member, [member], arena=Arena(), cleanup=member.close)
            try:
                with pytest.raises(RuntimeError, match=f"every engine is lost: {url}: .*ConnectError"):
                    await link.push(load_model(tiny_dir).state_dict(), 1)
            finally:
                await link.close()

        run(main())


def test_a_sandbox_cannot_see_the_shared_weights(backend, base_image):
    arena = Arena()
    arena.fill({"w": torch.full((1024,), 7.0)})
    name = next(iter(_shm_files()))

    async def go():
        box = await backend.create(spec(base_image))
        try:
            listing = await box.exec("ls -a /dev/shm")
            opened = await box.exec(f"cat /dev/shm/{name} | wc -c; echo done")
            return listing, opened
        finally:
            await box.close()

    listing, opened = run(go())
    arena.close()
    assert listing.exit_code == 0  # its own /dev/shm, empty: the host's arena file is not there
    assert listing.stdout.split() == [".", ".."] and opened.stdout.split() == ["0", "done"]


@pytest.mark.parametrize("overrides, message", [
    (["train.sync.transport=shared"], "set train.sync.engine=server"),
    (["train.cluster=ray", "train.sync.transport=shared", "train.ray.placement=disaggregated"],
     "needs the engines on the trainer's node"),
    (["train.cluster=ray", "train.sync.transport=shared", "train.trainer=fsdp2", "train.ray.address=auto"],
     "the driver holds the gathered weights"),
])
def test_shared_memory_is_refused_where_it_cannot_reach_the_engines(overrides, message):
    with pytest.raises(Exception, match=message):
        load_config(None, overrides)

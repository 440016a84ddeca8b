"""An episode's receipt: what its reward was computed from, so that a run's rewards can be checked later.

The verifier (furlong.tasks.verifier.verify) writes one per run of the tests it scores: the image the tests
ran in, the tests themselves as copied into /tests, who ran them and how they ended, the reward file they
left, what tamper detection found, and the sandbox backend. `furlong eval --verify-receipts`
(furlong.eval.receipts) recomputes the image's and the tests' digests from the task directory as it is now.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from dataclasses import asdict, dataclass
from typing import Any

DIGEST = "sha256"


@dataclass(frozen=True)
class Receipt:
    image_digest: str  # the image the tests ran in (furlong.sandbox.base.ImageRef.digest): content-addressed
    tests_digest: str  # `digest_tests` of what went in /tests
    verifier_uid: int  # the uid the tests ran as, inside the sandbox
    agent_uid: int  # the agent's: the same as verifier_uid where the sandbox has one uid only
    exit_code: int | None  # the test script's (a timed-out one's is what killing it left)
    reward_file: str | None  # reward.json or reward.txt, the one read; None: none was (a timeout, TB1's exit status)
    reward_digest: str | None  # of that file's bytes
    tampered_paths: tuple[str, ...]  # what furlong.tasks.integrity counted; () on an honest episode
    tamper_checked: bool  # False: the backend cannot say what the agent changed, so nothing was checked
    backend: str  # the sandbox backend that ran the tests (bwrap, remote, ...)
    step: str | None = None  # a multi-step task's step whose tests these were (Harbor's [[steps]])

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["tampered_paths"] = list(self.tampered_paths)
        return out

    @classmethod
    def from_json(cls, data: Any, where: str) -> Receipt:
        """A receipt as an episode record holds it; `where` names the record in the error."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: a receipt must be an object, got {type(data).__name__}")
        known = set(cls.__dataclass_fields__)
        missing = sorted(known - {"step"} - set(data))
        if missing:
            raise ValueError(f"{where}: receipt lacks {', '.join(missing)}")
        fields = {k: v for k, v in data.items() if k in known}
        return cls(**{**fields, "tampered_paths": tuple(fields["tampered_paths"])})


def digest_tests(tests_tar: bytes) -> str:
    """A digest of the tests in a tar by content: each member's name, type, mode, link target and bytes, in
    name order. Times and owners are left out: a copy of the task directory has the same digest."""
    sha = hashlib.sha256()
    with tarfile.open(fileobj=io.BytesIO(tests_tar), mode="r:") as tar:
        for m in sorted(tar.getmembers(), key=lambda m: m.name):
            data = tar.extractfile(m).read() if m.isfile() else b""  # type: ignore[union-attr]  # a file has bytes
            head = f"{m.name}\0{m.type.decode()}\0{m.mode & 0o7777:o}\0{m.linkname}\0{len(data)}\0"
            sha.update(head.encode() + data)
    return f"{DIGEST}:{sha.hexdigest()}"


def bytes_digest(data: bytes) -> str:
    return f"{DIGEST}:{hashlib.sha256(data).hexdigest()}"

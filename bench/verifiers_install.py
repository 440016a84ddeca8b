"""What the verifiers harness's venv costs (`bash install.sh --verifiers`, docs/gateway.md#a-verifiers-environment):
the same steps as install.sh's (a venv, then `pip install -r scripts/verifiers-requirements.txt`) into a fresh
temporary directory, timed, with the venv's size on disk, its package count, and the time to import
`verifiers.v1` once installed. pip's cache is used as found (a machine that installed it before downloads
nothing; the JSON says which it was only through the time).

    python bench/verifiers_install.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from provenance import ROOT, finish, provenance

RESULTS = ROOT / "bench" / "results" / "verifiers_install.json"
LOCK = ROOT / "scripts" / "verifiers-requirements.txt"


def timed(argv: list[str]) -> float:
    start = time.monotonic()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    prov = provenance()
    with tempfile.TemporaryDirectory() as d:
        venv = Path(d) / "venv"
        python = str(venv / "bin" / "python")
        venv_s = timed(["python3", "-m", "venv", str(venv)])
        pip_s = timed([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-r", str(LOCK)])
        import_s = timed([python, "-c", "import verifiers.v1"])
        size = sum(p.stat().st_size for p in venv.rglob("*") if p.is_file() and not p.is_symlink())
        packages = len(subprocess.run([python, "-m", "pip", "freeze", "--disable-pip-version-check"], check=True,
                                      capture_output=True, text=True).stdout.splitlines())  # fmt: skip
    out = {"provenance": finish(prov), "lock": str(LOCK.relative_to(ROOT)), "packages": packages,
           "install_s": round(venv_s + pip_s, 1), "size_mb": round(size / 2**20), "import_s": round(import_s, 1)}  # fmt: skip
    print(f"{packages} packages, {out['size_mb']} MB, installed in {out['install_s']} s; import {out['import_s']} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

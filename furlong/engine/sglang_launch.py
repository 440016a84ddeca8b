"""Start and stop `python -m sglang.launch_server` for a local model directory.

The server is ready when GET /health answers 200 (SGLang answers 503 until its warm-up generation is done,
http_server.py). A process that exits, or stays unhealthy past the timeout, is one EngineError that quotes
the end of its log. Flags used are SGLang's own (server_args.py): --model-path, --host, --port, --dtype,
--random-seed, --weight-version, --enable-lora, --max-lora-rank, --lora-target-modules, --lora-paths NAME=PATH.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import httpx
from tenacity import RetryCallState, Retrying, retry_if_result, stop_after_delay, wait_fixed

from furlong.engine.base import EngineError
from furlong.engine.sglang import SGLangEngine

LOG_TAIL_LINES = 40
# SGLang switches to temperature-1 logprobs when this is set; furlong's contract is temperature-scaled ones.
_DROPPED_ENV = ("SGLANG_RETURN_ORIGINAL_LOGPROB",)


@dataclass(frozen=True)
class SGLangLaunch:
    """How to start one server. `module` is what `python -m` runs (the tests' stand-in is
    tests.sglang_standin); `python` is the interpreter that has it installed."""

    model_dir: Path
    log: Path
    python: str = sys.executable
    module: str = "sglang.launch_server"
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    dtype: str = "float32"
    seed: int = 0
    lora_paths: tuple[tuple[str, Path], ...] = ()  # (name, PEFT adapter directory) loaded at start
    max_lora_rank: int | None = None  # with no lora_paths: enables LoRA so adapters can be loaded later
    lora_target_modules: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()
    start_timeout_s: float = 600.0
    env: dict[str, str] = field(default_factory=dict)

    def command(self, port: int) -> list[str]:
        cmd = [
            self.python,
            "-m",
            self.module,
            "--model-path",
            str(self.model_dir),
            "--host",
            self.host,
            "--port",
            str(port),
            "--dtype",
            self.dtype,
            "--random-seed",
            str(self.seed),
            "--weight-version",
            "0",
        ]
        if self.lora_paths or self.max_lora_rank:
            cmd.append("--enable-lora")
        if self.max_lora_rank:
            cmd += ["--max-lora-rank", str(self.max_lora_rank)]
        if self.lora_target_modules:
            cmd += ["--lora-target-modules", *self.lora_target_modules]
        if self.lora_paths:
            cmd += ["--lora-paths", *(f"{name}={path}" for name, path in self.lora_paths)]
        return cmd + list(self.extra_args)


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


class SGLangServer:
    """One running server; `url` once the constructor returns. stop() ends its whole process group (SGLang
    runs its scheduler and detokenizer as child processes)."""

    def __init__(self, launch: SGLangLaunch) -> None:
        self.launch = launch
        port = launch.port or free_port(launch.host)
        host = f"[{launch.host}]" if ":" in launch.host else launch.host
        self.url = f"http://{host}:{port}"
        self.cmd = launch.command(port)
        launch.log.parent.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
        env.update(launch.env, PYTHONUNBUFFERED="1")
        with open(launch.log, "ab") as log:
            self._proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        try:
            self._wait_healthy(launch.start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        def give_up(state: RetryCallState) -> NoReturn:
            raise self._failure(f"not healthy at {self.url}/health within {timeout_s:.0f} s")

        with httpx.Client(trust_env=False, timeout=5.0) as client:
            Retrying(
                stop=stop_after_delay(timeout_s),
                wait=wait_fixed(0.25),
                retry=retry_if_result(lambda healthy: not healthy),
                retry_error_callback=give_up,
            )(self._healthy, client)

    def _healthy(self, client: httpx.Client) -> bool:
        code = self._proc.poll()
        if code is not None:
            raise self._failure(f"exited with code {code} before it was healthy")
        try:
            return client.get(f"{self.url}/health").status_code == 200
        except httpx.HTTPError:
            return False  # not listening yet

    def _failure(self, what: str) -> EngineError:
        return EngineError(
            f"SGLang server {what}\n  command: {' '.join(self.cmd)}\n"
            f"  last lines of {self.launch.log}:\n{log_tail(self.launch.log)}"
        )

    @property
    def running(self) -> bool:
        return self._proc.poll() is None

    def stop(self, timeout_s: float = 15.0) -> None:
        if self._proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self._proc.pid, sig)  # its own session: the group is exactly what we started
            except ProcessLookupError:
                return
            try:
                self._proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> SGLangServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def open_sglang(
    model_dir: Path,
    *,
    work_dir: Path,
    adapter: Path | None = None,
    dtype: str = "float32",
    seed: int = 0,
    url: str | None = None,
    python: str | None = None,
    module: str = "sglang.launch_server",
    port: int = 0,
    extra_args: tuple[str, ...] = (),
    start_timeout_s: float = 600.0,
    weights_via: str = "disk",
    max_lora_rank: int | None = None,
) -> SGLangEngine:
    """An SGLangEngine for `model_dir`: attached to the server at `url`, or on a server started here (its log
    is work_dir/sglang-server.log; updates are staged under work_dir/weights). `adapter` (a PEFT directory)
    is loaded at start as "adapter" and selected; an attached server must have been started with it."""
    server = None
    if url is None:
        launch = SGLangLaunch(
            model_dir=model_dir,
            log=work_dir / "sglang-server.log",
            python=python or sys.executable,
            module=module,
            port=port,
            dtype=dtype,
            seed=seed,
            extra_args=extra_args,
            lora_paths=(("adapter", adapter),) if adapter else (),
            max_lora_rank=max_lora_rank,
            start_timeout_s=start_timeout_s,
        )
        server = SGLangServer(launch)
        url = server.url
    engine = SGLangEngine(
        url, staging_dir=work_dir / "weights", base_model_dir=model_dir, weights_via=weights_via, server=server
    )
    if adapter is not None:
        engine.select_lora("adapter", Path(adapter))
    return engine

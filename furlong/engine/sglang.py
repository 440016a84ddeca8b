"""The Engine protocol over SGLang's native HTTP API (a `python -m sglang.launch_server` process).

Request and response shapes follow SGLang's own definitions, checked in sgl-project/sglang:
`python/sglang/srt/entrypoints/http_server.py` (routes), `python/sglang/srt/managers/io_struct.py`
(`GenerateReqInput`, `UpdateWeightFromDiskReqInput`, `UpdateWeightsFromTensorReqInput`,
`LoadLoRAAdapterReqInput`, `UnloadLoRAAdapterReqInput`, `PauseGenerationReqInput`),
`python/sglang/srt/sampling/sampling_params.py` and `managers/tokenizer_manager.py` (the `meta_info` of a
/generate reply), and docs/basic_usage/native_api + sampling_params.

Logprobs: SGLang's sampler divides the logits by the temperature, takes the softmax, samples from it with
top-k / top-p, and returns log(probs) of that softmax, i.e. the temperature-scaled logprob *before*
truncation (`layers/sampler.py`); temperature 0 becomes temperature 1 with top_k 1, so greedy logprobs are
at temperature 1. That is exactly furlong's contract (`furlong.engine.base.Generation`), so no conversion is
done. The environment variable SGLANG_RETURN_ORIGINAL_LOGPROB=1 switches SGLang to temperature-1 logprobs,
which cannot be converted back from one logprob per token: the launcher (furlong.engine.sglang_launch)
removes it, and a server you start yourself must not set it.

Weight versions: SGLang labels a reply with the server's version when the reply is built, not per token.
Tokens are labelled with the version current when the request was sent; if the reply carries a newer one
(an update landed mid-generation), that older label over-states staleness, never under-states it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import torch

from furlong.engine.base import EngineError, EngineRefused, FinishReason, Generation, SamplingParams
from furlong.sync.handover import serialize_named_tensors
from furlong.sync.serving import CLIENT_KEEPALIVE_S

_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
INITIAL_VERSION_LABEL = "default"  # ServerArgs.weight_version when --weight-version is not given


def sampling_params(s: SamplingParams) -> dict[str, Any]:
    """furlong's SamplingParams as SGLang's `sampling_params` (sampling/sampling_params.py): top_k -1 is
    SGLang's "no top-k", and a temperature of 0 is its greedy switch as it is ours."""
    out: dict[str, Any] = {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k if s.top_k > 0 else -1,
        "max_new_tokens": s.max_new_tokens,
        "stop_token_ids": list(s.stop_token_ids),
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if s.seed is not None:  # reproducible per request only with SGLang's --enable-deterministic-inference
        out["sampling_seed"] = s.seed
    return out


def parse_version(label: Any) -> int:
    """SGLang's weight_version is a free string; furlong sends str(int). Its startup default means 0."""
    if label is None or label == INITIAL_VERSION_LABEL:
        return 0
    try:
        return int(label)
    except (TypeError, ValueError):
        raise EngineError(
            f"SGLang weight_version {label!r} is not an integer (start the server with "
            "--weight-version 0, or let furlong launch it)"
        ) from None


def parse_generation(out: Any, prompt_len: int, sent_version: int) -> Generation:
    """A non-streamed /generate reply -> Generation. The token ids come from `output_token_logprobs`
    ([logprob, token_id, text] triples) and must equal `output_ids`, so ids and logprobs cannot drift."""
    if not isinstance(out, dict) or not isinstance(out.get("meta_info"), dict):
        raise EngineError(f"SGLang /generate: expected an object with meta_info, got {str(out)[:300]}")
    meta = out["meta_info"]
    triples = meta.get("output_token_logprobs")
    if triples is None:
        raise EngineError("SGLang /generate: no meta_info.output_token_logprobs (return_logprob was ignored?)")
    ids = [int(t[1]) for t in triples]
    logprobs = [t[0] for t in triples]
    if "output_ids" in out and list(out["output_ids"]) != ids:
        raise EngineError(
            f"SGLang /generate: output_ids {out['output_ids'][:8]}... disagree with the ids of "
            f"output_token_logprobs {ids[:8]}..."
        )
    if any(lp is None for lp in logprobs):
        raise EngineError("SGLang /generate: an output token has no logprob")
    reason = meta.get("finish_reason") or {}
    finish = _FINISH.get(reason.get("type") or "") if isinstance(reason, dict) else None
    if finish is None:
        raise EngineError(f"SGLang /generate: unknown finish_reason {reason!r}")
    return Generation(
        output_ids=tuple(ids),
        logprobs=tuple(float(lp) for lp in logprobs),
        finish_reason=finish,
        weight_version=sent_version,
        token_weight_versions=(sent_version,) * len(ids),
        prompt_len=prompt_len,
    )


def is_adapter_state(state_dict: Mapping[str, Any]) -> bool:
    return bool(state_dict) and all(".lora_A." in k or ".lora_B." in k for k in state_dict)


class SGLangEngine:
    """An SGLang server at `url`. Full-weight updates go through a checkpoint written under `staging_dir`
    (/update_weights_from_disk: works wherever the server can read that directory) or, with
    `weights_via="tensor"`, through /update_weights_from_tensor (same host only). LoRA-only updates become a
    new adapter (/load_lora_adapter) that later requests select. `server` is stopped by close()."""

    def __init__(
        self,
        url: str,
        *,
        staging_dir: Path | None = None,
        base_model_dir: Path | None = None,
        weights_via: str = "disk",
        timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        server: Any = None,
    ) -> None:
        if weights_via not in ("disk", "tensor"):
            raise ValueError(f"weights_via must be 'disk' or 'tensor', got {weights_via!r}")
        self.url = url.rstrip("/")
        self.staging_dir, self.base_model_dir, self.weights_via = staging_dir, base_model_dir, weights_via
        self.server = server
        # A refused or dead connection fails within connect_timeout_s; only a generation may take long.
        self._client = httpx.AsyncClient(
            base_url=self.url,
            trust_env=False,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64, keepalive_expiry=CLIENT_KEEPALIVE_S),
        )
        self._version = 0
        self._lora: str | None = None  # adapter name sent as `lora_path` with every request
        self._adapter_config: dict | None = None
        self.last_update: dict[str, float] = {}  # sync_stage_s, sync_pause_s of the last update

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def lora(self) -> str | None:
        return self._lora

    async def _request(self, method: str, route: str, body: dict | None = None) -> httpx.Response:
        try:
            resp = await self._client.request(method, route, json=body)
        except httpx.HTTPError as e:
            raise EngineError(f"SGLang at {self.url}{route}: {type(e).__name__}: {e}") from e
        if resp.status_code != 200:
            error = EngineRefused if 400 <= resp.status_code < 500 else EngineError
            raise error(f"SGLang at {self.url}{route}: HTTP {resp.status_code}: {resp.text[:500]}")
        return resp

    async def _post_json(self, route: str, body: dict | None = None) -> Any:
        resp = await self._request("POST", route, body if body is not None else {})
        try:
            return resp.json()
        except json.JSONDecodeError:
            raise EngineError(f"SGLang at {self.url}{route}: expected JSON, got {resp.text[:300]!r}") from None

    async def generate(self, input_ids: list[int], sampling: SamplingParams | None = None) -> Generation:
        s = sampling or SamplingParams()
        prompt = [int(t) for t in input_ids]
        if not prompt:
            raise EngineError("input_ids is empty")
        body: dict[str, Any] = {
            "input_ids": prompt,
            "sampling_params": sampling_params(s),
            "return_logprob": True,
            "logprob_start_len": -1,
        }  # -1: logprobs of the output tokens only
        if self._lora is not None:
            body["lora_path"] = self._lora  # a loaded adapter's name selects it for this request
        sent = self._version
        out = await self._post_json("/generate", body)
        return parse_generation(out, len(prompt), sent)

    async def score(self, input_ids: list[int], start: int, temperature: float = 1.0) -> list[float]:
        """The logprobs of input_ids[start:] from SGLang's input-token logprobs (`return_logprob` from
        `logprob_start_len` = start; one token sampled and dropped). SGLang's input logprobs are untempered:
        only temperature 1 is served."""
        ids = [int(t) for t in input_ids]
        if not 1 <= int(start) < len(ids):
            raise EngineError(f"start: expected 1 <= start < len(input_ids) = {len(ids)}, got {start}")
        if temperature != 1.0:
            raise EngineError(f"temperature: the sglang engine scores at temperature 1 only, got {temperature}")
        body: dict[str, Any] = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": int(start),
        }
        if self._lora is not None:
            body["lora_path"] = self._lora
        out = await self._post_json("/generate", body)
        got = (out.get("meta_info") or {}).get("input_token_logprobs") or []
        values = [entry[0] for entry in got]
        if len(values) != len(ids) - start or any(v is None for v in values):
            raise EngineError(f"SGLang at {self.url}: {len(values)} input logprobs for {len(ids) - start} tokens")
        return [float(v) for v in values]

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """The Engine protocol's update: LoRA tensors become a new adapter, others go via disk or tensor."""
        start = time.perf_counter()
        if is_adapter_state(state_dict):
            await self._update_adapter(state_dict, version)
        elif self.weights_via == "tensor":
            await self.update_weights_from_tensor(state_dict, version)
        else:
            staged = await asyncio.to_thread(self._stage, state_dict, version)
            await self.update_weights_from_disk(staged, version)
        self.last_update["sync_stage_s"] = time.perf_counter() - start - self.last_update["sync_pause_s"]
        self._drop_staged(keep=version)

    async def update_weights_from_disk(self, model_dir: Path | str, version: int) -> dict:
        """POST /update_weights_from_disk (UpdateWeightFromDiskReqInput): the server reads the checkpoint at
        `model_dir` (a Hugging Face directory it can see) and labels later tokens with `version`."""
        body = {"model_path": str(model_dir), "weight_version": str(version), "abort_all_requests": False}
        return await self._timed_update("/update_weights_from_disk", body, version)

    async def update_weights_from_tensor(self, state_dict: Mapping[str, torch.Tensor], version: int) -> dict:
        """POST /update_weights_from_tensor (UpdateWeightsFromTensorReqInput), one serialized copy for a
        tp_size 1 server. Tensors are cloned: sharing them would move the trainer's own storage to shm."""
        named = [(k, v.detach().clone()) for k, v in state_dict.items()]
        body = {
            "serialized_named_tensors": [serialize_named_tensors(named)],
            "flush_cache": True,
            "abort_all_requests": False,
            "weight_version": str(version),
        }
        return await self._timed_update("/update_weights_from_tensor", body, version)

    async def _timed_update(self, route: str, body: dict, version: int) -> dict:
        start = time.perf_counter()
        out = await self._succeeded(route, body)
        self._version = version
        # The server stops scheduling for the load, so the call's duration bounds the generation pause.
        self.last_update = {"sync_pause_s": time.perf_counter() - start}
        return out

    async def init_weights_update_group(self, body: dict) -> dict:
        """POST /init_weights_update_group (InitWeightsUpdateGroupReqInput; furlong.sync.broadcast.GroupSpec's
        body): the server joins the trainer's group from rank `rank_offset` on (one rank per tensor-parallel
        worker; furlong's BroadcastLink gives each member one rank, so tp_size 1). Returns once joined."""
        return await self._succeeded("/init_weights_update_group", body)

    async def update_weights_from_distributed(self, body: dict) -> dict:
        """POST /update_weights_from_distributed (UpdateWeightsFromDistributedReqInput; a Manifest's body) while
        rank 0 broadcasts the tensors; a body with weight_version labels later tokens with it."""
        start = time.perf_counter()
        out = await self._succeeded("/update_weights_from_distributed", body)
        if body.get("weight_version") is not None:
            self._version = parse_version(body["weight_version"])
        self.last_update = {"sync_pause_s": time.perf_counter() - start}  # the server stops scheduling to load
        return out

    async def destroy_weights_update_group(self, group_name: str) -> dict:
        """POST /destroy_weights_update_group (DestroyWeightsUpdateGroupReqInput)."""
        return await self._succeeded("/destroy_weights_update_group", {"group_name": group_name})

    async def _succeeded(self, route: str, body: dict) -> dict:
        out = await self._post_json(route, body)
        if not out.get("success", False):  # a refusal, whatever the HTTP status (some servers answer 200)
            raise EngineRefused(f"SGLang at {self.url}{route} refused: {out.get('message')}")
        return out

    def _stage(self, state_dict: Mapping[str, torch.Tensor], version: int) -> Path:
        """Write the tensors as a safetensors checkpoint (with the base model's config) for the server."""
        from safetensors.torch import save_file

        if self.staging_dir is None:
            raise EngineError("SGLangEngine: updates from disk need staging_dir (a directory the server can read)")
        out = self.staging_dir / f"v{version}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        # clone(): tied tensors (embeddings / lm_head) share storage, which safetensors refuses to save.
        save_file(
            {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()},
            str(out / "model.safetensors"),
        )
        for name in ("config.json", "generation_config.json"):
            if self.base_model_dir is not None and (self.base_model_dir / name).is_file():
                shutil.copy(self.base_model_dir / name, out / name)
        return out

    def _drop_staged(self, keep: int) -> None:
        if self.staging_dir is not None and self.staging_dir.is_dir():
            for old in self.staging_dir.glob("v*"):
                if old.name != f"v{keep}":
                    shutil.rmtree(old, ignore_errors=True)

    async def _update_adapter(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Save the adapter (PEFT layout) as `v<version>`, load it, select it, unload the previous one."""
        from safetensors.torch import save_file

        if self._adapter_config is None or self.staging_dir is None:
            raise EngineError("SGLangEngine: a LoRA update needs a loaded adapter (load_lora) and staging_dir")
        out = self.staging_dir / f"v{version}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        save_file(
            {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()},
            str(out / "adapter_model.safetensors"),
        )
        (out / "adapter_config.json").write_text(json.dumps(self._adapter_config))
        previous = self._lora
        start = time.perf_counter()
        await self.load_lora(f"v{version}", out)
        self.select_lora(f"v{version}")
        self._version = version
        self.last_update = {"sync_pause_s": time.perf_counter() - start}  # loading an adapter pauses nothing
        if previous is not None and previous != f"v{version}":
            await self.unload_lora(previous)

    async def load_lora(self, name: str, path: Path | str, *, pinned: bool = False) -> dict:
        """POST /load_lora_adapter (LoadLoRAAdapterReqInput: lora_name, lora_path, pinned). The server must
        run with --enable-lora (and --max-lora-rank / --lora-target-modules if none was given at start)."""
        self._remember_adapter_config(Path(path))
        out = await self._post_json("/load_lora_adapter", {"lora_name": name, "lora_path": str(path), "pinned": pinned})
        if not out.get("success", False):
            raise EngineError(f"SGLang could not load LoRA adapter {name!r} from {path}: {out.get('error_message')}")
        return out

    async def unload_lora(self, name: str) -> dict:
        """POST /unload_lora_adapter (UnloadLoRAAdapterReqInput: lora_name)."""
        out = await self._post_json("/unload_lora_adapter", {"lora_name": name})
        if not out.get("success", False):
            raise EngineError(f"SGLang could not unload LoRA adapter {name!r}: {out.get('error_message')}")
        if self._lora == name:
            self._lora = None
        return out

    def select_lora(self, name: str | None, path: Path | None = None) -> None:
        """Which adapter later requests use (its name goes in `lora_path`); None: the base model. `path`: the
        adapter's directory when it was loaded at server start (its config shapes later LoRA updates)."""
        if path is not None:
            self._remember_adapter_config(Path(path))
        self._lora = name

    def _remember_adapter_config(self, path: Path) -> None:
        if (path / "adapter_config.json").is_file():
            self._adapter_config = json.loads((path / "adapter_config.json").read_text())

    async def pause(self, mode: str = "in_place") -> None:
        """POST /pause_generation. in_place (PauseGenerationReqInput): running requests stay in the batch
        with their KV cache and continue after resume(), as the Engine protocol asks; "abort" ends them,
        "retract" requeues them (their KV may then be flushed and recomputed)."""
        await self._post_json("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        """POST /continue_generation."""
        await self._post_json("/continue_generation", {})

    async def flush_cache(self) -> bool:
        """POST /flush_cache: False when SGLang refuses (400: requests are running or waiting)."""
        try:
            await self._request("POST", "/flush_cache")
        except EngineError as e:
            if "HTTP 400" in str(e):
                return False
            raise
        return True

    async def health(self) -> bool:
        """GET /health: 200 once the server has generated its warm-up token; 503 while starting."""
        try:
            await self._request("GET", "/health")
        except EngineError:
            return False
        return True

    async def model_info(self) -> dict:
        """GET /get_model_info (model_path, is_generation, weight_version, ...); syncs weight_version."""
        info = (await self._request("GET", "/get_model_info")).json()
        self._version = parse_version(info.get("weight_version"))
        return info

    async def close(self) -> None:
        await self._client.aclose()
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)

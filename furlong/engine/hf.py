"""In-process engine over a Hugging Face causal LM, with continuous batching.

Any number of asyncio tasks call `generate`; one background task runs *steps*. A step, under `_step_lock`:
decode one token for every running request (one batched forward), then admit waiting requests (prefill,
first token) into the running batch, then retire finished ones. Admitted prompts are prefilled together (a few
forwards of similar length), each after the longest prefix whose KV the prefix cache holds (furlong.engine.prefix:
the earlier turns of the same episode, the group's shared prompt); a retired request's KV goes into that cache. New requests join and finished ones leave at
step boundaries. All torch work runs on one dedicated worker thread so the event loop (sandboxes, other
episodes) stays responsive. `update_weights` and `pause` take the same lock, so weights never change and
pauses never begin in the middle of a step; an update empties the prefix cache (its KV came from older weights)
and recomputes the running requests' KV under the new weights.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from furlong.engine.base import EngineError, FinishReason, Generation, SamplingParams, check_prompt, check_score
from furlong.engine.kv import KV, DecodeBatch, PrefillRow, SoloBatch, prefill
from furlong.engine.prefix import PrefixCache
from furlong.engine.sampling import sample_next
from furlong.model.fp8 import is_quantized
from furlong.model.loading import load_model
from furlong.model.moe import UNKNOWN, RouteHooks, moe_routers
from furlong.sync.checksum import quantized_digest


@dataclass
class EngineStats:
    prefill_calls: int = 0  # prefill forwards (each may hold several prompts)
    decode_steps: int = 0
    generated_tokens: int = 0
    decode_batch_sizes: dict[int, int] = field(default_factory=dict)  # batch size -> number of steps
    prompt_tokens: int = 0  # every admitted request's prompt
    prefill_tokens: int = 0  # of those, the tokens a prefill forward ran (the rest reused KV)
    cached_tokens: int = 0  # of those reused, the ones found in the prefix cache (the rest: a group's shared prompt)
    prefix_evictions: int = 0
    recomputed_tokens: int = 0  # context re-prefilled for running requests after weight updates

    @property
    def reused_tokens(self) -> int:
        return self.prompt_tokens - self.prefill_tokens

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens whose KV was reused (prefix cache or a group member's prefill) / prompt tokens."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def max_decode_batch(self) -> int:
        return max(self.decode_batch_sizes, default=0)


@dataclass(eq=False)
class _Request:
    prompt: list[int]
    sampling: SamplingParams
    rng: random.Random
    future: asyncio.Future[Generation]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    kv_epoch: int = -1  # the engine's weight epoch when this request's KV started (see HFEngine._epoch)
    routes: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (first position, [n, layers, top_k])

    def result(self, current_version: int) -> Generation:
        return Generation(
            output_ids=tuple(self.output_ids),
            logprobs=tuple(self.logprobs),
            finish_reason=self.finish or "abort",
            weight_version=min(self.versions, default=current_version),
            token_weight_versions=tuple(self.versions),
            prompt_len=len(self.prompt),
            routes=self._routes(),
        )

    def _routes(self) -> torch.Tensor | None:
        """Every position's recorded experts, a later forward's overwriting an earlier one's (a recompute
        after a weight update re-prefills the context under the new weights)."""
        if not self.routes:
            return None
        shape = self.routes[0][1].shape[1:]
        out = torch.full((len(self.prompt) + len(self.output_ids), *shape), UNKNOWN, dtype=torch.int16)
        for start, part in self.routes:
            out[start : start + len(part)] = part
        return out


class HFEngine:
    """Token-in/token-out engine over an in-process HF model. Use one per event loop."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_batch_size: int = 64,
        eos_token_ids: Sequence[int] | None = None,
        max_context: int | None = None,
        seed: int = 0,
        weight_version: int = 0,
        prefix_cache_mb: float = 256,
        batch_prefill: bool = True,
        max_prefill_tokens: int = 8192,
        deterministic: bool = False,
        record_routes: bool = False,
    ) -> None:
        """`eos_token_ids` stop every request in addition to its own stop ids (None: the model's
        generation_config eos ids; () for none). `max_context` caps prompt + output (default: the model's
        max_position_embeddings). `prefix_cache_mb` bounds the prefix cache's KV (0: no cache);
        `batch_prefill` False prefills one distinct prompt per forward; a batched prefill forward holds at
        most `max_prefill_tokens` padded tokens (one longer prompt goes alone). `deterministic` makes a seeded
        request's tokens and logprobs a function of the request and the weights alone, whatever else is
        running: each prompt is prefilled whole and alone (no prefix cache, no shared forwards; identical
        prompts still share theirs, the same computation) and each row decodes in its own forward
        (kv.SoloBatch); slower, see docs/training.md#reproducibility. `record_routes` (on an MoE model; a
        dense one has none) keeps the experts every MoE layer chose for each token a forward ran, returned as
        Generation.routes for the trainer's routing replay (furlong.model.moe)."""
        self.model = model.eval()
        self.max_batch_size = max_batch_size
        self.eos_token_ids = frozenset(_default_eos(model) if eos_token_ids is None else eos_token_ids)
        self.max_context = max_context or int(getattr(model.config, "max_position_embeddings", 1 << 31))
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.stats = EngineStats()
        self.deterministic = deterministic
        # A cache hit's KV came from another request's forwards (other shapes, other bits): none when deterministic.
        self.prefix_cache = PrefixCache(0 if deterministic else int(prefix_cache_mb * 2**20))
        self.batch_prefill = batch_prefill and not deterministic
        self.max_prefill_tokens = max_prefill_tokens
        self._version = weight_version
        self._epoch = 0  # bumped by every weight update: KV from an older epoch is never cached
        self._seeds = random.Random(seed)  # RNG seeds for requests that bring none
        self._pending: list[_Request] = []
        self._batch: DecodeBatch[_Request] | SoloBatch[_Request] = SoloBatch() if deterministic else DecodeBatch()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="furlong-hf")
        self._loop_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._step_lock = asyncio.Lock()
        self._closed = False
        self._recorder = RouteHooks(model, record=True) if record_routes and moe_routers(model) else None

    @classmethod
    def from_pretrained(cls, path: Path | str, dtype: torch.dtype = torch.float32, **kwargs: Any) -> HFEngine:
        return cls(load_model(path, dtype=dtype), **kwargs)

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams | None = None) -> Generation:
        sampling = sampling or SamplingParams()
        prompt = self._check_prompt(input_ids)
        seed = sampling.seed if sampling.seed is not None else self._seeds.getrandbits(64)
        request = _Request(prompt, sampling, random.Random(seed), asyncio.get_running_loop().create_future())
        self._pending.append(request)
        self._ensure_loop()
        self._wake.set()
        # A cancelled caller cancels the future; the loop drops that request at the next step boundary.
        return await request.future

    async def score(self, input_ids: Sequence[int], start: int, temperature: float = 1.0) -> list[float]:
        """One forward over `input_ids` on the engine's worker thread (between decode steps, never beside a
        weight update): fp32 log-softmax of the tempered logits, the trainer's token_logprobs numerics."""
        ids = check_score(
            input_ids, start, temperature, closed=self._closed, vocab_size=self.vocab_size, max_context=self.max_context
        )
        async with self._step_lock:
            return await asyncio.get_running_loop().run_in_executor(
                self._executor, self._score, ids, start, temperature
            )

    def _score(self, ids: list[int], start: int, temperature: float) -> list[float]:
        device = next(self.model.parameters()).device
        tokens = torch.tensor([ids], device=device)
        with torch.inference_mode():
            logits = self.model(input_ids=tokens, use_cache=False).logits[0, start - 1 : -1]
            z = logits.float() / temperature
            chosen = z.gather(-1, tokens[0, start:, None]).squeeze(-1) - z.logsumexp(dim=-1)
        return chosen.cpu().tolist()

    def _check_prompt(self, input_ids: Sequence[int]) -> list[int]:
        return check_prompt(input_ids, closed=self._closed, vocab_size=self.vocab_size, max_context=self.max_context)

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy `state_dict` (all or some of the model's tensors) into the model between steps. Tokens sampled
        afterwards carry `version`. Running requests continue (a partial rollout) on KV recomputed under the
        new weights, so each token after the update is sampled from the new policy alone, as AReaL's
        interruptible rollouts do: new weights attending to KV the old ones computed would sample from
        neither policy, and no trainer could reproduce those logprobs. The prefix cache is emptied."""
        async with self._step_lock:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._executor, self._load_weights, state_dict)
            self._version = version
            self._epoch += 1
            self.prefix_cache.clear()
            await loop.run_in_executor(self._executor, self._recompute_running)

    def _recompute_running(self) -> None:
        """Worker thread: re-prefill every running request's context (prompt and the tokens fed back so far;
        the last sampled token is fed by the next decode step) under the current weights."""
        rows = list(self._batch.rows)
        if not rows:
            return
        todo = [PrefillRow(r.prompt + r.output_ids[:-1]) for r in rows]
        kvs: dict[int, KV] = {}
        with torch.inference_mode():
            for chunk, _, chunk_kvs, routes in self._prefills(todo):
                kvs.update(zip(chunk, chunk_kvs, strict=True))
                for i, part in zip(chunk, routes, strict=True):
                    if part is not None:
                        rows[i].routes.append((0, part))
        self._batch.keep([])
        self._batch.add(rows, [kvs[i] for i in range(len(rows))])
        for r in rows:
            r.kv_epoch = self._epoch  # its KV is the current weights' alone again: cacheable when it retires
        self.stats.recomputed_tokens += sum(len(row.tokens) for row in todo)

    def fp8_digest(self) -> str:
        """quantized_digest over the fp8 weights and scales this engine holds (furlong.model.fp8.Fp8Linear):
        equal to the trainer's Publisher.fp8_digest exactly when both hold the same quantized tensors."""
        state = self.model.state_dict()
        return quantized_digest(state, [n for n, t in state.items() if is_quantized(n, t)])

    def check_weights(self, shapes: Mapping[str, Sequence[int]]) -> None:
        """EngineError unless update_weights would take tensors of these names and shapes (changes nothing)."""
        self._checked_targets(shapes)

    def _checked_targets(self, shapes: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        # keep_vars: the live tensors, including tied aliases such as lm_head.weight.
        targets = self.model.state_dict(keep_vars=True)
        shapes = _adapter_names(self.model, shapes, targets)
        unknown = sorted(set(shapes) - set(targets))
        if unknown:
            raise EngineError(f"update_weights: unknown tensors {unknown[:5]} (of {len(unknown)})")
        for name, shape in shapes.items():
            shape = tuple(shape.shape if isinstance(shape, torch.Tensor) else shape)
            if shape != tuple(targets[name].shape):
                raise EngineError(
                    f"update_weights: {name} has shape {shape}, model expects {tuple(targets[name].shape)}"
                )
        return dict(shapes), targets

    def _load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        state_dict, targets = self._checked_targets(state_dict)  # everything checked before anything is touched
        with torch.no_grad():
            for name, tensor in state_dict.items():
                targets[name].copy_(tensor)

    async def pause(self) -> None:
        """Stop scheduling steps; returns once the step in progress (if any) has finished."""
        self._resumed.clear()
        async with self._step_lock:
            pass

    async def resume(self) -> None:
        self._resumed.set()
        self._wake.set()

    async def abort_all(self) -> int:
        """Finish every running and waiting request now with finish_reason "abort", keeping the tokens
        generated so far (a partial rollout the caller may continue later). Returns how many were aborted."""
        async with self._step_lock:
            return self._abort_open()

    def _abort_open(self) -> int:
        requests = [*self._batch.rows, *self._pending]
        self._batch.keep([])
        self._pending.clear()
        for request in requests:
            self._resolve(request)
        return len(requests)

    async def close(self) -> None:
        """Abort every open request (as abort_all) and stop the loop; later generate() calls fail."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._resumed.set()
        if self._loop_task is not None:
            await asyncio.wait([self._loop_task])  # its own failure was already reported to its requests
        self._abort_open()
        self._executor.shutdown(wait=True)
        if self._recorder is not None:
            self._recorder.close()

    async def __aenter__(self) -> HFEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="furlong-hf-engine")
            self._loop_task.add_done_callback(self._on_loop_exit)

    def _on_loop_exit(self, task: asyncio.Task[None]) -> None:
        """A crashed scheduler must not leave callers waiting forever: fail what it was serving."""
        if task.cancelled() or task.exception() is None:
            return
        self._fail([*self._batch.rows, *self._pending], task.exception() or RuntimeError("engine loop died"))
        self._pending.clear()

    async def _run(self) -> None:
        while not self._closed:
            if not self._pending and not self._batch.rows:
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._resumed.wait()
            async with self._step_lock:
                # Re-check under the lock: pause() may have won the lock between the wait and here.
                if self._closed or not self._resumed.is_set():
                    continue
                await self._step()
            await asyncio.sleep(0)  # let callers enqueue requests and updates between steps

    async def _step(self) -> None:
        self._drop_cancelled()
        admitted = self._pending[: max(0, self.max_batch_size - len(self._batch))]
        del self._pending[: len(admitted)]
        if not admitted and not self._batch.rows:
            return
        loop = asyncio.get_running_loop()
        try:
            done = await loop.run_in_executor(self._executor, self._compute_step, admitted, self._version)
        except Exception as e:  # noqa: BLE001  # a failed forward fails its requests, not the engine
            self._fail([*self._batch.rows, *admitted], e)
            return
        for request in done:
            self._resolve(request)

    def _compute_step(self, admitted: list[_Request], version: int) -> list[_Request]:
        """Worker thread: one decode step for the running rows, then prefill the admitted ones."""
        with torch.inference_mode():
            if self._recorder is not None:
                self._recorder.take()  # drop what a failed step's forwards recorded: no request owns it
            running = list(self._batch.rows)
            if running:
                logits = self._batch.step(self.model, [r.output_ids[-1] for r in running])
                if self._recorder is not None:  # one token per row, in row order (SoloBatch: one forward each)
                    for r, part in zip(running, self._recorder.take().split(1), strict=True):
                        r.routes.append((len(r.prompt) + len(r.output_ids) - 1, part))
                self.stats.decode_steps += 1
                sizes = self.stats.decode_batch_sizes
                sizes[len(running)] = sizes.get(len(running), 0) + 1
                self._sample(running, logits, version)
            if admitted:
                self._admit(admitted, version)
            rows = self._batch.rows
            done = [i for i, r in enumerate(rows) if r.finish is not None]
            for i in done:
                self._remember(rows[i], self._batch.row_kv(i) if self._cacheable(rows[i]) else None)
            self._batch.keep([i for i, r in enumerate(rows) if r.finish is None])
            return [rows[i] for i in done]

    def _admit(self, admitted: list[_Request], version: int) -> None:
        """Prefill the admitted requests (identical prompts once) and sample their first tokens."""
        groups: dict[tuple[int, ...], list[_Request]] = {}
        for r in admitted:
            r.kv_epoch = self._epoch
            groups.setdefault(tuple(r.prompt), []).append(r)
        members = list(groups.values())
        todo = []
        for group in members:
            hit = self.prefix_cache.lookup(group[0].prompt)
            todo.append(PrefillRow(group[0].prompt[hit.tokens :], hit.kv))
            self.stats.cached_tokens += hit.tokens
        self.stats.prompt_tokens += sum(len(r.prompt) for r in admitted)
        self.stats.prefill_tokens += sum(len(row.tokens) for row in todo)
        rows: list[_Request] = []
        kvs: list[KV] = []
        logits_rows: list[torch.Tensor] = []
        for chunk, logits, chunk_kvs, routes in self._prefills(todo):
            for j, i in enumerate(chunk):
                if (part := routes[j]) is not None:
                    for r in members[i]:
                        r.routes.append((todo[i].cached_len, part))
                rows += members[i]
                kvs += [chunk_kvs[j]] * len(members[i])
                logits_rows.append(logits[j : j + 1].expand(len(members[i]), -1))
        self._batch.add(rows, kvs)
        self._sample(rows, torch.cat(logits_rows), version)

    def _prefills(
        self, todo: list[PrefillRow]
    ) -> Iterator[tuple[list[int], torch.Tensor, list[KV], list[torch.Tensor | None]]]:
        """The prefill forwards for `todo`, batched by _chunks: per forward, the indices of its rows in
        `todo`, their last-position logits, their KV and (record_routes) the experts each of their tokens
        went to. Admission and recompute both prefill this way."""
        for chunk in _chunks([len(row.tokens) for row in todo], self.max_prefill_tokens if self.batch_prefill else 0):
            rows = [todo[i] for i in chunk]
            logits, kvs = prefill(self.model, rows)
            self.stats.prefill_calls += 1
            routes: list[torch.Tensor | None] = [None] * len(rows)
            if self._recorder is not None:  # the forward's rows are right-padded to its longest, flattened
                taken = self._recorder.take()
                taken = taken.view(len(rows), -1, *taken.shape[1:])
                routes = [taken[j, : len(row.tokens)] for j, row in enumerate(rows)]
            yield chunk, logits, kvs, routes

    def _cacheable(self, request: _Request) -> bool:
        # Only KV computed entirely under the current weights: no update since the request's prefill.
        return self.prefix_cache.max_bytes > 0 and request.kv_epoch == self._epoch

    def _remember(self, request: _Request, kv: KV | None) -> None:
        """Cache a retired request's KV: its prompt and every sampled token but the last (never fed back)."""
        if kv is None:
            return
        before = self.prefix_cache.evictions
        self.prefix_cache.insert(request.prompt + request.output_ids[:-1], kv)
        self.stats.prefix_evictions += self.prefix_cache.evictions - before

    def _sample(self, rows: list[_Request], logits: torch.Tensor, version: int) -> None:
        tokens, logprobs = sample_next(logits, [r.sampling for r in rows], [r.rng for r in rows])
        self.stats.generated_tokens += len(rows)
        for r, token, logprob in zip(rows, tokens, logprobs, strict=True):
            r.output_ids.append(token)
            r.logprobs.append(logprob)
            r.versions.append(version)
            if token in self.eos_token_ids or token in r.sampling.stop_token_ids:
                r.finish = "stop"
            elif (
                len(r.output_ids) >= r.sampling.max_new_tokens or len(r.prompt) + len(r.output_ids) >= self.max_context
            ):
                r.finish = "length"

    def _drop_cancelled(self) -> None:
        self._pending = [r for r in self._pending if not r.future.done()]
        rows = self._batch.rows
        self._batch.keep([i for i, r in enumerate(rows) if not r.future.done()])

    def _resolve(self, request: _Request) -> None:
        if not request.future.done():
            request.future.set_result(request.result(self._version))

    def _fail(self, requests: list[_Request], error: BaseException) -> None:
        self._batch.keep([])
        for request in requests:
            if not request.future.done():
                request.future.set_exception(EngineError(f"engine step failed: {error!r}"))


def _chunks(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices of `lengths` grouped into prefill forwards, longest first. A forward pads every row to its
    longest, so a row joins only while the padded total stays within `max_tokens` and at most twice the real
    tokens (or under 512: short forwards cost mostly fixed overhead). max_tokens 0: one row per forward."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    chunks: list[list[int]] = []
    real = 0
    for i in order:
        if chunks and max_tokens:
            padded = (len(chunks[-1]) + 1) * lengths[chunks[-1][0]]
            if padded <= max_tokens and (padded <= 2 * (real + lengths[i]) or padded <= 512):
                chunks[-1].append(i)
                real += lengths[i]
                continue
        chunks.append([i])
        real = lengths[i]
    return chunks


def _default_eos(model: PreTrainedModel) -> list[int]:
    config = getattr(model, "generation_config", None) or model.config
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _adapter_names(model: Any, state_dict: Mapping[str, Any], targets: Mapping[str, torch.Tensor]) -> Mapping[str, Any]:
    """A PEFT model's live adapter tensors are `...lora_A.<adapter>.weight`; PEFT saves (and furlong publishes)
    `...lora_A.weight`. Map saved names onto the active adapter's live ones; other models are unaffected."""
    adapter = getattr(model, "active_adapter", None)
    if not isinstance(adapter, str):
        return state_dict
    out = {}
    for name, tensor in state_dict.items():
        head, _, leaf = name.rpartition(".")
        live = f"{head}.{adapter}.{leaf}"
        out[live if name not in targets and live in targets else name] = tensor
    return out

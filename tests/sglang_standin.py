"""SGLangStandIn: a TEST DOUBLE for an SGLang server, because SGLang cannot be installed on this machine.

It is a real FastAPI/uvicorn server on loopback that answers SGLang's native routes with SGLang's request and
response shapes (as documented in sgl-project/sglang: entrypoints/http_server.py, managers/io_struct.py,
sampling/sampling_params.py, managers/tokenizer_manager.py) and serves a real model with furlong's in-process
hf engine, so tokens and logprobs are real. It answers like a server started with --skip-tokenizer-init
(no "text" in a reply) and implements only what furlong uses:

  GET  /health, /get_model_info
  POST /generate              single `input_ids`, `sampling_params`, `return_logprob` (with `logprob_start_len`
                              >= 0: input_token_logprobs), `lora_path` (a name)
  POST /update_weights_from_disk, /update_weights_from_tensor, /load_lora_adapter, /unload_lora_adapter,
       /pause_generation {"mode"}, /continue_generation, /flush_cache,
       /init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group
       (tp_size 1: the server is rank `rank_offset`; received over furlong.sync.broadcast's group, either
       layout, each request loaded at once as SGLang does)

A switch that SGLang does not have, for tests only: POST /standin/refuse {"route": "update_weights_from_distributed"
or "init_weights_update_group", "times": n} makes the next n calls of that route refuse as SGLang's do, with
HTTP 200 and {"success": false, "message": ...}, and do nothing else (no join, nothing received).

Each loaded adapter is served by its own copy of the model with the adapter merged in. Pause modes: "abort"
ends running requests (finish_reason abort); "in_place" and "retract" both hold them in the hf engine.
Run: python -m tests.sglang_standin --model-path DIR --host 127.0.0.1 --port N [SGLang's LoRA flags]
(unknown SGLang flags are accepted and ignored, so furlong's launcher starts it like the real server).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import copy
import pickle
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  registers the tensor reductions pickle.loads needs
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from safetensors.torch import load_file

from furlong.engine.base import EngineError, Generation, SamplingParams
from furlong.engine.hf import HFEngine
from furlong.model.loading import load_model
from furlong.sync.broadcast import GroupSpec, Manifest, WeightGroup


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)  # http_server._create_error_response


def to_sampling(p: dict[str, Any]) -> SamplingParams:
    """SGLang sampling_params -> furlong's (its defaults: max_new_tokens 128, top_k -1 = off)."""
    top_k = int(p.get("top_k", -1) if p.get("top_k") is not None else -1)
    return SamplingParams(temperature=float(p.get("temperature", 1.0)), top_p=float(p.get("top_p", 1.0)),
                          top_k=0 if top_k < 0 or top_k >= 1 << 30 else top_k,
                          max_new_tokens=int(p.get("max_new_tokens") or 128),
                          stop_token_ids=tuple(p.get("stop_token_ids") or ()), seed=p.get("sampling_seed"))


def finish_reason(gen: Generation) -> dict:
    """schedule_batch.FINISH_MATCHED_TOKEN / FINISH_LENGTH / FINISH_ABORT .to_json()."""
    if gen.finish_reason == "stop":
        return {"type": "stop", "matched": gen.output_ids[-1]}
    if gen.finish_reason == "length":
        return {"type": "length", "length": gen.num_tokens}
    return {"type": "abort", "message": "Abort in waiting queue"}


class SGLangStandIn:
    """The stand-in's state: the base engine, one engine per adapter, the version label, in-flight count."""

    def __init__(self, model_dir: Path, *, weight_version: str = "default", seed: int = 0) -> None:
        self.model_dir = model_dir
        self.model = load_model(model_dir)
        self.seed = seed
        self.engines: dict[str | None, HFEngine] = {None: HFEngine(self.model, seed=seed)}
        self.adapters: dict[str, str] = {}
        self.weight_version = weight_version
        self.in_flight = 0
        self.groups: dict[str, WeightGroup] = {}
        self.refusals: dict[str, int] = {}  # the test switch: route -> how many more calls to refuse

    def refusal(self, route: str) -> dict | None:
        """The refusal owed to this call of `route` by the test switch, if any."""
        if self.refusals.get(route, 0) <= 0:
            return None
        self.refusals[route] -= 1
        return {"success": False, "message": f"stand-in: {route} refused by the test switch"}

    async def generate(self, body: dict) -> dict | JSONResponse:
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            return _error("the stand-in takes one prompt as a flat list of input_ids")
        engine = self.engines.get(body.get("lora_path"))
        if engine is None:
            return _error(f"LoRA adapter {body.get('lora_path')!r} is not loaded")
        start = time.time()
        first = int(body.get("logprob_start_len", -1))
        self.in_flight += 1
        try:
            # SGLang's input_token_logprobs from logprob_start_len (untempered; None for token 0, which has none)
            inputs = [None] * (first == 0) + await engine.score(ids, max(first, 1)) if first >= 0 else None
            gen = await engine.generate(ids, to_sampling(body.get("sampling_params") or {}))
        except (EngineError, ValueError) as e:
            return _error(str(e))
        finally:
            self.in_flight -= 1
        meta: dict[str, Any] = {"id": f"standin-{start}", "finish_reason": finish_reason(gen),
                                "prompt_tokens": len(ids), "weight_version": self.weight_version,
                                "completion_tokens": gen.num_tokens, "cached_tokens": 0,
                                "e2e_latency": time.time() - start}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(gen.logprobs, gen.output_ids)]
            if inputs is not None:
                meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(inputs, ids[first:])]
        return {"output_ids": list(gen.output_ids), "meta_info": meta}

    async def load_weights(self, state: dict[str, torch.Tensor], version: Any) -> dict | JSONResponse:
        try:
            await self.engines[None].update_weights(state, self.engines[None].weight_version + 1)
        except EngineError as e:
            return JSONResponse({"success": False, "message": str(e), "num_paused_requests": 0}, status_code=400)
        message = "Succeeded to update model weights."
        if version is not None:
            self.weight_version = str(version)
            message += f" Weight version updated to {version}."
        return {"success": True, "message": message, "num_paused_requests": 0}

    async def load_from_disk(self, body: dict) -> dict | JSONResponse:
        files = sorted(Path(body.get("model_path", "")).glob("*.safetensors"))
        if not files:
            return JSONResponse({"success": False, "message": f"no safetensors in {body.get('model_path')!r}",
                                 "num_paused_requests": 0}, status_code=400)
        tensors = {k: v for f in files for k, v in load_file(str(f)).items()}
        return await self.load_weights(tensors, body.get("weight_version"))

    async def load_from_tensors(self, body: dict) -> dict | JSONResponse:
        # One serialized copy per TP rank (rank 0 here): a ForkingPickler dump of [(name, tensor), ...].
        named = pickle.loads(base64.b64decode(body["serialized_named_tensors"][0]))
        result = await self.load_weights(dict(named), body.get("weight_version"))
        return {k: v for k, v in result.items() if k != "num_paused_requests"} if isinstance(result, dict) else result

    async def init_group(self, body: dict) -> dict | JSONResponse:
        if refused := self.refusal("init_weights_update_group"):
            return refused
        try:
            spec = GroupSpec(**{k: body[k] for k in ("master_address", "master_port", "rank_offset", "world_size")},
                             group_name=body.get("group_name", "weight_update_group"),
                             backend=body.get("backend", "nccl"))
        except (KeyError, TypeError, ValueError) as e:
            return JSONResponse({"success": False, "message": f"bad request: {e!r}"}, status_code=400)
        self.groups[spec.group_name] = await asyncio.to_thread(WeightGroup, spec, spec.rank_offset, 60.0)
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    async def load_from_distributed(self, body: dict) -> dict | JSONResponse:
        if refused := self.refusal("update_weights_from_distributed"):
            return refused
        group = self.groups.get(body.get("group_name", "weight_update_group"))
        if group is None:
            return JSONResponse({"success": False, "message": "Please call `init_weights_update_group` first."},
                                status_code=400)
        manifest = Manifest(names=tuple(body["names"]), dtypes=tuple(body["dtypes"]),
                            shapes=tuple(tuple(s) for s in body["shapes"]), load_format=body.get("load_format"))
        tensors = await asyncio.to_thread(group.receive, manifest)
        return await self.load_weights(tensors, body.get("weight_version"))

    async def destroy_group(self, body: dict) -> dict:
        self.groups.pop(body.get("group_name", "weight_update_group"), None)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    async def load_lora(self, name: str, path: str) -> dict | JSONResponse:
        from peft import PeftModel

        if name in self.adapters:
            return _lora_reply(False, self.adapters, f"LoRA adapter {name!r} is already loaded")
        try:
            merged = PeftModel.from_pretrained(copy.deepcopy(self.model), path).merge_and_unload()
        except (OSError, ValueError) as e:
            return _lora_reply(False, self.adapters, f"cannot load {path}: {e}")
        self.engines[name] = HFEngine(merged.eval(), seed=self.seed)
        self.adapters[name] = path
        return _lora_reply(True, self.adapters)

    async def unload_lora(self, name: str) -> dict | JSONResponse:
        if name not in self.adapters:
            return _lora_reply(False, self.adapters, f"LoRA adapter {name!r} is not loaded")
        await self.engines.pop(name).close()
        del self.adapters[name]
        return _lora_reply(True, self.adapters)


def _lora_reply(success: bool, adapters: dict[str, str], error: str | None = None) -> dict | JSONResponse:
    body = {"success": success, "error_message": error, "loaded_adapters": dict(adapters)}  # LoRAUpdateOutput
    return body if success else JSONResponse(body, status_code=400)


def build_app(state: SGLangStandIn) -> FastAPI:
    app = FastAPI(title="SGLangStandIn (test double of an SGLang server)")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info() -> dict:
        return {"model_path": str(state.model_dir), "tokenizer_path": str(state.model_dir), "is_generation": True,
                "preferred_sampling_params": None, "weight_version": state.weight_version}

    @app.post("/generate")
    async def generate(request: Request):
        return await state.generate(await request.json())

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        return await state.load_from_disk(await request.json())

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        return await state.load_from_tensors(await request.json())

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        return await state.init_group(await request.json())

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        return await state.load_from_distributed(await request.json())

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        return await state.destroy_group(await request.json())

    @app.post("/standin/refuse")
    async def refuse(request: Request):
        body = await request.json()
        if body.get("route") not in ("init_weights_update_group", "update_weights_from_distributed"):
            return _error(f"the stand-in's switch refuses only the weight group routes, not {body.get('route')!r}")
        state.refusals[body["route"]] = int(body.get("times", 1))
        return {"success": True, "refusals": state.refusals}

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await request.json()
        return await state.load_lora(body["lora_name"], body["lora_path"])

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        return await state.unload_lora((await request.json())["lora_name"])

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict:
        mode = (await request.json() if await request.body() else {}).get("mode", "abort")
        for engine in state.engines.values():
            if mode == "abort":
                await engine.abort_all()
            await engine.pause()
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation() -> dict:
        for engine in state.engines.values():
            await engine.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        # SGLang refuses while requests run or wait; the hf engine keeps no cache between requests.
        return Response(content="Cache flushed.\n", status_code=400 if state.in_flight else 200)

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--lora-paths", nargs="*", default=[])
    args, _ignored = parser.parse_known_args(argv)  # --dtype, --enable-lora, --max-lora-rank, ...: not needed
    torch.set_num_threads(1)
    state = SGLangStandIn(args.model_path, weight_version=args.weight_version, seed=args.random_seed)
    for item in args.lora_paths:
        name, _, path = item.partition("=")
        asyncio.run(state.load_lora(name, path))
    uvicorn.run(build_app(state), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()

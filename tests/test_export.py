"""The policy exported as a Hugging Face directory (furlong.train.export): plain transformers and PEFT load
it, and it computes exactly what the trainer's model computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from furlong.model.loading import load_model, load_tokenizer
from furlong.train.export import ADAPTER_DIR, write_hf

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IDS = torch.tensor([[5, 17, 99, 250, 3, 1024, 7, 42]])


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _perturb(model, scale: float, only: str = "") -> None:
    """Weights a trainer could have produced: the export must not just reproduce the checkpoint it started from."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if only in name:
                p.add_(scale * torch.randn(p.shape, generator=g))


def test_export_loads_with_plain_transformers_and_gives_the_same_logits(tiny_dir: Path, tmp_path: Path):
    policy = load_model(tiny_dir)
    _perturb(policy, 0.01)
    out = write_hf(policy, load_tokenizer(tiny_dir), tmp_path / "ckpt" / "hf")
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32).eval()
    assert torch.equal(_logits(loaded), _logits(policy))
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tok.chat_template and tok("ls -la").input_ids == load_tokenizer(tiny_dir)("ls -la").input_ids
    assert loaded.generation_config.eos_token_id == policy.generation_config.eos_token_id

    # written atomically: a second export replaces the first whole, and no temporary directory is left
    _perturb(policy, 0.01)
    write_hf(policy, load_tokenizer(tiny_dir), out)
    again = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32).eval()
    assert torch.equal(_logits(again), _logits(policy)) and not torch.equal(_logits(again), _logits(loaded))
    assert [p.name for p in out.parent.iterdir()] == ["hf"]


def test_lora_export_is_a_merged_model_plus_a_peft_adapter(tiny_dir: Path, tmp_path: Path):
    from peft import PeftModel

    from furlong.model.lora import LoraSpec, wrap_lora

    policy = wrap_lora(load_model(tiny_dir), LoraSpec(rank=4, alpha=8))
    _perturb(policy, 0.05, only="lora_B")  # lora_B starts at zero: without this the adapter is the identity
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    out = write_hf(policy, load_tokenizer(tiny_dir), tmp_path / "hf", base_model=tiny_dir)
    want = _logits(policy)
    assert not torch.allclose(want, _logits(load_model(tiny_dir)), atol=1e-3)  # the adapter matters

    merged = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32).eval()
    assert not any("lora" in k for k in merged.state_dict())
    torch.testing.assert_close(_logits(merged), want, atol=2e-5, rtol=0)  # merging rounds in fp32

    adapter = out / ADAPTER_DIR
    assert (adapter / "adapter_config.json").is_file()
    peft = PeftModel.from_pretrained(load_model(tiny_dir), str(adapter)).eval()
    assert torch.equal(_logits(peft), want)
    # the live policy was not merged (merging in place and unmerging would leave rounding error)
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())

"""Bad Hugging Face directories get one clear message naming the problem — from the API as an
ArchcError, from the CLI as one line on stderr and exit status 2, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import archc
from archc.cli import main
from archc.errors import ArchcError, SpecError, WeightsError

safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs safetensors")
transformers = pytest.importorskip("transformers", reason="needs transformers "
                                   "(pip install 'archc[hf]')")


def gpt2_dir(directory: Path, **config: Any) -> Path:
    """A tiny GPT-2 saved by transformers."""
    cfg = transformers.GPT2Config(n_embd=32, n_head=4, n_layer=1, n_positions=16,
                                  vocab_size=50, bos_token_id=1, eos_token_id=2, **config)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(directory)
    return directory


def edit_config(directory: Path, **changes: Any) -> None:
    path = directory / "config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def edit_tensors(directory: Path, edit: Any) -> None:
    path = directory / "model.safetensors"
    tensors = dict(safetensors_torch.load_file(str(path)))
    edit(tensors)
    safetensors_torch.save_file(tensors, str(path))


def cli_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    capsys.readouterr()  # what building the test model printed
    status = main(list(argv))
    out, err = capsys.readouterr()
    assert status == 2, (out, err)
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


def test_directory_without_config_json(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SpecError, match=r"has no config.json"):
        archc.load(tmp_path)
    assert "has no config.json" in cli_error(capsys, "run", str(tmp_path), "--prompt", "hi")


def test_unsupported_model_type_names_the_supported_ones(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "rwkv"}))
    with pytest.raises(SpecError, match=r"model_type: 'rwkv' is not supported \(allowed: bert, "
                       r"bloom, cohere2, deepseek_v2, deepseek_v3, exaone4, falcon, gemma, "
                       r"gemma2, gemma3_text, glm4, "
                       r"gpt2, gpt_neox, gpt_oss, gptj, granite, jamba, llama, llama4_text, "
                       r"mamba, mistral, mixtral, mpt, olmo2, opt, phi, phi3, qwen2, qwen3, "
                       r"qwen3_moe, qwen3_next, smollm3, starcoder2, t5\)"):
        archc.load(tmp_path)
    assert "'rwkv' is not supported" in cli_error(capsys, "export-spec", str(tmp_path))


def test_config_that_is_not_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{model_type: llama")
    with pytest.raises(SpecError, match=r"config.json: is not valid JSON at line 1"):
        archc.load(tmp_path)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("scale_attn_by_inverse_layer_idx", True, r"scale_attn_by_inverse_layer_idx: True cannot "
     r"be honoured for model_type 'gpt2'"),
    ("add_cross_attention", True, r"add_cross_attention: True cannot be honoured"),
    ("activation_function", "quick_gelu", r"activation_function: 'quick_gelu' cannot be "
     r"honoured.*activations are"),
    ("attention_temperature", 0.5, r"attention_temperature: 0.5 is a field archc does not "
     r"know for model_type 'gpt2'"),
    ("pruned_heads", {"0": [1]}, r"pruned_heads: .* cannot be honoured"),
])
def test_config_field_archc_cannot_honour_is_refused_by_name(
        field: str, value: Any, message: str, tmp_path: Path) -> None:
    gpt2_dir(tmp_path)
    edit_config(tmp_path, **{field: value})
    with pytest.raises(SpecError, match=message):
        archc.load(tmp_path)


@pytest.mark.parametrize("field,value", [
    ("unk_token_id", 0), ("_model_name_or_path", "org/model"), ("cls_token_id", 3),
    ("mask_token_id", 4)])
def test_bookkeeping_fields_of_common_configs_are_accepted(field: str, value: Any,
                                                           tmp_path: Path) -> None:
    gpt2_dir(tmp_path)
    edit_config(tmp_path, **{field: value})
    assert archc.load(tmp_path).spec.layers == 1


@pytest.mark.parametrize(("rope", "message"), [
    ({"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0, "short_factor": [1.0]},
     r"rope_parameters.long_factor: None cannot be honoured"),
    ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "extrapolation_factor": 0.7},
     r"rope_parameters.extrapolation_factor: 0.7 cannot be honoured"),
    ({"rope_type": "default", "rope_theta": 1e4, "factor": 2.0},
     r"rope_parameters.factor: 2.0 cannot be honoured"),
])
def test_rope_settings_archc_cannot_honour(rope: dict[str, Any], message: str,
                                           tmp_path: Path) -> None:
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   max_position_embeddings=32)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    edit_config(tmp_path, rope_parameters=rope)
    with pytest.raises(SpecError, match=message):
        archc.load(tmp_path)


def test_missing_tensor_names_it_and_its_shape(tmp_path: Path) -> None:
    gpt2_dir(tmp_path)
    edit_tensors(tmp_path, lambda t: t.pop("transformer.h.0.mlp.c_fc.bias"))
    with pytest.raises(WeightsError, match=r"checkpoint tensor 'transformer.h.0.mlp.c_fc.bias' "
                       r"is missing \(expected shape \[128\], for archc's layers.0.ffn.up.bias"):
        archc.load(tmp_path)


def test_misshaped_tensor_names_expected_and_found(tmp_path: Path) -> None:
    gpt2_dir(tmp_path)
    edit_tensors(tmp_path, lambda t: t.update({"transformer.h.0.attn.c_proj.weight":
                                               torch.zeros(32, 31)}))
    with pytest.raises(WeightsError, match=r"'transformer.h.0.attn.c_proj.weight' has shape "
                       r"\[32, 31\], expected \[32, 32\]"):
        archc.load(tmp_path)


def test_unexpected_tensor_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gpt2_dir(tmp_path)
    edit_tensors(tmp_path, lambda t: t.update({"transformer.h.0.attn.extra.weight":
                                               torch.zeros(2, 3)}))
    with pytest.raises(WeightsError, match=r"tensors the model does not use: "
                       r"'transformer.h.0.attn.extra.weight' \[2, 3\]"):
        archc.load(tmp_path)
    assert "does not use" in cli_error(capsys, "run", str(tmp_path))


def test_truncated_safetensors_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gpt2_dir(tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(WeightsError, match=r"model.safetensors: not a readable safetensors "
                       r"file .*truncated"):
        archc.load(tmp_path)
    assert "not a readable safetensors file" in cli_error(capsys, "run", str(tmp_path))


def test_pickle_checkpoints_are_never_loaded(tmp_path: Path) -> None:
    gpt2_dir(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(WeightsError, match=r"no \*.safetensors weights; pytorch_model.bin is a "
                       r"pickle, which archc never loads"):
        archc.load(tmp_path)


def test_sharded_checkpoint_with_a_missing_shard(tmp_path: Path) -> None:
    gpt2_dir(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"transformer.wte.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(WeightsError, match=r"lists model-00002-of-00002.safetensors, which is "
                       r"not in"):
        archc.load(tmp_path)


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    whole = gpt2_dir(tmp_path / "whole")
    sharded = tmp_path / "sharded"
    model = transformers.GPT2LMHeadModel.from_pretrained(whole)
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    a, b = archc.load(whole), archc.load(sharded)
    assert a.weights is not None and b.weights is not None
    assert a.weights.keys() == b.weights.keys()
    assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)


def test_every_error_is_an_archc_error() -> None:
    assert issubclass(SpecError, ArchcError) and issubclass(WeightsError, ArchcError)


def test_tensorflow_era_layernorm_names_load_as_transformers_renames_them(tmp_path: Path) -> None:
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=4, intermediate_size=48,
                                  max_position_embeddings=16)
    transformers.BertModel(cfg).save_pretrained(tmp_path)
    plain = archc.load(tmp_path)

    def rename(tensors: dict[str, torch.Tensor]) -> None:
        for name in [n for n in tensors if ".LayerNorm." in n]:
            tensors[name.replace(".weight", ".gamma").replace(".bias", ".beta")] = \
                tensors.pop(name)

    edit_tensors(tmp_path, rename)
    legacy = archc.load(tmp_path)
    assert plain.weights is not None and legacy.weights is not None
    assert all(torch.equal(plain.weights[k], legacy.weights[k]) for k in plain.weights)
    assert any("pooler" in note for note in legacy.notes)   # skipped, and said so

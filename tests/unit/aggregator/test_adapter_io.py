"""PEFT directories in and out (collm_common.adapter_io) with a tiny Llama built from a config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from collm_common.adapter_io import AdapterImportError, export_peft_dir, import_peft_dir, same_base_model
from collm_common.lora import decode_adapter, encode_adapter

pytestmark = pytest.mark.unit
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
BASE = "tiny-llama-test"


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def saved_adapter(tmp_path: Path, name: str = "peft", **lora: object) -> tuple[Path, torch.nn.Module]:
    kw: dict[str, object] = {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "v_proj"],
        "lora_dropout": 0.0,
    }
    kw.update(lora)
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(init_lora_weights=False, **kw)).eval()
    model.peft_config["default"].base_model_name_or_path = BASE
    out = tmp_path / name
    model.save_pretrained(str(out))
    return out, model


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[1, 5, 9, 13, 2]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_round_trip_through_a_blob_loads_in_peft_with_the_same_outputs(tmp_path: Path) -> None:
    src, model = saved_adapter(tmp_path)
    weights = import_peft_dir(src, expected_base_model=BASE)
    assert weights.spec.r == 4 and weights.spec.target_modules == ("q_proj", "v_proj")
    assert weights.base_model == BASE
    blob = encode_adapter(weights)
    out = export_peft_dir(blob, tmp_path / "exported")
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["base_model_name_or_path"] == BASE
    loaded = peft.PeftModel.from_pretrained(tiny_llama(), str(out)).eval()
    torch.testing.assert_close(logits(loaded), logits(model))
    # and the exported directory imports back to the same tensors
    again = import_peft_dir(out)
    assert decode_adapter(encode_adapter(again)).tensors.keys() == weights.tensors.keys()
    for k, v in weights.tensors.items():
        torch.testing.assert_close(again.tensors[k], v)


def test_rslora_is_folded_into_an_equivalent_alpha(tmp_path: Path) -> None:
    src, model = saved_adapter(tmp_path, use_rslora=True)
    weights = import_peft_dir(src)
    assert weights.spec.alpha == pytest.approx(8 * 2.0)  # alpha * sqrt(r)
    out = export_peft_dir(weights, tmp_path / "plain")
    loaded = peft.PeftModel.from_pretrained(tiny_llama(), str(out)).eval()
    torch.testing.assert_close(logits(loaded), logits(model))


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "not supported"),
        ({"r": 128, "lora_alpha": 8}, "outside"),
    ],
)
def test_unservable_adapters_are_refused(tmp_path: Path, lora: dict[str, object], message: str) -> None:
    src, _ = saved_adapter(tmp_path, **lora)
    with pytest.raises(AdapterImportError, match=message):
        import_peft_dir(src, max_rank=64)


def test_wrong_base_model_pickles_and_broken_files_are_refused(tmp_path: Path) -> None:
    src, _ = saved_adapter(tmp_path)
    with pytest.raises(AdapterImportError, match="expected base model"):
        import_peft_dir(src, expected_base_model="someone/other-model")
    with pytest.raises(AdapterImportError, match="not a directory"):
        import_peft_dir(tmp_path / "missing")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(AdapterImportError, match="pickle"):
        import_peft_dir(pickled)
    (pickled / "adapter_model.bin").unlink()
    (pickled / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(AdapterImportError, match="safetensors"):
        import_peft_dir(pickled)
    (pickled / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterImportError, match="JSON"):
        import_peft_dir(pickled)


def test_nan_and_unpaired_tensors_and_shape_expectations(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    src, _ = saved_adapter(tmp_path)
    tensors = load_file(str(src / "adapter_model.safetensors"))
    key_a = next(k for k in tensors if k.endswith("lora_A.weight"))
    bad = dict(tensors)
    bad[key_a] = bad[key_a].clone()
    bad[key_a][0, 0] = float("nan")
    save_file(bad, str(src / "adapter_model.safetensors"))
    with pytest.raises(AdapterImportError, match="NaN"):
        import_peft_dir(src)
    unpaired = {k: v for k, v in tensors.items() if k != key_a}
    save_file(unpaired, str(src / "adapter_model.safetensors"))
    with pytest.raises(AdapterImportError, match="no matching lora_A"):
        import_peft_dir(src)
    save_file(tensors, str(src / "adapter_model.safetensors"))
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    import_peft_dir(src, expected_shapes=shapes)
    shapes[key_a] = (4, 999)
    with pytest.raises(AdapterImportError, match="shape"):
        import_peft_dir(src, expected_shapes=shapes)


def test_same_base_model() -> None:
    assert same_base_model("HuggingFaceTB/SmolLM2-135M-Instruct", "/models/SmolLM2-135M-Instruct/")
    assert not same_base_model("a/x", "a/y")
    assert not same_base_model("", "x")

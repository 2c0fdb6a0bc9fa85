"""PEFT directories in and out (collm_common.adapter_io) with a tiny Llama built from a config."""

from __future__ import annotations

import json
import os
import pickle
import tempfile
from pathlib import Path

import pytest
import torch

from collm_common.adapter_io import (
    AdapterAccessDenied,
    AdapterImportError,
    AdapterNotFound,
    check_base_dims,
    export_peft_dir,
    import_peft_dir,
    same_base_model,
)
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
    with pytest.raises(AdapterNotFound, match="does not exist"):
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


def test_paths_that_name_nothing_are_not_found(tmp_path: Path) -> None:
    src, _ = saved_adapter(tmp_path)
    a_file = src / "adapter_config.json"
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    for path, reason in [
        (tmp_path / "missing", "No such file"),
        (a_file / "sub", "Not a directory"),
        (tmp_path / ("x" * 300), "too long"),
        (loop, "symbolic links"),
    ]:
        with pytest.raises(AdapterNotFound, match=reason):
            import_peft_dir(path)
    with pytest.raises(AdapterImportError, match="is a file, not a PEFT adapter directory") as err:
        import_peft_dir(a_file)
    assert type(err.value) is AdapterImportError


def _import_as_nobody(path: Path) -> BaseException | None:
    """import_peft_dir(path) in a child process without root's right to read anything (uid 65534)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop root, import, send back what it raised
        code = 0
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            try:
                import_peft_dir(path)
                result: BaseException | None = None
            except Exception as exc:
                result = exc
            os.write(write_fd, pickle.dumps(result))
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and data
    return pickle.loads(data)


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_unreadable_paths_are_access_denied(tmp_path: Path) -> None:
    with tempfile.TemporaryDirectory() as root:
        top = Path(root)
        top.chmod(0o755)
        src, _ = saved_adapter(top, "locked")
        # A directory that may not be listed, and one whose weights file may not be read.
        readable, _ = saved_adapter(top, "open")
        readable.chmod(0o755)
        for f in readable.iterdir():
            f.chmod(0o644)
        (readable / "adapter_model.safetensors").chmod(0o000)
        src.chmod(0o000)
        if os.geteuid() == 0:
            errors = [_import_as_nobody(src), _import_as_nobody(readable)]
        else:
            errors = []
            for path in (src, readable):
                try:
                    import_peft_dir(path)
                    errors.append(None)
                except AdapterImportError as exc:
                    errors.append(exc)
        src.chmod(0o755)
        for err in errors:
            assert isinstance(err, AdapterAccessDenied), repr(err)
            assert "Permission denied" in str(err)


def _rewrite_weights(src: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(src / "adapter_model.safetensors"))


def test_content_that_is_no_servable_lora_is_refused_with_the_reason(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    src, _ = saved_adapter(tmp_path)
    good = load_file(str(src / "adapter_model.safetensors"))
    key_a = sorted(k for k in good if k.endswith("q_proj.lora_A.weight"))[0]
    key_b = key_a.replace("lora_A", "lora_B")

    def with_(changes: dict[str, torch.Tensor], drop: tuple[str, ...] = ()) -> None:
        _rewrite_weights(src, {**{k: v for k, v in good.items() if k not in drop}, **changes})

    cases: list[tuple[dict[str, torch.Tensor], tuple[str, ...], str]] = [
        ({key_a: good[key_a].to(torch.int32)}, (), "dtype int32"),
        ({key_a: good[key_a].to(torch.float8_e4m3fn)}, (), "dtype float8_e4m3fn"),
        ({key_a: torch.zeros(4, 0), key_b: torch.zeros(0, 4)}, (), "empty"),
        ({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 32)}, (), "not a LoRA A/B weight"),
        ({"model.layers.0.self_attn.q_proj.weight": torch.zeros(32, 32)}, (), "not a LoRA A/B weight"),
        ({key_a.replace("self_attn", "mlp"): good[key_a]}, (key_a,), "belongs to self_attn"),
        # one layer with other in/out features than the rest: not the layers of one base model
        ({key_a: torch.ones(4, 48), key_b: torch.ones(48, 4)}, (), "same shapes"),
    ]
    for changes, drop, message in cases:
        with_(changes, drop)
        with pytest.raises(AdapterImportError, match=message):
            import_peft_dir(src)
    _rewrite_weights(src, good)
    cfg = json.loads((src / "adapter_config.json").read_text())
    for bad_cfg, message in [
        ({**cfg, "target_modules": 5}, "list of module names"),
        ({**cfg, "r": 1e400}, "integer r"),
        ({**cfg, "peft_type": "PREFIX_TUNING"}, "only LoRA"),
    ]:
        (src / "adapter_config.json").write_text(json.dumps(bad_cfg))
        with pytest.raises(AdapterImportError, match=message):
            import_peft_dir(src)
    (src / "adapter_config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(AdapterImportError, match="JSON"):
        import_peft_dir(src)
    (src / "adapter_config.json").write_text(json.dumps(cfg))
    import_peft_dir(src)  # and the directory as saved is fine


def test_check_base_dims_compares_in_and_out_features_at_any_rank(tmp_path: Path) -> None:
    r4 = import_peft_dir(saved_adapter(tmp_path, "r4")[0])
    r8 = import_peft_dir(
        saved_adapter(tmp_path, "r8", r=8, lora_alpha=16, target_modules=["q_proj", "o_proj"])[0]
    )
    shapes = {k: tuple(v.shape) for k, v in r4.tensors.items()}
    check_base_dims(
        {k: tuple(v.shape) for k, v in r8.tensors.items()}, shapes
    )  # q_proj agrees, o_proj unknown
    wider = {k: (s[0], 48) if k.endswith("q_proj.lora_A.weight") else s for k, s in shapes.items()}
    with pytest.raises(
        AdapterImportError, match=r"q_proj has in/out features \(48, 32\); the base model's are \(32, 32\)"
    ):
        check_base_dims(wider, shapes)

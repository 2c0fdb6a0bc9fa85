"""The custom forward is provably the model: logits equal HF's, and with a LoRA equal PEFT's."""

from __future__ import annotations

import pytest
import torch

from collm_common.lora import AdapterWeights, LoraSpec, decode_adapter, encode_adapter
from collm_replica.engine.executor import Executor, ForwardItem, LayerPass
from collm_replica.lora_bank import AdapterMismatch, LiveLora, LoraBank
from collm_replica.models import LoadedModel, build_tiny_model, load_model

PROMPT = [5, 17, 42, 99, 120, 7, 3, 250, 11, 64, 33]


def random_adapter(tiny: LoadedModel, seed: int, spec: LoraSpec | None = None) -> AdapterWeights:
    ex = Executor(tiny)
    spec = spec or LoraSpec()
    live = LiveLora.init_new(spec, ex.n_layers, ex.shapes, tiny.name, seed=seed)
    g = torch.Generator().manual_seed(seed + 1000)
    for _a, b in live.params.values():
        b.data.copy_(torch.randn(b.shape, generator=g) * 0.3)
    return live.to_weights()


def make_bank(ex: Executor, slots: int = 4) -> LoraBank:
    return LoraBank(
        slots, ex.n_layers, ex.shapes, ("q_proj", "k_proj", "v_proj", "o_proj"), 16, ex.dtype, ex.device
    )


def test_forward_equals_hf_logits(tiny: LoadedModel) -> None:
    ex = Executor(tiny)
    kv = ex.new_kv(64)
    (mine,) = ex.forward([ForwardItem(PROMPT, 0, kv, all_logits=True)])
    with torch.no_grad():
        ref = tiny.model(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(mine, ref, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_and_decode_equal_hf(tiny: LoadedModel) -> None:
    """Prefill in two chunks, then decode tokens one by one: same logits as one full HF pass."""
    ex = Executor(tiny)
    kv = ex.new_kv(64, initial_tokens=2)  # forces growth of the cache
    a = ex.forward([ForwardItem(PROMPT[:4], 0, kv, all_logits=True)])[0]
    b = ex.forward([ForwardItem(PROMPT[4:9], 4, kv, all_logits=True)])[0]
    c = [ex.forward([ForwardItem([t], 9 + i, kv)])[0] for i, t in enumerate(PROMPT[9:])]
    mine = torch.cat([a, b, torch.stack(c)])
    with torch.no_grad():
        ref = tiny.model(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(mine, ref, atol=1e-4, rtol=1e-4)


def test_small_steps_multiply_with_fp16_copies_and_larger_ones_do_not(tiny: LoadedModel) -> None:
    """With copies for steps of at most 2 tokens: decode steps use them (close to fp32, not equal);
    a prefill of more tokens computes exactly as without them."""
    plain, small = Executor(tiny), Executor(tiny)
    small.enable_small_step_copies(torch.float16, 2)
    assert small.small_rows == 2 and small._small and small._small_head is not None
    outs = []
    for ex in (plain, small):
        kv = ex.new_kv(64)
        prefill = ex.forward([ForwardItem(PROMPT[:9], 0, kv, all_logits=True)])[0]
        decodes = [ex.forward([ForwardItem([t], 9 + i, kv)])[0] for i, t in enumerate(PROMPT[9:])]
        outs.append((prefill, torch.stack(decodes)))
    (p_plain, d_plain), (p_small, d_small) = outs
    assert torch.equal(p_plain, p_small)
    assert not torch.equal(d_plain, d_small)
    torch.testing.assert_close(d_small, d_plain, atol=2e-2, rtol=2e-2)


def test_small_step_copies_stay_off_where_every_pass_has_its_own_precision(tiny: LoadedModel) -> None:
    ex = Executor(tiny)
    ex.enable_small_step_copies(torch.float32, 3)  # the model's own dtype: nothing to gain
    ex.enable_small_step_copies(torch.float16, 0)
    assert ex.small_rows == 0 and not ex._small


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_other_architectures_equal_hf(arch: str) -> None:
    model, tok = build_tiny_model(1, arch)
    loaded = LoadedModel(arch, model.eval(), tok, torch.device("cpu"), torch.float32, 512)
    ex = Executor(loaded)
    (mine,) = ex.forward([ForwardItem(PROMPT, 0, ex.new_kv(32), all_logits=True)])
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(mine, ref, atol=1e-4, rtol=1e-4)


def test_unsupported_architecture_is_refused() -> None:
    import transformers

    from collm_replica.models import ModelLoadError, check_architecture

    m = transformers.AutoModelForCausalLM.from_config(
        transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100)
    )
    with pytest.raises(ModelLoadError, match="gpt2.*not supported"):
        check_architecture(m)


def test_lora_equals_peft(tiny: LoadedModel) -> None:
    """The bank's per-token LoRA gives PeftModel's logits for the same adapter blob."""
    from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict

    weights = decode_adapter(encode_adapter(random_adapter(tiny, seed=3)))
    ex = Executor(tiny)
    ex.bank = make_bank(ex)
    ex.bank.write(2, weights)
    (mine,) = ex.forward([ForwardItem(PROMPT, 0, ex.new_kv(32), slot=2, all_logits=True)])

    import copy

    base = copy.deepcopy(tiny.model)
    cfg = LoraConfig(
        **{
            k: v
            for k, v in weights.spec.peft_config(tiny.name).items()
            if k in ("r", "lora_alpha", "target_modules", "lora_dropout", "bias")
        }
    )
    pm = get_peft_model(base, cfg)
    set_peft_model_state_dict(pm, dict(weights.tensors.items()))
    assert isinstance(pm, PeftModel)
    pm.eval()
    with torch.no_grad():
        ref = pm(torch.tensor([PROMPT])).logits[0]
        plain = tiny.model(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(mine, ref, atol=1e-4, rtol=1e-4)
    assert (mine - plain).abs().max() > 1e-2  # the adapter really changes the output


def test_mixed_slots_in_one_batch_equal_single_runs(tiny: LoadedModel) -> None:
    ex = Executor(tiny)
    ex.bank = make_bank(ex)
    ex.bank.write(0, random_adapter(tiny, 1))
    ex.bank.write(1, random_adapter(tiny, 2))
    prompts = [(PROMPT, 0), (PROMPT[:5], 1), (PROMPT[2:], -1), (PROMPT[:7], 0)]
    alone = [ex.forward([ForwardItem(p, 0, ex.new_kv(32), slot=s)])[0] for p, s in prompts]
    together = ex.forward([ForwardItem(p, 0, ex.new_kv(32), slot=s) for p, s in prompts])
    for a, b in zip(alone, together, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert (alone[0] - ex.forward([ForwardItem(PROMPT, 0, ex.new_kv(32), slot=1)])[0]).abs().max() > 1e-3


def test_bank_refuses_mismatched_adapter(tiny: LoadedModel) -> None:
    ex = Executor(tiny)
    bank = make_bank(ex)
    w = random_adapter(tiny, 1)
    bad = AdapterWeights(
        {k: (v[:, :-1] if k.endswith("lora_A.weight") else v) for k, v in w.tensors.items()},
        w.spec,
        w.base_model,
    )
    with pytest.raises(AdapterMismatch, match="do not match"):
        bank.write(0, bad)
    too_big = random_adapter(tiny, 1, LoraSpec(r=32))
    with pytest.raises(AdapterMismatch, match="rank 32"):
        bank.write(0, too_big)
    mlp = random_adapter(tiny, 1, LoraSpec(target_modules=("gate_proj",)))
    with pytest.raises(AdapterMismatch, match="gate_proj"):
        bank.write(0, mlp)


def test_train_forward_equals_hf_and_grads_reach_only_live(tiny: LoadedModel) -> None:
    ex = Executor(tiny)
    live = LiveLora.from_weights(random_adapter(tiny, 4), ex.n_layers, ex.shapes)
    ids = torch.tensor([PROMPT, PROMPT[:6] + [0] * 5])
    mask = torch.tensor([[1] * 11, [1] * 6 + [0] * 5])
    logits = ex.train_forward(ids, mask, None)
    with torch.no_grad():
        ref = tiny.model(ids, attention_mask=mask).logits
    torch.testing.assert_close(logits[0], ref[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1, :6], ref[1, :6], atol=1e-4, rtol=1e-4)
    labels = ids.clone()
    labels[mask == 0] = -100
    loss, n = ex.response_loss(ids, mask, labels, live)
    loss.backward()
    assert n == 15
    assert all(p.grad is not None for p in live.parameters())
    assert all(p.grad is None for p in tiny.model.parameters())


def test_load_model_rejects_unknown_spec() -> None:
    from collm_replica.models import ModelLoadError

    with pytest.raises(ModelLoadError, match="neither"):
        load_model("/nonexistent/model")


def test_tiny_model_dir_loads_as_a_local_hf_directory(tiny_model_dir, tiny: LoadedModel) -> None:
    loaded = load_model(str(tiny_model_dir))
    assert loaded.name == tiny_model_dir.name and loaded.max_model_len == 512
    ex = Executor(loaded)
    (a,) = ex.forward([ForwardItem(PROMPT, 0, ex.new_kv(32))])
    (b,) = Executor(tiny).forward([ForwardItem(PROMPT, 0, Executor(tiny).new_kv(32))])
    torch.testing.assert_close(a, b)
    assert (
        loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
        )
        == "<s>user: hi</s><s>assistant: "
    )


def test_grouped_and_per_segment_lora_agree(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    import collm_replica.engine.executor as executor_mod

    ex = Executor(tiny)
    ex.bank = make_bank(ex)
    ex.bank.write(0, random_adapter(tiny, 1))
    ex.bank.write(3, random_adapter(tiny, 2, LoraSpec(r=4, alpha=8)))
    prompts = [(PROMPT, 0), (PROMPT[:5], 3), (PROMPT[2:], -1), (PROMPT[:7], 0)]
    grouped = ex.forward([ForwardItem(p, 0, ex.new_kv(32), slot=s, all_logits=True) for p, s in prompts])
    monkeypatch.setattr(executor_mod, "GROUPED_MAX_ROWS", 0)
    per_segment = ex.forward([ForwardItem(p, 0, ex.new_kv(32), slot=s, all_logits=True) for p, s in prompts])
    for a, b in zip(grouped, per_segment, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_layer_pass_in_pieces_equals_the_whole_loss_and_gradients(tiny: LoadedModel) -> None:
    """A micro-step run piece by piece (one layer, one LM-head chunk of 3 rows at a time) gives the same
    loss and the same LoRA gradients as the whole graph at once, and never touches the base weights."""
    from collm_replica.engine.executor import LayerPass

    ex = Executor(tiny)
    w = random_adapter(tiny, 4)
    ids = torch.tensor([PROMPT, PROMPT[:6] + [0] * 5])
    mask = torch.tensor([[1] * 11, [1] * 6 + [0] * 5])
    labels = ids.clone()
    labels[:, :4] = -100  # a prompt: no loss there
    labels[mask == 0] = -100
    whole = LiveLora.from_weights(w, ex.n_layers, ex.shapes)
    with torch.enable_grad():
        logits = ex.train_forward(ids, mask, whole)
        ref = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), reduction="sum"
        )
        (ref * 0.5).backward()
    pieces = LiveLora.from_weights(w, ex.n_layers, ex.shapes)
    p = LayerPass(ex, ids, mask, labels, pieces, train=True, loss_scale=0.5, head_rows=3)
    from collm_replica.costs import PieceCosts

    costs = PieceCosts({"fwd": (2.0, 0.0), "head": (1.0, 1.0), "bwd": (3.0, 0.0)})
    kinds, left = [], []
    while not p.done:
        left.append(p.remaining_ms(costs))
        kinds.append(p.run_piece())
    n = ex.n_layers
    assert kinds == ["fwd"] * n + ["head"] * 3 + ["bwd"] * n  # 9 labelled rows in chunks of 3
    # the predicted rest: every piece ahead at its model's cost (a head chunk of 3 rows costs 1 + 3)
    assert left[0] == 2.0 * n + 3 * 4.0 + 3.0 * n and left[n] == 3 * 4.0 + 3.0 * n and left[-1] == 3.0
    assert p.remaining_ms(costs) == 0.0
    assert p.n_labels == 9 and p.tokens == 17
    assert abs(p.loss_sum - float(ref.detach())) < 1e-3
    for key, (a, b) in pieces.params.items():
        ra, rb = whole.params[key]
        torch.testing.assert_close(a.grad, ra.grad, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(b.grad, rb.grad, atol=1e-5, rtol=1e-4)
    assert all(q.grad is None for q in tiny.model.parameters())
    # Evaluation: the same loss per example, no graph, no gradient.
    ev = LayerPass(ex, ids, mask, labels, LiveLora.from_weights(w, ex.n_layers, ex.shapes), train=False)
    ev.run_all()
    assert abs(ev.loss_sum - float(ref.detach())) < 1e-3 and ev.example_labels == [7, 2]
    assert abs(float(ev.example_loss.sum()) - ev.loss_sum) < 1e-4
    loss, count = ex.response_loss(ids, mask, labels, None)
    assert count == 9 and float(loss) > 0


def test_fast_eval_scores_close_to_the_model_dtype_and_leaves_training_alone(tiny: LoadedModel) -> None:
    ex = Executor(tiny)
    w = random_adapter(tiny, 5)
    ids = torch.tensor([PROMPT, PROMPT[:6] + [0] * 5])
    mask = torch.tensor([[1] * 11, [1] * 6 + [0] * 5])
    labels = ids.clone()
    labels[:, :4] = -100
    labels[mask == 0] = -100
    live = LiveLora.from_weights(w, ex.n_layers, ex.shapes)
    exact = LayerPass(ex, ids, mask, labels, live, train=False).run_all()
    assert ex.eval_precision == ""
    ex.enable_fast_eval(torch.bfloat16)
    assert ex.eval_precision == "bfloat16-matmul"
    fast = LayerPass(ex, ids, mask, labels, live, train=False, fast=True).run_all()
    assert fast.loss_sum != exact.loss_sum  # the products really ran in bf16
    torch.testing.assert_close(fast.example_loss, exact.example_loss, rtol=2e-2, atol=2e-2)
    # A training pass ignores `fast`: same loss as before the copies existed.
    a = LayerPass(ex, ids, mask, labels, live, train=True, fast=True)
    assert not a.fast
    with torch.enable_grad():
        a.run_all()
    assert abs(a.loss_sum - exact.loss_sum) < 1e-3


def test_evaluation_batches_bound_their_padding_and_score_as_one_by_one(tiny: LoadedModel) -> None:
    from collm_replica.training import EVAL_PAD_FRAC, EvalRun, Rendered

    def item(i: int, n: int) -> Rendered:
        ids = [(7 * i + j) % 200 + 3 for j in range(n)]
        return Rendered(f"e{i}", "d", ids, [-100] * (n // 2) + ids[n // 2 :])

    items = [item(0, 100), item(1, 96), item(2, 50), item(3, 48)]
    ex = Executor(tiny)
    run = EvalRun(items, None, 4096)
    padded = []
    while not run.done:
        padded.append(run.step(ex, 0))
    # [100, 96] pads 4 of 200 tokens; adding 50 would pad 54 of 300 (> EVAL_PAD_FRAC): a batch of its own.
    assert EVAL_PAD_FRAC < 54 / 300 and padded == [200, 100]
    alone = EvalRun(items, None, 1)  # a chunk of one token: every example alone
    while not alone.done:
        alone.step(ex, 0)
    assert run.per_domain()["d"] == pytest.approx(alone.per_domain()["d"], rel=1e-5)
    assert run.tokens == alone.tokens == {"d": 50 + 48 + 25 + 24}


def test_evaluation_progress_counts_tokens_of_batches_and_layers(tiny: LoadedModel) -> None:
    from collm_replica.training import EvalRun, Rendered

    items = [Rendered(f"e{i}", "d", list(range(3, 3 + n)), [-100] * (n // 2) + list(range(3 + n // 2, 3 + n)))
             for i, n in enumerate((60, 20))]  # fmt: skip
    ex = Executor(tiny)
    run = EvalRun(items, None, 64)  # 60 and 20 tokens do not share a batch of 64
    seen = [run.progress]
    while not run.done:
        run.run_piece(ex, 0)
        seen.append(run.progress)
    assert seen[0] == 0.0 and seen[-1] == 1.0
    assert all(b >= a for a, b in zip(seen, seen[1:], strict=False))
    # After the first batch's forward and head: its 60 of 80 tokens.
    assert 60 / 80 in seen


def test_bf16_products_serve_and_train_close_to_fp32_in_every_pass(tiny: LoadedModel) -> None:
    bf = load_model("tiny", device="cpu", tiny_seed=0, matmul_dtype="bfloat16")
    assert bf.matmul_precision == "bfloat16" and tiny.matmul_precision == "float32"
    ex, ref_ex = Executor(bf), Executor(tiny)
    assert ex.fast_all and not ref_ex.fast_all and ex.eval_precision == "bfloat16-matmul"
    # Inference: the products run in bf16 (logits differ) and stay close to fp32's.
    (mine,) = ex.forward([ForwardItem(PROMPT, 0, ex.new_kv(64), all_logits=True)])
    (ref,) = ref_ex.forward([ForwardItem(PROMPT, 0, ref_ex.new_kv(64), all_logits=True)])
    assert mine.dtype == torch.float32 and not torch.equal(mine, ref)
    assert float((mine - ref).abs().max()) < 0.05 * float(ref.abs().max())  # bf16 keeps ~3 digits
    assert float((mine.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.9
    # Training: the loss and the LoRA gradients close to fp32's; the LoRA, its gradients and the base
    # weights stay fp32, and the base weights get no gradient.
    ids = torch.tensor([PROMPT, PROMPT[:6] + [0] * 5])
    mask = torch.tensor([[1] * 11, [1] * 6 + [0] * 5])
    labels = ids.clone()
    labels[mask == 0] = -100
    grads = []
    for e in (ex, ref_ex):
        live = LiveLora.from_weights(random_adapter(tiny, 4), e.n_layers, e.shapes)
        p = LayerPass(e, ids, mask, labels, live, train=True)
        assert p.fast is e.fast_all
        with torch.enable_grad():
            p.run_all()
        grads.append((p.loss_sum, torch.cat([q.grad.flatten() for q in live.parameters()])))
        assert all(q.dtype == torch.float32 and q.grad.dtype == torch.float32 for q in live.parameters())
    (loss_bf, g_bf), (loss_fp, g_fp) = grads
    assert loss_bf != loss_fp and abs(loss_bf - loss_fp) < 2e-2 * abs(loss_fp)
    assert float(torch.nn.functional.cosine_similarity(g_bf, g_fp, dim=0)) > 0.99
    assert all(q.grad is None for q in bf.model.parameters())
    # The projections are held in bf16 in place of their fp32 weights; the rest of the model stays fp32.
    proj = {id(w) for w in ex._fast.values()}
    assert len(proj) == 7 * ex.n_layers and all(w.dtype == torch.bfloat16 for w in ex._fast.values())
    assert all(q.dtype == torch.float32 for q in bf.model.parameters() if id(q) not in proj)


def test_load_model_rejects_an_unknown_matmul_dtype() -> None:
    from collm_replica.models import ModelLoadError

    with pytest.raises(ModelLoadError, match="matmul dtype"):
        load_model("tiny", matmul_dtype="float16")


def test_padded_keys_never_read_uninitialised_memory(tiny: LoadedModel) -> None:
    """Batched attention pads shorter contexts; the padding reads the pool's zeroed null slot, so a NaN
    left in a block nobody wrote (the pool is allocated uninitialised) cannot reach any output."""
    ex = Executor(tiny)
    pool = ex.init_kv_pool(num_blocks=16, block_size=4)
    pool.k[:, :, : pool.null_slot].fill_(float("nan"))
    pool.v[:, :, : pool.null_slot].fill_(float("nan"))
    short, long = ex.new_kv(64), ex.new_kv(64)
    ex.forward([ForwardItem(PROMPT[:8], 0, short), ForwardItem(PROMPT, 0, long)])
    # contexts of 9 and 12 tokens: one attention call, the shorter padded by 3 keys
    a, b = ex.forward([ForwardItem([7], 8, short), ForwardItem([7], len(PROMPT), long)])
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    (alone,) = Executor(tiny).forward([ForwardItem(PROMPT[:8] + [7], 0, Executor(tiny).new_kv(64))])
    assert torch.allclose(a, alone, atol=1e-4)

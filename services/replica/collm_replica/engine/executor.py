"""The torch executor: a Llama-family decoder run on the Hugging Face model's own weights.

Why our own forward and not `model(...)`: a batch here is *ragged* (each sequence brings a decode token or
a prefill chunk at its own position) and *multi-adapter* (each token gets the LoRA of its request's
adapter version, Punica/S-LoRA style), which transformers' forward and its continuous-batching manager do
not do. The executor reuses every module of the HF model (embedding, RMSNorms, the rotary module, the
projections, the activation, the lm_head, tied or not), so its logits equal the HF model's (tested), and
it supports llama, mistral, qwen2 and qwen3 (q/k norms); anything else is refused when loading.

Guarantees: `forward` writes each item's new keys/values into that item's own `SeqKV` and reads only
slots named by the items, so requests never see each other's state; `train_forward` builds a graph through
a `LiveLora` only (base weights are frozen), so training never touches the bank the requests read.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from collm_replica.costs import PieceCosts
from collm_replica.engine.kv import BlockManager
from collm_replica.lora_bank import MODULE_PATHS, LiveLora, LoraBank, module_shapes
from collm_replica.models import LoadedModel, check_architecture

# lora(layer, module, x, out) -> out with the adapter's delta added
LoraFn = Callable[[int, str, torch.Tensor, torch.Tensor], torch.Tensor]
# attend(layer, q [T,H,d], k [T,Hkv,d], v [T,Hkv,d]) -> [T, H*d]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class KVPool:
    """The paged KV cache's storage: for every layer, keys and values of `num_blocks * block_size` token
    slots (`[layers, kv_heads, slots, head_dim]` each: head-major, so the keys a step gathers for a
    head lie contiguous per sequence), handed out in blocks by `blocks`, the `BlockManager` of whoever
    allocates them (the engine's scheduler, `batcher.Batcher`).

    The tensors are allocated uninitialised: the OS maps a page when it is first written, and blocks are
    handed out lowest first, so resident memory follows the blocks in use, not the pool's size (with
    caching, the blocks in use and the cached ones: `kv.BlockManager`)."""

    def __init__(
        self, n_layers: int, n_kv: int, head_dim: int, blocks: BlockManager, dtype: torch.dtype,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.blocks = blocks
        self.block_size = block_size = blocks.block_size
        num_blocks = blocks.num_blocks
        # One block more than the manager hands out, zeroed: the slot padded keys read (`null_slot`), so
        # a masked key never brings uninitialised memory (a NaN there would survive its zero weight).
        shape = (n_layers, n_kv, (num_blocks + 1) * block_size, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.null_slot = num_blocks * block_size
        self.k[:, :, self.null_slot :].zero_()
        self.v[:, :, self.null_slot :].zero_()
        self._ids = itertools.count()

    def sequence(self, limit_tokens: int) -> SeqKV:
        """A new sequence's handle, holding no blocks yet, that may grow to `limit_tokens` tokens."""
        return SeqKV(self, f"kv{next(self._ids)}", limit_tokens)

    def copy_prefix(self, src: SeqKV, dst: SeqKV, tokens: int) -> None:
        """Copy the keys and values of `src`'s first `tokens` tokens into `dst` (whose blocks must hold
        them): a forked choice starts from its parent's prompt without computing it again."""
        if tokens <= 0:
            return
        to, frm = dst.slots(0, tokens), src.slots(0, tokens)
        self.k[:, :, to] = self.k[:, :, frm]
        self.v[:, :, to] = self.v[:, :, frm]
        dst.length = tokens

    def fork_prefix(self, src: SeqKV, dst: SeqKV, tokens: int) -> None:
        """Give `dst` (holding no blocks) `src`'s first `tokens` tokens: the full blocks shared, the
        tokens of a last partial block copied into a block of its own (`dst` writes there next). All or
        nothing: `OutOfBlocks` when no block is free for the copy, `dst` then holding none."""
        full = tokens // self.block_size
        self.blocks.share(dst.seq_id, src.blocks[:full])
        try:
            dst.ensure(tokens)
        except BaseException:
            dst.free()
            raise
        start = full * self.block_size
        if tokens > start:
            to, frm = dst.slots(start, tokens), src.slots(start, tokens)
            self.k[:, :, to] = self.k[:, :, frm]
            self.v[:, :, to] = self.v[:, :, frm]
        dst.length = tokens


class SeqKV:
    """One sequence's share of a `KVPool`: its block table and how many of its tokens are written.

    `ensure(n)` takes the blocks `n` tokens need from the pool (all or none: `OutOfBlocks`); `free()`
    returns them all at once (also done when the handle is garbage-collected)."""

    def __init__(self, pool: KVPool, seq_id: str, limit: int) -> None:
        self.pool = pool
        self.seq_id = seq_id
        self.limit = limit
        self.length = 0  # tokens whose keys/values are written
        self._finalizer = weakref.finalize(self, pool.blocks.free, seq_id)

    @property
    def blocks(self) -> list[int]:
        return self.pool.blocks.table(self.seq_id)

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.pool.block_size

    def ensure(self, n: int) -> None:
        if n > self.limit:
            raise ValueError(f"sequence of {n} tokens exceeds its KV limit of {self.limit}")
        self.pool.blocks.grow(self.seq_id, n)

    def free(self) -> None:
        self.pool.blocks.free(self.seq_id)
        self.length = 0

    def slots(self, start: int, end: int) -> torch.Tensor:
        """Pool slots of the sequence's tokens `start..end-1` (their blocks must be held), as a CPU
        tensor of longs."""
        bs = self.pool.block_size
        first = start // bs
        table = torch.tensor(self.blocks[first : (end - 1) // bs + 1], dtype=torch.long)
        slots = (table[:, None] * bs + torch.arange(bs)).view(-1)
        return slots[start - first * bs : end - first * bs]


@dataclass
class ForwardItem:
    """One sequence's share of an iteration: `token_ids` at positions `start_pos...`."""

    token_ids: list[int]
    start_pos: int
    kv: SeqKV  # all items of one forward share one pool
    slot: int = -1  # LoRA bank slot of its adapter version; -1 = base model
    all_logits: bool = False  # tests: logits of every position, not just the last


# Token slots of the pool `new_kv` makes when the executor was given none (`init_kv_pool`).
DEFAULT_POOL_TOKENS = 1 << 16

# Batched attention pads a group's work (sequences x longest query x longest context) to at most this
# multiple of its useful work; beyond it, sequences go to another group (another attention call).
ATTENTION_MAX_PADDING = 1.3

# Above this many (tokens x distinct adapters), LoRA is applied per adapter segment instead of grouped.
GROUPED_MAX_ROWS = 512


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Executor:
    """Runs ragged multi-adapter batches and training passes on one loaded model (see module doc)."""

    def __init__(self, loaded: LoadedModel, bank: LoraBank | None = None) -> None:
        check_architecture(loaded.model)
        self.loaded = loaded
        self.model = loaded.model
        cfg = loaded.model.config
        self.inner = loaded.model.model
        self.layers = list(self.inner.layers)
        self.n_layers = len(self.layers)
        attn0 = self.layers[0].self_attn
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(attn0, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.scaling = float(getattr(attn0, "scaling", self.head_dim**-0.5))
        self.has_qk_norm = hasattr(attn0, "q_norm") and hasattr(attn0, "k_norm")
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.shapes = module_shapes(loaded.model)
        self.bank = bank
        self.kv_pool: KVPool | None = None
        # Low-precision copies of the base projections and LM head for no-grad evaluation passes
        # (`enable_fast_eval`); empty: evaluation runs in the model's dtype like everything else.
        self._fast: dict[tuple[int, str], torch.Tensor] = {}
        self._fast_head: torch.Tensor | None = None
        # Every pass multiplies in `loaded.matmul_dtype`, not only evaluation passes (`hold_projections_in`).
        self.fast_all = False
        # Copies of the projections and LM head for inference steps of at most `small_rows` tokens
        # (`enable_small_step_copies`); `_small_pass`: the forward in progress uses them.
        self._small: dict[tuple[int, str], torch.Tensor] = {}
        self._small_head: torch.Tensor | None = None
        self.small_rows = 0
        self._small_pass = False
        if loaded.matmul_dtype is not None:
            self.hold_projections_in(loaded.matmul_dtype)

    # --- evaluation precision -------------------------------------------------------------------------
    def enable_fast_eval(self, dtype: torch.dtype = torch.bfloat16) -> None:
        """Run the base model's matrix products of evaluation passes (`LayerPass(train=False, fast=True)`)
        on a `dtype` copy of the weights: on CPUs with AMX a bf16 product is several times faster than an
        fp32 one. Only the products change precision: their inputs are cast per call and their outputs come
        back in the model's dtype, so the residual stream, norms, attention, the LoRA delta and the loss
        stay in the model's dtype. Costs a copy of the projections and LM head (about 270 MB for
        SmolLM2-135M in bf16). Inference and training never use it (see `hold_projections_in`)."""
        if dtype == self.dtype:
            return
        self._fast, self._fast_head = self._weight_copies(dtype)

    def _weight_copies(self, dtype: torch.dtype) -> tuple[dict[tuple[int, str], torch.Tensor], torch.Tensor]:
        """`dtype` copies of the base projections (by layer and module) and of the LM head."""
        copies = {}
        for i, layer in enumerate(self.layers):
            for name, path in MODULE_PATHS.items():
                parent, attr = path.split(".")
                lin = getattr(getattr(layer, parent), attr)
                copies[(i, name)] = lin.weight.detach().to(dtype).contiguous()
        return copies, self.model.lm_head.weight.detach().to(dtype).contiguous()

    def hold_projections_in(self, dtype: torch.dtype) -> None:
        """Every pass (inference, training, evaluation) multiplies in `dtype`: the base projections are
        converted in place (the model's fp32 copies are dropped: about 210 MB less for SmolLM2-135M in
        bf16) and the LM head, tied to the embedding, gets a `dtype` copy. Activations, norms, attention,
        the LoRA delta, gradients and the loss stay in the model's dtype, as with `enable_fast_eval`. The
        model then serves only through executors (an HF `model(...)` call would mix dtypes)."""
        fast = {}
        for i, layer in enumerate(self.layers):
            for name, path in MODULE_PATHS.items():
                parent, attr = path.split(".")
                lin = getattr(getattr(layer, parent), attr)
                if lin.weight.dtype != dtype:  # another executor of the same model may have done it
                    lin.weight = torch.nn.Parameter(lin.weight.detach().to(dtype).contiguous(), False)
                fast[(i, name)] = lin.weight
        self._fast = fast
        self._fast_head = self.model.lm_head.weight.detach().to(dtype).contiguous()
        self.fast_all = True

    def enable_small_step_copies(self, dtype: torch.dtype, max_rows: int) -> None:
        """Inference steps (`forward`) of at most `max_rows` tokens multiply with `dtype` copies of the base
        projections and LM head: where a product at a few rows is bound by reading the weights (a CPU
        without native bf16 products: fp32 decode at batch 1-3), half the bytes make the step faster.
        Inputs are cast per call and outputs come back in the model's dtype, as with `enable_fast_eval`;
        training and evaluation passes and larger steps are unchanged. Costs a copy of the weights
        (about 270 MB for SmolLM2-135M in fp16). Nothing to do on an accelerator, where the products
        already multiply the model's own dtype, or while every pass uses `hold_projections_in`'s."""
        if max_rows <= 0 or dtype == self.dtype or self.fast_all or self.device.type != "cpu":
            return
        self._small, self._small_head = self._weight_copies(dtype)
        self.small_rows = max_rows

    @property
    def eval_precision(self) -> str:
        """How evaluation passes compute: "" (the model's dtype) or e.g. "bfloat16-matmul"."""
        if not self._fast:
            return ""
        return str(next(iter(self._fast.values())).dtype).removeprefix("torch.") + "-matmul"

    def _fast_linear(self, lin: torch.nn.Module, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x.to(w.dtype), w).to(x.dtype)
        bias = getattr(lin, "bias", None)
        return out + bias if bias is not None else out

    # --- KV ------------------------------------------------------------------------------------------
    def init_kv_pool(self, num_blocks: int, block_size: int = 16, caching: bool = False) -> KVPool:
        """Give this executor a paged KV pool of `num_blocks` blocks with a block manager of its own
        (`attach_kv_pool`); `caching`: released registered blocks stay cached (`kv.BlockManager`)."""
        return self.attach_kv_pool(BlockManager(num_blocks, block_size, caching))

    def attach_kv_pool(self, blocks: BlockManager) -> KVPool:
        """Give this executor its paged KV pool: the keys' and values' tensors of the blocks `blocks`
        hands out (replacing any earlier pool, whose handles stay valid)."""
        self.kv_pool = KVPool(self.n_layers, self.n_kv, self.head_dim, blocks, self.dtype, self.device)
        return self.kv_pool

    def new_kv(self, limit_tokens: int, initial_tokens: int | None = None) -> SeqKV:
        """A sequence's KV handle that may grow to `limit_tokens`, from this executor's pool (one of
        `DEFAULT_POOL_TOKENS` tokens is made on first use); `initial_tokens` are allocated now."""
        if self.kv_pool is None:
            self.init_kv_pool(DEFAULT_POOL_TOKENS // 16, 16)
        assert self.kv_pool is not None
        kv = self.kv_pool.sequence(limit_tokens)
        if initial_tokens:
            kv.ensure(min(initial_tokens, limit_tokens))
        return kv

    # --- the decoder layer, shared by inference and training ------------------------------------------
    def _proj(
        self,
        lin: torch.nn.Module,
        x: torch.Tensor,
        layer: int,
        name: str,
        lora: LoraFn | None,
        fast: bool = False,
    ) -> torch.Tensor:
        w = self._fast.get((layer, name)) if fast or self.fast_all else None
        if w is None and self._small_pass:
            w = self._small.get((layer, name))
        out = lin(x) if w is None else self._fast_linear(lin, w, x)
        return lora(layer, name, x, out) if lora is not None else out

    def _layer(
        self,
        i: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: AttendFn,
        lora: LoraFn | None,
        fast: bool = False,
    ) -> torch.Tensor:
        layer = self.layers[i]
        attn = layer.self_attn
        t = x.shape[0]
        h = layer.input_layernorm(x)
        q = self._proj(attn.q_proj, h, i, "q_proj", lora, fast).view(t, self.n_heads, self.head_dim)
        k = self._proj(attn.k_proj, h, i, "k_proj", lora, fast).view(t, self.n_kv, self.head_dim)
        v = self._proj(attn.v_proj, h, i, "v_proj", lora, fast).view(t, self.n_kv, self.head_dim)
        if self.has_qk_norm:
            q = attn.q_norm(q)
            k = attn.k_norm(k)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        o = attend(i, q, k, v)
        x = x + self._proj(attn.o_proj, o, i, "o_proj", lora, fast)
        h = layer.post_attention_layernorm(x)
        mlp = layer.mlp
        g = self._proj(mlp.gate_proj, h, i, "gate_proj", lora, fast)
        u = self._proj(mlp.up_proj, h, i, "up_proj", lora, fast)
        return x + self._proj(mlp.down_proj, mlp.act_fn(g) * u, i, "down_proj", lora, fast)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.inner.rotary_emb(x[None], positions[None])
        return cos[0][:, None, :], sin[0][:, None, :]

    def _inference_lora(
        self, items: list[ForwardItem], ranges: list[tuple[int, int]], n_rows: int
    ) -> LoraFn | None:
        """The LoRA of one inference pass: each item's rows through its slot's adapter (none for slot
        -1). Neighbouring items of one slot form one segment; when the adapted rows are few (decode),
        the grouped form, two small matmuls per module for all the pass's adapters."""
        segments: list[tuple[int, int, int]] = []
        for it, (s, e) in zip(items, ranges, strict=True):
            if segments and segments[-1][0] == it.slot and segments[-1][2] == s:
                segments[-1] = (it.slot, segments[-1][1], e)
            else:
                segments.append((it.slot, s, e))
        bank = self.bank
        adapted = [seg for seg in segments if seg[0] >= 0]
        if bank is None or not adapted:
            return None
        slots = tuple(sorted({seg[0] for seg in adapted}))
        n_adapted = sum(e - s for _, s, e in adapted)
        if n_adapted * len(slots) <= GROUPED_MAX_ROWS:
            r = bank.rank_of(slots)
            mask = torch.zeros(n_rows, len(slots) * r, dtype=self.dtype, device=self.device)
            for slot, s, e in adapted:
                j = slots.index(slot)
                mask[s:e, j * r : (j + 1) * r] = 1

            def grouped(layer: int, module: str, xin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
                bank.apply_grouped(layer, module, xin, out, slots, mask)
                return out

            return grouped

        def segmented(layer: int, module: str, xin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            bank.apply(layer, module, xin, out, segments)
            return out

        return segmented

    # --- inference ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor]:
        """Run one iteration; returns per item the logits of its last token ([V]) or of all ([n, V]).

        Items should be ordered by slot so each adapter is one contiguous segment (fewer LoRA matmuls);
        any order is correct.
        """
        if not items:
            return []
        ranges: list[tuple[int, int]] = []
        ids: list[int] = []
        pos: list[int] = []
        pool = items[0].kv.pool
        for it in items:
            n = len(it.token_ids)
            if n == 0:
                raise ValueError("a forward item needs at least one token")
            if it.kv.pool is not pool:
                raise ValueError("the items of one forward must share one KV pool")
            it.kv.ensure(it.start_pos + n)
            ranges.append((len(ids), len(ids) + n))
            ids.extend(it.token_ids)
            pos.extend(range(it.start_pos, it.start_pos + n))
        dev = self.device
        x = self.inner.embed_tokens(torch.tensor(ids, dtype=torch.long, device=dev))
        cos, sin = self._rope(x, torch.tensor(pos, dtype=torch.long, device=dev))

        lora = self._inference_lora(items, ranges, len(ids))
        attend = PagedAttention(self, items, ranges)
        small = len(ids) <= self.small_rows and not self.fast_all
        self._small_pass = small
        try:
            for i in range(self.n_layers):
                x = self._layer(i, x, cos, sin, attend, lora)
        finally:
            self._small_pass = False
        for it, (s, e) in zip(items, ranges, strict=True):
            it.kv.length = max(it.kv.length, it.start_pos + e - s)
        rows = []
        for it, (s, e) in zip(items, ranges, strict=True):
            rows.append((s, e) if it.all_logits else (e - 1, e))
        idx = torch.cat([torch.arange(s, e, device=dev) for s, e in rows])
        h = self.inner.norm(x[idx])
        head = self._fast_head if self.fast_all else (self._small_head if small else None)
        logits = (
            self.model.lm_head(h) if head is None else self._fast_linear(self.model.lm_head, head, h)
        ).float()
        result = []
        off = 0
        for it, (s, e) in zip(items, rows, strict=True):
            n = e - s
            result.append(logits[off : off + n] if it.all_logits else logits[off])
            off += n
        return result

    # --- training and evaluation ----------------------------------------------------------------------
    def _train_setup(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, live: LiveLora | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttendFn, LoraFn | None]:
        """Embeddings, rotary tables, attention and LoRA closures of a right-padded batch [B, L]."""
        b, length = input_ids.shape
        dev = self.device
        ids = input_ids.to(dev)
        mask = attention_mask.to(dev).bool()
        x = self.inner.embed_tokens(ids).reshape(b * length, -1)
        positions = torch.arange(length, device=dev).repeat(b)
        cos, sin = self._rope(x, positions)
        lora: LoraFn | None = None
        if live is not None:
            scaling = live.spec.scaling
            params = live.params

            def lora(layer: int, module: str, xin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
                ab = params.get((layer, module))
                if ab is None:
                    return out
                a, bmat = ab
                return out + (xin @ a.T) @ bmat.T * scaling

        causal = torch.ones(length, length, dtype=torch.bool, device=dev).tril()
        attn_mask = causal[None, None] & mask[:, None, None, :]
        # Fully padded query rows would make softmax NaN: let them see themselves (their loss is masked).
        attn_mask = attn_mask | torch.eye(length, dtype=torch.bool, device=dev)[None, None]
        hd = self.n_heads * self.head_dim

        def attend(_layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            qh = q.view(b, length, self.n_heads, self.head_dim).transpose(1, 2)
            kh = k.view(b, length, self.n_kv, self.head_dim).transpose(1, 2)
            vh = v.view(b, length, self.n_kv, self.head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=attn_mask, scale=self.scaling, enable_gqa=True
            )
            return o.transpose(1, 2).reshape(b * length, hd)

        return x, cos, sin, attend, lora

    def train_forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, live: LiveLora | None
    ) -> torch.Tensor:
        """Logits [B, L, V] of a right-padded batch through the base model plus `live` (grad-enabled).

        Gradients reach only `live`'s parameters; the bank (served versions) is not read.
        """
        b, length = input_ids.shape
        x, cos, sin, attend, lora = self._train_setup(input_ids, attention_mask, live)
        for i in range(self.n_layers):
            x = self._layer(i, x, cos, sin, attend, lora)
        return self.model.lm_head(self.inner.norm(x)).float().view(b, length, -1)

    def response_loss(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor,
        live: LiveLora | None,
    ) -> tuple[torch.Tensor, int]:
        """Summed next-token cross-entropy over labelled positions (labels -100 elsewhere) and their count.

        The LM head runs on the labelled positions only (on a prompt-heavy batch it is a large share of
        the work, and its result there would be thrown away)."""
        p = LayerPass(self, input_ids, attention_mask, labels, live, train=False, head_rows=1 << 30)
        x, cos, sin, attend, lora = p.x, p.cos, p.sin, p.attend, p.lora
        for i in range(self.n_layers):
            x = self._layer(i, x, cos, sin, attend, lora)
        if p.n_labels == 0:
            return x.sum() * 0.0, 0
        logits = self.model.lm_head(self.inner.norm(x[p.rows])).float()
        return F.cross_entropy(logits, p.targets, reduction="sum"), p.n_labels


def attention_groups(
    q_lens: list[int], k_lens: list[int], max_padding: float = ATTENTION_MAX_PADDING
) -> list[list[int]]:
    """Sequences of one step grouped for batched attention (pure): each group is one attention call
    whose queries are padded to its longest and keys to its longest context, so a group's padded work
    (`len x max q x max k`) stays within `max_padding` x its sequences' own (`sum q x k`). Decodes (one
    query) and prefill chunks never share a group. Returns indices into the inputs, groups ordered by
    their longest context."""
    groups: list[list[int]] = []
    for kind in (True, False):
        idx = sorted((i for i, q in enumerate(q_lens) if (q == 1) is kind), key=lambda i: -k_lens[i])
        cur: list[int] = []
        q_max = k_max = useful = 0
        for i in idx:
            nq, nk, nu = max(q_max, q_lens[i]), max(k_max, k_lens[i]), useful + q_lens[i] * k_lens[i]
            if cur and (len(cur) + 1) * nq * nk > max_padding * nu:
                groups.append(cur)
                cur, nq, nk, nu = [], q_lens[i], k_lens[i], q_lens[i] * k_lens[i]
            cur.append(i)
            q_max, k_max, useful = nq, nk, nu
        if cur:
            groups.append(cur)
    return groups


class PagedAttention:
    """The attention of one inference iteration over the paged KV cache: per layer, the new tokens'
    keys and values are written into their pool slots, then every sequence's queries attend to its whole
    context in one `scaled_dot_product_attention` call per group of the step (`attention_groups`:
    decodes of similar context length together, prefill chunks of similar size together, so padding
    costs at most `ATTENTION_MAX_PADDING` x the useful work), each over keys and values gathered from
    the sequences' blocks into a padded batch with a mask. The gather indices and masks are built once
    per iteration and reused by every layer."""

    def __init__(self, ex: Executor, items: list[ForwardItem], ranges: list[tuple[int, int]]) -> None:
        pool = items[0].kv.pool
        dev = ex.device
        self.pool = pool
        self.n_heads, self.head_dim, self.scaling = ex.n_heads, ex.head_dim, ex.scaling
        self.total = ranges[-1][1] if ranges else 0
        pairs = zip(items, ranges, strict=True)
        self.write = torch.cat([it.kv.slots(it.start_pos, it.start_pos + e - s) for it, (s, e) in pairs])
        self.write = self.write.to(dev)
        q_lens = [e - s for s, e in ranges]
        k_lens = [it.start_pos + n for it, n in zip(items, q_lens, strict=True)]
        self.groups = [
            self._group(ex, [items[i] for i in g], [ranges[i] for i in g])
            for g in attention_groups(q_lens, k_lens)
        ]

    @staticmethod
    def _group(
        ex: Executor, items: list[ForwardItem], ranges: list[tuple[int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(query rows [B, Q], key slots [B, L], mask [B, 1, Q, L], output rows, their rows in [B*Q])."""
        dev = ex.device
        q_len = max(e - s for s, e in ranges)
        k_len = max(it.start_pos + e - s for it, (s, e) in zip(items, ranges, strict=True))
        rows = torch.zeros(len(items), q_len, dtype=torch.long)
        keys = torch.full((len(items), k_len), items[0].kv.pool.null_slot, dtype=torch.long)  # padding: null
        qpos = torch.full((len(items), q_len), -1, dtype=torch.long)
        dest: list[int] = []
        src: list[int] = []
        for b, (it, (s, e)) in enumerate(zip(items, ranges, strict=True)):
            n, end = e - s, it.start_pos + e - s
            rows[b, :n] = torch.arange(s, e)
            keys[b, :end] = it.kv.slots(0, end)
            qpos[b, :n] = torch.arange(it.start_pos, end)
            dest.extend(range(s, e))
            src.extend(range(b * q_len, b * q_len + n))
        kpos = torch.arange(k_len)
        mask = kpos[None, None, :] <= qpos[:, :, None]  # causal within the sequence's own context
        mask[:, :, 0] |= qpos < 0  # padded query rows see one key (their output is dropped): no NaN
        return (
            rows.to(dev),
            keys.view(-1).to(dev),
            mask[:, None].to(dev),
            torch.tensor(dest, dtype=torch.long, device=dev),
            torch.tensor(src, dtype=torch.long, device=dev),
        )

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pk, pv = self.pool.k[layer], self.pool.v[layer]  # [Hkv, slots, d]
        pk.index_copy_(1, self.write, k.transpose(0, 1))
        pv.index_copy_(1, self.write, v.transpose(0, 1))
        hd = self.n_heads * self.head_dim
        n_kv = pk.shape[0]
        out = torch.empty(self.total, hd, dtype=q.dtype, device=q.device)
        for rows, keys, mask, dest, src in self.groups:
            b, q_len = rows.shape
            k_len = keys.shape[0] // b
            qh = q[rows].transpose(1, 2)  # [B, H, Q, d]
            # index_select along the slots, then a view: [B, Hkv, L, d] without a second copy
            kh = pk.index_select(1, keys).view(n_kv, b, k_len, self.head_dim).transpose(0, 1)
            vh = pv.index_select(1, keys).view(n_kv, b, k_len, self.head_dim).transpose(0, 1)
            o = F.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=mask, scale=self.scaling, enable_gqa=True
            )
            out[dest] = o.transpose(1, 2).reshape(b * q_len, hd)[src]
        return out


class LayerPass:
    """One right-padded batch through the decoder, run one bounded *piece* at a time.

    A training micro-step (or an evaluation chunk) of a long sequence can take longer than any gap the
    engine has between inference iterations; split into pieces it never has to. The pieces, in order:

    * `fwd`: one decoder layer (training keeps that layer's graph, cut from the next layer's by a detached
      input, so each layer's backward can run on its own later);
    * `head`: the final norm, the LM head and the next-token loss on at most `head_rows` labelled
      positions (the LM head never runs on unlabelled ones) and, when training, that loss's backward into
      the top hidden state;
    * `bwd` (training only): one layer's backward, last layer first, handing the gradient of its input
      down to the layer below.

    Between two pieces nothing runs, so the engine may serve an iteration and resume later (the pass holds
    its activations meanwhile). Training builds graphs through `live` only: gradients (scaled by
    `loss_scale`) accumulate in its parameters' `.grad`; the base weights and the bank are never written.
    """

    def __init__(
        self,
        ex: Executor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor,
        live: LiveLora | None,
        train: bool,
        loss_scale: float = 1.0,
        head_rows: int = 64,
        fast: bool = False,
    ) -> None:
        self.ex = ex
        self.train = train
        # The low-precision copies serve no-grad passes, and every pass when the model was loaded so.
        self.fast = ex.fast_all or (fast and not train)
        self.loss_scale = loss_scale
        self.head_rows = max(1, head_rows)
        b, length = input_ids.shape
        self.batch = b
        self.tokens = int(attention_mask.sum())
        self.padded_tokens = int(b * length)
        with torch.no_grad():
            self.x, self.cos, self.sin, self.attend, self.lora = ex._train_setup(
                input_ids, attention_mask, live
            )
            tgt = labels[:, 1:].to(ex.device)
            valid = tgt != -100
            bi, ti = valid.nonzero(as_tuple=True)
            self.rows = bi * length + ti  # flat positions whose next token is labelled
            self.targets = tgt[bi, ti]
            self.row_example = bi
        self.n_labels = int(self.rows.numel())
        self.example_labels = valid.sum(1).tolist()
        self.example_loss = torch.zeros(b, dtype=torch.float64)
        self.loss_sum = 0.0
        self._layer = 0
        self._head_pos = 0
        self._top: torch.Tensor | None = None
        self._saved: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self._bwd = ex.n_layers - 1

    @property
    def next_piece(self) -> str | None:
        """What `run_piece` would do next: "fwd", "head", "bwd", or None when the pass is complete."""
        if self._layer < self.ex.n_layers:
            return "fwd"
        if self._head_pos < self.n_labels:
            return "head"
        if self.train and self.n_labels > 0 and self._bwd >= 0:
            return "bwd"
        return None

    @property
    def done(self) -> bool:
        return self.next_piece is None

    @property
    def forward_frac(self) -> float:
        """Share of the decoder layers the forward has passed (1.0 from the head on)."""
        return min(1.0, self._layer / max(1, self.ex.n_layers))

    def next_units(self) -> int:
        """Size of the next piece for the cost model: tokens of the batch, or rows of a head piece."""
        if self.next_piece == "head":
            return min(self.head_rows, self.n_labels - self._head_pos)
        return self.padded_tokens

    def remaining_ms(self, costs: PieceCosts) -> float:
        """Predicted ms of the pieces still ahead (a training pass's cost-model kinds)."""
        fwd, head, bwd = "fwd", "head", "bwd"
        n = self.padded_tokens
        ms = (self.ex.n_layers - self._layer) * costs.predict(fwd, n)
        rows = max(0, self.n_labels - self._head_pos)
        ms += (rows // self.head_rows) * costs.predict(head, self.head_rows)
        if rows % self.head_rows:
            ms += costs.predict(head, rows % self.head_rows)
        if self.train and self.n_labels > 0:
            ms += (self._bwd + 1) * costs.predict(bwd, n)
        return ms

    def run_piece(self) -> str | None:
        kind = self.next_piece
        if kind == "fwd":
            self._forward_layer()
        elif kind == "head":
            self._head()
        elif kind == "bwd":
            self._backward_layer()
        return kind

    def run_all(self) -> LayerPass:
        while self.run_piece() is not None:
            pass
        return self

    def _forward_layer(self) -> None:
        i = self._layer
        ex = self.ex
        if self.train:
            inp = self.x.detach()
            if i > 0:
                inp.requires_grad_(True)  # the embedding is frozen: layer 0 needs no input gradient
            with torch.enable_grad():
                out = ex._layer(i, inp, self.cos, self.sin, self.attend, self.lora)
            self._saved.append((inp, out))
            self.x = out
        else:
            with torch.no_grad():
                self.x = ex._layer(i, self.x, self.cos, self.sin, self.attend, self.lora, self.fast)
        self._layer += 1

    def _head(self) -> None:
        ex = self.ex
        if self._top is None:
            self._top = self.x.detach()
            if self.train:
                self._top.requires_grad_(True)
        s, e = self._head_pos, min(self.n_labels, self._head_pos + self.head_rows)
        rows = self.rows[s:e]
        with torch.set_grad_enabled(self.train):
            h = ex.inner.norm(self._top[rows])
            head = ex._fast_head if self.fast else None
            logits = (
                ex.model.lm_head(h) if head is None else ex._fast_linear(ex.model.lm_head, head, h)
            ).float()
            nll = F.cross_entropy(logits, self.targets[s:e], reduction="none")
            if self.train:
                (nll.sum() * self.loss_scale).backward()
        nll = nll.detach()
        self.loss_sum += float(nll.sum())
        self.example_loss.index_add_(0, self.row_example[s:e].cpu(), nll.double().cpu())
        self._head_pos = e

    def _backward_layer(self) -> None:
        i = self._bwd
        saved = self._saved[i]
        assert saved is not None and self._top is not None
        inp, out = saved
        nxt = self._saved[i + 1] if i + 1 < len(self._saved) else None
        grad = self._top.grad if nxt is None else nxt[0].grad
        if grad is not None:
            torch.autograd.backward(out, grad)
        if i + 1 < len(self._saved):
            self._saved[i + 1] = None  # its input gradient is consumed: free the layer's activations
        if i == 0:
            self._saved = []
            self._top = None
        self._bwd -= 1

    def release(self) -> None:
        """Drop the activations (a pass abandoned halfway)."""
        self._saved = []
        self._top = None

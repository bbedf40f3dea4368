"""Tiny random-weight models for tests: many transformers architectures and two
hand-written attention modules that are not transformers code.

Every builder returns a small model in eval mode, quickly. The transformers
models are configured small (2 layers, head_dim 32, GQA where the architecture has it)
but otherwise left as the library builds them, so that the compiler sees each
architecture's real attention code: partial rotary, per-head key norms, fused qkv
projections, learned positions.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.layout import RotarySpec

__all__ = [
    "TINY_ARCHITECTURES",
    "tiny_config",
    "tiny_model",
    "byte_tokenizer",
    "NanoGPT",
    "NanoGPTAttention",
    "GptFast",
    "GptFastAttention",
    "rope_spec",
]

# Common shape of every tiny model: hidden 128 = 4 query heads x head_dim 32 (the smallest
# head_dim that the default group of 32 channels divides).
_BASE: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
_GQA = dict(num_key_value_heads=2)

# Per-architecture settings: only what the architecture needs to be small and to keep
# its characteristic attention (GQA, partial rotary, key norm, MQA ...).
TINY_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {**_GQA, "head_dim": 32},
    "mistral": {**_GQA, "head_dim": 32, "sliding_window": None},
    "qwen2": {**_GQA},
    "qwen3": {**_GQA, "head_dim": 32},  # per-head q/k RMSNorm before RoPE
    "gemma": {**_GQA, "head_dim": 32},
    "gemma3_text": {**_GQA, "head_dim": 32, "sliding_window": 64},  # q/k norm, local+global
    # Logit soft-capping (cap * tanh(s / cap) before the mask), local+global. Weights at
    # std 0.1 and 1/sqrt(head_dim) scaling give scores of a few units, so that a cap of 2
    # is far from linear (at the defaults, std 0.02 and 1/16, scores stay below 0.1).
    "gemma2": {**_GQA, "head_dim": 32, "sliding_window": 64, "query_pre_attn_scalar": 32,
               "initializer_range": 0.1, "attn_logit_softcapping": 2.0,
               "final_logit_softcapping": 30.0},
    "phi": {**_GQA},  # partial rotary (factor 0.5), biases, dense
    "gpt_neox": {},  # fused qkv, partial rotary (0.25)
    "gpt2": {},  # fused qkv Conv1D, learned absolute positions, no RoPE
    "opt": {"ffn_dim": 256, "word_embed_proj_dim": 128},  # learned positions, no RoPE
    "stablelm": {**_GQA},  # partial rotary (0.25)
    "olmo2": {**_GQA},  # q/k RMSNorm over the whole projection before RoPE
    "starcoder2": {**_GQA, "sliding_window": None},
    "mixtral": {**_GQA, "head_dim": 32, "num_local_experts": 2, "num_experts_per_tok": 1},
    "gpt_bigcode": {"multi_query": True},  # MQA, fused c_attn, learned positions
    "codegen": {"rotary_dim": 16, "n_ctx": 256},  # GPT-J style interleaved, partial
    # MLA: keys [k_nope | k_rope] assembled in place, RoPE on the trailing 16 of 32
    # channels (interleaved, one rotary part shared by all heads), values of 32 channels.
    "deepseek_v3": {
        "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 32,
        "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 32, "head_dim": 16,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "moe_intermediate_size": 64, "n_group": 1, "topk_group": 1,
    },
}


def tiny_config(arch: str, **overrides: Any):
    """The ``transformers`` config of the tiny model for ``arch`` (see TINY_ARCHITECTURES)."""
    from transformers import AutoConfig

    if arch not in TINY_ARCHITECTURES:
        raise KeyError(
            f"no tiny model for architecture {arch!r}; known: {', '.join(TINY_ARCHITECTURES)}"
        )
    kwargs = {**_BASE, **TINY_ARCHITECTURES[arch], **overrides}
    return AutoConfig.for_model(arch, **kwargs)


def tiny_model(arch: str, *, seed: int = 0, attn_implementation: str | None = None, **overrides):
    """A tiny random-weight causal LM of a transformers architecture, in eval mode.

    Args:
        arch: a key of ``TINY_ARCHITECTURES`` (``"llama"``, ``"gpt2"``, ...).
        seed: seed of the random weights (the global RNG state is restored afterwards).
        attn_implementation: ``"sdpa"`` (the library default) or ``"eager"``.
        **overrides: config fields to change.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **overrides)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model.eval()


def byte_tokenizer():
    """A transformers tokenizer whose 256 tokens are the bytes (byte-level, no merges), for
    a tiny model of ``vocab_size=256``: what lets text calibration (``channel_widths:
    auto``, ``levels: vq``) run on one, saved beside it with ``save_pretrained``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


# ---------------------------------------------------------------------------------------
# Hand-written attention modules (not transformers code)
# ---------------------------------------------------------------------------------------


class NanoGPTAttention(nn.Module):
    """nanoGPT-style causal self-attention: one fused qkv linear, no RoPE, SDPA."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # [B, H, T, D]
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class NanoGPTPastAttention(NanoGPTAttention):
    """NanoGPTAttention that keeps its past the common hand-written way: past keys and
    values passed in, concatenated with the new ones, and returned to the caller."""

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None = None
    ):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if past is not None:
            k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=past is None)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)), (k, v)


class _NanoGPTBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = NanoGPTAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class _NanoGPTPastBlock(_NanoGPTBlock):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__(n_embd, n_head)
        self.attn = NanoGPTPastAttention(n_embd, n_head)

    def forward(self, x, past=None):  # type: ignore[override]
        a, present = self.attn(self.ln_1(x), past)
        x = x + a
        return x + self.mlp(self.ln_2(x)), present


class NanoGPT(nn.Module):
    """A small nanoGPT-style LM: learned positions, fused-qkv SDPA attention.

    ``forward(idx [B, T]) -> logits [B, T, vocab]`` recomputes the whole prefix (nanoGPT
    keeps no KV cache of its own). With ``keeps_past=True`` it keeps one the common
    hand-written way: ``forward(idx, past=None) -> (logits, present)``, each layer's past
    keys and values passed in and returned.
    """

    def __init__(
        self, vocab_size: int = 128, n_embd: int = 128, n_head: int = 4, n_layer: int = 2,
        block_size: int = 256, seed: int = 0, keeps_past: bool = False,
    ) -> None:
        super().__init__()
        self.keeps_past = keeps_past
        block = _NanoGPTPastBlock if keeps_past else _NanoGPTBlock
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.block_size = block_size
            self.wte = nn.Embedding(vocab_size, n_embd)
            self.wpe = nn.Embedding(block_size, n_embd)
            self.h = nn.ModuleList(block(n_embd, n_head) for _ in range(n_layer))
            self.ln_f = nn.LayerNorm(n_embd)
            self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.eval()

    def forward(self, idx: torch.Tensor, past: list | None = None):
        T = idx.shape[1]
        start = 0 if past is None else past[0][0].shape[2]
        if start + T > self.block_size:
            raise ValueError(f"sequence of {start + T} tokens exceeds block_size={self.block_size}")
        pos = torch.arange(start, start + T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        if not self.keeps_past:
            for block in self.h:
                x = block(x)
            return self.lm_head(self.ln_f(x))
        present = []
        for i, block in enumerate(self.h):
            x, kv = block(x, None if past is None else past[i])
            present.append(kv)
        return self.lm_head(self.ln_f(x)), present


def _precompute_freqs_cis(seq_len: int, n_elem: int, base: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2)[: n_elem // 2].float() / n_elem))
    t = torch.arange(seq_len, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64 [seq_len, n_elem // 2]


def _apply_rotary_complex(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    # x [B, T, H, D] real; pairs (2i, 2i+1) are one complex number.
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    fc = freqs_cis.view(1, xc.shape[1], 1, xc.shape[3])
    return torch.view_as_real(xc * fc).flatten(3).type_as(x)


class _GptFastKVCache(nn.Module):
    """Preallocated cache buffers written at ``input_pos`` (gpt-fast style)."""

    def __init__(self, max_batch: int, max_seq: int, n_heads: int, head_dim: int) -> None:
        super().__init__()
        shape = (max_batch, n_heads, max_seq, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        self.k_cache[: k.shape[0], :, input_pos] = k
        self.v_cache[: v.shape[0], :, input_pos] = v
        return self.k_cache[: k.shape[0]], self.v_cache[: v.shape[0]]


class GptFastAttention(nn.Module):
    """gpt-fast-style attention: separate q/k/v projections, complex-number RoPE
    (``view_as_complex``), its own preallocated KV cache buffers, GQA by
    ``repeat_interleave``, and an explicit matmul -> softmax -> matmul."""

    def __init__(self, dim: int, n_head: int, n_local_heads: int) -> None:
        super().__init__()
        self.n_head, self.n_local_heads = n_head, n_local_heads
        self.head_dim = dim // n_head
        self.wq = nn.Linear(dim, n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_local_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_local_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_head * self.head_dim, dim, bias=False)
        self.kv_cache: _GptFastKVCache | None = None

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: torch.Tensor,
        input_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim)
        k = self.wk(x).view(B, T, self.n_local_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_local_heads, self.head_dim)
        q = _apply_rotary_complex(q, freqs_cis)
        k = _apply_rotary_complex(k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        if self.kv_cache is not None and input_pos is not None:
            k, v = self.kv_cache.update(input_pos, k, v)
        rep = self.n_head // self.n_local_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        y = torch.matmul(probs, v)
        return self.wo(y.transpose(1, 2).contiguous().view(B, T, -1))


class _GptFastBlock(nn.Module):
    def __init__(self, dim: int, n_head: int, n_local_heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = GptFastAttention(dim, n_head, n_local_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.w1 = nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x, freqs_cis, mask, input_pos=None):
        x = x + self.attention(self.attention_norm(x), freqs_cis, mask, input_pos)
        return x + self.w2(F.silu(self.w1(self.ffn_norm(x))))


class GptFast(nn.Module):
    """A small gpt-fast-style LM.

    ``forward(idx [B, T], input_pos [T] | None) -> logits``. Without ``setup_caches``
    every call attends over its own tokens; after ``setup_caches(max_batch, max_seq)``
    calls with ``input_pos`` write into and attend over the preallocated buffers.
    """

    def __init__(
        self, vocab_size: int = 128, dim: int = 128, n_head: int = 4, n_local_heads: int = 2,
        n_layer: int = 2, block_size: int = 256, rope_base: float = 10000.0, seed: int = 0,
    ) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.tok_embeddings = nn.Embedding(vocab_size, dim)
            self.layers = nn.ModuleList(
                _GptFastBlock(dim, n_head, n_local_heads) for _ in range(n_layer)
            )
            self.norm = nn.RMSNorm(dim)
            self.output = nn.Linear(dim, vocab_size, bias=False)
        self.block_size = block_size
        self.register_buffer(
            "freqs_cis", _precompute_freqs_cis(block_size, dim // n_head, rope_base),
            persistent=False,
        )
        self.eval()

    def setup_caches(self, max_batch: int, max_seq: int) -> None:
        for layer in self.layers:
            attn = layer.attention
            attn.kv_cache = _GptFastKVCache(max_batch, max_seq, attn.n_local_heads, attn.head_dim)

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        T = idx.shape[1]
        if input_pos is None:
            input_pos = torch.arange(T, device=idx.device)
            mask = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
            use_cache_pos = None
        else:
            max_seq = self.layers[0].attention.kv_cache.k_cache.shape[2]
            causal = torch.ones(self.block_size, self.block_size, dtype=torch.bool).tril()
            mask = causal[input_pos][:, :max_seq].to(idx.device)
            use_cache_pos = input_pos
        freqs_cis = self.freqs_cis[input_pos]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, freqs_cis, mask, use_cache_pos)
        return self.output(self.norm(x))


def rope_spec(style: str, rotary_dim: int, positions: int = 2048, base: float = 1e4):
    """A standard RoPE table (``kvpolicy.kernels.layout.RotarySpec``) for kernel tests.

    ``style`` is ``"rotate_half"`` (cos/sin laid out ``cat(f, f)``) or ``"interleaved"``
    (``repeat_interleave(f, 2)``).
    """
    inv = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None]
    ang = torch.cat((ang, ang), -1) if style == "rotate_half" else ang.repeat_interleave(2, -1)
    return RotarySpec(style, rotary_dim, ang.cos().float(), ang.sin().float())

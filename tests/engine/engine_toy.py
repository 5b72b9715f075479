"""Tiny models for the engine tests: random HF models of each architecture (built here, nothing
downloaded) and ``TableLM``, a fast toy LM whose context lives in a real transformers ``DynamicCache``."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
from transformers import (GemmaConfig, GemmaForCausalLM, GPT2Config, GPT2LMHeadModel, GraniteConfig,
                          GraniteForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          OPTConfig, OPTForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM)

try:
    from transformers import Qwen3Config, Qwen3ForCausalLM
except ImportError:  # pragma: no cover - older transformers
    Qwen3Config = Qwen3ForCausalLM = None

NO_SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)

# Where ``hf_pair`` puts its models: the CPU in the suite; ``GBV_TEST_DEVICE=cuda`` runs the tests built on
# it (greedy equality with Hugging Face, the chi-square law of the tree engine) on a GPU
# (scripts/gpu_check.sh).
TEST_DEVICE = torch.device(os.environ.get("GBV_TEST_DEVICE", "cpu"))


class TableLM(torch.nn.Module):
    """Toy causal LM over ``vocab`` tokens: the logits after a context ``c_1..c_t`` are
    ``A[c_t] + B[c_{t-1}] + C[(c_1 + ... + c_t) mod 5]`` (random tables), so they depend on the whole
    context. The model reads its context back from the keys it stored in the cache: a cache that
    was replicated, selected or cropped wrongly gives wrong logits."""

    def __init__(self, vocab: int = 6, seed: int = 0, scale: float = 1.0, base: "TableLM | None" = None,
                 noise: float = 0.0, max_positions: int = 64) -> None:
        super().__init__()
        self.config = LlamaConfig(vocab_size=vocab, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                  num_attention_heads=1, num_key_value_heads=1,
                                  max_position_embeddings=max_positions, **NO_SPECIAL)
        gen = torch.Generator().manual_seed(seed)
        shapes = {"A": (vocab, vocab), "B": (vocab + 1, vocab), "C": (5, vocab)}
        for name, shape in shapes.items():
            if base is None:
                table = torch.randn(shape, generator=gen) * scale
            else:
                table = getattr(base, name) + torch.randn(shape, generator=gen) * noise
            self.register_buffer(name, table)
        self.vocab = vocab

    def get_output_embeddings(self):
        return None

    def forward(self, input_ids, cache=None, use_cache=True, logits_to_keep=0, **kwargs):
        batch, new = input_ids.shape
        if cache is not None:
            stored = input_ids.to(torch.float32).reshape(batch, 1, new, 1)
            keys, _ = cache.update(stored, stored, 0)
            context = keys[:, 0, :, 0].long()
        else:
            context = input_ids
        total = context.shape[1]
        prev = torch.cat([torch.full((batch, 1), self.vocab, dtype=torch.long), context[:, :-1]], dim=1)
        sums = context.cumsum(1) % 5
        logits = self.A[context] + self.B[prev] + self.C[sums]
        keep = new if not logits_to_keep else min(new, logits_to_keep)
        return SimpleNamespace(logits=logits[:, total - keep:], cache=cache)


def table_pair(vocab: int = 6, noise: float = 0.8, seed: int = 0):
    target = TableLM(vocab, seed=seed)
    draft = TableLM(vocab, seed=seed + 1, base=target, noise=noise)
    return target, draft


def _llama(vocab, hidden, layers):
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                        max_position_embeddings=128, **NO_SPECIAL))


def _qwen2(vocab, hidden, layers):
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                        max_position_embeddings=128, **NO_SPECIAL))


def _qwen3(vocab, hidden, layers):
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                        head_dim=hidden // 2, max_position_embeddings=128, **NO_SPECIAL))


# The toys with sliding windows (Mistral, Gemma 2 and 3) attend within one this short, so that
# generations of the tests pass it.
TOY_WINDOW = 8


def _gemma(vocab, hidden, layers):
    """Gemma: norms scaling by 1 + weight (random here: the zeros it starts from would hide the offset),
    a scaled embedding, GELU (tanh)."""
    return _random_norms(GemmaForCausalLM(GemmaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2, max_position_embeddings=128,
        **NO_SPECIAL)))


def _random_norms(model):
    """Gemma's norm weights start at zero (a scale of 1): random ones, so that the offset is seen."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(-0.5, 0.5)
    return model


def _gemma2(vocab, hidden, layers):
    """Gemma 2: norms after each block, soft-capped attention (cap 0.05 here, about the toy's largest
    scores, so that it bends them) and logits, and sliding windows (TOY_WINDOW) on alternate layers."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return _random_norms(Gemma2ForCausalLM(Gemma2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=max(layers, 2),
        num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2, query_pre_attn_scalar=hidden // 2,
        attn_logit_softcapping=0.05, final_logit_softcapping=3.0, max_position_embeddings=128,
        sliding_window=TOY_WINDOW, **NO_SPECIAL)))


def _gemma3_text(vocab, hidden, layers) -> dict:
    """The settings of the Gemma 3 toys' text model: q/k norms, norms after each block, sliding windows
    (TOY_WINDOW) on all layers but every third, and a rotary base per layer kind."""
    count = max(layers, 3)
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=count,
                num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2, query_pre_attn_scalar=hidden // 2,
                max_position_embeddings=128, sliding_window=TOY_WINDOW,
                layer_types=["full_attention" if i % 3 == 2 else "sliding_attention" for i in range(count)],
                **NO_SPECIAL)


def _gemma3(vocab, hidden, layers):
    """Gemma 3's text model (the 1B checkpoint's class)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return _random_norms(Gemma3ForCausalLM(Gemma3TextConfig(**_gemma3_text(vocab, hidden, layers))))


def _gemma3mm(vocab, hidden, layers):
    """Gemma 3 as its 4B and larger models load: the multimodal Gemma3ForConditionalGeneration (a tiny
    vision tower, unused by text prompts) around the text decoder of ``_gemma3``."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    return _random_norms(Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=_gemma3_text(vocab, hidden, layers), vision_config=vision, mm_tokens_per_image=4,
        image_token_index=vocab - 1, boi_token_index=vocab - 3, eoi_token_index=vocab - 2)))


def _smollm3(vocab, hidden, layers):
    """SmolLM3: Llama with no rotation in every fourth layer ("NoPE", ``no_rope_layers``)."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    return SmolLM3ForCausalLM(SmolLM3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=max(layers, 4),
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, **NO_SPECIAL))


def _granite(vocab, hidden, layers):
    """Granite: embedding, residual and attention multipliers and a logits divisor, none of them 1."""
    return GraniteForCausalLM(GraniteConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                            num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                            max_position_embeddings=128, embedding_multiplier=3.0,
                                            residual_multiplier=0.7, attention_multiplier=0.3, logits_scaling=2.5,
                                            **NO_SPECIAL))


def _phi3(vocab, hidden, layers):
    """Phi-3: fused q/k/v and gate/up matrices, and (as Phi-4-mini) a rotation of part of each head."""
    return Phi3ForCausalLM(Phi3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=128, partial_rotary_factor=0.5,
                                      **NO_SPECIAL))


def _mistral(vocab, hidden, layers):
    """Mistral (v0.1): every layer attends within a sliding window (here TOY_WINDOW positions)."""
    return MistralForCausalLM(MistralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                            num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                            max_position_embeddings=128, sliding_window=TOY_WINDOW, **NO_SPECIAL))


def _gptneox(vocab, hidden, layers, parallel: bool = True):
    """GPT-NeoX (Pythia): LayerNorms with biases (random here: the ones and zeros they start from would
    hide them), q/k/v one matrix head by head, biases on every matrix, an MLP without a gate (GELU), a
    rotation of a quarter of each head, and (``parallel``, Pythia's setting) attention and MLP reading
    the same input."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    model = GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, max_position_embeddings=128, use_parallel_residual=parallel, **NO_SPECIAL))
    return _random_layer_norms_and_biases(model, "query_key_value")


def _random_layer_norms_and_biases(model, qkv: str):
    """LayerNorm weights in [0.5, 1.5] and every bias (LayerNorms' too) in [-0.5, 0.5]: the ones and zeros
    they start from would hide them. The matrices whose names hold ``qkv`` times 4 (the q/k/v matrices):
    attention sharp enough that the positions it sees weigh in the logits."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or ("norm" in name or ".ln_" in name):
                parameter.uniform_(-0.5, 0.5)
                if not name.endswith("bias"):
                    parameter.add_(1.0)
            if qkv in name:
                parameter.mul_(4.0)
    return model


def _gptneox_sequential(vocab, hidden, layers):
    """GPT-NeoX with ``use_parallel_residual`` off (attention, then the MLP on its output)."""
    return _gptneox(vocab, hidden, layers, parallel=False)


def _gpt2(vocab, hidden, layers):
    """GPT-2: learned positions, LayerNorms with biases, Conv1D matrices (q/k/v one), tanh GELU (Python)."""
    return _random_layer_norms_and_biases(GPT2LMHeadModel(GPT2Config(
        vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=2, n_positions=128, **NO_SPECIAL)), "c_attn")


def _opt(vocab, hidden, layers):
    """OPT: learned positions (rows offset by 2), LayerNorms with biases, ReLU, q scaled after its product."""
    return _random_layer_norms_and_biases(OPTForCausalLM(OPTConfig(
        vocab_size=vocab, hidden_size=hidden, ffn_dim=2 * hidden, num_hidden_layers=layers, num_attention_heads=2,
        max_position_embeddings=128, word_embed_proj_dim=hidden, **NO_SPECIAL)), "_proj.weight")


def _gpt_bigcode(vocab, hidden, layers, multi_query: bool = True):
    """GPT-BigCode (StarCoder, SantaCoder): GPT-2's layout with nn.Linear matrices and (``multi_query``, as
    released) one kv head."""
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    return _random_layer_norms_and_biases(GPTBigCodeForCausalLM(GPTBigCodeConfig(
        vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=2, n_positions=128, multi_query=multi_query,
        **NO_SPECIAL)), "c_attn")


def _gpt_bigcode_heads(vocab, hidden, layers):
    """GPT-BigCode without multi-query attention: q/k/v head by head, as GPT-NeoX's."""
    return _gpt_bigcode(vocab, hidden, layers, multi_query=False)


def _starcoder2(vocab, hidden, layers):
    """StarCoder2: Llama's layout with LayerNorms, biases, an MLP without a gate (tanh GELU), grouped-query
    attention and a sliding window (TOY_WINDOW)."""
    from transformers import Starcoder2Config, Starcoder2ForCausalLM

    return _random_layer_norms_and_biases(Starcoder2ForCausalLM(Starcoder2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, sliding_window=TOY_WINDOW,
        **NO_SPECIAL)), "_proj.weight")


def _phi(vocab, hidden, layers):
    """Phi (phi-1, 1.5, 2): one LayerNorm a layer for attention and the MLP in parallel, half of each head
    rotated, biases everywhere (the LM head's too), tanh GELU (Python form)."""
    from transformers import PhiConfig, PhiForCausalLM

    return _random_layer_norms_and_biases(PhiForCausalLM(PhiConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, max_position_embeddings=128, partial_rotary_factor=0.5, **NO_SPECIAL)),
        "_proj.weight")


def _olmo(vocab, hidden, layers):
    """OLMo (1): Llama's layout with LayerNorms that have no weight nor bias."""
    from transformers import OlmoConfig, OlmoForCausalLM

    return OlmoForCausalLM(OlmoConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, **NO_SPECIAL))


def _olmo2(vocab, hidden, layers):
    """OLMo 2: no norms before attention or the MLP, norms after each block, q and k normed over all heads
    (random norm weights: the ones they start from would hide their order)."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    return _random_norms(Olmo2ForCausalLM(Olmo2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, **NO_SPECIAL)))


def _olmo3(vocab, hidden, layers):
    """OLMo 3: OLMo 2 with sliding windows (TOY_WINDOW) on all layers but every third, each layer kind
    rotated by its own table."""
    from transformers import Olmo3Config, Olmo3ForCausalLM

    count = max(layers, 3)
    return _random_norms(Olmo3ForCausalLM(Olmo3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=count,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, sliding_window=TOY_WINDOW,
        layer_types=["full_attention" if i % 3 == 2 else "sliding_attention" for i in range(count)],
        **NO_SPECIAL)))


def _bloom(vocab, hidden, layers):
    """BLOOM (ALiBi attention biases, no positions in the inputs): on the plain Hugging Face path."""
    from transformers import BloomConfig, BloomForCausalLM

    return BloomForCausalLM(BloomConfig(vocab_size=vocab, hidden_size=hidden, n_layer=layers, n_head=2, **NO_SPECIAL))


def _gptj(vocab, hidden, layers):
    """GPT-J: a rotation of adjacent pairs of the first ``rotary_dim`` dimensions (8 of 16 here), one
    LayerNorm for attention and the MLP in parallel, biases on the MLP and the LM head."""
    from transformers import GPTJConfig, GPTJForCausalLM

    return _random_layer_norms_and_biases(GPTJForCausalLM(GPTJConfig(
        vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=2, rotary_dim=8, n_positions=128, **NO_SPECIAL)),
        "_proj.weight")


def _falcon(vocab, hidden, layers):
    """Falcon: on the plain Hugging Face path."""
    from transformers import FalconConfig, FalconForCausalLM

    return FalconForCausalLM(FalconConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                          num_attention_heads=2, **NO_SPECIAL))


ARCHITECTURES = {"bloom": _bloom, "falcon": _falcon, "gptj": _gptj, "gpt2": _gpt2, "opt": _opt, "llama": _llama,
                 "qwen2": _qwen2, "gemma": _gemma, "granite": _granite,
                 "phi3": _phi3, "mistral": _mistral, "gemma2": _gemma2, "gemma3": _gemma3, "gemma3mm": _gemma3mm,
                 "smollm3": _smollm3, "gptneox": _gptneox, "gptneox-sequential": _gptneox_sequential,
                 "gpt-bigcode": _gpt_bigcode, "gpt-bigcode-heads": _gpt_bigcode_heads, "starcoder2": _starcoder2,
                 "phi": _phi, "olmo": _olmo, "olmo2": _olmo2, "olmo3": _olmo3}
if Qwen3ForCausalLM is not None:
    ARCHITECTURES["qwen3"] = _qwen3


# The architectures the lean tree engine runs (the rest, BLOOM and Falcon, take the plain Hugging Face path).
LEAN = ("llama", "qwen2", "qwen3", "gemma", "granite", "phi3", "mistral", "gemma2", "gemma3", "gemma3mm", "smollm3",
        "gptneox", "gptneox-sequential", "gpt2", "opt", "gpt-bigcode", "gpt-bigcode-heads", "starcoder2",
        "phi", "olmo", "olmo2", "olmo3", "gptj")


def hf_pair(arch: str = "llama", vocab: int = 32, seed: int = 0, target_size=(32, 2), draft_size=(16, 1)):
    """A random target and a smaller random draft of one architecture, in eval mode, on ``TEST_DEVICE``."""
    torch.manual_seed(seed)
    target = ARCHITECTURES[arch](vocab, *target_size).eval().to(TEST_DEVICE)
    draft = ARCHITECTURES[arch](vocab, *draft_size).eval().to(TEST_DEVICE)
    return target, draft


CHARS = list("abcdefghijklmnopqrstuvwxyz .,!")


def char_tokenizer():
    """A character-level fast tokenizer with 32 tokens (30 characters, <eos>, <unk>), built offline."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(CHARS)}
    vocab["<eos>"] = len(vocab)
    vocab["<unk>"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>")


def sharpen(*models, scale: float = 30.0):
    """Scale the output heads of random models so that their distributions are far from uniform
    (clear argmax margins for greedy tests)."""
    with torch.no_grad():
        for model in models:
            model.get_output_embeddings().weight.mul_(scale)
    return models


def save_pair(tmp_path, arch: str = "llama", max_positions: int = 128, with_tokenizer: bool = True):
    """Random target/draft of ``arch`` (vocab 32) saved with ``save_pretrained``; returns the two dirs."""
    target, draft = hf_pair(arch, vocab=32)
    tokenizer = char_tokenizer() if with_tokenizer else None
    dirs = []
    for name, model in (("target", target), ("draft", draft)):
        model.config.max_position_embeddings = max_positions
        path = tmp_path / name
        model.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        dirs.append(str(path))
    return dirs


def sharp_llama_pair():
    """A tiny random Llama target/draft over 5 tokens with sharpened heads (runs on the tree engine):
    the pair of the tree-path law tests."""
    from gbv.models.loading import ModelPair

    target, draft = hf_pair("llama", vocab=5, seed=3, target_size=(16, 1), draft_size=(8, 1))
    sharpen(target, scale=25.0)
    sharpen(draft, scale=15.0)
    return ModelPair(target, draft)


def _gemma_weights(state: dict, model, hidden_size: int) -> None:
    """Llama weights in Gemma's form, in ``state``: an untied head, the embedding over sqrt(hidden) (Gemma's
    embedding multiplies it back) and norm weights minus 1 (Gemma's norms scale by 1 + weight)."""
    scale = torch.tensor(hidden_size ** 0.5, dtype=torch.float32)
    state["lm_head.weight"] = model.lm_head.weight.detach().clone()
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] / scale
    for name in list(state):
        if "norm" in name:
            state[name] = state[name] - 1.0


def as_family(model, family: str, window: int = 128):
    """A Llama model (float32, tied embeddings, SiLU) rewritten in another family's layout, computing the
    same function: ``"phi3"`` fuses q/k/v and gate/up; ``"granite"`` sets embedding multiplier 2, residual
    multiplier 0.5 and logits divisor 0.5 and divides the weights they multiply by them (powers of two:
    exact); ``"gemma"`` stores norm weights minus 1 and the embedding over sqrt(hidden) (with an untied
    head) and keeps SiLU. So a trained pair (the bundled one) keeps its acceptance in every family, and
    the engines can be compared on it (scripts/bench_architectures.py). ``"mistral"`` is the same weights
    attending within a sliding ``window``: the same function up to that many positions only.
    ``"gemma2"`` / ``"gemma3"`` are the Gemma layout with windows on alternate layers, and norms of scale 1
    after each block (and, Gemma 3, on q and k): another function, whose drafts agree as they may;
    Gemma 2 keeps its soft caps (50 and 30). ``"smollm3"`` is the same weights without rotation in every
    fourth layer: another function too."""
    from transformers import GemmaConfig, GemmaForCausalLM, GraniteConfig, GraniteForCausalLM, MistralConfig, \
        MistralForCausalLM, Phi3Config, Phi3ForCausalLM

    src = model.config
    rope_theta = (getattr(src, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    common = dict(vocab_size=src.vocab_size, hidden_size=src.hidden_size, intermediate_size=src.intermediate_size,
                  num_hidden_layers=src.num_hidden_layers, num_attention_heads=src.num_attention_heads,
                  num_key_value_heads=src.num_key_value_heads, max_position_embeddings=src.max_position_embeddings,
                  rms_norm_eps=src.rms_norm_eps, bos_token_id=src.bos_token_id, eos_token_id=src.eos_token_id,
                  pad_token_id=src.pad_token_id)
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    head_dim = src.hidden_size // src.num_attention_heads
    assert getattr(src, "head_dim", head_dim) == head_dim and src.hidden_act == "silu"
    if family == "phi3":
        new = Phi3ForCausalLM(Phi3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
                                         tie_word_embeddings=src.tie_word_embeddings, hidden_act="silu"))
        for i in range(src.num_hidden_layers):
            p = f"model.layers.{i}."
            state[p + "self_attn.qkv_proj.weight"] = torch.cat([state.pop(p + f"self_attn.{x}_proj.weight")
                                                                for x in "qkv"])
            state[p + "mlp.gate_up_proj.weight"] = torch.cat([state.pop(p + f"mlp.{x}_proj.weight")
                                                              for x in ("gate", "up")])
    elif family == "granite":
        new = GraniteForCausalLM(GraniteConfig(**common, rope_parameters={"rope_type": "default",
                                                                           "rope_theta": rope_theta},
                                               tie_word_embeddings=True, embedding_multiplier=2.0,
                                               residual_multiplier=0.5, attention_multiplier=head_dim ** -0.5,
                                               logits_scaling=0.5))
        assert src.tie_word_embeddings
        state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] / 2
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
        for i in range(src.num_hidden_layers):
            for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
                state[f"model.layers.{i}.{name}"] = state[f"model.layers.{i}.{name}"] * 2
    elif family == "smollm3":  # (no rotation in every fourth layer: another function)
        from transformers import SmolLM3Config, SmolLM3ForCausalLM

        new = SmolLM3ForCausalLM(SmolLM3Config(**common, tie_word_embeddings=src.tie_word_embeddings,
                                               rope_parameters={"rope_type": "default", "rope_theta": rope_theta}))
    elif family == "mistral":
        new = MistralForCausalLM(MistralConfig(**common, head_dim=head_dim, sliding_window=window,
                                               tie_word_embeddings=src.tie_word_embeddings,
                                               rope_parameters={"rope_type": "default", "rope_theta": rope_theta}))
    elif family in ("gemma2", "gemma3"):  # (their norms after each block: another function, see above)
        from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

        kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(src.num_hidden_layers)]
        settings = dict(**common, head_dim=head_dim, hidden_activation="silu", tie_word_embeddings=False,
                        query_pre_attn_scalar=head_dim, sliding_window=window, layer_types=kinds)
        if family == "gemma2":
            new = Gemma2ForCausalLM(Gemma2Config(**settings, rope_parameters={"rope_type": "default",
                                                                               "rope_theta": rope_theta}))
        else:
            rope = {"rope_type": "default", "rope_theta": rope_theta}
            new = Gemma3ForCausalLM(Gemma3TextConfig(**settings, rope_parameters={
                "sliding_attention": dict(rope), "full_attention": dict(rope)}))
        _gemma_weights(state, model, src.hidden_size)
        for i in range(src.num_hidden_layers):  # (the Llama MLP norm is Gemma's pre-feedforward one)
            p = f"model.layers.{i}."
            state[p + "pre_feedforward_layernorm.weight"] = state.pop(p + "post_attention_layernorm.weight")
            for name in ("post_attention_layernorm", "post_feedforward_layernorm"):
                state[p + name + ".weight"] = torch.zeros(src.hidden_size)
            if family == "gemma3":
                for name in ("q_norm", "k_norm"):
                    state[p + f"self_attn.{name}.weight"] = torch.zeros(head_dim)
    elif family == "gemma":
        new = GemmaForCausalLM(GemmaConfig(**common, head_dim=head_dim, hidden_act="silu",
                                           hidden_activation="silu", tie_word_embeddings=False,
                                           rope_parameters={"rope_type": "default", "rope_theta": rope_theta}))
        _gemma_weights(state, model, src.hidden_size)
    else:
        raise ValueError(f"no conversion to {family!r}")
    missing, unexpected = new.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in name or "embed_scale" in name for name in missing), (missing, unexpected)
    new.generation_config = model.generation_config
    return new.eval()


# Families whose layers cannot compute a Llama model's function: their pairs are random models of its shapes.
SHAPED_LIKE = ("gptneox", "gpt2", "opt", "gpt-bigcode", "starcoder2", "phi", "olmo", "olmo-clip", "olmo2", "olmo3",
               "gptj", "qwen3")


def family_models(target, draft, family: str):
    """A Llama target and draft in ``family``'s layout (:func:`as_family`), or, for the ``SHAPED_LIKE``
    families, random models of their shapes (:func:`shaped_like`, seeds 1 and 2): the pairs of
    scripts/bench_architectures.py and scripts/fuzz_engine.py ``--family``."""
    if family in SHAPED_LIKE:
        return shaped_like(target, family, 1), shaped_like(draft, family, 2)
    return as_family(target, family), as_family(draft, family)


def shaped_like(model, family: str, seed: int, window: int = 128):
    """A random ``family`` model of the shape of a Llama ``model`` (hidden size, layers, heads, MLP width,
    vocabulary, context and special tokens; float32, eval mode, weights from ``seed``), for the families
    whose layers cannot compute a Llama model's function (LayerNorms, MLPs without a gate; see
    ``as_family``): ``"gptneox"``, ``"gpt2"``, ``"opt"``, ``"gpt-bigcode"`` (multi-query), ``"starcoder2"``
    (its kv heads as ``model``'s, a sliding ``window``), ``"phi"``, ``"olmo"`` (``"olmo-clip"``: OLMo 1.7's
    ``clip_qkv`` of 8, on torch's lean forward), ``"olmo2"``, ``"olmo3"`` (a sliding
    ``window`` on three layers of four), ``"gptj"`` and ``"qwen3"`` (q/k norms, random weights about 1)."""
    from transformers import (GPT2Config, GPT2LMHeadModel, GPTBigCodeConfig, GPTBigCodeForCausalLM, GPTNeoXConfig,
                              GPTNeoXForCausalLM, OPTConfig, OPTForCausalLM, PhiConfig, PhiForCausalLM,
                              Starcoder2Config, Starcoder2ForCausalLM)

    like = model.config
    torch.manual_seed(seed)
    shape = dict(vocab_size=like.vocab_size, hidden_size=like.hidden_size, num_hidden_layers=like.num_hidden_layers,
                 num_attention_heads=like.num_attention_heads, max_position_embeddings=like.max_position_embeddings,
                 bos_token_id=like.bos_token_id, eos_token_id=like.eos_token_id, pad_token_id=like.pad_token_id)
    if family == "gptneox":
        return GPTNeoXForCausalLM(GPTNeoXConfig(**shape, intermediate_size=like.intermediate_size)).eval()
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(**shape, n_inner=like.intermediate_size)).eval()
    if family == "gpt-bigcode":
        return GPTBigCodeForCausalLM(GPTBigCodeConfig(**shape, n_inner=like.intermediate_size)).eval()
    if family == "opt":
        return OPTForCausalLM(OPTConfig(**shape, ffn_dim=like.intermediate_size,
                                        word_embed_proj_dim=like.hidden_size)).eval()
    if family == "starcoder2":
        return Starcoder2ForCausalLM(Starcoder2Config(**shape, intermediate_size=like.intermediate_size,
                                                      num_key_value_heads=like.num_key_value_heads,
                                                      sliding_window=window)).eval()
    if family == "phi":
        return PhiForCausalLM(PhiConfig(**shape, intermediate_size=like.intermediate_size)).eval()
    if family == "gptj":  # (a quarter of each head rotated, as GPT-J-6B's 64 of 256)
        from transformers import GPTJConfig, GPTJForCausalLM

        head_dim = like.hidden_size // like.num_attention_heads
        return GPTJForCausalLM(GPTJConfig(**shape, n_inner=like.intermediate_size, rotary_dim=head_dim // 4)).eval()
    if family in ("olmo", "olmo-clip", "olmo2", "olmo3"):
        from transformers import (Olmo2Config, Olmo2ForCausalLM, Olmo3Config, Olmo3ForCausalLM, OlmoConfig,
                                  OlmoForCausalLM)

        settings = dict(**shape, intermediate_size=like.intermediate_size, num_key_value_heads=like.num_key_value_heads)
        if family in ("olmo", "olmo-clip"):
            return OlmoForCausalLM(OlmoConfig(**settings, clip_qkv=8.0 if family == "olmo-clip" else None)).eval()
        if family == "olmo2":
            return Olmo2ForCausalLM(Olmo2Config(**settings)).eval()
        kinds = ["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(like.num_hidden_layers)]
        return Olmo3ForCausalLM(Olmo3Config(**settings, sliding_window=window, layer_types=kinds)).eval()
    if family == "qwen3":  # (its q/k norms' weights random too: ones would hide their order)
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(**shape, intermediate_size=like.intermediate_size,
                                             num_key_value_heads=like.num_key_value_heads,
                                             head_dim=like.hidden_size // like.num_attention_heads)).eval()
        with torch.no_grad():
            for layer in model.model.layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.uniform_(0.5, 1.5)
        return model
    raise ValueError(f"no random model of family {family!r}")


# Random models of real models' shapes (no download): scripts/bench_family_steps.py, bench_real_sizes.py and
# bench_lean_build.py.
REAL_SIZES = ("pythia-14m", "pythia-70m", "pythia-410m", "distilgpt2", "smollm2-135m", "smollm2-360m", "qwen3-0.6b",
              "llama-3.2-1b", "gemma-3-270m", "gemma-3-1b")
# Target / draft pairs of those shapes (scripts/bench_real_sizes.py, scripts/bench_first_call.py).
REAL_PAIRS = {"pythia": ("pythia-410m", "pythia-70m"), "smollm2": ("smollm2-360m", "smollm2-135m"),
              "pythia-small": ("pythia-70m", "pythia-14m"), "gemma3": ("gemma-3-1b", "gemma-3-270m")}


def real_size(name: str, seed: int = 0):
    """A random model of ``name``'s shape (``REAL_SIZES``), in eval mode: Pythia-14m, -70m and -410m (GPT-NeoX,
    a quarter of each head rotated, 50k vocabulary), distilgpt2 (GPT-2 small's layers, 6 of them) and
    SmolLM2-135M and SmolLM2-360M (Llama, grouped-query attention, tied embeddings), and Qwen3-0.6B (q/k norms,
    head_dim 128, 152k vocabulary, tied embeddings; its norms' weights random about 1), Llama-3.2-1B (1.24B
    parameters, 128k vocabulary, tied embeddings), and Gemma-3-270M and Gemma-3-1B (Gemma 3: one kv head of 256
    values, windows of 512 on five layers in six, a rotary base per layer kind, norms after each block, q/k norms,
    GELU-tanh gates, 262k vocabulary, tied embeddings; 268M and 1.0B parameters, 168M and 302M of them the
    embedding)."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    pythia = dict(vocab_size=50304, rotary_pct=0.25, max_position_embeddings=2048)
    if name == "pythia-14m":
        return GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=128, num_hidden_layers=6, num_attention_heads=4,
                                                intermediate_size=512, **pythia)).eval()
    if name == "pythia-70m":
        return GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                                                intermediate_size=2048, **pythia)).eval()
    if name == "pythia-410m":
        return GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                                intermediate_size=4096, **pythia)).eval()
    if name == "distilgpt2":
        return GPT2LMHeadModel(GPT2Config(n_layer=6)).eval()
    if name == "smollm2-135m":
        return LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=576, num_hidden_layers=30,
                                            num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                                            tie_word_embeddings=True, max_position_embeddings=8192)).eval()
    if name == "smollm2-360m":
        return LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=960, num_hidden_layers=32,
                                            num_attention_heads=15, num_key_value_heads=5, intermediate_size=2560,
                                            tie_word_embeddings=True, max_position_embeddings=8192)).eval()
    if name == "llama-3.2-1b":
        return LlamaForCausalLM(LlamaConfig(vocab_size=128256, hidden_size=2048, num_hidden_layers=16,
                                            num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192,
                                            tie_word_embeddings=True, max_position_embeddings=131072,
                                            rope_theta=500000.0)).eval()
    if name == "qwen3-0.6b":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=151936, hidden_size=1024, num_hidden_layers=28,
                                             num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                             intermediate_size=3072, tie_word_embeddings=True,
                                             max_position_embeddings=40960)).eval()
        with torch.no_grad():
            for layer in model.model.layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.uniform_(0.5, 1.5)
        return model
    if name in ("gemma-3-270m", "gemma-3-1b"):
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        small = name == "gemma-3-270m"
        layers = 18 if small else 26
        return Gemma3ForCausalLM(Gemma3TextConfig(
            vocab_size=262144, hidden_size=640 if small else 1152, intermediate_size=2048 if small else 6912,
            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
            query_pre_attn_scalar=256, sliding_window=512, max_position_embeddings=32768, tie_word_embeddings=True,
            layer_types=["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers)])).eval()
    raise ValueError(f"no real size {name!r}; the sizes are: {', '.join(REAL_SIZES)}")

"""Write small random-weight models in Hugging Face layout, with a tokenizer trained locally.

Both `mlx_lm.load` and `transformers.AutoModelForCausalLM` read the folders written here, so tests can
compare Orchard against lm-eval's `hf` backend on the same weights, and `driver demo` runs offline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ARCHITECTURES = ("llama", "qwen2", "gpt2", "mistral", "gemma", "phi3", "mixtral")

_WORDS = (
    "the of and to in is was for that with as on by at from his her they are be this which or an were "
    "had not but it one all their has been would there more who when what so if about out up into two "
    "time some could them only other then its new these also first may over after any most where water "
    "question answer true false number value energy cell acid law state court market price theory "
    "river mountain city king queen war peace science history biology chemistry physics mathematics "
    "computer logic economics philosophy medicine story little girl boy dog cat happy sad day night "
    "because said went saw big small red blue green once upon there lived played friend tree house"
).split()


def _corpus(n_sentences: int = 4000, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n_sentences):
        words = rng.choice(_WORDS, size=int(rng.integers(4, 16)))
        sentence = " ".join(words).capitalize()
        tail = rng.choice([".", "?", "!", ":", ",", " 42.", " (A)", " B)", " 3.14", "\n"])
        lines.append(sentence + tail)
    lines += ["Question: Answer: A. B. C. D. 0123456789 +-*/=()[]{}<>'\"$%&#@;", "éàüß ñ 日本語 😀 — …"]
    return lines


def write_tokenizer(out: Path, *, vocab_size: int = 1024, style: str = "llama") -> None:
    """Byte-level BPE trained on a built-in corpus: any text (non-ASCII too) encodes without <unk>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if style == "gpt2":
        bos = eos = "<|endoftext|>"
        specials = [eos]
    else:
        bos, eos = "<s>", "</s>"
        specials = ["<unk>", bos, eos]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if style == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    else:  # llama-style: every encoding starts with BOS
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
    }
    if style != "gpt2":
        config["unk_token"] = "<unk>"
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({k: config[k] for k in ("bos_token", "eos_token", "unk_token") if k in config}, indent=2)
    )


# HF class names, and what each family changes in the llama block (see mlx-lm's models/<arch>.py).
_HF_CLASS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma": "GemmaForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


@dataclass(frozen=True)
class _Dims:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int
    tie: bool
    experts: int = 4
    experts_per_tok: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class _Init:
    """Seeded random tensors; the draw order fixes the weights, so keep it when adding families."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def w(self, *shape: int, scale: float | None = None) -> np.ndarray:
        scale = scale if scale is not None else shape[-1] ** -0.5
        return (self.rng.standard_normal(shape) * scale).astype(np.float32)

    def ones(self, n: int) -> np.ndarray:
        return (1.0 + 0.1 * self.rng.standard_normal(n)).astype(np.float32)

    def norm(self, n: int, arch: str) -> np.ndarray:
        # Gemma's RMSNorm multiplies by (1 + weight): store the offset from 1.
        return self.ones(n) - 1.0 if arch == "gemma" else self.ones(n)


def write_model(
    out: str | Path,
    *,
    arch: str = "llama",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab_size: int = 1024,
    max_positions: int = 512,
    tie_embeddings: bool = False,
    seed: int = 0,
) -> Path:
    """Random float32 weights in HF layout plus a trained tokenizer; returns the folder.

    gemma always ties its embeddings; mixtral has 4 experts of `intermediate` width, 2 per token.
    """
    from safetensors.numpy import save_file

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}: choose one of {', '.join(ARCHITECTURES)}")
    out = Path(out)
    write_tokenizer(out, vocab_size=vocab_size, style="gpt2" if arch == "gpt2" else "llama")
    tok = json.loads((out / "tokenizer.json").read_text())
    vocab = max(tok["model"]["vocab"].values()) + 1 + len(tok.get("added_tokens", []))
    vocab = max(vocab, max(t["id"] for t in tok["added_tokens"]) + 1)
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    dims = _Dims(hidden, layers, heads, kv_heads, intermediate, vocab, max_positions, tie_embeddings or arch == "gemma")
    init = _Init(seed)
    if arch == "gpt2":
        weights, config = _gpt2_weights(init, dims), _gpt2_config(dims, special["<|endoftext|>"], heads)
    else:
        weights, config = _decoder_weights(init, dims, arch), _decoder_config(dims, special, arch)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})
    )
    return out


def _gpt2_weights(r: _Init, dims: _Dims) -> dict[str, np.ndarray]:
    d, w, ones = dims.hidden, r.w, r.ones
    weights = {"wte.weight": w(dims.vocab, d, scale=0.5), "wpe.weight": w(dims.max_positions, d, scale=0.1)}
    for i in range(dims.layers):
        p = f"h.{i}."
        weights[p + "ln_1.weight"], weights[p + "ln_1.bias"] = ones(d), w(d, scale=0.02)
        weights[p + "ln_2.weight"], weights[p + "ln_2.bias"] = ones(d), w(d, scale=0.02)
        weights[p + "attn.c_attn.weight"] = w(d, 3 * d, scale=d**-0.5)  # Conv1D: (in, out)
        weights[p + "attn.c_attn.bias"] = w(3 * d, scale=0.02)
        weights[p + "attn.c_proj.weight"] = w(d, d, scale=d**-0.5)
        weights[p + "attn.c_proj.bias"] = w(d, scale=0.02)
        weights[p + "mlp.c_fc.weight"] = w(d, 4 * d, scale=d**-0.5)
        weights[p + "mlp.c_fc.bias"] = w(4 * d, scale=0.02)
        weights[p + "mlp.c_proj.weight"] = w(4 * d, d, scale=(4 * d) ** -0.5)
        weights[p + "mlp.c_proj.bias"] = w(d, scale=0.02)
    weights["ln_f.weight"], weights["ln_f.bias"] = ones(d), w(d, scale=0.02)
    return weights


def _gpt2_config(dims: _Dims, eos_id: int, heads: int) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_embd": dims.hidden,
        "n_head": heads,
        "n_layer": dims.layers,
        "n_positions": dims.max_positions,
        "n_ctx": dims.max_positions,
        "n_inner": None,
        "vocab_size": dims.vocab,
        "layer_norm_epsilon": 1e-5,
        "activation_function": "gelu_new",
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }


def _attention_weights(r: _Init, dims: _Dims, p: str, arch: str) -> dict[str, np.ndarray]:
    d, hd, h, kv = dims.hidden, dims.head_dim, dims.heads, dims.kv_heads
    if arch == "phi3":  # one fused q|k|v projection
        return {p + "qkv_proj.weight": r.w((h + 2 * kv) * hd, d), p + "o_proj.weight": r.w(d, h * hd)}
    out = {
        p + "q_proj.weight": r.w(h * hd, d),
        p + "k_proj.weight": r.w(kv * hd, d),
        p + "v_proj.weight": r.w(kv * hd, d),
        p + "o_proj.weight": r.w(d, h * hd),
    }
    if arch == "qwen2":
        out[p + "q_proj.bias"] = r.w(h * hd, scale=0.1)
        out[p + "k_proj.bias"] = r.w(kv * hd, scale=0.1)
        out[p + "v_proj.bias"] = r.w(kv * hd, scale=0.1)
    return out


def _mlp_weights(r: _Init, dims: _Dims, p: str, arch: str) -> dict[str, np.ndarray]:
    d, n = dims.hidden, dims.intermediate
    if arch == "phi3":  # one fused gate|up projection
        return {p + "mlp.gate_up_proj.weight": r.w(2 * n, d), p + "mlp.down_proj.weight": r.w(d, n)}
    if arch == "mixtral":  # router + experts in HF's per-expert layout (w1 gate, w3 up, w2 down)
        q = p + "block_sparse_moe."
        out = {q + "gate.weight": r.w(dims.experts, d)}
        for e in range(dims.experts):
            out[q + f"experts.{e}.w1.weight"] = r.w(n, d)
            out[q + f"experts.{e}.w3.weight"] = r.w(n, d)
            out[q + f"experts.{e}.w2.weight"] = r.w(d, n)
        return out
    return {p + "mlp.gate_proj.weight": r.w(n, d), p + "mlp.up_proj.weight": r.w(n, d), p + "mlp.down_proj.weight": r.w(d, n)}


def _decoder_weights(r: _Init, dims: _Dims, arch: str) -> dict[str, np.ndarray]:
    d = dims.hidden
    # Gemma scales its embeddings by sqrt(d) and reads logits off them: keep both near unit size.
    weights = {"model.embed_tokens.weight": r.w(dims.vocab, d, scale=2 * d**-0.5 if arch == "gemma" else 1.0)}
    for i in range(dims.layers):
        p = f"model.layers.{i}."
        weights.update(_attention_weights(r, dims, p + "self_attn.", arch))
        weights.update(_mlp_weights(r, dims, p, arch))
        weights[p + "input_layernorm.weight"] = r.norm(d, arch)
        weights[p + "post_attention_layernorm.weight"] = r.norm(d, arch)
    weights["model.norm.weight"] = r.norm(d, arch)
    if not dims.tie:
        weights["lm_head.weight"] = r.w(dims.vocab, d, scale=d**-0.5 * 4)
    return weights


def _decoder_config(dims: _Dims, special: dict[str, int], arch: str) -> dict:
    config = {
        "architectures": [_HF_CLASS[arch]],
        "model_type": arch,
        "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate,
        "num_hidden_layers": dims.layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "vocab_size": dims.vocab,
        "max_position_embeddings": dims.max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "attention_bias": arch == "qwen2",
        "tie_word_embeddings": dims.tie,
        "bos_token_id": special["<s>"],
        "eos_token_id": special["</s>"],
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        config["use_sliding_window"] = False
    elif arch in ("mistral", "mixtral"):
        config["sliding_window"] = None  # HF's default window (4096) is wider than any test sequence anyway
    if arch == "gemma":  # HF runs Gemma's tanh GELU; mlx-lm's gemma runs the exact one (logits differ ~1e-3)
        config.update(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh")
    elif arch == "phi3":
        config.update(pad_token_id=special["</s>"], original_max_position_embeddings=dims.max_positions, rope_scaling=None)
    elif arch == "mixtral":
        config.update(num_local_experts=dims.experts, num_experts_per_tok=dims.experts_per_tok)
    return config

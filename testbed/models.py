"""Write small random-weight models in Hugging Face layout, with a tokenizer trained locally.

Both `mlx_lm.load` and `transformers.AutoModelForCausalLM` read the folders written here, so tests can
compare Orchard against lm-eval's `hf` backend on the same weights, and `driver demo` runs offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ARCHITECTURES = ("llama", "qwen2", "gpt2")

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
    """Random float32 weights in HF layout plus a trained tokenizer; returns the folder."""
    from safetensors.numpy import save_file

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}: choose one of {', '.join(ARCHITECTURES)}")
    out = Path(out)
    write_tokenizer(out, vocab_size=vocab_size, style="gpt2" if arch == "gpt2" else "llama")
    tok = json.loads((out / "tokenizer.json").read_text())
    vocab = max(tok["model"]["vocab"].values()) + 1 + len(tok.get("added_tokens", []))
    vocab = max(vocab, max(t["id"] for t in tok["added_tokens"]) + 1)
    rng = np.random.default_rng(seed)

    def w(*shape, scale=None):
        scale = scale if scale is not None else shape[-1] ** -0.5
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def ones(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    weights: dict[str, np.ndarray] = {}
    if arch == "gpt2":
        d = hidden
        weights["wte.weight"] = w(vocab, d, scale=0.5)
        weights["wpe.weight"] = w(max_positions, d, scale=0.1)
        for i in range(layers):
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
        eos_id = special["<|endoftext|>"]
        config = {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_embd": d,
            "n_head": heads,
            "n_layer": layers,
            "n_positions": max_positions,
            "n_ctx": max_positions,
            "n_inner": None,
            "vocab_size": vocab,
            "layer_norm_epsilon": 1e-5,
            "activation_function": "gelu_new",
            "bos_token_id": eos_id,
            "eos_token_id": eos_id,
            "tie_word_embeddings": True,
            "torch_dtype": "float32",
        }
    else:
        d, hd = hidden, hidden // heads
        weights["model.embed_tokens.weight"] = w(vocab, d, scale=1.0)
        for i in range(layers):
            p = f"model.layers.{i}."
            weights[p + "self_attn.q_proj.weight"] = w(heads * hd, d)
            weights[p + "self_attn.k_proj.weight"] = w(kv_heads * hd, d)
            weights[p + "self_attn.v_proj.weight"] = w(kv_heads * hd, d)
            weights[p + "self_attn.o_proj.weight"] = w(d, heads * hd)
            if arch == "qwen2":
                weights[p + "self_attn.q_proj.bias"] = w(heads * hd, scale=0.1)
                weights[p + "self_attn.k_proj.bias"] = w(kv_heads * hd, scale=0.1)
                weights[p + "self_attn.v_proj.bias"] = w(kv_heads * hd, scale=0.1)
            weights[p + "mlp.gate_proj.weight"] = w(intermediate, d)
            weights[p + "mlp.up_proj.weight"] = w(intermediate, d)
            weights[p + "mlp.down_proj.weight"] = w(d, intermediate)
            weights[p + "input_layernorm.weight"] = ones(d)
            weights[p + "post_attention_layernorm.weight"] = ones(d)
        weights["model.norm.weight"] = ones(d)
        if not tie_embeddings:
            weights["lm_head.weight"] = w(vocab, d, scale=d**-0.5 * 4)
        config = {
            "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
            "model_type": arch,
            "hidden_size": d,
            "intermediate_size": intermediate,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": hd,
            "vocab_size": vocab,
            "max_position_embeddings": max_positions,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "attention_bias": arch == "qwen2",
            "tie_word_embeddings": tie_embeddings,
            "bos_token_id": special["<s>"],
            "eos_token_id": special["</s>"],
            "torch_dtype": "float32",
        }
        if arch == "qwen2":
            config["use_sliding_window"] = False
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})
    )
    return out

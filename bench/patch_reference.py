"""The reference the issue asks bench_patch.py to report: the same patch cells through TransformerLens's `patching`
module on this CPU (torch), the way its users run it: `HookedTransformer.run_with_cache` on the clean prompt once
per pair, then `patching.get_act_patch_<site>` (one `run_with_hooks` forward of the corrupt prompt per cell).

The bench's random llama is read by transformers and converted with TransformerLens's own `convert_llama_weights`
(no weight processing: no folded norms, no centred weights, so its activations are the model's own). Test-only /
bench-only: TransformerLens comes with sae-lens in the test extras, never at run time.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

SITE_FUNCTIONS = {"resid_pre": "get_act_patch_resid_pre", "resid_mid": "get_act_patch_resid_mid",
                  "attn_out": "get_act_patch_attn_out", "mlp_out": "get_act_patch_mlp_out"}  # fmt: skip


def available() -> str | None:
    """None when TransformerLens imports, else why not (one line)."""
    try:
        import transformer_lens  # noqa: F401
    except Exception as e:  # noqa: BLE001 (any import failure means: no reference row)
        return f"TransformerLens not importable ({type(e).__name__}: {e}); pip install transformer-lens"
    return None


def hooked_model(folder: Path):
    """A HookedTransformer holding the llama in `folder` (HF layout), float32, weights unprocessed."""
    import torch
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.loading_from_pretrained import _get_rope_theta
    from transformer_lens.pretrained.weight_conversions.llama import convert_llama_weights
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    c = hf.config
    cfg = HookedTransformerConfig(  # what loading_from_pretrained builds for LlamaForCausalLM
        d_model=c.hidden_size, d_head=c.hidden_size // c.num_attention_heads, n_heads=c.num_attention_heads,
        d_mlp=c.intermediate_size, n_layers=c.num_hidden_layers, n_ctx=c.max_position_embeddings, eps=c.rms_norm_eps,
        d_vocab=c.vocab_size, act_fn=c.hidden_act, normalization_type="RMS", positional_embedding_type="rotary",
        rotary_adjacent_pairs=False, rotary_dim=c.hidden_size // c.num_attention_heads, rotary_base=_get_rope_theta(c),
        final_rms=True, gated_mlp=True, dtype=torch.float32,
        n_key_value_heads=c.num_key_value_heads if c.num_key_value_heads != c.num_attention_heads else None,
    )  # fmt: skip
    model = HookedTransformer(cfg)
    model.load_and_process_state_dict(convert_llama_weights(hf, cfg), fold_ln=False, center_writing_weights=False,
                                      center_unembed=False, fold_value_biases=False, refactor_factored_attn_matrices=False)  # fmt: skip
    return model.eval()


def patched_logit_diffs(model, pairs: list[dict], sample: list[tuple[int, object]]) -> list[float]:
    """The patched logit difference of each sampled (pair index, PatchCell), in `sample`'s order, through
    TransformerLens's patching functions (one index_df of (layer, pos) rows per pair and site: its functions' own
    loop, over the sampled cells rather than the whole grid)."""
    import pandas as pd
    import torch
    from transformer_lens import patching

    groups: dict[tuple[int, str], list[int]] = defaultdict(list)
    for n, (p, cell) in enumerate(sample):
        groups[(p, cell.site)].append(n)
    out: list[float] = [0.0] * len(sample)
    with torch.no_grad():  # as TransformerLens's demos run patching
        caches = {}
        for (p, site), members in groups.items():
            pair = pairs[p]
            if p not in caches:
                caches[p] = model.run_with_cache(torch.tensor([pair["clean"]]))[1]

            def metric(logits, pair=pair):
                return logits[0, -1, pair["correct"]] - logits[0, -1, pair["wrong"]]

            index = pd.DataFrame([(sample[n][1].layer, sample[n][1].position) for n in members], columns=["layer", "pos"])
            values = getattr(patching, SITE_FUNCTIONS[site])(model, torch.tensor([pair["corrupt"]]), caches[p], metric, index_axis_names=None, index_df=index)
            for n, v in zip(members, values.tolist()):
                out[n] = v
    return out

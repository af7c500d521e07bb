"""Head-side tokenization of lm-eval loglikelihood requests: fast, and token-identical to lm-eval's
`TemplateLM.loglikelihood` / `_encode_pair` with OrchardLM's `tok_encode` (the BOS-prefix rule included).

For each (context, continuation) lm-eval computes, per request, `whole = tok_encode(ctx + cont)`,
`ctx_ids = tok_encode(ctx)`, `cont_ids = whole[len(ctx_ids):]`: two full encodes of a ~3,000-character 5-shot
prompt per answer choice. Here, instead:

- each distinct string is encoded once, in `tokenizers`' Rust `encode_batch_fast`;
- where it is proved for this tokenizer that no token can cross a boundary "non-space char | whitespace"
  (see `make_plan`), a string is cut at such boundaries before each paragraph break "\\n\\n" (lm-eval's
  few-shot delimiter) and between context and continuation, and each distinct piece is encoded once, for
  all requests: the shared few-shot examples of a subject are tokenized once, not once per question.
  A piece other than a string's first is encoded behind a fixed anchor ("a") and the anchor's tokens are
  checked and cut off, so start-of-string rules (Prepend "▁", add_prefix_space) apply as in the whole string;
- anything not proved (a slow tokenizer, an unknown pipeline component, a string holding added-token text)
  takes the exact path: whole strings through the backend, or `tokenizer.encode` one string at a time.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

Pair = tuple[list[int], list[int]]
ANCHOR = "a"
BREAK = "\n\n"
# Split patterns of known byte-level families (Llama-3: \p{N}{1,3}; Qwen2: \p{N}): "punctuation + newlines"
# is one pre-token there, so a cut before "\n" needs a letter or digit on its left.
_LLAMA3_PATTERNS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
# Normalizer regexes whose effect stays inside a run of spaces or at the string's ends (stories260K, Llama-2).
_LOCAL_REGEXES = {r"\A +", r" +\z", r" {2,}"}
_LOCAL_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend", "Strip", "StripAccents", "BertNormalizer"}
_FIXED_POST = {None, "ByteLevel", "TemplateProcessing", "BertProcessing", "RobertaProcessing"}


@dataclass
class Plan:
    """What was proved about one tokenizer. backend None: exact path (`tokenizer.encode` per string)."""

    tokenizer: Any
    backend: Any = None  # a private copy of the fast backend: no truncation/padding, same special-token mode
    safe: Callable[[str, str], bool] | None = None  # None: no cutting, whole strings only
    added: re.Pattern | None = None  # added-token texts: strings holding one are never cut
    specials: dict[bool, tuple[list[int], list[int]]] = field(default_factory=dict)  # flag -> (before, after)
    anchor: list[int] = field(default_factory=list)
    reason: str = ""
    bad: set = field(default_factory=set)  # anchored pieces that failed the anchor check: their strings go whole


def _plain_safe(prev: str, nxt: str) -> bool:
    # printable and not a space: no kind of whitespace (Unicode White_Space, regex \s) nor a control char
    return nxt in " \n" and prev.isprintable() and not prev.isspace()


def _llama3_safe(prev: str, nxt: str) -> bool:
    return _plain_safe(prev, nxt) and (nxt == " " or prev.isalnum())


def _normalizer_local(node: dict | None) -> bool:
    """True when normalizing s = P + R (P ending in a non-space, R starting with a space or newline) gives
    norm(P) followed by what R becomes behind any non-space prefix: each rule is char-local, or acts only on
    runs of spaces, or only at the string's ends (Prepend, Strip, \\A, \\z), which the anchor reproduces."""
    if node is None:
        return True
    kind = node.get("type")
    if kind == "Sequence":
        return all(_normalizer_local(n) for n in node["normalizers"])
    if kind == "Replace":
        pattern = node["pattern"]
        return len(pattern.get("String", "xx")) == 1 or pattern.get("Regex") in _LOCAL_REGEXES
    return kind in _LOCAL_NORMALIZERS


def _bpe_never_crosses(backend: Any, model: dict) -> bool:
    """Without a splitting pre-tokenizer, BPE runs over the whole string: it is cut-safe when no vocabulary
    token holds a non-space char followed by a space-like one (then no merge spans the cut, and merges on
    either side do not interact), there is no dropout, and space/newline never become a fusable <unk>."""
    if model.get("type") != "BPE" or model.get("dropout") or model.get("ignore_merges"):
        return False
    spaces = set(" \n\t\r▁ĠĊ")
    for token in backend.get_vocab():
        if any(a not in spaces and b in spaces for a, b in zip(token, token[1:])):
            return False
    unk = backend.token_to_id(model["unk_token"]) if model.get("unk_token") else None
    return unk is None or unk not in backend.encode("a\nb c\n\nd", add_special_tokens=False).ids


def _cut_rule(backend: Any, config: dict) -> tuple[Callable[[str, str], bool] | None, str]:
    """The boundary predicate proved for this pipeline, or None and why not."""
    if not _normalizer_local(config.get("normalizer")):
        return None, f"normalizer not proved local: {json.dumps(config.get('normalizer'))[:120]}"
    model = config.get("model") or {}
    if model.get("dropout"):
        return None, "BPE dropout"
    pre = config.get("pre_tokenizer")
    steps = pre["pretokenizers"] if pre and pre.get("type") == "Sequence" else [pre] if pre else []
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return _plain_safe, "byte-level GPT-2 regex: a non-space char never shares a pre-token with a following space"
    if kinds == ["Split", "ByteLevel"] and steps[0]["pattern"].get("Regex") in _LLAMA3_PATTERNS \
            and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert") \
            and not steps[1].get("use_regex", True):  # fmt: skip
        return _llama3_safe, "Llama-3/Qwen2 split regex: cut before a space, or before a newline after a letter/digit"
    if kinds in ([], ["Metaspace"]) and _bpe_never_crosses(backend, model):
        return _plain_safe, "BPE over whole string, no vocabulary token crosses a space"
    return None, f"pre-tokenizer {kinds} / model {model.get('type')} not proved cut-safe"


def _fixed_specials(backend: Any, post: dict | None) -> dict[bool, tuple[list[int], list[int]]] | None:
    """encode(s, flag) == before + encode(s, False) + after, for fixed lists: checked on probes."""
    kinds = [p.get("type") for p in post["processors"]] if post and post.get("type") == "Sequence" else [post and post.get("type")]
    if any(k not in _FIXED_POST for k in kinds):
        return None
    out = {}
    for flag in (True, False):
        found = set()
        for probe in ("a", "b c\n\nd e"):
            core, full = backend.encode(probe, add_special_tokens=False).ids, backend.encode(probe, add_special_tokens=flag).ids
            k = next((i for i in range(len(full) - len(core) + 1) if full[i : i + len(core)] == core), None)
            if k is None:
                return None
            found.add((tuple(full[:k]), tuple(full[k + len(core) :])))
        if len(found) != 1:
            return None
        before, after = found.pop()
        out[flag] = (list(before), list(after))
    return out


def make_plan(tokenizer: Any) -> Plan:
    """Prove what can be done fast for `tokenizer` (once per tokenizer; hold on to the result)."""
    source = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if source is None:
        return Plan(tokenizer, reason="not a fast tokenizer: tokenizer.encode per string")
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(source.to_str())  # a copy: `tokenizer.encode` resets these per call, we set them once
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
    config = json.loads(backend.to_str())
    plan = Plan(tokenizer, backend)
    safe, plan.reason = _cut_rule(backend, config)
    specials = _fixed_specials(backend, config.get("post_processor"))
    added = [t for t in backend.get_added_tokens_decoder().values() if t.content]
    if safe and specials and not (config.get("normalizer") and any(t.normalized for t in added)):
        plan.safe, plan.specials, plan.anchor = safe, specials, backend.encode(ANCHOR, add_special_tokens=False).ids
        texts = sorted((t.content for t in added), key=len, reverse=True)
        plan.added = re.compile("|".join(map(re.escape, texts))) if texts else None
    elif safe:
        plan.reason = "special tokens are not a fixed before/after, or added tokens match normalized text"
    return _self_check(plan)


_PROBES = [
    "The following are multiple choice questions (with answers) about x.\n\nQ: 2+2?\nA. 4\nAnswer: A\n\nQ: next\nAnswer:",
    " A", "\n\n\nlead  \n\n mid.\n\nend \n", "héllo wörld 日本語 😀\n\nnext,\n\n(A) 42.\n\n\u00a0x", "x\n\n y  z",
]  # fmt: skip


def _self_check(plan: Plan) -> Plan:
    """Belt and braces: the fast paths must agree with `tokenizer.encode` on a few awkward strings."""
    if plan.backend is None:
        return plan
    tok = plan.tokenizer
    for flag in (True, False):
        whole = plan.backend.encode_batch_fast(_PROBES, add_special_tokens=flag)
        if [e.ids for e in whole] != [tok.encode(p, add_special_tokens=flag) for p in _PROBES]:
            return Plan(tok, reason="backend differs from tokenizer.encode on a probe: tokenizer.encode per string")
    if plan.safe is not None:
        pairs = [(p, c) for p in _PROBES[:1] + _PROBES[2:] for c in (" A", "\n\nB", " x y", "")]
        fast = _encode_chunk(plan, pairs, 0, None, {})
        if fast != [encode_pair_exact(tok, c, x, 0, None) for c, x in pairs]:
            plan.safe, plan.reason = None, f"cut rule failed its self-check ({plan.reason}): whole strings only"
    return plan


def tok_flag(string: str, bos: str | None) -> bool:
    """OrchardLM.tok_encode: add_special_tokens=False when the string already starts with the BOS text."""
    return not (bos is not None and string.startswith(bos))


def exact_encode(tokenizer: Any, string: str, bos: str | None) -> list[int]:
    return tokenizer.encode(string) if tok_flag(string, bos) else tokenizer.encode(string, add_special_tokens=False)


def lm_eval_split(context: str, continuation: str) -> tuple[str, str]:
    """_encode_pair: trailing whitespace of the context moves to the continuation."""
    n = len(context) - len(context.rstrip())
    return (context[:-n], context[-n:] + continuation) if n else (context, continuation)


def empty_context(continuation: list[int], prefix_token_id: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """TemplateLM.loglikelihood's rule for an empty context: the prefix token (BOS/EOS) conditions the
    continuation, unless the continuation already starts with it."""
    if prefix_token_id != continuation[0]:
        return (prefix_token_id,), tuple(continuation)
    return tuple(continuation[:1]), tuple(continuation[1:])


def encode_pair_exact(tokenizer: Any, context: str, continuation: str, prefix_token_id: int, bos: str | None) -> tuple:
    """The reference: TemplateLM.loglikelihood's tokenization of one request, OrchardLM.tok_encode semantics."""
    if context == "":
        return empty_context(tokenizer.encode(continuation, add_special_tokens=False), prefix_token_id)
    context, continuation = lm_eval_split(context, continuation)
    whole = exact_encode(tokenizer, context + continuation, bos)
    ctx = exact_encode(tokenizer, context, bos)
    return tuple(ctx), tuple(whole[len(ctx) :])


def _parts(plan: Plan, text: str, bad: set, tail: bool = False) -> list[tuple[str, str]] | None:
    """`text` cut before each paragraph break with a proved boundary: ("0", piece) is encoded as a string's
    start, ("+", piece) behind the anchor. None: encode the text whole."""
    if plan.safe is None or not text or (plan.added is not None and plan.added.search(text)):
        return None
    safe, cuts, p = plan.safe, [0], text.find(BREAK, 1)
    while p != -1:
        if safe(text[p - 1], "\n"):
            cuts.append(p)
        p = text.find(BREAK, p + 1)
    cuts.append(len(text))
    parts = [("+" if i or tail else "0", text[a:b]) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    return None if bad and any(p in bad for p in parts) else parts


def _specs(plan: Plan, pairs: Sequence[tuple[str, str]], bos: str | None, bad: set) -> list[tuple]:
    """Per request: ("empty", cont_spec) or ("pair", ctx_spec, whole_spec, cont_parts); a spec is
    (flag, parts or None, text). cont_parts: the whole is the context's parts followed by these."""
    out, memo, tails = [], {}, {}
    for context, continuation in pairs:
        if context == "":
            out.append(("empty", (False, _parts(plan, continuation, bad), continuation)))
            continue
        ctx, cont = lm_eval_split(context, continuation) if context[-1].isspace() else (context, continuation)
        cspec = memo.get(ctx)
        if cspec is None:
            cspec = memo[ctx] = (tok_flag(ctx, bos), _parts(plan, ctx, bad), ctx)
        tail = tails.get(cont, 0)
        if tail == 0:
            tail = tails[cont] = [] if cont == "" else _parts(plan, cont, bad, tail=True)
        # the whole string's flag: a BOS text longer than the context may end inside the continuation
        flag = cspec[0] if bos is None or len(ctx) >= len(bos) else tok_flag(ctx + cont, bos)
        if cspec[1] is not None and tail is not None and (not cont or plan.safe(ctx[-1], cont[0])):
            out.append(("pair", cspec, (flag, cspec[1] + tail, None), tail))
        else:
            out.append(("pair", cspec, (flag, _parts(plan, ctx + cont, bad), ctx + cont), None))
    return out


def _fill(plan: Plan, specs: list[tuple], cache: dict, parallel: bool | None) -> set:
    """Encode every piece and whole string not in `cache`, in batches; returns anchored pieces whose anchor
    did not come out as the anchor's own tokens (their strings must be encoded whole)."""
    pieces, wholes = {}, {}
    for spec in (s for r in specs for s in r[1:3] if isinstance(s, tuple)):
        flag, parts, text = spec
        if parts is None:
            wholes.setdefault((text, flag), None)
        else:
            pieces.update((p, None) for p in parts if p not in cache)
    wanted = list(pieces)
    with _parallelism(parallel):
        encoded = plan.backend.encode_batch_fast([ANCHOR + t if k == "+" else t for k, t in wanted], add_special_tokens=False)
        for flag in (True, False):
            texts = [t for t, f in wholes if f == flag]
            for t, e in zip(texts, plan.backend.encode_batch_fast(texts, add_special_tokens=flag) if texts else []):
                cache[("W", t, flag)] = e.ids
    n, bad = len(plan.anchor), set()
    for key, e in zip(wanted, encoded):
        ids = e.ids
        if key[0] == "+":
            if ids[:n] != plan.anchor:
                bad.add(key)
            ids = ids[n:]
        cache[key] = ids
    return bad


def _ids(plan: Plan, cache: dict, spec: tuple) -> list[int]:
    flag, parts, text = spec
    if parts is None:
        return cache[("W", text, flag)]
    before, after = plan.specials[flag]
    out = list(before)
    for p in parts:
        out += cache[p]
    return out + after if after else out


@contextlib.contextmanager
def _parallelism(parallel: bool | None):
    """`tokenizers` reads TOKENIZERS_PARALLELISM at each batch call; None leaves it as the process has it.
    Note: after a fork (Ray workers) the library turns it off in the child if the parent already used it."""
    if parallel is None:
        yield
        return
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if parallel else "false"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def _encode_chunk(plan: Plan, pairs: Sequence[tuple[str, str]], prefix_token_id: int, bos: str | None, cache: dict,
                  parallel: bool | None = None) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:  # fmt: skip
    if plan.backend is None:
        return [encode_pair_exact(plan.tokenizer, c, x, prefix_token_id, bos) for c, x in pairs]
    specs = _specs(plan, pairs, bos, plan.bad)
    failed = _fill(plan, specs, cache, parallel)
    if failed:  # rare: redo with the failed pieces' strings encoded whole
        plan.bad |= failed
        specs = _specs(plan, pairs, bos, plan.bad)
        _fill(plan, specs, cache, parallel)
    out, memo = [], {}
    for r in specs:
        if r[0] == "empty":
            out.append(empty_context(_ids(plan, cache, r[1]), prefix_token_id))
            continue
        _, cspec, wspec, tail = r
        ctx = memo.get(cspec[2])
        if ctx is None:
            ctx = memo[cspec[2]] = tuple(_ids(plan, cache, cspec))
        if tail is not None and cspec[0] == wspec[0] and not plan.specials[wspec[0]][1]:
            cont = tuple(cache[tail[0]]) if len(tail) == 1 else tuple(i for p in tail for i in cache[p])
        else:  # lm-eval's own arithmetic: whole[len(ctx):]
            cont = tuple(_ids(plan, cache, wspec)[len(ctx) :])
        out.append((ctx, cont))
    for key in [k for k in cache if k[0] == "W"]:  # whole strings are not shared across chunks: free them
        del cache[key]
    return out


def iter_encode_pairs(tokenizer: Any, pairs: Sequence[tuple[str, str]], prefix_token_id: int, *, chunk_size: int = 4096,
                      bounds: Iterable[tuple[int, int]] | None = None, bos_text: str | None = None,
                      plan: Plan | None = None, parallel: bool | None = None,
                      ) -> Iterator[list[tuple[tuple[int, ...], tuple[int, ...]]]]:  # fmt: skip
    """`encode_pairs` in chunks, in order, so the caller can dispatch a chunk while later ones are tokenized:
    `bounds` ([lo, hi) per chunk, covering the pairs in order) or fixed chunks of `chunk_size` requests.
    Pieces (few-shot examples) are cached across chunks: each is encoded once."""
    plan = plan or make_plan(tokenizer)
    bos = tokenizer.decode(prefix_token_id) if bos_text is None else bos_text
    cache: dict = {}
    if bounds is None:
        bounds = ((lo, min(lo + chunk_size, len(pairs))) for lo in range(0, len(pairs), chunk_size))
    for lo, hi in bounds:
        if len(cache) > 500_000:  # bound the memory of a very long run; correctness does not depend on it
            cache.clear()
        yield _encode_chunk(plan, pairs[lo:hi], prefix_token_id, bos, cache, parallel)


def encode_pairs(tokenizer: Any, pairs: Sequence[tuple[str, str]], prefix_token_id: int, *, bos_text: str | None = None,
                 plan: Plan | None = None, parallel: bool | None = None) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:  # fmt: skip
    """(context_ids, continuation_ids) per (context, continuation), exactly as TemplateLM.loglikelihood with
    OrchardLM.tok_encode computes them. `bos_text`: the BOS-prefix rule's text; None: decode(prefix_token_id),
    as OrchardLM does. Equal contexts share one tuple object. `parallel`: TOKENIZERS_PARALLELISM for the calls."""
    return [p for chunk in iter_encode_pairs(tokenizer, pairs, prefix_token_id, chunk_size=max(1, len(pairs)),
                                             bos_text=bos_text, plan=plan, parallel=parallel) for p in chunk]  # fmt: skip

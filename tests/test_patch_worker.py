"""The patch kernel (worker.patch, issue 37) against an independent implementation on the same weights: PyTorch forward
hooks on the transformers model, one forward per exact cell, and torch autograd for attribution patching; every
site, on the shipped stories260K (its BOS included) and a random llama and qwen2. Then what must not change a
number (chunking, batch size, two pairs in one chunk), the job kind, and the one-line refusals."""

from __future__ import annotations

from itertools import zip_longest

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from worker.jobs import run as run_job  # noqa: E402
from worker.load import load  # noqa: E402
from worker.patch import run  # noqa: E402
from worker.patch.spec import PatchCell, PatchRequest, cell_problem, group_problem  # noqa: E402
from worker.spec import Batching, Grouping, Job  # noqa: E402

SITES = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")
TOL = 1e-4


# --- the oracle: transformers + torch forward hooks ---------------------------------------------------------


class Oracle:
    """A HF llama-layout model run with forward hooks at each site: `acts` reads every site, `patched` one exact
    cell (one forward), `gradients` d metric / d activation at every site of the corrupt run (one backward)."""

    def __init__(self, path) -> None:
        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
        self.layers = self.model.model.layers

    def _module(self, site: str, layer: int):
        block = self.layers[layer]
        return {"attn_out": block.self_attn, "mlp_out": block.mlp, "resid_post": block, "resid_pre": block,
                "resid_mid": block.post_attention_layernorm, "attn_head": block.self_attn.o_proj}[site]  # fmt: skip

    def _hook(self, site: str, layer: int, fn):
        """fn(tensor) -> tensor or None on the site's activation; resid_pre, resid_mid (the post-attention norm's
        input) and attn_head (o_proj's input) are module inputs, the others outputs (first element of a tuple)."""
        module = self._module(site, layer)
        if site in ("resid_pre", "resid_mid", "attn_head"):

            def pre(mod, args, kwargs):
                x = args[0] if args else kwargs["hidden_states"]
                y = fn(x)
                if y is None:
                    return None
                return ((y, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": y})

            return module.register_forward_pre_hook(pre, with_kwargs=True)

        def post(mod, args, out):
            y = fn(out[0] if isinstance(out, tuple) else out)
            return None if y is None else ((y, *out[1:]) if isinstance(out, tuple) else y)

        return module.register_forward_hook(post)

    def ld(self, tokens, correct: int, wrong: int) -> torch.Tensor:
        logits = self.model(torch.tensor([tokens])).logits[0, -1]
        return logits[correct] - logits[wrong]

    def acts(self, tokens, points) -> dict:
        got, handles = {}, []
        for site, layer in points:
            handles.append(self._hook(site, layer, lambda x, k=(site, layer): got.__setitem__(k, x[0].detach().clone())))
        with torch.no_grad():
            self.model(torch.tensor([tokens]))
        for h in handles:
            h.remove()
        return got

    def patched(self, pair, cells: list[PatchCell], clean_acts: dict) -> list[float]:
        """The corrupt run with row b's cell patched in (cells of one site and layer; one forward, a row each)."""
        clean, corrupt, correct, wrong = pair
        site, layer = cells[0].site, cells[0].layer
        value, heads = clean_acts[site, layer], self.model.config.num_attention_heads
        seen = {}

        def put(y, base=None):
            y = y.clone()
            for b, cell in enumerate(cells):
                if site == "attn_head":
                    d = y.shape[-1] // heads
                    y[b, :, cell.head * d : (cell.head + 1) * d] = value[:, cell.head * d : (cell.head + 1) * d]
                else:
                    y[b, cell.position] = value[cell.position] - (0 if base is None else base[b, cell.position])
            return y

        if site == "resid_mid":  # the residual stream after attention: put in through the attention's output
            handles = [self._hook("resid_pre", layer, lambda x: seen.__setitem__("x", x)),
                       self._hook("attn_out", layer, lambda y: put(y, seen["x"]))]  # fmt: skip
        else:
            handles = [self._hook(site, layer, put)]
        with torch.no_grad():
            logits = self.model(torch.tensor([corrupt] * len(cells))).logits[:, -1]
        for h in handles:
            h.remove()
        return (logits[:, correct] - logits[:, wrong]).tolist()

    def gradients(self, pair, points) -> tuple[dict, dict]:
        """({point: grad [T, width]}, {point: corrupt activation}) at the corrupt run."""
        _, corrupt, correct, wrong = pair
        kept, handles = {}, []

        def keep(k, x):
            x.retain_grad()
            kept[k] = x

        for site, layer in points:
            handles.append(self._hook(site, layer, lambda x, k=(site, layer): keep(k, x)))
        self.model.zero_grad()
        self.ld(corrupt, correct, wrong).backward()
        for h in handles:
            h.remove()
        return {k: x.grad[0] for k, x in kept.items()}, {k: x[0].detach() for k, x in kept.items()}

    def expected(self, pair, requests) -> list[tuple[float, float, float]]:
        """(value, clean ld, corrupt ld) per request, as worker.patch.spec defines them. On one thread: these tiny
        matmuls spin torch's second thread on a loaded box (25 s instead of 1 s here)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._expected(pair, requests)
        finally:
            torch.set_num_threads(threads)

    def _expected(self, pair, requests) -> list[tuple[float, float, float]]:
        clean, corrupt, correct, wrong = pair
        points = {(r.cell.site, r.cell.layer) for r in requests if r.cell is not None}
        clean_acts = self.acts(clean, points)
        with torch.no_grad():
            lds = float(self.ld(clean, correct, wrong)), float(self.ld(corrupt, correct, wrong))
        grads, corrupt_acts = self.gradients(pair, points)
        by_point: dict = {}
        for r in requests:
            if r.cell is not None and r.cell.method == "exact":
                by_point.setdefault((r.cell.site, r.cell.layer), []).append(r.cell)
        exact = {(k, c): v for k, cells in by_point.items() for c, v in zip(cells, self.patched(pair, cells, clean_acts))}
        out = []
        for r in requests:
            cell = r.cell
            if cell is None:
                value = lds[1]
            elif cell.method == "exact":
                value = exact[(cell.site, cell.layer), cell]
            else:
                k = cell.site, cell.layer
                product = grads[k] * (clean_acts[k] - corrupt_acts[k])
                d = product.shape[-1] // self.model.config.num_attention_heads
                value = lds[1] + float(product[:, cell.head * d : (cell.head + 1) * d].sum() if cell.head is not None
                                       else product[cell.position].sum())  # fmt: skip
            out.append((value, *lds))
        return out


# --- fixtures -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(stories_path, llama_path, tmp_path_factory) -> dict:
    from testbed.models import write_model

    qwen2 = write_model(tmp_path_factory.mktemp("patch") / "qwen2", arch="qwen2", layers=3, heads=4, kv_heads=2, seed=3)
    return {"stories": stories_path, "llama": llama_path, "qwen2": qwen2}


@pytest.fixture(scope="module")
def loaded(models) -> dict:
    return {name: load(str(path)) for name, path in models.items()}


def stories_pair(lm):
    """A real pair on the shipped model: the tokenizer adds the BOS (position 0)."""
    clean = lm.tokenizer.encode("Lily had a red ball. She gave the ball to")
    corrupt = lm.tokenizer.encode("Lily had a red cat. She gave the ball to")
    assert clean[0] == corrupt[0] == lm.tokenizer.bos_token_id and len(clean) == len(corrupt)
    correct, wrong = (lm.tokenizer.encode(w, add_special_tokens=False)[0] for w in (" Lily", " Tom"))
    return tuple(clean), tuple(corrupt), correct, wrong


def random_pair(lm, seed: int, length: int = 7):
    rng = np.random.default_rng(seed)
    vocab = int(lm.config["vocab_size"])
    clean = [1, *rng.integers(3, vocab, length - 1).tolist()]
    corrupt = list(clean)
    corrupt[2], corrupt[4] = int(rng.integers(3, vocab)), int(rng.integers(3, vocab))
    return tuple(clean), tuple(corrupt), 5, 17


def every_cell(lm, pair, methods=("exact", "attribution"), positions=None) -> list[PatchRequest]:
    """Every site at every layer, at `positions` (default all) and every head, each method; and the no-cell request."""
    heads = int(lm.config["num_attention_heads"])
    positions = range(len(pair[0])) if positions is None else positions
    cells = [PatchCell(site=s, layer=L, position=p, method=m) for m in methods for s in SITES
             for L in range(lm.n_layers) for p in positions]  # fmt: skip
    cells += [PatchCell(site="attn_head", layer=L, head=h, method=m) for m in methods for L in range(lm.n_layers) for h in range(heads)]
    return [PatchRequest(clean=pair[0], corrupt=pair[1], correct=pair[2], wrong=pair[3], cell=c) for c in [None, *cells]]


def close(got, want, tol=TOL):
    assert len(got) == len(want) and all(len(g) == 3 for g in got)
    worst = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w))
    assert worst <= tol, worst


# --- against the oracle ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["stories", "llama", "qwen2"])
def test_every_site_exact_and_attribution_match_torch_hooks(models, loaded, name):
    lm = loaded[name]
    pair = stories_pair(lm) if name == "stories" else random_pair(lm, seed=1)
    n = len(pair[0])  # stories: the BOS, "ball" / "cat" (6, 7) and around, the last two
    requests = every_cell(lm, pair, positions=[0, 1, 6, 7, 8, n - 2, n - 1] if name == "stories" else None)
    got = run(lm, requests, Batching(batch_size=16))
    want = Oracle(models[name]).expected(pair, requests)
    close(got, want)
    # the cells are not all the corrupt run: patches move the metric well past the tolerance, both ways
    moved = [abs(g[0] - g[2]) for g in got]
    assert max(moved) > 0.05 and sum(m > 1e-3 for m in moved) > len(moved) // 10
    # the clean run's whole last-position residual stream put in gives the clean run's metric
    last = next(g for r, g in zip(requests, got) if r.cell and r.cell.method == "exact" and r.cell.site == "resid_post"
                and r.cell.layer == lm.n_layers - 1 and r.cell.position == len(pair[0]) - 1)  # fmt: skip
    assert abs(last[0] - last[1]) <= TOL


# --- what must not change a number ---------------------------------------------------------------------------


def test_chunking_batch_size_and_two_pairs_in_one_chunk(loaded):
    lm = loaded["stories"]
    one, two = stories_pair(lm), random_pair(lm, seed=4, length=9)
    a, b = every_cell(lm, one, positions=[0, 6, 16]), every_cell(lm, two, positions=[1, 4, 8])
    alone = run(lm, a, Batching(batch_size=64)) + run(lm, b, Batching(batch_size=64))
    tagged = [(k, r) for pair in zip_longest(enumerate(a), enumerate(b, len(a))) for k, r in filter(None, pair)]
    together = run(lm, [r for _, r in tagged], Batching(batch_size=5, max_batch_tokens=40))  # two pairs interleaved
    close([together[[k for k, _ in tagged].index(k)] for k in range(len(a) + len(b))], alone, 1e-5)
    order = np.random.default_rng(0).permutation(len(a))  # shuffled, in chunks
    pieces = [run(lm, [a[k] for k in order[s : s + 37]], Batching(batch_size=3)) for s in range(0, len(order), 37)]
    close([r for piece in pieces for r in piece], [alone[k] for k in order], 1e-5)


def test_a_patch_job_through_jobs_run(loaded):
    lm = loaded["llama"]
    pair = random_pair(lm, seed=2)
    requests = every_cell(lm, pair, methods=("exact",))[:20]
    out = run_job(lm, Job(kind="patch"), requests, Batching(batch_size=8))
    assert list(out) == run(lm, requests, Batching(batch_size=8)) and out.notes == ()
    assert Job(kind="patch").key() != Job(kind="capture").key()


# --- refusals ----------------------------------------------------------------------------------------------


def test_refusals_in_one_line(loaded):
    head = PatchCell(site="attn_head", layer=0, head=1)
    assert group_problem(None, [head]) is None and group_problem(Grouping(size=2, split="tensor"), [PatchCell(site="mlp_out", layer=0, position=0)]) is None
    assert group_problem(Grouping(size=2), [head]) is None  # pipeline groups run every site
    assert "tensor-split" in group_problem(Grouping(size=2, split="tensor"), [head])
    assert "layer 9 is out of range" in cell_problem(PatchCell(site="mlp_out", layer=9, position=0), 5, 8, {})
    assert "head 8 is out of range" in cell_problem(PatchCell(site="attn_head", layer=0, head=8), 5, 8, {})
    assert "no resid_mid" in cell_problem(PatchCell(site="resid_mid", layer=0, position=0), 5, 8, {"resid_mid": "the phi block has no resid_mid"})
    with pytest.raises(ValueError, match="same length"):
        PatchRequest(clean=(1, 2, 3), corrupt=(1, 2), correct=0, wrong=1)
    with pytest.raises(ValueError, match="names a head and no position"):
        PatchCell(site="attn_head", layer=0, position=2)
    with pytest.raises(ValueError, match="past the pair's 3 tokens"):
        PatchRequest(clean=(1, 2, 3), corrupt=(1, 2, 4), correct=0, wrong=1, cell=PatchCell(site="mlp_out", layer=0, position=3))
    lm = loaded["stories"]
    with pytest.raises(ValueError, match="request 0: head 8 is out of range"):
        run(lm, [PatchRequest(clean=(1, 2, 3), corrupt=(1, 2, 4), correct=0, wrong=1, cell=PatchCell(site="attn_head", layer=0, head=8))])


# --- worker groups: a real 2-rank mx.distributed ring (testbed.ring), no Ray ------------------------------------


@pytest.mark.parametrize("split", ["pipeline", "tensor"])
def test_a_group_of_two_gives_one_workers_numbers(loaded, split):
    from testbed.ring import run_split

    lm = loaded["stories"]
    pair = stories_pair(lm)
    last = len(pair[0]) - 1
    # every site at every layer (pipeline: layers 0-2 on rank 0, 3-4 on rank 1), at the BOS, one inside, the last
    requests = [r for r in every_cell(lm, pair, positions=(0, 6, last))
                if r.cell is None or r.cell.head in (None, 0, 7) and (split == "pipeline" or r.cell.head is None)]  # fmt: skip
    batching = Batching(batch_size=8)
    want = run(lm, requests, batching)
    reports = run_split({"stories": lm.path}, Grouping(size=2, split=split), [("stories", Job(kind="patch"), requests, batching)])
    answering = reports[-1 if split == "pipeline" else 0]["results"][0]
    assert not isinstance(answering, str), answering
    close(answering, want)
    if split == "pipeline":  # the other rank answers nothing, as every pipelined kernel
        assert reports[0]["results"][0] == [None] * len(requests)

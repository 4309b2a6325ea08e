"""tandem/engine/warm_up.py: what a first request would wait for is done when the engine is built — on a
GPU the decode graphs captured (and the Triton kernels compiled), on a CPU oneDNN's primitives made for
every row count a prompt up to CPU_WARM_ROWS tokens uses — without writing the cache or holding a block."""

import pytest
import torch
from tiny_models import hf_greedy, make_checkpoint

from tandem import LLM, SamplingParams
from tandem.engine import cuda_graphs
from tandem.engine.warm_up import CPU_WARM_ROWS, warm_up
from tandem.layers import linear as linear_mod

pytestmark = pytest.mark.slow  # real models: deselected by -m 'not slow'

NEW = 20


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("llama")), "llama")


def test_warm_up_captures_every_size_and_writes_nothing(path):
    """tandem/engine/warm_up.py: at start (forced here: a CPU has nothing to compile) every batch size is
    captured for plain steps and, up to the speculation batch, for the verification query lengths; its
    dummy forwards store no K/V (slots -1) and hold no block; the graphs then serve transformers' tokens."""
    llm = LLM(path, num_kv_blocks=96, max_model_len=256, dtype="float32")
    runner = llm.engine.runner
    runner.use_graphs = True  # on by default on a GPU only (a CPU's graphs run eagerly)
    before = [c.view(torch.uint8).clone() for c in runner.kv_caches]
    warm_up(runner, (1, 2, 3), spec_batch=2, force=True)
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.replays == 0
    assert set(graphs.graphs) == {(s, 1) for s in cuda_graphs.SIZES} | {(s, q) for s in (1, 2) for q in (2, 3)}
    assert all(torch.equal(a, c.view(torch.uint8)) for a, c in zip(before, runner.kv_caches))
    assert llm.engine.kv.pool.num_used == 0
    prompts = [[(5 * i + 2 * j) % 400 + 3 for j in range(n)] for i, n in enumerate([9, 40, 23])]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, NEW)
    assert graphs.replays > 0 and runner.decode_graphs is graphs



@pytest.fixture
def made(monkeypatch) -> set[tuple[int, int, int]]:
    """The oneDNN products run from now on, as (rows, in, out): each is a primitive oneDNN makes once."""
    real = linear_mod._ONEDNN
    assert real is not None  # this CPU has oneDNN: the path under test
    seen: set[tuple[int, int, int]] = set()

    def spy(x, w, *args):
        y = real(x, w, *args)
        seen.add((x.shape[0], x.shape[1], y.shape[1]))
        return y

    monkeypatch.setattr(linear_mod, "_ONEDNN", spy)
    return seen


def test_a_cpu_engine_makes_the_onednn_primitives_its_prompts_use(path, made):
    """Every oneDNN product a prompt of up to CPU_WARM_ROWS tokens makes (a shape at a row count: a
    primitive) was made while the engine was built; a longer prompt's were not (the bound holds)."""
    llm = LLM(path, num_kv_blocks=96, max_model_len=1024, dtype="float32", device="cpu")  # a GPU box too
    assert llm.engine.warm_up_seconds > 0
    at_start = set(made)
    assert {n for n, _, _ in at_start} == {linear_mod.bucket_rows(n) for n in range(9, CPU_WARM_ROWS + 1)}
    lm_head = llm.engine.runner.model.lm_head  # packed for a batch of more than 8 rows, not by its first step
    assert lm_head._packed_key == linear_mod._weight_key(lm_head.weight)
    made.clear()
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompts = [[(3 * i + 7 * j) % 400 + 3 for j in range(n)] for i, n in enumerate([37, 300, 11])]
    llm.generate(prompts, greedy)
    assert made and made <= at_start, made - at_start
    made.clear()
    llm.generate([[(5 * j) % 400 + 3 for j in range(700)]], greedy)
    assert made - at_start  # 700 rows: past the warm-up's bound


@pytest.mark.parametrize("speculator", ["eagle", "draft_model"])
def test_the_speculators_layers_are_warmed_up_too(speculator, made):
    """A speculator's own linears (an EAGLE head's fc and layer: its catch-up over a new prompt; a draft
    model's layers: its prefill) run at the prompt's size too: their primitives are made at start as well."""
    from tandem.default_model import default_draft_path, default_eagle_path, default_model_path

    draft = default_eagle_path() if speculator == "eagle" else default_draft_path()
    llm = LLM(default_model_path(), speculator=speculator, draft_model=draft, num_speculative_tokens=2,
              spec_max_batch=2, max_model_len=512, dtype="float32", device="cpu")
    at_start = set(made)
    # and every layer's own packed weight, not only the first module of each shape (the target's other layers,
    # the head's layer: the first prompt packed those)
    spec = llm.engine.speculator.runner
    trees = (llm.engine.runner.model.model.layers, getattr(spec, "head", None) or spec.model.model.layers)
    linears = [m for tree in trees for m in tree.modules() if isinstance(m, linear_mod.Linear)]
    assert len(linears) > 20 and all(m._packed_key == linear_mod._weight_key(m.weight) for m in linears)
    made.clear()
    llm.generate([[(7 * j) % 900 + 3 for j in range(n)] for n in (131, 290)],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert made and made <= at_start, made - at_start

"""tools/train_eagle.py's pieces that the shipped head depends on: the draft vocabulary it exports (the most
frequent tokens, as EAGLE-3's d2t) and the windows its distillation stage trains on (training-window
prefixes continued by the target itself: greedy, token for token transformers' continuation)."""

import json
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import hf_greedy

pytestmark = pytest.mark.slow  # real models: deselected by -m 'not slow'

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "tandem" / "assets" / "tiny-target"


@pytest.fixture(scope="module")
def tool():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import train_eagle
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return train_eagle


def test_the_draft_vocabulary_is_the_most_frequent_tokens_and_exports_as_d2t(tool, tmp_path):
    data = torch.tensor([[7, 7, 7, 2, 2, 9], [9, 9, 9, 9, 1, 3]])
    ids = tool.draft_vocab(data, 16, 3)
    assert ids.tolist() == [2, 7, 9]  # counts 9: 5, 7: 3, 2: 2 (1 and 3 once), ascending
    tool.export({"fc.weight": torch.ones(2, 2)}, TARGET, tmp_path, ids)
    from safetensors.torch import load_file

    cfg, sd = json.loads((tmp_path / "config.json").read_text()), load_file(str(tmp_path / "model.safetensors"))
    assert cfg["draft_vocab_size"] == 3 and (torch.arange(3) + sd["d2t"]).tolist() == [2, 7, 9]
    assert sd["fc.weight"].dtype == torch.bfloat16


def test_distillation_windows_are_the_targets_own_greedy_continuations(tool):
    from tokenizers import Tokenizer

    _, held = tool.corpus()  # held-out code windows, as the tool cuts the training files
    data = tool.to_windows(Tokenizer.from_file(str(TARGET / "tokenizer.json")), [t for _, t in held[:3]], 200)[:6]
    windows = tool.generated_windows(TARGET, data, n=3, seq=140, seed=5)
    assert windows.shape == (3, 140)
    pick = torch.randperm(len(data), generator=torch.Generator().manual_seed(5))[:3]
    for i, (w, row) in enumerate(zip(windows.tolist(), pick.tolist())):
        cut = 32 + (i * 37) % 96  # the prompt: that many tokens of the picked training window
        assert w[:cut] == data[row, :cut].tolist()
        # plain greedy: the shipped generation_config's repetition_penalty 1.2 is not what drafting meets
        assert w[cut:] == hf_greedy(str(TARGET), [w[:cut]], 140 - cut, repetition_penalty=1.0)[0]

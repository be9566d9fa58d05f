"""The trained fixture (bench/fixture/glm-moe-fixture) and its build scripts' deterministic parts:
the committed checkpoint is what moet and transformers expect and has learned something; the
corpus split, the training data order, the Hub export and the trace/coverage helpers behave."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[3]
FIXTURE = ROOT / "bench" / "fixture"
MODEL = FIXTURE / "glm-moe-fixture"
sys.path.insert(0, str(FIXTURE))
sys.path.insert(0, str(ROOT / "packages" / "moet-vllm" / "tests"))

import corpus  # noqa: E402
import model as fixture  # noqa: E402
import traces  # noqa: E402
import train  # noqa: E402

# Code written for this test, in no training source: a trained model predicts it far better than
# its unigram statistics do.
SNIPPET = '''import os


def read_lines(path):
    """Return the lines of a text file, without their newlines."""
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\\n") for line in f]


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1
        return self.counts[key]

    def __len__(self):
        return len(self.counts)


if __name__ == "__main__":
    for name in sorted(os.listdir(".")):
        print(name)
'''


@pytest.fixture(scope="module")
def loaded():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    return m, AutoTokenizer.from_pretrained(MODEL)


def test_committed_checkpoint_is_what_moet_reads():
    from moet_quant.checkpoint import open_checkpoint

    assert (MODEL / "model.safetensors").stat().st_size <= 8_000_000
    cfg = json.loads((MODEL / "config.json").read_text())
    assert cfg == fixture.CONFIG
    info = open_checkpoint(MODEL).info
    assert (info.architecture, info.family, info.source_format) == (
        "Glm4MoeForCausalLM",
        "glm",
        "bf16",
    )
    assert (info.n_experts, info.top_k, info.moe_layers, info.mtp_layers) == (64, 4, [1, 2, 3], [])
    assert info.n_projections == 3 * 64 * 3
    assert info.hidden_size % 32 == 0 and info.moe_intermediate_size % 32 == 0


def test_tokenizer_has_glm45_markup(loaded):
    from tiny_models import GLM_CHAT_TEMPLATE, SPECIAL_TOKENS

    _, tok = loaded
    assert len(tok) == fixture.VOCAB_SIZE
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.convert_tokens_to_ids(t) == i and tok.decode([i]) == t
    assert tok.chat_template == GLM_CHAT_TEMPLATE
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "[gMASK]<sop><|user|>\nhi<|assistant|>"
    assert tok.decode(tok(SNIPPET).input_ids) == SNIPPET  # byte-level: lossless


def test_fixture_has_learned(loaded):
    m, tok = loaded
    ids = torch.tensor([tok(SNIPPET).input_ids])
    with torch.no_grad():
        loss = float(m(input_ids=ids, labels=ids).loss)
    counts = np.bincount(ids[0].numpy(), minlength=fixture.VOCAB_SIZE)
    p = counts / counts.sum()
    unigram = float(-np.log(p[ids[0, 1:].numpy()]).mean())  # the snippet's own unigram: a floor
    assert loss < 0.5 * unigram, (loss, unigram)  # perplexity far under the square root
    assert np.exp(loss) < 5.0


def test_split_is_by_hashed_key():
    assert corpus.split_of("stdlib/json/decoder.py") == corpus.split_of("stdlib/json/decoder.py")
    splits = [corpus.split_of(f"stdlib/m{i}.py") for i in range(20000)]
    share = {s: splits.count(s) / len(splits) for s in ("train", "val", "test")}
    assert abs(share["val"] - 0.05) < 0.006 and abs(share["test"] - 0.05) < 0.006
    # pinned (documents of the committed manifest): a changed rule would move documents between
    # splits and leak test text into training
    assert corpus.split_of("doc/dpkg/README.bug-usertags.gz") == "val"
    assert corpus.split_of("doc/fonts-dejavu-core/unicover.txt.gz") == "val"
    assert corpus.split_of("doc/bash/README.commands.gz") == "test"
    assert corpus.split_of("doc/ed/README.gz") == "test"
    assert corpus.split_of("stdlib/os.py") == "train"


def test_training_order_is_resumable_and_covers_each_epoch():
    n, b = 37, 8
    seen = np.concatenate([train.batch_windows(n, 3, s, b) for s in range(10)])
    for epoch in range(2):
        assert sorted(seen[epoch * n : (epoch + 1) * n].tolist()) == list(range(n))
    np.testing.assert_array_equal(train.batch_windows(n, 3, 7, b), seen[56:64])
    assert not np.array_equal(train.batch_windows(n, 4, 0, b), seen[:8])
    assert train.lr_at(0, 1000) < train.lr_at(199, 1000) == pytest.approx(train.PEAK_LR)
    assert train.lr_at(999, 1000) == pytest.approx(0.1 * train.PEAK_LR, rel=1e-3)


def test_export_round_trip_and_dense_experts(tmp_path):
    from transformers import Glm4MoeForCausalLM

    small = {"num_hidden_layers": 2, "n_routed_experts": 8, "vocab_size": 64}
    m = fixture.new_model(5, **small)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
        for r in fixture.routers(m):
            r.e_score_correction_bias.normal_(0, 0.1)
    x = torch.randint(0, 64, (2, 24))
    with torch.no_grad():
        eager = m(input_ids=x).logits
        fixture.use_dense_experts(m)
        dense = m(input_ids=x).logits
    torch.testing.assert_close(dense, eager, rtol=1e-4, atol=1e-5)

    from safetensors.torch import save_file

    save_file(fixture.hub_state_dict(m), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({**fixture.CONFIG, **small}))
    back = Glm4MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for k, v in m.state_dict().items():
        want = v.float() if k.endswith("e_score_correction_bias") else v.bfloat16().float()
        assert torch.equal(back.state_dict()[k], want), k
    names = fixture.hub_state_dict(m)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert names["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


def test_traces_and_coverage(tmp_path):
    rng = np.random.default_rng(0)
    tokens, E = 4096, 64
    # layer 0: every token routed to experts 0..3; layer 1: uniform over all 64 experts
    hot = np.tile(np.arange(4), (tokens, 1))
    flat = np.stack([rng.permutation(E)[:4] for _ in range(tokens)])
    routes = np.stack([hot, flat], axis=1).astype(np.uint16)
    cov = traces.coverage(routes[:, :1], E)
    assert cov["experts_for_routings"]["0.99"] == 4 / 64
    assert cov["routings_at_experts"]["0.10"] == pytest.approx(1.0)
    cov = traces.coverage(routes[:, 1:], E)
    assert cov["routings_at_experts"]["0.51"] == pytest.approx(0.51, abs=0.03)
    # 64 routings per 16-token window over 64 experts: finite windows concentrate even uniform routing
    assert 0.8 < traces.coverage(routes[:, 1:], E, window=16)["routings_at_experts"]["0.51"] < 0.95
    sidecar = {"model": "x", "E": E, "top_k": 4, "moe_layer_ids": [1, 2], "split": "test"}
    traces.write_trace(tmp_path / "t.npy", routes, sidecar)
    back, meta = traces.read_trace(tmp_path / "t.npy")
    np.testing.assert_array_equal(back, routes)
    assert meta == sidecar
    with pytest.raises(ValueError):
        traces.write_trace(tmp_path / "bad.npy", routes.astype(np.int64), sidecar)

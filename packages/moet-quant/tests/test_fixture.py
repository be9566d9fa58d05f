"""The trained fixture (moet.models.fixture(), shipped by the meta-package) and the deterministic
parts of its build scripts (bench/fixture/): the committed checkpoint is what moet and
transformers expect and has learned something; the corpus split, the training data order, the Hub
export and the trace/coverage helpers behave."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import moet.models

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[3]
FIXTURE = ROOT / "bench" / "fixture"  # the fixture's pipeline
MODEL = moet.models.fixture()  # the model: the meta-package's package data
sys.path.insert(0, str(FIXTURE))
sys.path.insert(0, str(ROOT / "bench"))  # provenance.py
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


def test_an_mtp_layer_would_not_fit_the_budget():
    """The decision the card states (no MTP layer), with the numbers it states: the committed
    weights fit the 8 MB budget, the same weights with vLLM's Glm4MoeMTP layer do not."""
    from tiny_models import MTP_EXTRA

    # the MTP tensors sized are the ones vLLM's Glm4MoeMTP loads (tiny_models also stores a head)
    assert set(MTP_EXTRA) == {*fixture.MTP_EXTRA, "shared_head.head.weight"}
    b = fixture.mtp_budget(MODEL / "model.safetensors")
    assert b["bytes"] == (MODEL / "model.safetensors").stat().st_size <= b["budget_bytes"]
    assert b["budget_bytes"] < b["with_mtp_shared_head"] < b["with_mtp_own_head"]
    assert 0 < b["experts_that_fit_with_mtp"] < fixture.CONFIG["n_routed_experts"]
    card = (MODEL / "README.md").read_text()
    for key in ("bytes", "with_mtp_shared_head", "with_mtp_own_head"):
        assert f"{b[key]:,}" in card, key
    assert f"at most {b['experts_that_fit_with_mtp']}\nrouted experts" in card


def test_provenance_records_what_it_finds_and_says_what_it_cannot(tmp_path, monkeypatch):
    import subprocess

    import provenance

    cmd = [sys.executable, str(FIXTURE / "h200_train.py"), str(tmp_path / "data"), "out dir"]
    monkeypatch.delenv("MOET_COMMIT", raising=False)
    p = provenance.provenance(cmd)
    assert p["command"] == "python3 bench/fixture/h200_train.py <data> 'out dir'"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode == 0:
        assert (p["commit"], p["from"]) == (head.stdout.strip(), "git")
        assert isinstance(p["dirty"], bool)
    assert p["torch"] == torch.__version__
    for key in ("gpu", "driver", "cuda", "transformers", "python", "cpus"):
        assert p[key], key

    # on the device machine: no .git, so MOET_COMMIT or "not recorded"; nvidia-smi's answer parsed
    def fake_run(cmd):
        if cmd[0] == "nvidia-smi":
            return "NVIDIA H200, 570.00.01"
        return None

    monkeypatch.setattr(provenance, "_run", fake_run)
    monkeypatch.setattr(provenance.shutil, "which", lambda name: "/bin/" + name)
    monkeypatch.delenv("MOET_COMMIT", raising=False)
    p = provenance.provenance(["bash", "bench/fixture/h200_eval.sh"])
    assert (p["gpu"], p["driver"]) == ("NVIDIA H200", "570.00.01")
    assert (p["commit"], p["dirty"], p["from"]) == ("not recorded",) * 3
    assert p["command"] == "bash bench/fixture/h200_eval.sh"
    # MOET_COMMIT wins over git (the device machine can hold a stale .git folder)
    monkeypatch.setattr(provenance, "_run", lambda cmd: "f00d" if cmd[0] == "git" else None)
    monkeypatch.setenv("MOET_COMMIT", "0123abc")
    assert provenance.commit() == {
        "commit": "0123abc",
        "dirty": "not recorded",
        "from": "MOET_COMMIT",
    }


def test_h200_summary_states_what_is_known_and_not_recorded():
    summary = json.loads((FIXTURE / "results" / "h200_train_summary.json").read_text())
    prov = summary["provenance"]
    start = json.loads((FIXTURE / "results" / "train_log_A.jsonl").read_text().splitlines()[0])
    assert (prov["gpu"], prov["torch"], prov["transformers"]) == (
        start["device"],
        start["torch"],
        start["transformers"],
    )
    for key in ("driver", "commit", "command", "budget_s"):
        assert prov[key] == "not recorded", key  # that run did not record them: not guessed
    assert summary["steps"] == start["steps"]


def test_the_fixtures_exports_round_trip(tmp_path, loaded):
    """The fixture's exported flavours, made by the scripts that make them and read back by moet's
    readers: `bench/fixture/quality.py --make-exports` (real nvidia-modelopt:
    FP8_2D_BLOCKWISE_WEIGHT_ONLY and NVFP4_EXPERTS_ONLY) holds every routed expert projection of
    the 3 MoE layers x 64 experts in its format, within that format's error of the bf16 weights,
    NVFP4 touching nothing but the experts; `moet convert` holds exactly the W2 quantizer's
    output and every other tensor byte for byte."""
    pytest.importorskip("modelopt.torch.quantization")
    import quality as fixture_quality  # bench/fixture/quality.py
    from safetensors.torch import load_file

    from moet_quant import convert, w2
    from moet_quant.checkpoint import open_checkpoint

    _, tok = loaded
    ids = tok(SNIPPET).input_ids
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.array(ids * (2048 // len(ids) + 1), dtype=np.uint16))
    fixture_quality.main(["--tokens", str(tokens), "--make-exports", str(tmp_path / "exports")])
    bf16 = open_checkpoint(MODEL)
    want = {(s.key.layer, s.key.expert, s.key.proj): s.dequant() for s in bf16.sources}
    assert len(want) == 3 * 64 * 3
    expert_tensors = {t for s in bf16.sources for t in s.tensors}
    errors = {}
    # modelopt's FP8 blocks are 128 x 128, larger than every fixture projection (32 x 128, 128 x
    # 32): its export has one scale per projection, which moet reads as fp8-tensor (docs/quality.md)
    for variant, fmt in (("fp8", "fp8-tensor"), ("nvfp4", "nvfp4")):
        ck = open_checkpoint(tmp_path / "exports" / variant)
        info = ck.info
        assert (info.source_format, info.family) == (fmt, "glm")
        assert (info.n_experts, info.moe_layers, info.n_projections) == (64, [1, 2, 3], 576)
        rel = []
        for s in ck.sources:
            w = want[(s.key.layer, s.key.expert, s.key.proj)]
            rel.append(np.sqrt(np.mean((s.dequant() - w) ** 2) / np.mean(w**2)))
        errors[variant] = float(np.mean(rel))
        if variant == "nvfp4":  # experts only: every other tensor (shared experts too) as it was
            kept = [n for n in bf16.st.names() if n not in expert_tensors]
            assert len(kept) == 57 and set(kept) <= set(ck.st.names())
            for name in kept:
                assert ck.st.array(name).tobytes() == bf16.st.array(name).tobytes(), name
    # the quality table's rel-RMS means (docs/quality.md): fp8 0.026, nvfp4 0.095
    assert 0.01 < errors["fp8"] < 0.04 < errors["nvfp4"] < 0.15, errors

    out = convert.convert(MODEL, tmp_path / "moet", progress=False).out
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(f))
    for s in bf16.sources:
        ref = w2.quantize_f64(s.dequant())
        assert (got[f"{s.name}.w2_codes"].numpy() == ref.codes).all(), s.name
        assert (got[f"{s.name}.w2_scales"].numpy() == ref.scales).all(), s.name
    for name in bf16.st.names():
        if name not in expert_tensors:
            raw = got[name].contiguous().view(torch.uint8).numpy().tobytes()
            assert raw == bf16.st.array(name).tobytes(), name
    assert not expert_tensors & set(got)

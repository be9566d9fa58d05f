"""The quality harness (moet_quant.quality, `moet-quant eval`) on a tiny random GLM-4.5-family
model: variants hold exactly the quantizer's dequantized experts, bf16 agrees with itself, W2
moves the distributions, the report is deterministic, and the helpers decide correctly."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from moet_quant import cli, quality, w2  # noqa: E402


@pytest.fixture(scope="module")
def tiny_glm(tmp_path_factory):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    cfg = Glm4MoeConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        first_k_dense_replace=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        max_position_embeddings=128,
        num_nextn_predict_layers=0,
    )
    torch.manual_seed(0)
    model = Glm4MoeForCausalLM(cfg)
    with torch.no_grad():  # weights of a realistic scale (the default init is tiny), in bf16
        for p in model.parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
        for m in quality.expert_modules(model):
            m[1].gate_up_proj[0, 0, :8] = 0.0  # exact zeros: balancing has work to do
    out = tmp_path_factory.mktemp("glm") / "model"
    model.to(torch.bfloat16).save_pretrained(out)
    return out


def _tokens(n=300, seed=1):
    return np.random.default_rng(seed).integers(0, 96, size=n).astype(np.uint16)


def test_quantized_copy_holds_the_quantizers_output(tiny_glm):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_glm, dtype=torch.float32)
    q, stats = quality.quantized_copy(ref, "w2-reference")
    (_, m_ref), (_, m_q) = quality.expert_modules(ref)[0], quality.expert_modules(q)[0]
    inter = m_ref.gate_up_proj.shape[1] // 2
    for e in range(m_ref.gate_up_proj.shape[0]):
        w = m_ref.gate_up_proj[e, :inter].detach().double().numpy()
        want = w2.quantize_f64(w, "auto", "reference").dequant()
        np.testing.assert_array_equal(m_q.gate_up_proj[e, :inter].detach().double().numpy(), want)
        w = m_ref.down_proj[e].detach().double().numpy()
        want = w2.quantize_f64(w, "auto", "reference").dequant()
        np.testing.assert_array_equal(m_q.down_proj[e].detach().double().numpy(), want)
    # every other tensor untouched, the reference model itself unchanged
    sd_ref, sd_q = ref.state_dict(), q.state_dict()
    for k in sd_ref:
        if "experts." not in k or "shared" in k:
            assert torch.equal(sd_ref[k], sd_q[k]), k
    assert not torch.equal(m_ref.gate_up_proj, m_q.gate_up_proj)
    assert len(stats) == 8 * 3 and all(0 < s["rel_rms"] < 1 for s in stats)
    # zero balancing changes the zeros' signs: the no-balancing variant differs exactly there
    nb, _ = quality.quantized_copy(ref, "w2-nobalance")
    diff = (quality.expert_modules(nb)[0][1].gate_up_proj != m_q.gate_up_proj).nonzero().tolist()
    assert diff and all(e == 0 and n == 0 and k < 8 for e, n, k in diff)


def test_report_is_deterministic_and_sane(tiny_glm):
    opts = quality.EvalOptions(
        variants=("bf16", "w2-reference", "w2-optimal", "w2-l2opt"),
        window=64,
        batch=4,
        n_boot=200,
        n_prompts=2,
        prompt_len=8,
        gen_tokens=8,
    )
    a = quality.evaluate(tiny_glm, _tokens(), opts)
    b = quality.evaluate(tiny_glm, _tokens(), opts)
    a.pop("seconds"), b.pop("seconds")
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    ref = a["variants"]["bf16"]
    assert a["tokens"] == 299 and a["windows"] == 5
    assert ref["top1_agreement"] == 1.0 and ref["kl_mean"] == 0.0 and ref["kl_p99"] == 0.0
    assert ref["generation"]["mean_prefix_equal_bf16"] == 8
    for v in ("w2-reference", "w2-optimal", "w2-l2opt"):
        r = a["variants"][v]
        assert r["kl_mean"] > 0 and r["kl_p99"] >= r["kl_mean"]
        assert 0 < r["top1_agreement"] < 1
        assert r["vs_bf16"]["ci95"][0] <= r["vs_bf16"]["mean"] <= r["vs_bf16"]["ci95"][1]
        assert r["tensors"]["n"] == 24
    # the error-optimal exponent search never does worse per block, so not per tensor either
    assert (
        a["variants"]["w2-optimal"]["tensors"]["rel_rms_mean"]
        <= a["variants"]["w2-reference"]["tensors"]["rel_rms_mean"]
    )
    table = quality.format_table(a)
    assert table.count("\n") == 5 and "w2-l2opt" in table


def test_bootstrap_and_loop_detector():
    count = np.full(50, 10.0)
    pos = quality.bootstrap(np.full(50, 1.0) + np.linspace(-0.5, 0.5, 50), count, 500, 0)
    assert pos["significant"] and pos["ci95"][0] > 0
    sym = quality.bootstrap(np.tile([1.0, -1.0], 25), count, 500, 0)
    assert not sym["significant"] and sym["ci95"][0] < 0 < sym["ci95"][1]
    assert quality.loop_period([5] * 40) == 1
    assert quality.loop_period(list(range(10)) + [1, 2, 3] * 12) == 3
    assert quality.loop_period(list(range(40))) == 0
    assert quality.loop_period([1, 2] * 5) == 0  # shorter than the tail


def test_cli_eval(tiny_glm, tmp_path, capsys):
    tok = tmp_path / "tokens.npy"
    np.save(tok, _tokens(130))
    out = tmp_path / "report.json"
    rc = cli.main(
        ["eval", str(tiny_glm), "--tokens", str(tok), "--window", "64", "--variant",
         "w2-reference", "--n-boot", "50", "--json", str(out)]
    )  # fmt: skip
    assert rc == 0
    rep = json.loads(out.read_text())
    assert list(rep["variants"]) == ["bf16", "w2-reference"]
    assert "| w2-reference |" in capsys.readouterr().out
    bad = tmp_path / "bad.npy"
    np.save(bad, np.zeros((2, 2)))
    assert cli.main(["eval", str(tiny_glm), "--tokens", str(bad)]) == 2


def test_nvfp4_variant_from_a_real_modelopt_export(tiny_glm, tmp_path, monkeypatch):
    pytest.importorskip("modelopt.torch.quantization")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    opts = quality.EvalOptions(
        variants=("bf16", "w2-reference", "nvfp4"),
        window=64,
        n_boot=50,
        n_prompts=1,
        prompt_len=8,
        gen_tokens=4,
    )
    rep = quality.evaluate(tiny_glm, _tokens(200, seed=3), opts)
    assert rep["modelopt_exports"]["nvfp4"]["expert_format"] == "nvfp4"
    fp4, two = rep["variants"]["nvfp4"], rep["variants"]["w2-reference"]
    # 4-bit e2m1 with e4m3 scales per 16: well under W2's error, far from exact
    assert 0.03 < fp4["tensors"]["rel_rms_mean"] < 0.5 * two["tensors"]["rel_rms_mean"]
    assert 0 < fp4["kl_mean"] < two["kl_mean"]
    assert fp4["top1_agreement"] > two["top1_agreement"]
    assert list((tmp_path / "cache" / "moet").iterdir()) == []  # the export is cleaned up


def test_fp4r_variant_holds_the_fp4_tiers_values_and_errs_less_than_w2(tiny_glm):
    """`fp4r`: every routed expert at the FP4 tier's values (fp4r nibbles on the W2 block
    scales): each weight is an e2m1 grid value times its block's power of two, and the error is
    well below W2's."""
    from transformers import AutoModelForCausalLM

    from moet_quant.numerics import E2M1_VALUES

    ref = AutoModelForCausalLM.from_pretrained(tiny_glm, dtype=torch.float32)
    q, stats = quality.quantized_copy(ref, "fp4r")
    _, w2_stats = quality.quantized_copy(ref, "w2-reference")
    (_, m_ref), (_, m_q) = quality.expert_modules(ref)[0], quality.expert_modules(q)[0]
    w = m_ref.down_proj[1].detach().double().numpy()
    got = m_q.down_proj[1].detach().double().numpy()
    scales = w2.quantize_f64(w, "auto", "reference").scales  # fp4r shares the W2 block scales
    unit = np.repeat(np.exp2(scales.astype(np.float64) - 127.0), 32, axis=1)
    assert np.isin(np.abs(got / unit), np.abs(E2M1_VALUES)).all()
    fp4_err = np.mean([s["rel_rms"] for s in stats])
    w2_err = np.mean([s["rel_rms"] for s in w2_stats])
    assert fp4_err < w2_err / 2, (fp4_err, w2_err)

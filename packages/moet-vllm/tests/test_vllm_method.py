"""The "moet" quantization config as vLLM sees it (in-process; no engine started)."""

import pytest

pytest.importorskip("vllm")  # the CPU vLLM of CI

from moet_vllm.compat import MoetVllmError  # noqa: E402
from moet_vllm.vllm_method import MoetQuantConfig, _layer_index  # noqa: E402


def test_method_selection():
    over = MoetQuantConfig.override_quantization_method
    assert over({"quant_method": "moet"}, None) == "moet"  # a moet checkpoint: no flag needed
    assert over({"quant_method": "fp8"}, "moet") == "moet"  # forced on another checkpoint
    assert over({}, "moet") == "moet"
    assert over({"quant_method": "fp8"}, None) is None  # other checkpoints are left alone
    assert over({}, None) is None


def test_config_from_a_moet_checkpoint_and_bare():
    qc = {"quant_method": "moet", "format": "w2-ue8m0b32-v1", "zero_mode": "sign", "block_size": 32}
    cfg = MoetQuantConfig.from_config(qc)
    assert cfg.get_name() == "moet" and cfg.is_moet_checkpoint
    assert cfg.config().zero_mode == "sign"
    bare = MoetQuantConfig()  # what vLLM builds for --quantization moet on an unquantized ckpt
    assert not bare.is_moet_checkpoint and bare.config().zero_mode == "auto"


def test_quantized_sources_are_refused_with_what_to_do():
    cfg = MoetQuantConfig.from_config({"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(MoetVllmError, match="quantized with 'fp8'.*moet convert"):
        cfg.config()


def test_layer_index_from_module_names():
    assert _layer_index("model.layers.12.mlp.experts") == 12
    with pytest.raises(MoetVllmError, match="cannot tell the model layer"):
        _layer_index("lm_head")

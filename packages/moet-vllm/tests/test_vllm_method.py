"""The "moet" quantization config as vLLM sees it (in-process; no engine started)."""

import pytest

pytest.importorskip("vllm")  # the CPU vLLM of CI

from quantized_models import quantization_config  # noqa: E402

from moet_vllm.compat import MoetVllmError  # noqa: E402
from moet_vllm.method import MoetQuantConfig, _layer_index  # noqa: E402


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


def test_dense_layers_get_the_checkpoint_method():
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert isinstance(MoetQuantConfig.from_config(fp8).dense, Fp8Config)
    moet = {"quant_method": "moet", "source_quantization_config": fp8}
    assert isinstance(MoetQuantConfig.from_config(moet).dense, Fp8Config)
    assert MoetQuantConfig.from_config({"quant_method": "moet"}).dense is None
    assert MoetQuantConfig().dense is None
    # modelopt's NVFP4 is claimed by vLLM's modelopt_fp4 method, as vLLM itself resolves it
    nvfp4 = {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["lm_head"]}
    assert isinstance(MoetQuantConfig.from_config(nvfp4).dense, ModelOptNvFp4Config)
    int4 = quantization_config("int4-pack", experts_only=False)
    assert isinstance(MoetQuantConfig.from_config(int4).dense, CompressedTensorsConfig)
    with pytest.raises(MoetVllmError, match="quant_method 'bogus' is not a method this vLLM"):
        MoetQuantConfig.from_config({"quant_method": "bogus"})
    with pytest.raises(MoetVllmError, match=r"quantization_config \(fp8\): .*activation_scheme"):
        MoetQuantConfig.from_config({"quant_method": "fp8"})


def test_architectures_moet_cannot_serve_are_refused_at_boot():
    from types import SimpleNamespace

    from moet_quant.errors import CheckpointError

    def model(arch):
        cfg = {"architectures": [arch], "model_type": arch.lower()}
        return SimpleNamespace(model="/m", hf_config=SimpleNamespace(to_dict=lambda: cfg))

    with pytest.raises(
        CheckpointError, match=r"LlamaForCausalLM.*not a supported MoE; supported: "
    ):
        MoetQuantConfig().config(None, model("LlamaForCausalLM"))
    assert MoetQuantConfig().config(None, model("Qwen3MoeForCausalLM")).format  # accepted


def test_layer_index_from_module_names():
    assert _layer_index("model.layers.12.mlp.experts") == 12
    with pytest.raises(MoetVllmError, match="cannot tell the model layer"):
        _layer_index("lm_head")

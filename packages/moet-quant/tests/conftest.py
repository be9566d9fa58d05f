import pytest

from moet_quant import synth


@pytest.fixture
def make_ckpt(tmp_path):
    """make_ckpt(family, fmt, **kw) -> a fresh synthetic checkpoint directory."""
    count = iter(range(1000))

    def make(family="qwen3-moe", fmt="bf16", **kw):
        kw.setdefault("hidden", 64)
        kw.setdefault("inter", 32)
        kw.setdefault("n_experts", 4)
        return synth.write_checkpoint(tmp_path / f"ckpt{next(count)}", family, fmt, **kw)

    return make

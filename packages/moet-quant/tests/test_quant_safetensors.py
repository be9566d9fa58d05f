"""The safetensors reader/writer against the reference `safetensors` library, and bad files."""

import json
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from moet_quant.errors import CheckpointError
from moet_quant.safetensors_io import (
    OutTensor,
    SafetensorsFile,
    ShardedSafetensors,
    write_safetensors,
)


def test_reads_what_the_reference_library_writes(tmp_path):
    ts = {
        "a": torch.randn(3, 5, dtype=torch.bfloat16),
        "b": torch.arange(7, dtype=torch.int32),
        "c": torch.randn(2, 2).to(torch.float8_e4m3fn),
        "d": torch.randn(4, 1, dtype=torch.float16),
    }
    save_file(ts, tmp_path / "m.safetensors")
    f = SafetensorsFile(tmp_path / "m.safetensors")
    for name, t in ts.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        assert f.array(name).tobytes() == raw and f.array(name).shape == tuple(t.shape)
    assert f.tensors["a"].dtype == "BF16" and f.tensors["c"].dtype == "F8_E4M3"


def test_reference_library_reads_what_we_write(tmp_path):
    arrays = {"x": np.arange(12, dtype=np.float32).reshape(3, 4), "y": np.arange(5, dtype=np.uint8)}
    metas = [
        OutTensor(n, {"float32": "F32", "uint8": "U8"}[str(a.dtype)], a.shape)
        for n, a in arrays.items()
    ]
    write_safetensors(tmp_path / "w.safetensors", metas, iter(arrays.values()), {"format": "pt"})
    back = load_file(tmp_path / "w.safetensors")
    for n, a in arrays.items():
        assert (back[n].numpy() == a).all()
    assert not (tmp_path / "w.safetensors.partial").exists()


def test_writer_leaves_no_final_file_on_failure(tmp_path):
    metas = [OutTensor("x", "U8", (4,)), OutTensor("y", "U8", (4,))]

    def data():
        yield np.zeros(4, np.uint8)
        raise RuntimeError("producer died")

    with pytest.raises(RuntimeError):
        write_safetensors(tmp_path / "w.safetensors", metas, data())
    assert not (tmp_path / "w.safetensors").exists()


def _write(tmp_path, name="m.safetensors"):
    save_file({"w": torch.ones(64, 64), "v": torch.zeros(8)}, tmp_path / name)
    return tmp_path / name


def test_truncated_file_names_file_and_tensor(tmp_path):
    p = _write(tmp_path)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"m\.safetensors.*tensor 'w'.*truncated"):
        SafetensorsFile(p)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda b: b[:5], "truncated"),
        (lambda b: struct.pack("<Q", 10**12) + b[8:], "header length"),
        (lambda b: b[:8] + b"{not json" + b[17:], "corrupt header JSON"),
    ],
)
def test_corrupt_headers(tmp_path, mutate, match):
    p = _write(tmp_path)
    p.write_bytes(mutate(p.read_bytes()))
    with pytest.raises(CheckpointError, match=match):
        SafetensorsFile(p)


def test_wrong_byte_count_and_overlap(tmp_path):
    def write_header(h):
        raw = json.dumps(h).encode()
        (tmp_path / "h.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(64))

    write_header({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}})
    with pytest.raises(CheckpointError, match="needs 16 bytes"):
        SafetensorsFile(tmp_path / "h.safetensors")
    write_header(
        {
            "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
            "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
        }
    )
    with pytest.raises(CheckpointError, match="overlap"):
        SafetensorsFile(tmp_path / "h.safetensors")
    write_header({"a": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 2]}})
    with pytest.raises(CheckpointError, match="unsupported dtype 'Q4'"):
        SafetensorsFile(tmp_path / "h.safetensors")


def test_sharded_index_missing_shard_and_stale_index(tmp_path):
    _write(tmp_path, "a.safetensors")
    index = {"weight_map": {"w": "a.safetensors", "v": "a.safetensors", "z": "b.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="missing shard.*b.safetensors"):
        ShardedSafetensors(tmp_path)
    index["weight_map"]["z"] = "a.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="no tensor 'z'"):
        ShardedSafetensors(tmp_path)


def test_never_loads_pickles(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not a real pickle")
    with pytest.raises(CheckpointError, match="never loads pickled"):
        ShardedSafetensors(tmp_path)


class _Spy:
    """Records which methods of the library's handle are called."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        self.calls.append(name)
        return getattr(self.inner, name)


def test_part_reads_one_slice_through_the_library(tmp_path):
    ts = {
        "u": torch.randint(0, 255, (3, 4, 5), dtype=torch.uint8),
        "f": torch.randn(2, 3, 4),
        "b": torch.randn(3, 2, dtype=torch.bfloat16),
    }
    save_file(ts, tmp_path / "m.safetensors")
    f = SafetensorsFile(tmp_path / "m.safetensors")
    f._st = spy = _Spy(f._st)
    for name, t in ts.items():
        for e in range(t.shape[0]):
            raw = t[e].contiguous().view(torch.uint8).numpy().tobytes()
            assert f.part(name, e).tobytes() == raw and f.part(name, e).shape == tuple(t.shape[1:])
    assert set(spy.calls) == {"get_slice"}  # never the whole tensor (bf16 comes from the map)
    assert (f.array("f") == ts["f"].numpy()).all() and spy.calls[-1] == "get_tensor"
    with pytest.raises(IndexError, match="has no index 3"):
        f.part("u", 3)


def test_bf16_and_fp8_we_write_read_back_by_the_library(tmp_path):
    bits = {
        "b": ("BF16", torch.bfloat16, np.arange(0x3F00, 0x3F0C, dtype=np.uint16).reshape(3, 4)),
        "e4": ("F8_E4M3", torch.float8_e4m3fn, np.arange(0, 120, 10, dtype=np.uint8)),
        "e5": ("F8_E5M2", torch.float8_e5m2, np.arange(1, 13, dtype=np.uint8).reshape(2, 6)),
        "m": ("F8_E8M0", torch.float8_e8m0fnu, np.arange(120, 132, dtype=np.uint8)),
    }
    metas = [OutTensor(n, dt, a.shape) for n, (dt, _, a) in bits.items()]
    write_safetensors(tmp_path / "w.safetensors", metas, (a for _, _, a in bits.values()))
    back = load_file(tmp_path / "w.safetensors")
    f = SafetensorsFile(tmp_path / "w.safetensors")
    for n, (_, tdt, a) in bits.items():
        assert back[n].dtype == tdt and back[n].view(torch.uint8).numpy().tobytes() == a.tobytes()
        assert (f.array(n) == a).all() and f.tensors[n].dtype == bits[n][0]


def test_what_only_the_library_refuses_is_one_error_naming_the_file(tmp_path):
    p = _write(tmp_path)
    p.write_bytes(p.read_bytes() + bytes(8))  # bytes after the last tensor: our checks pass
    with pytest.raises(
        CheckpointError, match=r"m\.safetensors: refused by the safetensors library"
    ):
        SafetensorsFile(p)

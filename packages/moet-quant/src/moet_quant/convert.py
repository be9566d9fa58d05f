"""`convert`: an official MoE checkpoint -> a moet checkpoint (design.md, "moet checkpoints").

Routed expert projections become `<moe>.experts.<e>.<gate|up|down>_proj.w2_codes` / `.w2_scales`
(plus the FP4 tier's tensors when asked); every other tensor is copied byte for byte into the shard
it came from. Safety:

* a disk-space preflight from the exact planned sizes;
* each shard is written to `<shard>.partial`, fsynced, then renamed;
* `.moet-convert.json` records the finished shards with their sha256: an interrupted conversion
  resumes, keeping (and verifying) finished shards;
* `config.json`, the file that makes a directory look like a checkpoint, is written last.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import __version__, fp4, w2
from .checkpoint import Checkpoint, ProjectionSource, open_checkpoint
from .errors import CheckpointError, MoetError
from .numerics import unpack_nibbles
from .progress import progress_bar
from .safetensors_io import OutTensor, fsync_dir, planned_size, write_safetensors

FP4_TIERS = ("none", "fp4r", "fp4x")
MANIFEST = ".moet-convert.json"
SKIP_FILES = {"config.json", "model.safetensors.index.json", MANIFEST, "README.md"}


@dataclass
class ConvertOptions:
    zero_mode: str = "auto"
    mode: str = "reference"
    fp4_tier: str = "none"

    def validate(self) -> None:
        if self.zero_mode not in w2.ZERO_MODES:
            raise MoetError(
                f"--zero-mode {self.zero_mode!r} is unknown; choose one of "
                f"{', '.join(w2.ZERO_MODES)}"
            )
        if self.mode not in w2.MODES:
            raise MoetError(f"--mode {self.mode!r} is unknown; choose one of {', '.join(w2.MODES)}")
        if self.fp4_tier not in FP4_TIERS:
            raise MoetError(
                f"--fp4-tier {self.fp4_tier!r} is unknown; choose one of {', '.join(FP4_TIERS)}"
            )


@dataclass
class ShardPlan:
    name: str
    tensors: list[OutTensor] = field(default_factory=list)
    # per output tensor: ("copy", source tensor name) or ("proj", index into Checkpoint.sources, part)
    producers: list[tuple] = field(default_factory=list)
    source_bytes: int = 0

    @property
    def size(self) -> int:
        return planned_size(self.tensors, {"format": "pt"})


@dataclass
class Plan:
    shards: list[ShardPlan]
    tier_bytes: dict[str, int]  # w2, fp4, dense (copied), total

    @property
    def total(self) -> int:
        return sum(s.size for s in self.shards)


def _proj_outputs(src: ProjectionSource, opts: ConvertOptions, ck: Checkpoint) -> list[OutTensor]:
    n, k = src.shape
    out = [
        OutTensor(f"{src.name}.w2_codes", "U8", (n, k // 4)),
        OutTensor(f"{src.name}.w2_scales", "U8", (n, k // 32)),
    ]
    if opts.fp4_tier == "fp4r":
        out.append(OutTensor(f"{src.name}.fp4_refine", "U8", (n, k // 16 * 5)))
    elif opts.fp4_tier == "fp4x":
        if src.fmt == "nvfp4":
            s2 = ck.st.info(next(t for t in src.tensors if t.endswith("weight_scale_2")))
            out += [
                OutTensor(f"{src.name}.fp4_codes", "U8", (n, k // 2)),
                OutTensor(f"{src.name}.fp4_scales", "F8_E4M3", (n, k // 16)),
                OutTensor(f"{src.name}.fp4_scale_2", "F32", s2.shape),
            ]
        elif src.fmt == "mxfp4":
            out += [
                OutTensor(f"{src.name}.fp4_codes", "U8", (n, k // 2)),
                OutTensor(f"{src.name}.fp4_scales", "U8", (n, k // 32)),
            ]
        else:
            raise MoetError(
                f"--fp4-tier fp4x keeps the checkpoint's own FP4 data, but the experts "
                f"of {ck.path} are {src.fmt}; use --fp4-tier fp4r (or none)"
            )
    return out


def plan(ck: Checkpoint, opts: ConvertOptions) -> Plan:
    """Every output shard's tensors, in order, with what produces each."""
    opts.validate()
    first_of: dict[str, list[int]] = {}  # source tensor name -> projections whose outputs go there
    consumed: set[str] = set()
    for i, src in enumerate(ck.sources):
        consumed.update(src.tensors)
        first_of.setdefault(src.tensors[0], []).append(i)
    shards = []
    bytes_ = {"w2": 0, "fp4": 0, "dense": 0}
    for shard in ck.st.shard_names():
        sp = ShardPlan(shard)
        f = ck.st.files[shard]
        for name in sorted(f.tensors, key=lambda t: f.tensors[t].offset):
            info = f.tensors[name]
            if name not in consumed:
                sp.tensors.append(OutTensor(name, info.dtype, info.shape))
                sp.producers.append(("copy", name))
                sp.source_bytes += info.nbytes
                bytes_["dense"] += info.nbytes
                continue
            for i in first_of.get(name, []):
                src = ck.sources[i]
                for part, t in enumerate(_proj_outputs(src, opts, ck)):
                    sp.tensors.append(t)
                    sp.producers.append(("proj", i, part))
                    bytes_["w2" if part < 2 else "fp4"] += t.nbytes
                sp.source_bytes += src.source_bytes
        shards.append(sp)
    bytes_["total"] = sum(s.size for s in shards)
    return Plan(shards, bytes_)


def _shard_data(ck: Checkpoint, sp: ShardPlan, opts: ConvertOptions, bar) -> Iterator:
    """Yield each output tensor's bytes in order, quantizing one projection at a time."""
    cache: tuple[int, list[np.ndarray]] | None = None
    for prod in sp.producers:
        if prod[0] == "copy":
            yield ck.st.files[sp.name].raw_bytes(prod[1])
            bar.update(ck.st.info(prod[1]).nbytes)
            continue
        _, i, part = prod
        if cache is None or cache[0] != i:
            src = ck.sources[i]
            arrays = _quantize_projection(src, opts)
            cache = (i, arrays)
            bar.update(src.source_bytes)
        yield cache[1][part]


def _quantize_projection(src: ProjectionSource, opts: ConvertOptions) -> list[np.ndarray]:
    if opts.fp4_tier == "fp4r":
        base, nib = fp4.fp4r(src.load(), opts.zero_mode, name=src.name)
        return [base.codes, base.scales, fp4.refinement_plane(nib)]
    x = src.fp4x() if opts.fp4_tier == "fp4x" or src.fmt == "mxfp4" else None  # read once
    if opts.mode == "reference" and src.fmt == "mxfp4":
        # FP4 sources with UE8M0 block-32 scales map nibble -> code directly (scales verbatim)
        base = w2.from_fp4_nibbles(
            unpack_nibbles(x["codes"]), x["scales"], opts.zero_mode, src.name
        )
    else:
        base = w2.quantize(src.load(), opts.zero_mode, opts.mode, name=src.name)
    out = [base.codes, base.scales]
    if opts.fp4_tier == "fp4x":
        out += [x["codes"], x["scales"]] + ([x["scale_2"]] if "scale_2" in x else [])
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _atomic_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _modules_not_converted(ck: Checkpoint, consumed: set[str]) -> list[str]:
    mods = set()
    for name in ck.st.names():
        if name in consumed or not name.endswith(".weight"):
            continue
        mods.add(re.sub(r"\.layers\.\d+\.", ".layers.*.", name[: -len(".weight")]))
    return sorted(mods)


def quantization_config(ck: Checkpoint, opts: ConvertOptions) -> dict:
    consumed = {t for s in ck.sources for t in s.tensors}
    return {
        "quant_method": "moet",
        "format": w2.FORMAT,
        "zero_mode": opts.zero_mode,
        "mode": opts.mode,
        "block_size": w2.BLOCK,
        "fp4_tier": opts.fp4_tier,
        "modules_not_converted": _modules_not_converted(ck, consumed),
        "source_format": ck.info.source_format,
        "source_ckpt_id": ck.info.ckpt_id,
        "source_quantization_config": ck.source_qconfig,
        "moet_quant_version": __version__,
    }


@dataclass
class ConvertResult:
    out: Path
    plan: Plan
    kept_shards: list[str]
    written_shards: list[str]
    seconds: float
    dry_run: bool = False


def _check_out_dir(out: Path, manifest_key: dict) -> dict:
    """-> the finished shards {name: {size, sha256}} that may be kept."""
    if not out.exists():
        return {}
    if not out.is_dir():
        raise MoetError(f"{out}: exists and is not a directory; choose another output path")
    man_path = out / MANIFEST
    if not man_path.exists():
        if any(out.iterdir()):
            raise MoetError(
                f"{out}: not empty and not a moet conversion in progress; choose an "
                "empty or new output directory"
            )
        return {}
    try:
        man = json.loads(man_path.read_text())
        done = man["shards"]
        if not isinstance(done, dict):
            raise TypeError
    except (json.JSONDecodeError, KeyError, TypeError):
        raise MoetError(
            f"{man_path}: corrupt progress file; delete {out} and convert again"
        ) from None
    if man.get("key") != manifest_key:
        raise MoetError(
            f"{out}: holds a conversion of another checkpoint or with other options "
            f"({man.get('key')}); choose another output directory or delete it"
        )
    if manifest_key["source_ckpt_id"] is None:
        return {}  # an unresolvable identity is never trusted: redo every shard
    return done


def convert(
    source: str | os.PathLike,
    out: str | os.PathLike,
    opts: ConvertOptions | None = None,
    dry_run: bool = False,
    progress: bool | None = None,
) -> ConvertResult:
    opts = opts or ConvertOptions()
    opts.validate()
    t0 = time.perf_counter()
    ck = open_checkpoint(source)
    out = Path(out)
    try:
        p = plan(ck, opts)
        if dry_run:
            return ConvertResult(out, p, [], [], time.perf_counter() - t0, dry_run=True)
        key = {
            "source_ckpt_id": ck.info.ckpt_id,
            "source": str(Path(source).resolve()),
            "zero_mode": opts.zero_mode,
            "mode": opts.mode,
            "fp4_tier": opts.fp4_tier,
            "format": w2.FORMAT,
            "moet_quant_version": __version__,
        }
        done = _check_out_dir(out, key)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise MoetError(
                f"{out}: cannot create the output directory ({e.strerror}); choose a "
                "writable location"
            ) from None
        if not os.access(out, os.W_OK):
            raise MoetError(f"{out}: not writable; choose a writable output directory")
        kept = []
        for sp in p.shards:
            rec = done.get(sp.name)
            path = out / sp.name
            if (
                rec
                and path.exists()
                and path.stat().st_size == rec.get("size")
                and _sha256(path) == rec.get("sha256")
            ):
                kept.append(sp.name)
        done = {k: v for k, v in done.items() if k in kept}
        todo = [sp for sp in p.shards if sp.name not in kept]
        need = sum(sp.size for sp in todo)
        free = shutil.disk_usage(out).free
        if need > free:
            raise MoetError(
                f"{out}: needs {need / 1e9:.2f} GB free to write the converted shards, "
                f"found {free / 1e9:.2f} GB; free space or choose another directory"
            )
        manifest = {"key": key, "shards": done, "complete": False}
        _atomic_json(out / MANIFEST, manifest)
        total = sum(sp.source_bytes for sp in todo)
        with progress_bar(total, f"convert {ck.path.name}", progress) as bar:
            for sp in todo:
                path = out / sp.name
                try:
                    write_safetensors(
                        path, sp.tensors, _shard_data(ck, sp, opts, bar), {"format": "pt"}
                    )
                except OSError as e:
                    (path.with_name(path.name + ".partial")).unlink(missing_ok=True)
                    if e.errno == errno.ENOSPC:
                        raise MoetError(
                            f"{path}: disk full while writing ({need / 1e9:.2f} GB "
                            "planned); free space and run convert again to resume"
                        ) from None
                    raise MoetError(
                        f"{path}: write failed ({e.strerror}); fix it and run convert "
                        "again to resume"
                    ) from None
                manifest["shards"][sp.name] = {"size": path.stat().st_size, "sha256": _sha256(path)}
                _atomic_json(out / MANIFEST, manifest)
        _finish(ck, out, p, opts)
        manifest["complete"] = True
        _atomic_json(out / MANIFEST, manifest)
        return ConvertResult(out, p, kept, [sp.name for sp in todo], time.perf_counter() - t0)
    finally:
        ck.close()


def _finish(ck: Checkpoint, out: Path, p: Plan, opts: ConvertOptions) -> None:
    """Aux files, index and model card, then config.json last."""
    for f in ck.path.iterdir():
        if (
            f.is_file()
            and f.name not in SKIP_FILES
            and not f.name.endswith((".safetensors", ".bin", ".pt", ".pth", ".partial"))
        ):
            shutil.copy2(f, out / f.name)
    weight_map = {t.name: sp.name for sp in p.shards for t in sp.tensors}
    _atomic_json(
        out / "model.safetensors.index.json",
        {
            "metadata": {"total_size": sum(t.nbytes for sp in p.shards for t in sp.tensors)},
            "weight_map": weight_map,
        },
    )
    qc = quantization_config(ck, opts)
    (out / "README.md").write_text(model_card(ck, p, qc))
    config = dict(ck.config)
    config["quantization_config"] = qc
    _atomic_json(out / "config.json", config)


def model_card(ck: Checkpoint, p: Plan, qc: dict) -> str:
    i = ck.info
    gb = 1e9
    lines = [
        f"# {ck.path.name} (moet {qc['format']})",
        "",
        f"Converted by moet-quant {__version__} from `{ck.path.name}` ({i.architecture}, "
        f"{i.source_format} experts, source ckpt_id `{i.ckpt_id}`).",
        "",
        "Routed experts are 2-bit codes {-4, -1, +1, +4} with a UE8M0 scale per 32 weights "
        f"(zero_mode `{qc['zero_mode']}`, mode `{qc['mode']}`, FP4 tier `{qc['fp4_tier']}`); every "
        "other tensor is the source's, byte for byte.",
        "",
        "| what | value |",
        "|---|---|",
        f"| MoE layers | {len(i.moe_layers)} ({', '.join(map(str, i.moe_layers))}) |",
        f"| routed experts per layer / top-k | {i.n_experts} / {i.top_k} |",
        f"| hidden / expert intermediate | {i.hidden_size} / {i.moe_intermediate_size} |",
        f"| source expert bytes | {i.bytes['source_experts'] / gb:.3f} GB |",
        f"| W2 expert bytes | {p.tier_bytes['w2'] / gb:.3f} GB |",
        f"| FP4 tier bytes | {p.tier_bytes['fp4'] / gb:.3f} GB |",
        f"| dense bytes (unchanged) | {p.tier_bytes['dense'] / gb:.3f} GB |",
        f"| checkpoint total | {p.total / gb:.3f} GB |",
        "",
        "Serve it with vLLM and the moet plugin installed: `vllm serve <this directory>`.",
        "",
    ]
    return "\n".join(lines)


def verify_complete(out: str | os.PathLike) -> None:
    """Raise if `out` is an interrupted conversion (for tools that load moet checkpoints)."""
    out = Path(out)
    man = out / MANIFEST
    if man.exists():
        try:
            complete = json.loads(man.read_text()).get("complete")
        except json.JSONDecodeError:
            complete = False
        if not complete:
            raise CheckpointError(
                f"{out}: an interrupted moet conversion; run `moet convert` "
                "again with the same arguments to resume"
            )

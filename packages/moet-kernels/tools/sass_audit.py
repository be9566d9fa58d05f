#!/usr/bin/env python3
"""SASS listings, manifests and audit of moet-kernels' cubins (`nox -s sass`; docs/kernels.md).

For every cubin a build produced (the `<name>.cubins.txt` indexes that cmake/MoetCubins.cmake
writes next to the cubins and their ptxas logs), this script

* disassembles it with `cuobjdump -sass` and normalizes the listing (encoding comments and
  trailing blanks dropped, no machine paths): `sass/<name>.<arch>.sass`;
* writes a manifest, `sass/<name>.<arch>.json`: the cubin's sha256 and size, the ptxas and
  cuobjdump releases, and per function the registers, barriers, static shared memory
  (`smem_bytes`: ptxas -v, the kernel's own `__shared__`; `shared_bytes_cubin`: cuobjdump
  -res-usage, which adds the shared memory the system reserves), local memory, stack frame,
  spill store/load bytes (ptxas -v log and `cuobjdump -res-usage`), the instruction count and two opcode histograms (`opcodes`: mnemonic without modifiers, `IMMA`;
  `opcodes_full`: with them, `IMMA.16832.S8.S8`; predicates are not part of either);
* fails on: any drift between those and the committed files under sass/ (a short diff is
  printed), any spill or nonzero stack frame / local memory, for sm_90 an emulated FP8 MMA (an
  `F2FP` unpacking e4m3/e5m2 in a function that also issues `HMMA`: `mma.sync` with FP8
  operands is emulated there, design.md), and any ptxas "wgmma ... serialized" note.

`--update` rewrites the committed files (and removes listings of cubins no longer built); the
other checks still run and still fail. Exit status: 0 clean, 1 problems found, 2 usage/tool error.

The functions are importable for tests (packages/moet-kernels/tests/test_kernels_sass.py).
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_SASS_DIR = ROOT / "sass"
DIFF_LINES = 40  # per drifted file

# -- tools ---------------------------------------------------------------------------------------


class ToolError(Exception):
    pass


def find_cuobjdump() -> Path:
    """cuobjdump to use: $MOET_CUOBJDUMP, else the pinned `nvidia-cuda-cuobjdump` wheel of this
    Python environment (ci/requirements-dev.txt), else PATH, else next to nvcc."""
    env = os.environ.get("MOET_CUOBJDUMP")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("nvidia")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        for cand in sorted(Path(loc).glob("cu*/bin/cuobjdump")):
            return cand
    which = shutil.which("cuobjdump")
    if which:
        return Path(which)
    nvcc = shutil.which("nvcc")
    if nvcc:
        cand = Path(os.path.realpath(nvcc)).parent / "cuobjdump"
        if cand.exists():
            return cand
    raise ToolError(
        "cuobjdump not found: pip install -r ci/requirements-dev.txt (nvidia-cuda-cuobjdump and "
        "nvidia-cuda-nvdisasm), or set MOET_CUOBJDUMP"
    )


def _tool_env(cuobjdump: Path) -> dict[str, str]:
    # cuobjdump -sass runs nvdisasm, found on PATH: the one beside it first.
    env = dict(os.environ)
    env["PATH"] = str(cuobjdump.parent) + os.pathsep + env.get("PATH", "")
    return env


def run_cuobjdump(cuobjdump: Path, *args: str) -> str:
    proc = subprocess.run(
        [str(cuobjdump), *args], capture_output=True, text=True, env=_tool_env(cuobjdump)
    )
    if proc.returncode != 0:
        raise ToolError(f"{cuobjdump.name} {' '.join(args)} failed:\n{proc.stderr.strip()}")
    return proc.stdout


def tool_release(cuobjdump: Path) -> str:
    """'13.2.51' from `cuobjdump --version`."""
    m = re.search(r"\bV(\d+\.\d+\.\d+)", run_cuobjdump(cuobjdump, "--version"))
    return m.group(1) if m else "unknown"


def ptxas_build(cubin_bytes: bytes) -> str:
    """The ptxas build recorded in the cubin's .note.nv.tkinfo ('cuda_13.0.r13.0/compiler.36424714_0')."""
    m = re.search(rb"Build (cuda_[0-9A-Za-z._/-]+)", cubin_bytes)
    return m.group(1).decode() if m else "unknown"


# -- listings ------------------------------------------------------------------------------------

_ENCODING = re.compile(r"\s*/\*\s*0x[0-9a-fA-F]{16}\s*\*/")
_INSN = re.compile(r"^\s*/\*([0-9a-fA-F]+)\*/\s+(.*?)\s*;?\s*$")
_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)\s*$")


def normalize_listing(text: str, cubin_path: str | os.PathLike[str] | None = None) -> str:
    """A deterministic, path-free `cuobjdump -sass` listing: the 64-bit encoding comments (and
    the lines holding only one) dropped, trailing blanks stripped, leading/trailing blank lines
    dropped, any mention of the cubin's folder replaced by its name."""
    out: list[str] = []
    for line in text.splitlines():
        stripped = _ENCODING.sub("", line)
        if not stripped.strip() and line.strip():
            continue  # an encoding-only line
        stripped = stripped.rstrip()
        if re.match(r"^\s*identifier\s*=", stripped):
            continue  # fatbin dumps name their source file
        out.append(stripped)
    if cubin_path is not None:
        folder = str(Path(cubin_path).resolve().parent) + os.sep
        out = [line.replace(folder, "") for line in out]
    while out and not out[0]:
        out.pop(0)
    while out and not out[-1]:
        out.pop()
    return "\n".join(out) + "\n"


def listing_arch(listing: str) -> str | None:
    m = re.search(r"^\s*code for (sm_\w+)", listing, re.M)
    return m.group(1) if m else None


def parse_listing(listing: str) -> dict[str, list[str]]:
    """Function name -> its instructions in order, each as text without the offset (predicate,
    mnemonic and operands: '@!P0 BRA 0x1f0')."""
    funcs: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in listing.splitlines():
        m = _FUNCTION.match(line)
        if m:
            current = funcs.setdefault(m.group(1), [])
            continue
        m = _INSN.match(_ENCODING.sub("", line))
        if m and current is not None:
            current.append(m.group(2).strip())
    return funcs


def mnemonic(insn: str) -> str:
    """'@!P0 IMAD.WIDE.U32 R4, R13, 0x4, R4' -> 'IMAD.WIDE.U32' (predicate dropped)."""
    parts = insn.replace(";", " ").split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0] if parts else ""


def opcode_histograms(insns: list[str]) -> tuple[dict[str, int], dict[str, int]]:
    """(without modifiers, with modifiers), keys sorted."""
    full = Counter(mnemonic(i) for i in insns)
    base: Counter[str] = Counter()
    for name, n in full.items():
        base[name.split(".")[0]] += n
    return dict(sorted(base.items())), dict(sorted(full.items()))


# -- ptxas -v log and resource usage ------------------------------------------------------------

_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", re.I
)
_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?")
# "(C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to ..."
# (\b: a function merely named like "wgmma_serialized" does not match)
_WGMMA_SERIALIZED = re.compile(r"\bwgmma\b.*\bserialized\b", re.I)
# warnings and ptxas's C75xx performance advisories (injected warpgroup.wait/arrive, ...)
_NOTE = re.compile(r"warning|Performance Loss|\(C75\d\d\)", re.I)


def parse_ptxas_log(text: str) -> dict[str, dict[str, int]]:
    """Per function (kernels and non-inlined device functions) from `ptxas -v`:
    stack_frame_bytes, spill_store_bytes, spill_load_bytes; for kernels also registers,
    barriers and smem_bytes."""
    funcs: dict[str, dict[str, int]] = {}
    props_for: str | None = None
    entry: str | None = None
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            entry = m.group(1)
            funcs.setdefault(entry, {})
            continue
        m = _PROPS.search(line)
        if m:
            props_for = m.group(1)
            funcs.setdefault(props_for, {})
            continue
        m = _FRAME.search(line)
        if m and props_for is not None:
            frame, stores, loads = (int(g) for g in m.groups())
            funcs[props_for].update(
                stack_frame_bytes=frame, spill_store_bytes=stores, spill_load_bytes=loads
            )
            props_for = None
            continue
        m = _USED.search(line)
        if m and entry is not None:
            regs, bars, smem = m.groups()
            funcs[entry].update(
                registers=int(regs), barriers=int(bars or 0), smem_bytes=int(smem or 0)
            )
            entry = None
    return funcs


def ptxas_notes(text: str) -> list[str]:
    """Warnings and performance notes of the log, one line each (informational)."""
    return [line.strip() for line in text.splitlines() if _NOTE.search(line)]


def parse_res_usage(text: str) -> dict[str, dict[str, int]]:
    """`cuobjdump -res-usage`: function -> {REG, STACK, SHARED, LOCAL, ...} as ints."""
    funcs: dict[str, dict[str, int]] = {}
    current: str | None = None
    for line in text.splitlines():
        m = re.match(r"^\s*Function (\S+?):\s*$", line)
        if m:
            current = m.group(1)
            continue
        if current is not None and "REG:" in line:
            funcs[current] = {k: int(v) for k, v in re.findall(r"([A-Z]+)(?:\[\d+\])?:(\d+)", line)}
            current = None
    return funcs


def parse_kparams(text: str) -> dict[str, list[int]]:
    """`cuobjdump -elf`: function -> its parameters' sizes in bytes, in declaration order (the
    EIATTR_KPARAM_INFO records of .nv.info.<function>), which the launcher's arguments must match."""
    funcs: dict[str, dict[int, int]] = {}
    current: str | None = None
    for line in text.splitlines():
        m = re.match(r"^\.nv\.info\.(\S+)\s*$", line)
        if m:
            current = m.group(1)
            funcs.setdefault(current, {})
            continue
        m = re.search(
            r"Ordinal\s*:\s*0x([0-9a-f]+)\s+Offset\s*:\s*0x[0-9a-f]+\s+Size\s*:\s*0x([0-9a-f]+)",
            line,
        )
        if current is not None and m:
            funcs[current][int(m.group(1), 16)] = int(m.group(2), 16)
    return {name: [sizes[i] for i in sorted(sizes)] for name, sizes in funcs.items() if sizes}


# -- checks --------------------------------------------------------------------------------------

FP8_TYPES = ("E4M3", "E5M2")


def check_spills(stem: str, functions: dict[str, dict]) -> list[str]:
    """Any spill, stack frame or local memory is a problem."""
    problems = []
    for name, f in sorted(functions.items()):
        bad = {
            k: f.get(k, 0)
            for k in ("spill_store_bytes", "spill_load_bytes", "stack_frame_bytes", "local_bytes")
            if f.get(k, 0)
        }
        if bad:
            what = ", ".join(f"{k} {v}" for k, v in bad.items())
            problems.append(f"{stem}: {name}: spills / stack: {what}")
    return problems


def check_fp8_emulation(stem: str, arch: str, funcs: dict[str, list[str]]) -> list[str]:
    """sm_90: a function that unpacks FP8 with F2FP (F2FP.F16.E4M3.UNPACK_B, ...) and issues
    HMMA is running an emulated FP8 mma.sync. F2FP alone (e.g. F2FP.BF16.F32.PACK_AB packing
    results) is not flagged."""
    if not arch.startswith("sm_90"):
        return []
    problems = []
    for name, insns in sorted(funcs.items()):
        ops = [mnemonic(i) for i in insns]
        unpacks = [
            op
            for op in ops
            if op.startswith("F2FP.") and any(t in op.split(".") for t in FP8_TYPES)
        ]
        hmma = [op for op in ops if op.split(".")[0] == "HMMA"]
        if unpacks and hmma:
            kinds = ", ".join(sorted(set(unpacks)))
            problems.append(
                f"{stem}: {name}: emulated FP8 MMA: {len(unpacks)} FP8 unpacks ({kinds}) with "
                f"{len(hmma)} HMMA (mma.sync with e4m3/e5m2 is emulated on sm_90: use wgmma or "
                "the int8 path)"
            )
    return problems


def check_wgmma_serialized(stem: str, log: str) -> list[str]:
    return [
        f"{stem}: ptxas: {line.strip()}"
        for line in log.splitlines()
        if _WGMMA_SERIALIZED.search(line)
    ]


# -- one cubin -----------------------------------------------------------------------------------


@dataclass
class CubinAudit:
    stem: str  # "w2_moe.sm_90a"
    arch: str  # "sm_90a"
    listing: str
    manifest: dict
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def files(self) -> dict[str, str]:
        """Committed file name -> content."""
        return {
            f"{self.stem}.sass": self.listing,
            f"{self.stem}.json": json.dumps(self.manifest, indent=1, sort_keys=True) + "\n",
        }


def build_manifest(
    cubin_name: str,
    arch: str,
    cubin_bytes: bytes,
    funcs: dict[str, list[str]],
    ptxas: dict[str, dict[str, int]],
    res: dict[str, dict[str, int]],
    cuobjdump_release: str,
    kparams: dict[str, list[int]] | None = None,
) -> dict:
    functions = {}
    for name in sorted(set(funcs) | set(ptxas) | set(res)):
        p, r, insns = ptxas.get(name, {}), res.get(name, {}), funcs.get(name, [])
        base, full = opcode_histograms(insns)
        functions[name] = {
            "registers": r.get("REG", p.get("registers", 0)),
            "barriers": p.get("barriers", 0),
            "smem_bytes": p.get("smem_bytes", 0),
            "shared_bytes_cubin": r.get("SHARED", 0),
            "local_bytes": r.get("LOCAL", 0),
            "stack_frame_bytes": max(p.get("stack_frame_bytes", 0), r.get("STACK", 0)),
            "spill_store_bytes": p.get("spill_store_bytes", 0),
            "spill_load_bytes": p.get("spill_load_bytes", 0),
            "instructions": len(insns),
            "opcodes": base,
            "opcodes_full": full,
            "param_sizes": (kparams or {}).get(name, []),
        }
    return {
        "cubin": cubin_name,
        "arch": arch,
        "sha256": hashlib.sha256(cubin_bytes).hexdigest(),
        "size_bytes": len(cubin_bytes),
        "ptxas": ptxas_build(cubin_bytes),
        "cuobjdump": cuobjdump_release,
        "functions": functions,
    }


def audit_cubin(cubin: Path, log: Path | None, cuobjdump: Path | None = None) -> CubinAudit:
    """Disassemble, describe and check one cubin (`<name>.<arch>.cubin`) with its ptxas log."""
    cuobjdump = cuobjdump or find_cuobjdump()
    stem = cubin.name.removesuffix(".cubin")
    data = cubin.read_bytes()
    listing = normalize_listing(run_cuobjdump(cuobjdump, "-sass", str(cubin)), cubin)
    arch = listing_arch(listing) or stem.rsplit(".", 1)[-1]
    funcs = parse_listing(listing)
    res = parse_res_usage(run_cuobjdump(cuobjdump, "-res-usage", str(cubin)))
    log_text = log.read_text(errors="replace") if log is not None and log.exists() else ""
    ptxas = parse_ptxas_log(log_text)
    kparams = parse_kparams(run_cuobjdump(cuobjdump, "-elf", str(cubin)))
    manifest = build_manifest(
        cubin.name, arch, data, funcs, ptxas, res, tool_release(cuobjdump), kparams
    )
    problems = []
    if log is None or not log.exists():
        problems.append(f"{stem}: no ptxas log next to the cubin (spills and notes unchecked)")
    problems += check_spills(stem, manifest["functions"])
    problems += check_fp8_emulation(stem, arch, funcs)
    problems += check_wgmma_serialized(stem, log_text)
    notes = [
        f"{stem}: ptxas: {n}" for n in ptxas_notes(log_text) if not _WGMMA_SERIALIZED.search(n)
    ]
    return CubinAudit(stem, arch, listing, manifest, problems, notes)


# -- committed files -----------------------------------------------------------------------------


def short_diff(name: str, old: str, new: str, limit: int = DIFF_LINES) -> str:
    lines = list(
        difflib.unified_diff(
            old.splitlines(), new.splitlines(), f"committed/{name}", f"rebuilt/{name}", lineterm=""
        )
    )
    changed = sum(1 for x in lines if x[:1] in "+-" and not x.startswith(("+++", "---")))
    shown = lines[:limit]
    more = f"\n    ... ({len(lines) - limit} more diff lines)" if len(lines) > limit else ""
    return f"{changed} changed line(s):\n" + "\n".join("    " + x for x in shown) + more


def compare_committed(audits: list[CubinAudit], sass_dir: Path) -> list[str]:
    """Drift between the rebuilt listings/manifests and sass_dir: changed, missing or stale."""
    problems = []
    expected: set[str] = set()
    for a in audits:
        for name, text in a.files().items():
            expected.add(name)
            path = sass_dir / name
            if not path.exists():
                problems.append(
                    f"drift: sass/{name} is not committed (run `nox -s sass -- --update`)"
                )
                continue
            old = path.read_text()
            if old != text:
                problems.append(f"drift: sass/{name}: {short_diff(name, old, text)}")
    for path in sorted(sass_dir.glob("*.sass")) + sorted(sass_dir.glob("*.json")):
        if path.name not in expected:
            problems.append(f"drift: sass/{path.name} belongs to no cubin built now (stale)")
    return problems


def write_committed(audits: list[CubinAudit], sass_dir: Path) -> list[str]:
    """Writes every listing and manifest; removes stale ones. Returns the names written/removed."""
    sass_dir.mkdir(parents=True, exist_ok=True)
    expected = {}
    for a in audits:
        expected.update(a.files())
    changed = []
    for name, text in sorted(expected.items()):
        path = sass_dir / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            changed.append(f"wrote sass/{name}")
    for path in sorted(sass_dir.glob("*.sass")) + sorted(sass_dir.glob("*.json")):
        if path.name not in expected:
            path.unlink()
            changed.append(f"removed sass/{path.name}")
    return changed


def built_cubins(cubin_dir: Path) -> list[tuple[Path, Path]]:
    """(cubin, ptxas log) pairs a build made: the `<name>.cubins.txt` indexes that
    moet_add_cubins() (cmake/MoetCubins.cmake) writes next to its outputs."""
    indexes = sorted(cubin_dir.glob("*.cubins.txt"))
    if not indexes:
        raise ToolError(
            f"no *.cubins.txt in {cubin_dir}: the build made no cubins (nvcc not found? see the "
            "CMake output)"
        )
    pairs = []
    for index in indexes:
        for line in index.read_text().splitlines():
            if line.strip():
                cubin, log = line.split()
                pairs.append((cubin_dir / cubin, cubin_dir / log))
    return pairs


def summary(audits: list[CubinAudit]) -> str:
    rows = [("cubin", "function", "regs", "smem", "stack", "spills", "insns")]
    for a in audits:
        for name, f in a.manifest["functions"].items():
            spills = f["spill_store_bytes"] + f["spill_load_bytes"]
            rows.append(
                (
                    a.stem,
                    name,
                    str(f["registers"]),
                    str(f["smem_bytes"]),
                    str(f["stack_frame_bytes"]),
                    str(spills),
                    str(f["instructions"]),
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--cubins", type=Path, required=True, help="folder of the built cubins (*.cubins.txt)"
    )
    ap.add_argument("--sass-dir", type=Path, default=DEFAULT_SASS_DIR)
    ap.add_argument("--update", action="store_true", help="rewrite the committed sass/ files")
    args = ap.parse_args(argv)
    try:
        cuobjdump = find_cuobjdump()
        release = tool_release(cuobjdump)
        audits = [audit_cubin(c, log, cuobjdump) for c, log in built_cubins(args.cubins)]
    except (ToolError, OSError) as exc:
        print(f"sass_audit: {exc}", file=sys.stderr)
        return 2
    print(f"sass_audit: {len(audits)} cubin(s), cuobjdump {release}")
    print(summary(audits))
    for a in audits:
        for note in a.notes:
            print(f"note: {note}")
    problems = [p for a in audits for p in a.problems]
    if args.update:
        for line in write_committed(audits, args.sass_dir):
            print(line)
    else:
        problems += compare_committed(audits, args.sass_dir)
    if problems:
        for p in problems:
            print(f"FAIL: {p}", file=sys.stderr)
        print(f"sass_audit: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print("sass_audit: ok" + (" (sass/ updated)" if args.update else " (sass/ up to date)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The engine side of bench/serving_gpu.py: synthetic weights with a designed routing, made at load.

Imported inside vLLM's worker process through `worker_extension_cls`
("serving_gpu_engine.BenchWorker"; bench/ on PYTHONPATH), which has two effects there:

* importing it registers the model loader `LOAD_FORMAT` ("moet-bench-synthetic": vLLM's
  `register_model_loader`, a public plugin API), the one benchmark path that makes the weights
  of every engine, stock and moet alike. It is vLLM's dummy loader (every tensor seeded uniform in
  +-1e-3, `load_format="dummy"`) followed by `impose`, which runs *before* vLLM's
  `process_weights_after_loading`: the CPU's weight packing and moet's repacking of its logical W2
  sections into kernel-native rows see the imposed values, so nothing is rewritten in a processed
  layout afterwards, and CUDA graphs are captured on the final weights. (Online FP8 quantizes its
  linear layers inside the dummy loading, before `impose`; none of the tensors `impose` sets is
  one of them, and a quantized router is refused.);
* `BenchWorker`'s methods become `LLM.collective_rpc` calls (`bench_info`, `bench_record`,
  `bench_take`): what the engine holds, and the routing it actually took.

The routing design ("token program"). Each benchmark sequence is a stretch of distinct token ids
(`token_program`); each program position p routes, at every MoE layer, top-k experts fixed in
advance (`Design`: uniform, or a concentrated profile from moet_vllm.planning.traces). The
weights make the model follow the program exactly, whatever the engine:

* the embedding of p's token is e_p = A * sum_j Q_j L[p, j] + rho * Q_rand z_p, with Q a seeded
  random orthogonal basis split into one block Q_j of E columns per base layer j plus a random
  complement, and L[p, j] designed logits (+2..+1 on the routed experts, -1..-1.5 elsewhere,
  centred);
* each MoE layer's router gets W_l = g Q_j^T (rows permuted for layers past the blocks that fit:
  layer l reuses block l mod n_blocks under a fixed permutation), its correction bias zero, and
  the RMSNorm in front of it (post_attention_layernorm) and the final norm weight 1: the residual
  stream is the embedding plus small contributions (every dense weight is vLLM's dummy +-1e-3;
  moet's synthetic experts, whose trained-shaped scales reach 2^-4, add an RMS of ~27 per layer at
  GLM-4.5-Air's shape, to entries of RMS ~1000: A = RHO = 1024), so layer l's router logits are
  g A L[p, b(l)] / rms(x) and its top-k is the designed one, for stock and moet alike (checked
  offline at that shape with Gaussian perturbations of RMS 27 sqrt(94): every top-k as designed);
* lm_head row of the token at p + 1 is the unit vector of e_p, so greedy decoding generates the
  program: the generated tokens, and hence every decode step's routing, are known in advance.

Traps this avoids: (1) dummy routing collapse: vLLM's dummy weights give every router a tiny
random matrix (every tensor seeded with 1234: equal-sized routers are identical) in front of norm
weights of +-1e-3, and greedy decoding on them is a fixed map of the current token, so a batch
routes to nearly the same experts (stock bf16 at batch 32 ran faster than distinct experts' bytes
allow); here D, the distinct experts per layer per decode step, is designed (uniform top-8 of 128
at batch 32: D ~ 112) and measured. The profile "dummy" keeps vLLM's dummy routing (nothing
imposed but moet's experts), to measure that collapse. (2) The slow path of uniform random scales: scale bytes drawn per
block independently put nearly every tile on the kernels' slow path; moet's synthetic W2 scales
follow the trained fixture's histogram (moet_kernels.testing.random_scales "trained"), codes are
uniform bytes, and `bench_info` reports the rows' slow-tile fraction.

Limits: the router must be unquantized floating point at load (GLM-4.5's fp32 gate is never
quantized; Qwen3-MoE's gate is quantized by `quantization="fp8"`, which `impose` refuses); tied
embeddings are refused; n_blocks = (H - H/4) // E base layers fit (GLM-4.5-Air-12l: all 11 MoE
layers; deeper shapes reuse blocks under a permutation, which keeps D per layer exact but
correlates layers); the synthetic expert source (tiered residency) has no tensor parallelism.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

import numpy as np
import torch

LOAD_FORMAT = "moet-bench-synthetic"
FIRST_TOKEN = 16  # program tokens avoid the lowest ids (special tokens of real vocabularies)
A_STRUCT = 1024.0  # amplitude of the designed-logit part of an embedding entry
RHO = 1024.0  # per-entry RMS of the random part
LOGIT_SCALE = 2.0  # router logits ~ LOGIT_SCALE * L
PROFILES = ("uniform", "concentrated", "dummy")  # dummy: vLLM's own routing, nothing designed


# -- the design (pure: numpy and torch, no vLLM) ---------------------------------------------------


def token_program(vocab: int, n_seq: int, seq_len: int, seed: int) -> np.ndarray:
    """int64 [n_seq, seq_len]: distinct token ids in [FIRST_TOKEN, vocab), seeded."""
    need = n_seq * seq_len
    if vocab - FIRST_TOKEN < need:
        raise ValueError(
            f"the token program needs {need} distinct token ids ({n_seq} sequences x {seq_len}) "
            f"but the vocabulary has {vocab - FIRST_TOKEN} usable ids; fewer or shorter "
            "sequences, or a shape with a larger vocab_size"
        )
    rng = np.random.default_rng([seed, 1])
    return rng.permutation(np.arange(FIRST_TOKEN, vocab))[:need].reshape(n_seq, seq_len)


def n_blocks(hidden: int, n_experts: int, n_moe: int) -> int:
    """Base layers whose router blocks fit the hidden size next to a random complement of H/4."""
    fit = (hidden - hidden // 4) // n_experts
    if fit < 1:
        raise ValueError(f"hidden size {hidden} cannot hold a router block of {n_experts} experts")
    return min(n_moe, fit)


@dataclass
class Design:
    """The routing of every program position: `base_ids` int64 [positions, n_blocks, k] and, per
    MoE layer l, its block `block[l]` and expert permutation `perm[l]` (identity for l < blocks)."""

    tokens: np.ndarray
    base_ids: np.ndarray
    block: np.ndarray
    perm: np.ndarray
    profile: str
    alpha: float | None

    def layer_ids(self, moe_ordinal: int) -> np.ndarray:
        """int64 [positions, k]: the designed experts of one MoE layer at every position."""
        return self.perm[moe_ordinal][self.base_ids[:, self.block[moe_ordinal]]]

    def digest(self) -> str:
        h = hashlib.sha256()
        for a in (self.tokens, self.base_ids, self.block, self.perm):
            h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
        return h.hexdigest()[:16]


def concentrated_profile(nb: int, n_experts: int, top_k: int, hidden: int, inter: int):
    """GLM-5.2's synthetic-trace profile (moet_vllm.planning.traces) on this shape's geometry:
    the same coverage target (51% of (layer, expert) pairs serve 91% of routings; `calibrate`
    refits the power law to it), topic and phrase sets scaled by E / 256 (at least top_k)."""
    from dataclasses import replace

    from moet_vllm.planning import traces

    p = traces.GLM_5_2
    topic = max(top_k, round(p.topic_experts * n_experts / p.n_experts))
    phrase = max(top_k, min(topic, round(p.phrase_experts * n_experts / p.n_experts)))
    return replace(
        p, moe_layers=nb, n_experts=n_experts, top_k=top_k, hidden=hidden,
        moe_intermediate=inter, topic_experts=topic, phrase_experts=phrase,
    )  # fmt: skip


def calibrate(profile_name: str, nb, n_experts, top_k, hidden, inter, seed) -> float | None:
    """The concentrated profile's power-law exponent recalibrated to this E and top-k (None for
    the uniform profile); computed once by the driver and handed to the engine."""
    if profile_name != "concentrated":
        return None
    from moet_vllm.planning import traces

    prof = concentrated_profile(nb, n_experts, top_k, hidden, inter)
    return round(traces.calibrate_alpha(prof, 4096, seed), 4)


def design(spec: dict, n_moe: int) -> Design:
    """The design of `spec` (serving_gpu.py's `design_spec`) for a model of `n_moe` MoE layers."""
    e, k, h = spec["n_experts"], spec["top_k"], spec["hidden"]
    tokens = token_program(spec["vocab"], spec["n_seq"], spec["seq_len"], spec["seed"])
    n_pos = tokens.size
    nb = n_blocks(h, e, n_moe)
    rng = np.random.default_rng([spec["seed"], 2])
    if spec["profile"] in ("uniform", "dummy"):  # dummy: the token program only is used
        base = np.empty((n_pos, nb, k), dtype=np.int64)
        for a in range(0, n_pos, 2048):  # k distinct experts, uniform: the top-k of iid scores
            r = rng.random((min(n_pos, a + 2048) - a, nb, e), dtype=np.float32)
            base[a : a + len(r)] = np.argpartition(r, k - 1, axis=-1)[..., :k]
    elif spec["profile"] == "concentrated":
        from dataclasses import replace

        from moet_vllm.planning import traces

        prof = concentrated_profile(nb, e, k, h, spec["inter"])
        if spec.get("alpha") is not None:
            prof = replace(prof, alpha=spec["alpha"])
        base = traces.synthetic_trace(prof, n_pos, spec["seed"]).astype(np.int64)
    else:
        raise ValueError(f"routing profile {spec['profile']!r}: one of {PROFILES}")
    block = np.arange(n_moe) % nb
    perm = np.tile(np.arange(e), (n_moe, 1))
    for layer in range(nb, n_moe):
        perm[layer] = rng.permutation(e)
    return Design(tokens, base, block, perm, spec["profile"], spec.get("alpha"))


def designed_logits(d: Design, n_experts: int, seed: int) -> np.ndarray:
    """float32 [positions, n_blocks, E]: +2 .. +1 on the routed experts (in order), -1 .. -1.5
    elsewhere (distinct), centred per (position, block)."""
    n_pos, nb, k = d.base_ids.shape
    rng = np.random.default_rng([seed, 3])
    lg = -1.0 - 0.5 * rng.random((n_pos, nb, n_experts), dtype=np.float32)
    top = (2.0 - np.arange(k, dtype=np.float32) / k)[None, None, :]
    np.put_along_axis(lg, d.base_ids, np.broadcast_to(top, d.base_ids.shape), axis=-1)
    return lg - lg.mean(axis=-1, keepdims=True)


def basis(hidden: int, seed: int, device) -> torch.Tensor:
    """A seeded random orthogonal matrix [H, H] (float32) on `device`."""
    g = np.random.default_rng([seed, 4]).standard_normal((hidden, hidden), dtype=np.float32)
    q, r = torch.linalg.qr(torch.from_numpy(g).to(device))
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0)


# -- the loader (inside the engine) -----------------------------------------------------------------


def _moe_layers(model) -> list[tuple[int, str, torch.nn.Module]]:
    """(model layer index, runner name, runner) of every MoE layer, in layer order: the runner is
    the module vLLM's FusedMoE returns (MoERunner: `_apply_quant_method`, `routed_experts`)."""
    out = []
    for name, m in model.named_modules():
        if hasattr(m, "routed_experts") and hasattr(m, "_apply_quant_method"):
            hit = re.search(r"layers\.(\d+)\.", name + ".")
            if hit is None:
                raise RuntimeError(f"cannot tell the layer of MoE module {name}")
            out.append((int(hit.group(1)), name, m))
    if not out:
        raise RuntimeError("no MoE layer (MoERunner with routed_experts) in this model")
    return sorted(out, key=lambda t: t[0])


def _parent(model, name: str) -> torch.nn.Module:
    return model.get_submodule(name.rsplit(".", 1)[0])


def _float_weight(mod, what: str) -> torch.Tensor:
    w = getattr(mod, "weight", None)
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() != 2:
        desc = "missing" if w is None else f"{w.dtype} {tuple(w.shape)}"
        raise RuntimeError(
            f"{what}: the benchmark imposes routing through an unquantized router weight, found "
            f"{desc} ({type(mod).__name__}); a quantized router (e.g. Qwen3-MoE's gate under "
            "quantization='fp8') is not supported"
        )
    return w


def is_moet(experts) -> bool:
    return type(experts.quant_method).__name__ == "MoetMoEMethod"


@torch.no_grad()
def program_weights(spec: dict, d: Design, device, dtype) -> dict:
    """The design's weights (module doc), in float32 on `device` except the embedding rows,
    rounded to the model's `dtype` (the unit vectors of lm_head are taken from the rounded rows):
    tokens [positions], emb [positions, H], head_index / head_rows (the lm_head rows to set), one
    router weight [E, H] per MoE layer, and rms_e, the embeddings' mean RMS."""
    e, h = spec["n_experts"], spec["hidden"]
    q = basis(h, spec["seed"], device)
    nb = d.base_ids.shape[1]
    q_struct, q_rand = q[:, : nb * e], q[:, nb * e :]
    lg = designed_logits(d, e, spec["seed"])
    z_rng = np.random.default_rng([spec["seed"], 5])
    tokens = torch.from_numpy(d.tokens.reshape(-1)).to(device)
    n_pos = tokens.numel()
    emb = torch.empty(n_pos, h, dtype=dtype, device=device)
    unit = torch.empty(n_pos, h, dtype=torch.float32, device=device)
    rms_sum = 0.0
    for a in range(0, n_pos, 4096):
        b = min(n_pos, a + 4096)
        s = torch.from_numpy(lg[a:b].reshape(b - a, nb * e)).to(device)
        z = torch.from_numpy(z_rng.standard_normal((b - a, q_rand.shape[1]), dtype=np.float32))
        emb[a:b] = (A_STRUCT * s @ q_struct.T + RHO * z.to(device) @ q_rand.T).to(dtype)
        xr = emb[a:b].float()  # what the model reads
        rms_sum += float(xr.pow(2).mean(-1).sqrt().sum())
        unit[a:b] = xr / xr.norm(dim=-1, keepdim=True)
    rms_e = rms_sum / n_pos
    # greedy decoding follows the program: lm_head[token at p + 1] = unit(e_p)
    seq = d.tokens.shape[1]
    prog = tokens.view(-1, seq)
    head_index = prog[:, 1:].reshape(-1)
    head_rows = unit.view(-1, seq, h)[:, :-1].reshape(-1, h)
    g = LOGIT_SCALE * rms_e / A_STRUCT
    gates = []
    for ordinal in range(len(d.block)):
        block = int(d.block[ordinal])
        qb = q_struct[:, block * e : (block + 1) * e]  # [H, E]
        inv = torch.from_numpy(np.argsort(d.perm[ordinal])).to(device)
        gates.append(g * qb.T[inv])  # row perm[l, j] <- block column j
    return {"tokens": tokens, "emb": emb, "head_index": head_index, "head_rows": head_rows,
            "gates": gates, "rms_e": rms_e}  # fmt: skip


@torch.no_grad()
def impose(model, spec: dict) -> dict:
    """Set the routing design's weights and moet's synthetic experts (module doc); before vLLM's
    process_weights_after_loading. Returns a small report."""
    layers = _moe_layers(model)
    n_moe = len(layers)
    MOE_LAYERS[:] = [i for i, _, _ in layers]
    if spec["profile"] == "dummy":  # the control: vLLM's dummy routing, moet's experts only
        done = sum(
            synthetic_experts(r.routed_experts, layer_seed(spec["seed"], i))
            for i, _, r in layers
            if is_moet(r.routed_experts)
        )
        return {"moe_layers": n_moe, "routing": "vLLM's dummy weights", "moet_layers": done}
    d = design(spec, n_moe)
    e, h = spec["n_experts"], spec["hidden"]
    inner = model.model if hasattr(model, "model") else model
    emb = inner.embed_tokens.weight
    head = model.lm_head.weight
    if emb.data_ptr() == head.data_ptr():
        raise RuntimeError("tied word embeddings: the routing design needs its own lm_head")
    for what, w in (("embed_tokens", emb), ("lm_head", head)):
        if not w.is_floating_point() or w.shape[0] < spec["vocab"] or w.shape[1] != h:
            raise RuntimeError(f"{what}: {w.dtype} {tuple(w.shape)}, expected [>= vocab, {h}]")
    pw = program_weights(spec, d, emb.device, emb.dtype)
    emb[pw["tokens"]] = pw["emb"]
    head[pw["head_index"]] = pw["head_rows"].to(head.dtype)
    moet_layers = 0
    for ordinal, (idx, name, runner) in enumerate(layers):
        mlp = _parent(model, name)
        gate = getattr(mlp, "gate", None)
        w = _float_weight(gate, f"{name}: router {type(mlp).__name__}.gate")
        if tuple(w.shape) != (e, h):
            raise RuntimeError(f"{name}: router weight {tuple(w.shape)}, expected {(e, h)}")
        w.copy_(pw["gates"][ordinal].to(w.dtype))
        for owner in (gate, runner.routed_experts):  # the same Parameter in GLM-4.5
            bias = getattr(owner, "e_score_correction_bias", None)
            if bias is not None:
                bias.zero_()
        norm = getattr(inner.layers[idx], "post_attention_layernorm", None)
        if norm is None:
            raise RuntimeError(f"model layer {idx} has no post_attention_layernorm")
        norm.weight.fill_(1.0)
        if is_moet(runner.routed_experts):
            moet_layers += synthetic_experts(runner.routed_experts, layer_seed(spec["seed"], idx))
    inner.norm.weight.fill_(1.0)
    nb = d.base_ids.shape[1]
    return {"moe_layers": n_moe, "blocks": nb, "moet_layers": moet_layers, "rms_e": pw["rms_e"]}


def synthetic_sections(shapes: dict[str, tuple], seed: int, device) -> dict[str, torch.Tensor]:
    """moet's logical W2 sections of one layer ({section: [E, ...] shape}): uniform code bytes,
    trained-shaped UE8M0 scales (moet_kernels.testing.random_scales "trained")."""
    from moet_kernels.testing import random_scales

    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name in ("w13_codes", "w2_codes"):
        out[name] = torch.randint(
            0, 256, shapes[name], dtype=torch.uint8, device=device, generator=gen
        )
    for name in ("w13_scales", "w2_scales"):
        out[name] = random_scales(shapes[name], "trained", gen, device)
    return out


def layer_seed(seed: int, model_layer: int) -> int:
    return seed * 1000 + model_layer


def synthetic_experts(experts, seed: int) -> int:
    """Fill one layer's logical W2 parameters with `synthetic_sections`; 0 where the layer holds
    no experts (tiered residency: they come from SyntheticSource, through the packs)."""
    from moet_vllm.method import PARAMS

    params = {section: getattr(experts, name) for section, name in PARAMS.items()}
    if params["w13_codes"].shape[0] == 0:
        return 0
    shapes = {k: tuple(p.shape) for k, p in params.items()}
    for k, t in synthetic_sections(shapes, seed, params["w13_codes"].device).items():
        params[k].copy_(t)
    return 1


# the model layers of the engine's MoE layers, recorded by `impose` (which runs before moet's
# process_weights_after_loading opens the expert source)
MOE_LAYERS: list[int] = []


def _register_source() -> None:
    from moet_kernels.layout import RowLayout
    from moet_quant.checkpoint import read_config, text_config
    from moet_vllm.experts import ExpertSource, register_source

    class SyntheticSource(ExpertSource):
        """The same synthetic experts as `synthetic_experts` (equal bytes for a seed), one layer
        at a time, for the pack cache of tiered residency; no file holds them."""

        kind = "synthetic, made at load"

        def __init__(self, path, cfg, tp_rank, tp_size):
            super().__init__(path, cfg, tp_rank, tp_size)
            if tp_size != 1:
                raise RuntimeError(
                    "the benchmark's synthetic experts: tensor parallelism is not built"
                )
            config = read_config(path)
            text = text_config(config)
            self.seed = int(config["quantization_config"]["expert_source"]["seed"])
            self.n_experts = text.get("n_routed_experts") or text["num_experts"]
            self.hidden, self.inter = text["hidden_size"], text["moe_intermediate_size"]
            if not MOE_LAYERS:
                raise RuntimeError("SyntheticSource: the loader recorded no MoE layer")
            self.moe_layers = list(MOE_LAYERS)
            ident = json.dumps([text, self.seed], sort_keys=True).encode()
            self.ckpt_id = "synthetic-" + hashlib.sha256(ident).hexdigest()[:16]
            self.source_format = "synthetic W2 (bench/serving_gpu_engine.py)"

        def layer(self, model_layer: int) -> dict[str, np.ndarray]:
            shapes = {
                name: (self.n_experts, *shape)
                for name, (_, shape) in RowLayout(self.hidden, self.inter).sections.items()
            }
            dev = "cuda" if torch.cuda.is_available() else "cpu"
            secs = synthetic_sections(shapes, layer_seed(self.seed, model_layer), dev)
            return {k: v.cpu().numpy() for k, v in secs.items()}

        def fp4_layer(self, model_layer: int) -> dict[str, np.ndarray]:
            """Synthetic fp4r rows (the FP4 tier's, `--fp4`): uniform nibble bytes on
            trained-shaped scales, another seed than the W2 rows'."""
            shapes = {
                name: (self.n_experts, *shape)
                for name, (_, shape) in RowLayout(self.hidden, self.inter, "fp4r").sections.items()
            }
            dev = "cuda" if torch.cuda.is_available() else "cpu"
            secs = synthetic_sections(shapes, layer_seed(self.seed, model_layer) + 500, dev)
            return {k: v.cpu().numpy() for k, v in secs.items()}

        def close(self) -> None:
            pass

    register_source(LOAD_FORMAT, SyntheticSource)


def _register_loader() -> None:
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    @register_model_loader(LOAD_FORMAT)
    class SyntheticLoader(DummyModelLoader):
        """vLLM's dummy weights, then `impose` (module doc); the design's parameters come in
        `model_loader_extra_config` (which DummyModelLoader itself refuses)."""

        def __init__(self, load_config):
            BaseModelLoader.__init__(self, load_config)
            self.spec = dict(load_config.model_loader_extra_config or {})

        def load_weights(self, model, model_config) -> None:
            super().load_weights(model, model_config)
            import logging

            report = impose(model, self.spec)
            logging.getLogger("vllm.moet").info("moet-bench: synthetic weights imposed: %s", report)


# -- in the worker: what it holds, the routing it took -------------------------------------------


class _Recorder:
    def __init__(self):
        self.on = False
        self.ids: dict[int, list[torch.Tensor]] = {}  # per MoE ordinal, per recorded pass
        self.vllm_ids: dict[int, list[torch.Tensor]] = {}
        self.clear()

    def clear(self):
        self.ids, self.vllm_ids = {}, {}
        self.logit_sq, self.logit_n = 0.0, 0
        self.pass_start, self.replays = None, None  # marks of the last pass; replays counted then

    def start_pass(self):
        """At the first MoE layer of each forward pass. Under tiered residency a replayed step runs
        the forward again, and its routing, not the first pass's (computed on zeroed experts), is
        the step's: a pass the residency manager counted as a replay replaces the one before."""
        from moet_vllm.residency.manager import active

        mgr = active()
        replays = mgr.counters.replays if mgr is not None else 0
        if self.pass_start is not None and replays > self.replays:
            lengths, self.logit_sq, self.logit_n = self.pass_start
            for which, d in (("ids", self.ids), ("vllm", self.vllm_ids)):
                for o, ts in d.items():
                    del ts[lengths.get((which, o), 0) :]
        else:
            lengths = {(w, o): len(ts) for w, d in (("ids", self.ids), ("vllm", self.vllm_ids))
                       for o, ts in d.items()}  # fmt: skip
            self.pass_start = (lengths, self.logit_sq, self.logit_n)
        self.replays = replays


def _arg(args, kwargs, name, pos):
    return kwargs[name] if name in kwargs else args[pos] if len(args) > pos else None


class BenchWorker:
    """Mixed into vLLM's Worker (`worker_extension_cls`): collective_rpc methods of the bench."""

    def bench_info(self, spec: dict) -> dict:
        from moet_kernels.layout import NativeRowLayout

        model = self.get_model()
        layers = _moe_layers(model)
        d = design(spec, len(layers))
        out = {"moe_layers": [i for i, _, _ in layers], "design_digest": d.digest()}
        routed = dense = embed = 0
        per_layer_expert_bytes = []
        slow = {"w13": [], "w2": []}
        methods, compute = set(), set()
        routed_ids = set()
        for _, _name, runner in layers:
            ex = runner.routed_experts
            methods.add(type(ex.quant_method).__name__)
            b = sum(t.numel() * t.element_size() for t in _tensors(ex))
            for t in _tensors(ex):
                routed_ids.add(id(t))
            res = getattr(ex.quant_method, "resident", None)
            if res is not None:
                b += res.rows.numel()
            tiered = is_moet(ex) and res is None and ex.w13_w2_codes.shape[0] == 0
            if tiered:  # the rows live in the pool and the packs: a step moves whole rows
                b = spec["n_experts"] * NativeRowLayout(ex.quant_method.hidden,
                                                        ex.quant_method.inter).row_bytes  # fmt: skip
            routed += b
            per_layer_expert_bytes.append(b / spec["n_experts"])
            if is_moet(ex) and not tiered:  # tiered: the resident run of the seed has the bytes
                qm = ex.quant_method
                compute.add(qm.compute)
                lay = NativeRowLayout(qm.hidden, qm.inter)
                if res is not None:
                    rows = res.rows
                else:  # the torch reference serves the logical sections: pack them to measure
                    rows = lay.pack(
                        w13_codes=ex.w13_w2_codes.data, w13_scales=ex.w13_w2_scales.data,
                        w2_codes=ex.w2_w2_codes.data, w2_scales=ex.w2_w2_scales.data,
                    )  # fmt: skip
                for proj, sec in (("w13", "w13_scales"), ("w2", "w2_scales")):
                    o, n = lay.offsets[sec], lay.sizes[sec]
                    slow[proj].append(_slow(rows[:, o : o + n]))
        inner = model.model if hasattr(model, "model") else model
        emb_ptr = inner.embed_tokens.weight.data_ptr()
        seen = set()
        for t in list(model.parameters()) + list(model.buffers()):
            if id(t) in routed_ids or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            n = t.numel() * t.element_size()
            if t.data_ptr() == emb_ptr:
                embed += n
            else:
                dense += n
        from vllm.model_executor.layers.linear import LinearBase

        dense_methods = {  # how the dense projections run (routers included)
            "/".join(type(x).__name__ for x in (m.quant_method, getattr(m, "scheme", None)) if x)
            for m in model.modules()
            if isinstance(m, LinearBase)
        }
        out.update(
            dense_methods=sorted(dense_methods),
            routed_bytes=routed,
            expert_bytes_per_layer=per_layer_expert_bytes,
            dense_bytes=dense,
            embedding_bytes=embed,
            moe_methods=sorted(methods),
            moet_compute=sorted(compute) or None,
            slow_tile_fraction=(
                {p: float(np.mean(v)) for p, v in slow.items()} if slow["w13"] else None
            ),
            device=str(inner.embed_tokens.weight.device),
            gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        )
        cc = self.vllm_config.compilation_config
        out["cudagraph_mode"] = str(getattr(cc, "cudagraph_mode", None))
        out["capture_sizes"] = list(getattr(cc, "cudagraph_capture_sizes", None) or [])
        out["compilation_mode"] = str(getattr(cc, "mode", getattr(cc, "level", None)))
        return out

    def bench_residency(self) -> dict | None:
        """Tiered residency's counters since boot (moet_vllm.residency.manager.Counters), or None
        where every expert is resident."""
        import dataclasses

        from moet_vllm.residency.manager import active

        mgr = active()
        if mgr is None:
            return None
        out = dataclasses.asdict(mgr.counters)
        out.pop("window")
        if mgr.fp4 is not None:  # the FP4 tier's totals (gate replays, promotions, hits)
            out |= {k: v for k, v in mgr.fp4.metrics().items() if k != "fp4_pool_coverage"}
            out["fp4_steps"] = mgr.fp4.tier.counters.steps
        return out | {"slots": mgr.n_slots, "coverage": mgr.coverage}

    def bench_profile(self, on: bool) -> list | None:
        """Start, or stop and summarize, a torch profiler of this worker's GPU kernels:
        [(kernel, calls, total µs)] (serving_gpu.kernel_profile)."""
        if on:
            self._bench_prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CUDA]
            )
            self._bench_prof.__enter__()
            return None
        prof, self._bench_prof = self._bench_prof, None
        torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        rows = []
        for ev in prof.key_averages():
            us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            if us > 0:
                rows.append((ev.key, int(ev.count), float(us)))
        return {"kernels": rows, **_beside_experts(prof)}

    def bench_record(self, on: bool) -> int:
        """Start (clearing what was recorded) or stop recording each MoE layer's routing: the
        top-k of its router logits (moet's reference routing, the same function for every engine)
        and, where vLLM selects experts itself (modular methods), vLLM's own choice. Recording
        happens wherever the layer's Python runs: eager forwards, prefills above the captured
        sizes; never inside a CUDA graph replay."""
        rec = getattr(self, "_bench_rec", None)
        if rec is None:
            rec = self._bench_rec = _Recorder()
            _install(self.get_model(), rec)
        rec.clear()
        rec.on = bool(on)
        return len(_moe_layers(self.get_model()))

    def bench_take(self) -> dict:
        """What was recorded since `bench_record(True)`: per MoE ordinal, the ids of each recorded
        forward as int16 bytes ([rows, k] each) and their row counts; vLLM's own ids likewise."""
        rec = self._bench_rec
        rec.on = False

        def pack(d):
            return {
                str(o): {
                    "rows": [int(t.shape[0]) for t in ts],
                    "ids": b"".join(t.numpy().astype(np.int16).tobytes() for t in ts),
                }
                for o, ts in d.items()
            }

        out = {
            "ref": pack(rec.ids),
            "vllm": pack(rec.vllm_ids),
            "logit_rms": (rec.logit_sq / rec.logit_n) ** 0.5 if rec.logit_n else None,
        }
        rec.clear()
        return out


def _union_us(spans: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) spans, µs."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


EXPERT_KERNELS = ("moet_", "fused_moe_kernel", "marlin_moe")  # routed experts' kernels, by name (a
# dense GPTQ layer runs marlin::Marlin, the experts marlin_moe_wna16::Marlin)


def _beside_experts(prof) -> dict:
    """From a profile's kernel spans: GPU-busy µs (their union), the routed-expert kernels'
    union, and the µs in which another kernel runs beside them (e.g. the shared expert on vLLM's
    aux stream): expert + other - busy. Spans of PDL-launched kernels include their wait, so the
    expert union may start early; the overlap between two experts' kernels is not counted."""
    expert, other = [], []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA or ev.time_range.elapsed_us() <= 0:
            continue
        span = (ev.time_range.start, ev.time_range.end)
        name = ev.name.lower()
        (expert if any(k in name for k in EXPERT_KERNELS) else other).append(span)
    busy, ex, ot = _union_us(expert + other), _union_us(expert), _union_us(other)
    # max: the three unions' float sums can leave -0.0 where nothing overlaps
    return {"busy_us": busy, "expert_us": ex, "beside_experts_us": max(0.0, ex + ot - busy)}


def _tensors(mod) -> list[torch.Tensor]:
    return list(mod.parameters()) + list(mod.buffers())


def _slow(section_rows: torch.Tensor) -> float:
    from moet_kernels.layout import slow_tile_fraction

    return float(slow_tile_fraction(section_rows.contiguous()))


def _install(model, rec: _Recorder) -> None:
    from moet_kernels.reference import route_reference
    from moet_vllm.method import routing_of

    for ordinal, (_, _, runner) in enumerate(_moe_layers(model)):
        ex = runner.routed_experts
        routing = routing_of(ex)
        bias = getattr(ex, "e_score_correction_bias", None)
        orig = runner._apply_quant_method

        def apply(*args, _orig=orig, _o=ordinal, _routing=routing, _bias=bias, **kwargs):
            if rec.on:
                if _o == 0:
                    rec.start_pass()
                logits = _arg(args, kwargs, "router_logits", 1)
                _, ids = route_reference(logits, _routing, _bias)
                rec.ids.setdefault(_o, []).append(ids.to(torch.int16).cpu())
                rec.logit_sq += float(logits.float().pow(2).sum())
                rec.logit_n += logits.numel()
            return _orig(*args, **kwargs)

        runner._apply_quant_method = apply
        router = getattr(runner, "router", None)
        if router is not None and hasattr(router, "select_experts"):
            sel = router.select_experts

            def select(*args, _sel=sel, _o=ordinal, **kwargs):
                weights, ids = _sel(*args, **kwargs)
                if rec.on:
                    rec.vllm_ids.setdefault(_o, []).append(ids.to(torch.int16).cpu())
                return weights, ids

            router.select_experts = select


_register_loader()
_register_source()

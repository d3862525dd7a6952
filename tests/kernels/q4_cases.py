"""Expert units of every format moe_q4_experts_ reads (csrc/moe_experts_q4.cpp), built as the expert plans build them
(fused_spec.q4_units over a UnitLayout), and the op written plainly in torch: each projection dequantized by the
format's own decoder (moeserve/formats/, checked against compressed-tensors and the gpt-oss reference in
tests/formats/), then canonical_dot.h's order (tests/kernels/test_canonical_isa.py's reference) and the op's bf16
roundings. Shared by the kernel tests and their subprocesses (one ISA level per process)."""

from __future__ import annotations

import torch

from moeserve.bench.q4_units import ProjectionShape, assemble, dequantized
from moeserve.checkpoint.gguf.quants import TYPES_BY_NAME
from moeserve.experts.unit import UnitLayout
from moeserve.formats import create_format
from moeserve.models.experts.fused_spec import Activation, bf16_interleaved_units
from tests.kernels.q8_reference import q8_dots
from tests.kernels.test_canonical_isa import _expf, bf16_from_float, canonical_dots, edge_values, interleave

GPT_OSS = Activation("gptoss", 1.702, 7.0)
ACTS = {"swiglu": Activation("swiglu"), "relu2": Activation("relu2"), "gptoss": GPT_OSS,
        "gptoss-split": Activation("gptoss-split", GPT_OSS.alpha, GPT_OSS.limit)}  # a GGUF's: gate rows, up rows


# edge: False (typical scales), "small" (scales down to bf16 / fp32 denormal products, none overflowing: results
# stay finite) or "all" (every scale byte or value, overflow and infinities included: for the decoder)
Edge = bool | str


def _scale_bytes(shape: tuple[int, ...], gen: torch.Generator, typical: tuple[int, int], edge: Edge) -> torch.Tensor:
    """uint8 E8M0 scale bytes: in `typical`, or from the smallest up (small), or any byte (all)."""
    lo, hi = {False: typical, "small": (0, typical[1]), "all": (0, 256)}[edge]
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.uint8)


def _fp8_scales(shape: tuple[int, ...], gen: torch.Generator, edge: Edge) -> torch.Tensor:
    """float8_e4m3fn group scales: normal ones around 1, or (edge) any byte but the two NaNs, subnormals included."""
    b = _scale_bytes(shape, gen, (0x30, 0x48), "all" if edge else False)
    b = torch.where((b & 0x7F) == 0x7F, b - 1, b)
    return b.view(torch.float8_e4m3fn)


def _bf16_scales(shape: tuple[int, ...], gen: torch.Generator, edge: Edge) -> torch.Tensor:
    s = torch.rand(shape, generator=gen) * 0.02 + 0.001
    if edge:  # bf16 subnormals, the smallest normals (products below 2^-126), (all) huge ones (products overflow)
        pick = torch.rand(shape, generator=gen)
        s = torch.where(pick < 0.1, torch.randint(1, 128, shape, generator=gen) * 2.0**-133, s)
        s = torch.where((pick >= 0.1) & (pick < 0.2), (1 + torch.rand(shape, generator=gen)) * 2.0**-126, s)
        if edge == "all":
            s = torch.where((pick >= 0.2) & (pick < 0.25), 2.0**125 * (1 + torch.rand(shape, generator=gen)), s)
        s = torch.where(torch.rand(shape, generator=gen) < 0.5, -s, s)
    return s.bfloat16()


# byte offsets of the f16 scales in a block of each GGUF type; MXFP4's E8M0 exponent is byte 0
GGUF_F16 = {"Q8_0": (0,), "Q4_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _f16_scales(shape: tuple[int, ...], gen: torch.Generator, edge: Edge) -> torch.Tensor:
    """f16 scales as a quantizer writes them (a few hundredths), or (edge) with f16 subnormals and zeros among them."""
    s = torch.randn(shape, generator=gen) * 0.01
    if edge:
        pick = torch.rand(shape, generator=gen)
        s = torch.where(pick < 0.2, torch.randint(-1023, 1024, shape, generator=gen) * 2.0**-24, s)
        s = torch.where(pick > 0.95, torch.zeros(shape), s)
    return s.half()


def gguf_blocks(type_name: str, rows: int, cols: int, gen: torch.Generator, edge: Edge) -> torch.Tensor:
    """uint8 [rows, row bytes]: random blocks of a GGUF type, its scales from `_f16_scales` (MXFP4: exponents near
    2^0, or from the smallest up)."""
    t = TYPES_BY_NAME[type_name]
    blocks = torch.randint(0, 256, (rows, cols // t.block_elems, t.block_bytes), generator=gen, dtype=torch.uint8)
    for at in GGUF_F16.get(type_name, ()):
        blocks[..., at : at + 2] = _f16_scales((rows, cols // t.block_elems, 1), gen, edge).view(torch.uint8)
    if type_name == "MXFP4":
        blocks[..., 0] = _scale_bytes((rows, cols // t.block_elems), gen, (118, 130), edge)
    return blocks.reshape(rows, -1)


def stored(fmt_name: str, rows: int, cols: int, gen: torch.Generator, edge: Edge, group: int) -> dict:
    """Random stored tensors of one weight [rows, cols] in `fmt_name`, by role."""
    if fmt_name.startswith("gguf-"):
        return {"weight": gguf_blocks(fmt_name.removeprefix("gguf-").upper(), rows, cols, gen, edge)}
    codes = torch.randint(0, 256, (rows, cols // 2), generator=gen, dtype=torch.uint8)
    if fmt_name == "mxfp4-gpt-oss":
        return {"blocks": codes.view(rows, cols // 32, 16), "scales": _scale_bytes((rows, cols // 32), gen, (118, 128), edge)}
    if fmt_name == "mxfp4-ct":
        return {"weight_packed": codes, "weight_scale": _scale_bytes((rows, cols // 32), gen, (118, 128), edge)}
    if fmt_name in ("nvfp4-ct", "nvfp4-modelopt"):
        # edge: a tensor scale making some group scales fp32 denormals, whose products round up to bf16 normals
        g = 2.0 ** float(torch.randint(118, 124, (1,), generator=gen)) if edge else float(1 + torch.rand(1, generator=gen)) * 64
        tensor = torch.tensor([g if fmt_name == "nvfp4-ct" else 1 / g], dtype=torch.float32)
        roles = ("weight_packed", "weight_scale", "weight_global_scale") if fmt_name == "nvfp4-ct" else \
            ("weight", "weight_scale", "weight_scale_2")
        return dict(zip(roles, (codes, _fp8_scales((rows, cols // 16), gen, edge), tensor)))
    if fmt_name in ("int4-ct", "int4-q8"):
        return {"weight_packed": codes.view(torch.int32), "weight_scale": _bf16_scales((rows, cols // group), gen, edge),
                "weight_shape": torch.tensor([rows, cols], dtype=torch.int64)}
    raise ValueError(fmt_name)


def make_case(fmt_name: str, act: str, h: int, isz: int, n_exp: int, tokens: int, shards: int, seed: int,
              edge: Edge = False, group: int = 32) -> dict:
    """Units of `n_exp` experts, tokens routed to them, and each expert's dense (reference-decoded) weights."""
    gen = torch.Generator().manual_seed(seed)
    q8 = fmt_name == "int4-q8"  # INT4 units computed against int8 activations (q8_reference.py)
    fmt = create_format("int4-ct" if q8 else fmt_name, **({"group_size": group} if fmt_name.startswith("int4") else {}))
    r1 = isz if act == "relu2" else 2 * isz
    bias = act.startswith("gptoss")
    shapes = (ProjectionShape(r1, h, shards, bias), ProjectionShape(h, isz, 1, bias))
    stored_w = [[stored(fmt_name, p.rows // p.shards, p.cols, gen, edge, group) for p in shapes for _ in range(p.shards)]
                for _ in range(n_exp)]
    biases = [[(torch.randn(p.rows, generator=gen) * 0.1).bfloat16() if p.bias else None for p in shapes]
              for _ in range(n_exp)]
    units = assemble(fmt, shapes, stored_w, biases, ACTS[act], int8_activations=q8)
    dense, int4 = [], []
    for w, b in zip(stored_w, biases):
        w1, w2 = dequantized(fmt, shapes, w)
        dense.append((w1, b[0], w2, b[1]))
        if q8:  # each projection's codes [rows, cols / 2] and scales, its shards' rows stacked
            gu, dn = w[:shapes[0].shards], w[shapes[0].shards:]
            int4.append([(torch.cat([t["weight_packed"].view(torch.uint8) for t in part]),
                          torch.cat([t["weight_scale"] for t in part])) for part in (gu, dn)])
    return {**_routing(h, tokens, n_exp, gen, edge), "units": units.unit_bytes, "nbytes": units.layout.nbytes,
            "fields": [(f.dtype, f.shape, f.offset) for f in units.layout.fields], "gate_up": units.fused.gate_up,
            "down": units.fused.down, "spec": units.fused.spec, "dense": dense, "act": act, "int4": int4}


def make_bf16_case(h: int, isz: int, n_exp: int, tokens: int, seed: int, edge: Edge = False) -> dict:
    """gpt-oss units in bf16, held row-interleaved with their biases (plans.interleaved_expert_plan's layout)."""
    gen = torch.Generator().manual_seed(seed)
    specs = [("gate_up", torch.bfloat16, (2 * isz * h,)), ("gate_up_bias", torch.bfloat16, (2 * isz,)),
             ("down", torch.bfloat16, (h * isz,)), ("down_bias", torch.bfloat16, (h,))]
    layout = UnitLayout.build(specs)
    units = bf16_interleaved_units(layout, GPT_OSS, h, isz)
    unit_bytes, dense = [], []
    for _ in range(n_exp):
        w1 = edge_values((2 * isz, h), gen, inf=False) if edge else (torch.randn(2 * isz, h, generator=gen) * h**-0.5).bfloat16()
        w2 = (torch.randn(h, isz, generator=gen) * isz**-0.5).bfloat16()
        b1, b2 = ((torch.randn(n, generator=gen) * 0.1).bfloat16() for n in (2 * isz, h))
        buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
        for view, t in zip(layout.views(buf), (interleave(w1), b1, interleave(w2), b2)):
            view.copy_(t)
        unit_bytes.append(buf)
        dense.append((w1, b1, w2, b2))
    return {**_routing(h, tokens, n_exp, gen, edge), "units": unit_bytes, "nbytes": layout.nbytes,
            "fields": [(f.dtype, f.shape, f.offset) for f in layout.fields], "gate_up": units.gate_up,
            "down": units.down, "spec": units.spec, "dense": dense, "act": "gptoss"}


def _routing(h: int, tokens: int, n_exp: int, gen: torch.Generator, edge: Edge) -> dict:
    x = edge_values((tokens, h), gen, inf=False) if edge else (torch.randn(tokens, h, generator=gen) * 0.5).bfloat16()
    pairs = [(t, e) for t in range(tokens) for e in range(n_exp) if torch.rand(1, generator=gen) < 0.6]
    pairs.sort(key=lambda p: (p[1], p[0]))
    bounds, lo = [], 0
    for e in range(n_exp):
        hi = lo + sum(1 for p in pairs if p[1] == e)
        bounds.append((lo, hi))
        lo = hi
    return {"x": x, "out": (torch.randn(tokens, h, generator=gen) * 0.1).bfloat16(),
            "token_of": torch.tensor([p[0] for p in pairs], dtype=torch.long),
            "weight_of": torch.rand(len(pairs), generator=gen), "bounds": bounds}


def unit_views(case: dict, e: int) -> list[torch.Tensor]:
    """Expert e's field views into its unit bytes (what the store lends)."""
    buf = case["units"][e]
    return [buf[off : off + torch.empty((), dtype=dt).element_size() * int(torch.tensor(shape).prod())]
            .view(dt).view(shape) for dt, shape, off in case["fields"]]


def run_op(case: dict, ops) -> torch.Tensor:  # noqa: ANN001 - torch.ops namespace
    out = case["out"].clone()
    views = [unit_views(case, e) for e in range(len(case["units"]))]
    ops.moe_q4_experts_(out, case["x"], [v[case["gate_up"]] for v in views], [v[case["down"]] for v in views],
                        case["token_of"], case["weight_of"], [b for lo_hi in case["bounds"] for b in lo_hi],
                        case["spec"])
    return out


# ---------------------------------------------------------------------------------------------- the reference
def _rnd(v: torch.Tensor) -> torch.Tensor:
    return bf16_from_float(v).float()


def _activation(act: str, gu: torch.Tensor) -> torch.Tensor:
    expf = _expf()
    exp = lambda t: torch.tensor([[expf(v) for v in row] for row in t.tolist()], dtype=torch.float32)  # noqa: E731
    if act == "swiglu":
        isz = gu.shape[1] // 2
        g, u = gu[:, :isz], gu[:, isz:]
        return _rnd(_rnd(g / (1.0 + exp(-g))) * u)
    if act == "relu2":
        return _rnd(torch.relu(gu) ** 2)
    lim = _rnd(torch.tensor(GPT_OSS.limit))
    gate, up = gu.chunk(2, dim=1) if act == "gptoss-split" else (gu[:, ::2], gu[:, 1::2])
    g = torch.minimum(gate, lim)
    u = torch.maximum(torch.minimum(up, lim), -lim)
    sig = _rnd(1.0 / (1.0 + exp(-_rnd(g * GPT_OSS.alpha))))
    return _rnd(_rnd(u + 1.0) * _rnd(g * sig))


def _dots(case: dict, e: int, proj: int, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Projection `proj` of expert e against x: canonical bf16 dots of the decoded weights, or (int4-q8) q8 dots."""
    if case.get("int4"):
        return q8_dots(*case["int4"][e][proj], x)
    return canonical_dots(w, x)


def reference(case: dict) -> torch.Tensor:
    """The op written plainly (see the module docstring); int4-q8 cases with q8_reference's dots."""
    x, out = case["x"], case["out"].clone()
    for e, ((lo, hi), (w1, b1, w2, b2)) in enumerate(zip(case["bounds"], case["dense"])):
        if hi == lo:
            continue
        toks = case["token_of"][lo:hi]
        gu = _rnd(_dots(case, e, 0, w1, x[toks]))
        if b1 is not None:
            gu = _rnd(gu + b1.float())
        a = bf16_from_float(_activation(case["act"], gu))
        d = _rnd(_dots(case, e, 1, w2, a))
        if b2 is not None:
            d = _rnd(d + b2.float())
        y = _rnd(d * case["weight_of"][lo:hi, None])
        for t, tok in enumerate(toks.tolist()):  # expert after expert, token after token: each add rounded
            out[tok] = bf16_from_float(out[tok].float() + y[t])
    return out

"""A checkpoint sized from config.json alone: will a download fit before it is downloaded?

`config_only_checkpoint(path)` builds a `Checkpoint` whose tensor map holds every tensor the model reads, with the
name, dtype and shape its safetensors header would have, and no data: the non-expert tensors from the
architecture spec (`validate.expected_tensors`, the list `read_model` checks a real checkpoint against), the
expert tensors from `EXPERT_TENSORS` (one generator per expert kind, beside `EXPERT_PLANNERS`), and each
Linear's stored tensors from its `Format.stored_shapes` (scales and packing included) under the checkpoint's
quantization scheme. `moeserve plan` and `moeserve inspect` then size it with the same functions they use on a
real checkpoint (read_model, expert_plan, resident_nbytes, size_tiers): no second estimate. tests/cli/
test_config_only.py checks the tensor map against the headers of checkpoints transformers writes.

Not in the map (what a real checkpoint may hold beside it): tensors the model does not serve (a vision tower,
MTP layers) and activation scales (ModelOpt `input_scale`). Unquantized tensors take config.json's dtype (bfloat16
if unset), except the routers transformers keeps in float32 and their routing correction biases (float32, as
transformers and the published checkpoints store them); a producer storing such a router in bf16 differs by
experts x hidden x 2 bytes per MoE layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from moeserve.checkpoint.folder import Checkpoint, read_json
from moeserve.checkpoint.safetensors_file import DTYPES, TensorRef
from moeserve.errors import CheckpointError
from moeserve.formats import QuantScheme, load_quant_scheme
from moeserve.models.registry import Architecture, get_architecture
from moeserve.models.spec import ModelSpec
from moeserve.models.validate import Expected, expected_tensors, ngram_hash_buffers, ngram_tables

# Expert kind (ModelSpec.moe.expert_kind) -> the expert tensors its planner reads (models/experts/plans.py).
ExpertTensors = Callable[[Architecture, ModelSpec, QuantScheme], Iterator[Expected]]
EXPERT_TENSORS: dict[str, ExpertTensors] = {}
# Experts (MoE layers x experts per layer) sized from a config alone; Kimi-K2 has 60 x 384 = 23040. Past it a
# config of in-bounds fields would have the tensor map take gigabytes.
MAX_EXPERT_UNITS = 2**20
_DTYPE_CODES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def _register(kind: str) -> Callable[[ExpertTensors], ExpertTensors]:
    def add(fn: ExpertTensors) -> ExpertTensors:
        EXPERT_TENSORS[kind] = fn
        return fn

    return add


def _per_expert(templates: list[tuple[str, int, int]], spec: ModelSpec) -> Iterator[Expected]:
    for layer in spec.moe_layer_ids:
        for e in range(spec.moe.num_experts):
            for template, rows, cols in templates:
                yield template.format(L=layer, E=e), (rows, cols), True


@_register("swiglu")
@_register("swiglu_clamp")
def _swiglu(arch: Architecture, spec: ModelSpec, scheme: QuantScheme) -> Iterator[Expected]:
    n, h, i = arch.names, spec.hidden_size, spec.moe.intermediate_size
    yield from _per_expert([(n.expert_gate, i, h), (n.expert_up, i, h), (n.expert_down, h, i)], spec)


@_register("relu2")
def _relu2(arch: Architecture, spec: ModelSpec, scheme: QuantScheme) -> Iterator[Expected]:
    n, h, i = arch.names, spec.hidden_size, spec.moe.intermediate_size
    yield from _per_expert([(n.expert_up, i, h), (n.expert_down, h, i)], spec)


@_register("gpt_oss")
def _gpt_oss(arch: Architecture, spec: ModelSpec, scheme: QuantScheme) -> Iterator[Expected]:
    """Stacked experts: quantized, [E, out, in] in the stored format; bf16, the tensors as named, [E, in, out]."""
    n, h, i, e = arch.names, spec.hidden_size, spec.moe.intermediate_size, spec.moe.num_experts
    for layer in spec.moe_layer_ids:
        for template, out, inp in ((n.stacked_gate_up, 2 * i, h), (n.stacked_down, h, i)):
            prefix = template.format(L=layer)
            if scheme.is_quantized(prefix):
                yield prefix, (e, out, inp), True
            else:
                yield prefix, (e, inp, out), False
            yield prefix + "_bias", (e, out), False


@_register("geglu")
def _geglu(arch: Architecture, spec: ModelSpec, scheme: QuantScheme) -> Iterator[Expected]:
    """Every expert of a layer in one tensor per projection, [E, out, in], as transformers stores them (Gemma-4)."""
    n, h, i, e = arch.names, spec.hidden_size, spec.moe.intermediate_size, spec.moe.num_experts
    for layer in spec.moe_layer_ids:
        yield n.stacked_gate_up.format(L=layer), (e, 2 * i, h), False
        yield n.stacked_down.format(L=layer), (e, h, i), False


def expert_parameters(arch: Architecture, spec: ModelSpec) -> int:
    """Parameters in all experts (weights and biases, as unquantized shapes: packed 4-bit storage does not halve
    them), from the same per-kind tensor list the config-only checkpoint is built from (relu2: up + down only)."""
    total = 0
    for _name, shape, _linear in EXPERT_TENSORS[spec.moe.expert_kind](arch, spec, QuantScheme(method="none")):
        count = 1
        for dim in shape:
            count *= dim
        total += count
    return total


@dataclass(frozen=True)
class ParameterCounts:
    """A model's parameters as unquantized element counts (packed 4-bit storage does not halve them; scales are not
    parameters), from the spec's tensor list (`expected_tensors`, `EXPERT_TENSORS`): served tensors only."""

    total: int
    active: int  # per token: every non-expert tensor (the embedding table whole) + top_k of each MoE layer's experts
    embedding: int  # of which the embedding table (one row of it is read per token)
    # the n-gram tables (ModelSpec.ngram), in `total`; `active` counts only the rows a token reads (one per head)
    ngram_table: int = 0

    @property
    def active_without_embedding(self) -> int:
        return self.active - self.embedding


def parameter_counts(arch: Architecture, spec: ModelSpec) -> ParameterCounts:
    """Total and per-token parameters of `spec`. Publishers count "active" either way: with the embedding table
    (Qwen) or without it (DeepSeek, Kimi, gpt-oss); both are given."""
    empty = Checkpoint(path=Path("config.json"), config={}, generation_config={}, tensors={})
    ng, tables = spec.ngram, ngram_tables(arch, spec)
    other = embedding = table = 0
    for name, shape, _linear in expected_tensors(empty, arch, spec):
        count = math.prod(shape)
        if name in tables:
            table += count
            continue
        other += count
        embedding += count if name == arch.names.embed else 0
    experts = expert_parameters(arch, spec)
    rows_read = len(ng.layers) * ng.embed_dim if ng else 0  # one row of head_dim per head and PLE layer
    active = other + rows_read + experts // spec.moe.num_experts * spec.moe.top_k
    return ParameterCounts(total=other + table + experts, active=active, embedding=embedding, ngram_table=table)


def config_only_checkpoint(path: Path) -> Checkpoint:
    """A Checkpoint of the config file `path` (config.json, or any JSON file holding one) with every tensor the
    model reads and no data; CheckpointError / UnsupportedModelError (one line, naming the file) as for a real one."""
    config = read_json(path)
    where = str(path)
    arch = get_architecture(config, where)
    spec = arch.spec(config, where)
    units = len(spec.moe_layer_ids) * spec.moe.num_experts
    if units > MAX_EXPERT_UNITS:  # each field within its bound, but a map of billions of tensors (a size bomb)
        raise CheckpointError(f"{path}: {len(spec.moe_layer_ids)} MoE layers x {spec.moe.num_experts} experts = "
                              f"{units} experts, more than the {MAX_EXPERT_UNITS} a config alone is sized for")
    scheme = load_quant_scheme(path)
    dense_code = _DTYPE_CODES.get(str(spec.config_dtype), "BF16")
    empty = Checkpoint(path=path, config=config, generation_config={}, tensors={})
    tensors: dict[str, TensorRef] = {}
    expected = [*expected_tensors(empty, arch, spec), *EXPERT_TENSORS[spec.moe.expert_kind](arch, spec, scheme)]
    int64 = _stored_as_int64(arch, spec)
    fp32 = _stored_in_fp32(arch, spec) | _kept_fp32_tensors(arch, spec, expected, int64)
    for name, shape, is_linear in expected:
        if not is_linear:
            _add(tensors, path, name, "F32" if name in fp32 else "I64" if name in int64 else dense_code, shape)
            continue
        fmt = scheme.format_for(name)
        for role, (code, stored_shape) in fmt.stored_shapes(shape, dense_code).items():
            _add(tensors, path, fmt.stored_name(name, role), code, stored_shape)
    generation = read_json(path.parent / "generation_config.json", required=False) if path.name == "config.json" \
        else {}
    return Checkpoint(path=path, config=config, generation_config=generation, tensors=tensors, origin="config")


def _stored_in_fp32(arch: Architecture, spec: ModelSpec) -> set[str]:
    """The routers transformers keeps in float32 (MoeSpec.router_fp32) and, beside them, the routing correction biases:
    stored so. A router in the compute dtype (MiniMax-M2) has its correction bias in that dtype too, as transformers
    writes it (a plain buffer)."""
    names, m = arch.names, spec.moe
    out = {names.router_correction_bias.format(L=L) for L in spec.moe_layer_ids if m.correction_bias and m.router_fp32}
    return out | {names.router.format(L=L) + ".weight" for L in spec.moe_layer_ids if m.router_fp32}


# DeepSeek-V4's projections stored as plain tensors in the compute dtype (the compressors' and the indexer's)
_COMPUTE_DTYPE_PROJECTIONS = (".wkv.weight", ".wgate.weight", ".weights_proj.weight")


def _kept_fp32_tensors(arch: Architecture, spec: ModelSpec, expected: list[Expected], int64: set[str]) -> set[str]:
    """DeepSeek-V4 (ModelSpec.compressed): transformers keeps every tensor that is not a Linear or the embedding in
    float32 (norms, sinks, the compressors' gate biases, the hyper-connections, the correction biases)."""
    if spec.compressed is None:
        return set()
    return {name for name, _shape, linear in expected if not linear and name != arch.names.embed and name not in int64
            and not name.endswith(_COMPUTE_DTYPE_PROJECTIONS)}


def _stored_as_int64(arch: Architecture, spec: ModelSpec) -> set[str]:
    """The n-gram hash buffers beside each PLE table (ModelSpec.ngram) and the hash-routed layers' token -> experts
    tables (MoeSpec.hash_layers), int64 as transformers stores them."""
    layers = spec.ngram.layers if spec.ngram is not None else ()
    hashed = {arch.names.router_hash.format(L=L) for L in spec.moe.hash_layers}
    return hashed | {name for L in layers for name, _shape in ngram_hash_buffers(arch, spec, L)}


def _add(tensors: dict[str, TensorRef], path: Path, name: str, code: str, shape: tuple[int, ...]) -> None:
    if name in tensors:
        raise CheckpointError(f"{path}: tensor '{name}' would be stored twice (architecture spec)")
    dtype, itemsize = DTYPES[code]
    nbytes = itemsize
    for dim in shape:
        nbytes *= dim
    tensors[name] = TensorRef(name=name, path=path, offset=0, nbytes=nbytes, dtype=dtype, dtype_code=code,
                              shape=tuple(shape))


def config_file_of(model: str) -> Path | None:
    """The config file to size `model` from when it has no weights: a JSON file path, or a folder holding
    config.json and no safetensors file. None: a checkpoint with weights (or no such path: open_checkpoint says)."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".json":
        return path
    if path.is_dir() and (path / "config.json").is_file() and not any(path.glob("*.safetensors")) \
            and not (path / "model.safetensors.index.json").is_file():
        return path / "config.json"
    return None


def open_for_sizing(model: str) -> Checkpoint:
    """What `plan` and `inspect` size: the checkpoint at `model`, or, without weights, its config file's
    config-only checkpoint (see `config_file_of`)."""
    from moeserve.checkpoint.folder import open_checkpoint

    config_file = config_file_of(model)
    return open_checkpoint(model) if config_file is None else config_only_checkpoint(config_file)


def has_weights(ckpt: Checkpoint) -> bool:
    """False for a config-only checkpoint (its tensors point into the config file: nothing to read)."""
    return ckpt.origin != "config"

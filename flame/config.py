"""One TOML file describes a run: typed sections, `--section.key=value` overrides, one-line errors.

Every section is a dataclass whose fields carry their default and, in the docstring below the field, what it means.
`load_config` checks names, types and ranges before anything touches a device or a process group; any problem
raises `ConfigError`, which `flame.train` turns into one line on stderr and exit code 2.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from flame.data.config import DataConfig
from flame.errors import ConfigError, RunError, check  # noqa: F401  (also imported from here by the rest of flame)
from kernels.limits import CHUNK_MULTIPLE

CONTEXT_PARALLEL_MODELS = ("rwkv7", "rwkv6", "gsa")
"""The models whose layers run as pieces of a sequence (flame/context_parallel.py)."""
RECOMPUTE_MODELS = {"low_rank": ("rwkv7", "rwkv6"), "chunk_tensors": ("rwkv7",)}
"""training.recompute's parts that only some models have (the others apply to every model)."""


# ----------------------------------------------------------------------------------------------------------- sections
@dataclass
class JobConfig:
    name: str = "flame"
    """Run name (console, wandb)."""
    dump_folder: str = "runs/flame"
    """The run folder: resolved config (config.toml; a launch whose config differs keeps the previous one as
    config.step-N.toml, N the step it starts from), metrics.jsonl, per-rank logs, checkpoints."""

    def validate(self) -> None:
        check(bool(self.dump_folder), "job.dump_folder", "a non-empty path")


@dataclass
class ModelArgs:
    """Fields every model shares; each model extends this with its own (see flame/models)."""

    name: str = "transformer"
    """Registered model name: transformer | rwkv7 | gsa | ..."""
    vocab_size: int = 50304
    """Embedding rows; at least the tokenizer's vocabulary (GPT-NeoX 50277, padded to a multiple of 64)."""
    l2wrap: bool = False
    """RWKV-LM's L2Wrap: same loss value, but each target position's largest logit gets an extra gradient of
    1e-4 * logit / (target tokens of the global batch), which keeps logits from growing (flame/loss.py)."""

    def validate(self) -> None:
        check(self.vocab_size >= 2, "model.vocab_size", "an integer >= 2", self.vocab_size)


@dataclass
class OptimizerConfig:
    name: Literal["AdamW"] = "AdamW"
    lr: float = 3e-4
    """Peak learning rate."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    """Decoupled (AdamW) decay of the parameter groups that take it. A model may declare its own groups
    (`optimizer_groups()`, see flame/optim.py; RWKV-7: RWKV-LM's); otherwise matrices decay, and norms, biases,
    vectors and embeddings do not (see decay_embeddings)."""
    decay_embeddings: bool = False
    """Also decay embedding tables, under the default groups (a model that declares its own groups decides)."""
    fused: bool | None = None
    """Fused AdamW kernel (None: yes, on GPU and CPU). It skips a step whose loss or gradient norm is not finite on the
    device; false (the foreach kernel) makes every step wait for the host to check them before the update."""

    def validate(self) -> None:
        check(self.lr > 0, "optimizer.lr", "a number > 0", self.lr)
        check(0 <= self.beta1 < 1, "optimizer.beta1", "a number in [0, 1)", self.beta1)
        check(0 <= self.beta2 < 1, "optimizer.beta2", "a number in [0, 1)", self.beta2)
        check(self.eps > 0, "optimizer.eps", "a number > 0", self.eps)
        check(self.weight_decay >= 0, "optimizer.weight_decay", "a number >= 0", self.weight_decay)


@dataclass
class LRSchedulerConfig:
    """Linear warmup, then decay (torchtitan's schedule). decay_ratio set -> warmup-stable-decay (WSD)."""

    warmup_steps: int = 200
    """Linear warmup steps; a run shorter than this warms up over all of its steps (capped in
    flame.optim.build_lr_scheduler, so a quick short run of any config works)."""
    decay_type: Literal["linear", "cosine", "sqrt"] = "cosine"
    decay_ratio: float | None = None
    """Fraction of the steps spent decaying at the end; None decays right after warmup."""
    min_lr_factor: float = 0.1
    """The schedule ends at lr * min_lr_factor."""

    def validate(self) -> None:
        check(self.warmup_steps >= 0, "lr_scheduler.warmup_steps", "an integer >= 0", self.warmup_steps)
        if self.decay_ratio is not None:
            check(0 < self.decay_ratio <= 1, "lr_scheduler.decay_ratio", "a number in (0, 1]", self.decay_ratio)
        check(0 <= self.min_lr_factor <= 1, "lr_scheduler.min_lr_factor", "a number in [0, 1]", self.min_lr_factor)


@dataclass
class TrainingConfig:
    batch_size: int = 8
    """Micro-batch size per rank (sequences)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step. Global batch = batch_size * this * data-parallel ranks."""
    seq_len: int = 2048
    steps: int = 1000
    """Optimizer steps."""
    max_norm: float = 1.0
    """Gradient clipping norm; 0 disables clipping (the norm is still logged)."""
    seed: int = 42
    """Seeds the initial weights and the data order. The weights are drawn on the training device: the same on any
    number of ranks, but a CPU run and a GPU run start from different ones (CPU and CUDA draw different random numbers;
    checkpoint.init_from gives both the same)."""
    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """Parameter dtype in forward/backward on GPU (FSDP MixedPrecisionPolicy). CPU always runs fp32."""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    compile: bool = False
    """torch.compile each block."""
    activation_checkpoint: Literal["none", "selective", "full"] = "none"
    """Per block: 'full' keeps only its input and reruns it in backward; 'selective' keeps the outputs of matmuls,
    attention and chunk kernels, and recomputes the rest (elementwise work, norms): flame/activation_checkpoint.py."""
    recompute: list[Literal["mlp_hidden", "low_rank", "chunk_tensors"]] = field(default_factory=list)
    """With activation_checkpoint = 'selective', parts recomputed in backward too, for less memory at some speed:
    'mlp_hidden' the MLP's hidden activations (one more matmul per input projection), 'low_rank' the wide outputs of
    RWKV's low-rank projections (one more thin matmul each), 'chunk_tensors' RWKV-7's chunk kernel's per-chunk tensors
    (it keeps its chunk states alone). Each one's cost: docs/configuration.md."""
    max_consecutive_skips: int = 10
    """Stop after this many optimizer steps in a row were skipped for a non-finite loss or gradient norm."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms (slower on GPU; CPU runs are deterministic anyway)."""

    def validate(self) -> None:
        for key in ("batch_size", "gradient_accumulation_steps", "seq_len", "steps", "max_consecutive_skips"):
            value = getattr(self, key)
            check(value >= 1, f"training.{key}", "an integer >= 1", value)
        check(self.max_norm >= 0, "training.max_norm", "a number >= 0", self.max_norm)
        check(not self.recompute or self.activation_checkpoint == "selective", "training.recompute",
              f"[] with activation_checkpoint = {self.activation_checkpoint!r} (it adds to 'selective')", self.recompute)
        check(len(set(self.recompute)) == len(self.recompute), "training.recompute", "each part named once",
              self.recompute)


@dataclass
class ParallelismConfig:
    dp_shard: int = -1
    """FSDP shard group size; -1 takes every rank not used by dp_replicate."""
    dp_replicate: int = 1
    """Replica groups (HSDP across nodes when > 1)."""
    context_parallel_degree: int = 1
    """Ranks that share each sequence (RWKV-7, GSA, RWKV-6): every row of a micro-batch is cut into this many
    contiguous pieces, one per rank, so a context too long for one GPU trains on several (docs/context_parallel.md).
    Processes = dp_replicate x dp_shard x this; the ranks of one group read the same rows, so the global batch is
    batch_size x accumulation x dp_replicate x dp_shard sequences; FSDP shards over dp_shard x this.
    training.seq_len must be a multiple of this x 64."""
    context_parallel_exchange: Literal["gather", "chain"] = "chain"
    """How the pieces of a row exchange what crosses their boundaries (docs/context_parallel.md). chain: rank r waits
    for rank r - 1's state of each layer and sends its own on, computing nothing twice (faster and leaner than the
    gather at cp 2 and 4, docs/benchmarks.md). gather: every rank computes its piece's transition beside its outputs
    and all-gathers states and tokens."""
    fsdp_wrap: Literal["auto", "blocks", "model"] = "auto"
    """FSDP's units. blocks: each block its own (its parameters gathered just before it runs, its gradients reduced
    as soon as they exist: communication overlaps the step); model: one unit, one all-gather before the forward and
    one reduce-scatter after the backward, with none of FSDP's per-block work on the host (about 5 ms a layer and
    step at 0.6B) and no per-layer collective holding the ranks in step (context parallelism's chain); costs the whole
    model's gathered bf16 parameters and unreduced fp32 gradients at once. auto: model with context parallelism
    (faster at cp 2 and 4 for RWKV-7 and GSA, docs/benchmarks.md), blocks without."""
    collective_timeout_sec: float = 600.0
    """Seconds every rank may take to reach a step or a collective; past it the job fails naming the ranks that did
    not arrive (a hung or lost rank), instead of torch's 30 minutes of silence."""

    def fsdp_units(self) -> str:
        """fsdp_wrap with "auto" resolved: "blocks" or "model"."""
        if self.fsdp_wrap != "auto":
            return self.fsdp_wrap
        return "model" if self.context_parallel_degree > 1 else "blocks"

    def validate(self) -> None:
        check(self.dp_shard == -1 or self.dp_shard >= 1, "parallelism.dp_shard", "-1 or an integer >= 1",
              self.dp_shard)
        check(self.dp_replicate >= 1, "parallelism.dp_replicate", "an integer >= 1", self.dp_replicate)
        check(self.context_parallel_degree >= 1, "parallelism.context_parallel_degree", "an integer >= 1",
              self.context_parallel_degree)
        check(self.collective_timeout_sec > 0, "parallelism.collective_timeout_sec", "a number of seconds > 0",
              self.collective_timeout_sec)


def resolve_dp_degrees(cfg: ParallelismConfig, world_size: int) -> tuple[int, int, int]:
    """(dp_replicate, dp_shard, cp) for this world size, or ConfigError; called before the process group exists."""
    replicate, cp = cfg.dp_replicate, cfg.context_parallel_degree
    shard = cfg.dp_shard if cfg.dp_shard != -1 else world_size // (replicate * cp)
    if replicate * shard * cp != world_size:
        if cp == 1:
            raise ConfigError("parallelism", f"dp_replicate * dp_shard = number of processes ({world_size})",
                              f"{replicate} * {shard}")
        raise ConfigError("parallelism", f"dp_replicate * dp_shard * context_parallel_degree = number of processes "
                          f"({world_size})", f"{replicate} * {'-1 (the rest)' if cfg.dp_shard == -1 else shard} * {cp}")
    return replicate, shard, cp


@dataclass
class CheckpointConfig:
    enable: bool = True
    folder: str = "checkpoint"
    """Inside the run folder."""
    interval: int = 500
    """Save every this many steps (and at the end)."""
    keep_latest_k: int = 3
    """Keep this many complete checkpoints; 0 keeps all."""
    load_step: int = -1
    """-1 resumes from the newest complete checkpoint; N from step N."""
    resume: Literal["auto", "never"] = "auto"
    """auto: a run folder that holds a complete checkpoint resumes from it ("resuming run X from step N"; never:
    "starting fresh"). The config may differ from the checkpoint's: changes are listed and applied (lr, schedule,
    steps, logging, intervals, validation, ...), except the model, the tokenizer and its boundary tokens, and, for
    text data under data_state = strict, what the saved data streams depend on (sequence length, batch size, seed,
    sources, workers): those stop with one line (flame/checkpoint.py FIXED_ON_RESUME, DATA_BOUND)."""
    async_mode: Literal["auto", "sync", "async"] = "auto"
    """auto: async on GPU (training blocks only to copy the state to CPU), sync on CPU."""
    init_from: str = ""
    """Weights a new run starts from (ignored on resume): a flame export or run folder, an RWKV-LM .pth or an FLA /
    Hugging Face folder (whatever `python -m flame.convert` reads); they must fit the configured model."""
    data_state: Literal["strict", "restart"] = "strict"
    """Resuming on another number of data-parallel ranks or data workers: strict stops with a message;
    restart starts the data streams over (documents already seen are seen again)."""

    def validate(self) -> None:
        check(self.interval >= 1, "checkpoint.interval", "an integer >= 1", self.interval)
        check(self.keep_latest_k >= 0, "checkpoint.keep_latest_k", "an integer >= 0", self.keep_latest_k)
        check(self.load_step >= -1, "checkpoint.load_step", "-1 or a step >= 0", self.load_step)


@dataclass
class MetricsConfig:
    log_freq: int = 10
    enable_wandb: bool = False
    wandb_project: str = "flame"
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    """auto: online when WANDB_API_KEY (or a netrc login) is set, offline otherwise."""
    peak_tflops: float = 0.0
    """Peak bf16 TFLOP/s of one device for MFU; 0 detects it from the GPU name (MFU is null on CPU)."""

    def validate(self) -> None:
        check(self.log_freq >= 1, "metrics.log_freq", "an integer >= 1", self.log_freq)
        check(self.peak_tflops >= 0, "metrics.peak_tflops", "a number >= 0", self.peak_tflops)


@dataclass
class ValidationConfig:
    enable: bool = False
    """Needs data.eval_sources."""
    freq: int = 500
    """Evaluate every this many steps."""
    steps: int = 20
    """Batches per evaluation."""

    def validate(self) -> None:
        check(self.freq >= 1, "validation.freq", "an integer >= 1", self.freq)
        check(self.steps >= 1, "validation.steps", "an integer >= 1", self.steps)


@dataclass
class ProfilingConfig:
    """Trace a few whole training steps with the PyTorch profiler (flame/profiling.py)."""

    enable: bool = False
    """Write {dump_folder}/profile/step-<first>-<last>-rank<R>.json.gz (Chrome trace) and .txt (where the time
    went: wall time, device busy and idle time, the top kernels and ops) on every rank."""
    start_step: int = 5
    """The first profiled optimizer step; the steps before it warm up (compilation, autotuning). A step this run
    never reaches (past training.steps, or at or before the step a resume starts from) profiles nothing."""
    steps: int = 1
    """Consecutive steps recorded (fewer if training ends or stops first)."""
    record_shapes: bool = False
    """Record each op's input shapes in the trace (a larger trace, slower to write)."""

    def validate(self) -> None:
        check(self.start_step >= 1, "profiling.start_step", "an integer >= 1", self.start_step)
        check(self.steps >= 1, "profiling.steps", "an integer >= 1", self.steps)


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate()
        if self.validation.enable:
            check(bool(self.data.eval_sources), "data.eval_sources", "at least one source when validation.enable")
        for part in self.training.recompute:
            models = RECOMPUTE_MODELS.get(part, (self.model.name,))
            check(self.model.name in models, "training.recompute",
                  f"no {part!r} with model.name = {self.model.name!r} (only {', '.join(models)})", self.training.recompute)
        cp = self.parallelism.context_parallel_degree
        if cp > 1:
            check(self.model.name in CONTEXT_PARALLEL_MODELS, "parallelism.context_parallel_degree",
                  f"1 with model.name = {self.model.name!r}: context parallelism needs a recurrent model "
                  f"({', '.join(CONTEXT_PARALLEL_MODELS)})", cp)
            multiple = cp * CHUNK_MULTIPLE
            check(self.training.seq_len % multiple == 0, "training.seq_len",
                  f"a multiple of {multiple} (context_parallel_degree {cp} x {multiple // cp}: every rank's piece "
                  "holds whole chunks)", self.training.seq_len)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------------------------ parsing
def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp)
        return f"a list of {_type_name(item)}"
    if dataclasses.is_dataclass(tp):
        return "a table"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
            type(None): "nothing (omit the key)", dict: "a table"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return `value` as type `tp`, or raise ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return _coerce(value, option, key)
            except ConfigError:
                continue
        raise ConfigError(key, _type_name(tp), value)
    if origin is Literal:
        if value in typing.get_args(tp) and not isinstance(value, bool):
            return value
        raise ConfigError(key, _type_name(tp), value)
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(key, _type_name(tp), value)
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(key, "a table", value)
        return build_dataclass(tp, value, key)
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(key, "nothing", value)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is dict or typing.get_origin(tp) is dict:
        if isinstance(value, dict):
            return value
    else:  # pragma: no cover - a field type this parser does not know is a programming error
        raise TypeError(f"unsupported config field type {tp} for {key}")
    raise ConfigError(key, _type_name(tp), value)


def build_dataclass(cls: type, raw: dict, prefix: str) -> Any:
    """Build dataclass `cls` from a TOML table; unknown keys are errors naming the valid ones."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if key not in names:
            raise ConfigError(dotted, "a known key (one of: " + ", ".join(names) + ")", value)
        kwargs[key] = _coerce(value, hints[key], dotted)
    missing = [f.name for f in dataclasses.fields(cls)
               if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               and f.name not in kwargs]
    if missing:
        raise ConfigError(f"{prefix}.{missing[0]}" if prefix else missing[0], "a value (this key is required)")
    return cls(**kwargs)


def _parse_override_value(text: str) -> Any:
    """TOML literal if it parses as one (numbers, booleans, lists, quoted strings), else the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """`--a.b=v` and `--a.b v` -> [("a.b", v)]."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(arg, "an override of the form --section.key=value")
        if "=" in arg:
            key, text = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ConfigError(arg[2:], "a value after the key")
            key, text = arg[2:], args[i + 1]
            i += 2
        if "." not in key:
            raise ConfigError(key, "section.key")
        out.append((key, _parse_override_value(text)))
    return out


def parse_config_args(argv: list[str]) -> tuple[str, list[str]]:
    """A command line `--config FILE [overrides]` (or --config=FILE, anywhere in it) -> (FILE, the overrides)."""
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise ConfigError("--config", "a TOML file after --config")
        return argv[i + 1], argv[:i] + argv[i + 2:]
    for i, a in enumerate(argv):
        if a.startswith("--config="):
            return a.split("=", 1)[1], argv[:i] + argv[i + 1:]
    raise ConfigError("--config", "--config FILE")


def _apply_override(raw: dict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = raw
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(key, f"a table at '{p}'")
    node[leaf] = value


def config_from_dict(raw: dict) -> Config:
    from flame.models import model_args_class  # the model's own Args dataclass, chosen by model.name

    raw = dict(raw)
    sections = {f.name: f for f in dataclasses.fields(Config)}
    for name in raw:
        if name not in sections:
            raise ConfigError(name, "a known section (one of: " + ", ".join(sections) + ")")
        if not isinstance(raw[name], dict):
            raise ConfigError(name, "a table", raw[name])
    model_raw = raw.get("model", {})
    name = model_raw.get("name", ModelArgs.name)
    args_cls = model_args_class(name)
    if args_cls is None:
        from flame.models import known_models
        raise ConfigError("model.name", "one of " + ", ".join(known_models()), name)
    kwargs = {}
    hints = typing.get_type_hints(Config)
    for section in sections:
        cls = args_cls if section == "model" else hints[section]
        kwargs[section] = build_dataclass(cls, raw.get(section, {}), section)
    cfg = Config(**kwargs)
    cfg.validate()
    return cfg


def config_from_toml(text: str) -> Config:
    return config_from_dict(tomllib.loads(text))


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read a TOML file, apply overrides, build and validate. Raises ConfigError naming the file."""
    path = str(path)
    try:
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError("--config", "an existing TOML file", path) from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError("(syntax)", f"valid TOML ({e})") from None
        for key, value in parse_overrides(overrides or []):
            _apply_override(raw, key, value)
        return config_from_dict(raw)
    except ConfigError as e:
        e.file = path
        e.args = (e.line(),)
        raise


# ------------------------------------------------------------------------------------------------------------ writing
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items() if x is not None) + " }"
    raise TypeError(type(v))


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML that load_config reads back to an equal Config (None values are omitted)."""
    lines = []
    for section, table in cfg.to_dict().items():
        lines.append(f"[{section}]")
        tables = []
        for key, value in table.items():
            if value is None:
                continue
            if isinstance(value, list) and value and all(isinstance(x, dict) for x in value):
                tables.append((key, value))
                continue
            lines.append(f"{key} = {_toml_value(value)}")
        for key, items in tables:
            for item in items:
                lines.append(f"\n[[{section}.{key}]]")
                lines.extend(f"{k} = {_toml_value(x)}" for k, x in item.items() if x is not None)
        lines.append("")
    return "\n".join(lines)

"""The settings model: the one typed schema of every parameter block, in pydantic.

``conf/base/parameters_*.yml`` holds the same values as the defaults here (a test keeps them equal),
Kedro validates each ``params:<block>`` against these models before any node runs, and the core
(``qerl.train``, ``qerl.rl``, ``qerl.noise`` ...) takes these models (or their sub-models) directly:
there is no second settings type and no translation layer. Usable without Kedro::

    from qerl.params import TrainParams
    settings = TrainParams(rl={"steps": 20, "lr": 5e-4})

Errors name the field and the fix: :func:`qerl.validation.validate_block` turns a pydantic
``ValidationError`` into one :class:`~qerl.errors.QerlConfigError` line (``qerl.rl.steps: ... Fix: ...``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from qerl.data.specs import SourceSpec
from qerl.errors import QerlConfigError
from qerl.noise.schedules import SCHEDULES
from qerl.quant.formats import QUANT_FORMATS
from qerl.rl.objective import IS_MODES as ROLLOUT_IS_MODES
from qerl.rl.objective import LOSS_TYPES

FORMATS = QUANT_FORMATS  # the one list of formats (qerl.quant.formats)
ALL_PROJECTIONS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# Literal types built from the one list of each kind of value (a tuple subscript = several arguments).
QuantFormat = Literal[QUANT_FORMATS]  # type: ignore[valid-type]
Schedule = Literal[SCHEDULES]  # type: ignore[valid-type]
LossType = Literal[LOSS_TYPES]  # type: ignore[valid-type]
RolloutIS = Literal[ROLLOUT_IS_MODES]  # type: ignore[valid-type]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class DataParams(_Strict):
    """Prompt sources and the split (``params:data``). Each source is one of ``qerl.data.specs``'
    models, chosen by its ``kind`` (reasoning_gym, file or hf); errors name ``data.sources[i].<field>``."""

    sources: list[SourceSpec] = Field(validate_default=True, default_factory=lambda: [
        {"kind": "reasoning_gym", "name": "chain_sum", "size": 2000, "seed": 17,
         "config": {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}}])
    template: str = "{question}\n"
    system_prompt: str | None = ""
    eval_size: int | None = 200
    eval_fraction: float | None = None
    seed: int = 0
    max_prompts: int | None = None
    max_prompt_chars: int | None = 2000


class TaskParams(_Strict):
    """The embedded task (``qerl.embedded.task.EmbeddedTask``). ``preset`` names an entry of
    ``embedded_tasks`` (conf/base/parameters_embedded_tasks.yml) whose values fill every field not
    set here (``qerl.embedded.presets.resolve_params``); ``trace_fraction`` of the warm-start answers
    show the ``trace`` style inside ``<think>`` (``qerl.embedded.traces``), the rest answer directly."""

    preset: str | None = None
    name: str = "chain_sum"
    config: dict[str, Any] = Field(
        default_factory=lambda: {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}
    )
    template: str = "{question}\n"
    trace: str = "column"
    trace_fraction: float = Field(0.3, ge=0, le=1)


class TinyModelParams(_Strict):
    """The embedded default model (``qerl.modeling.tiny``) and its supervised warm start
    (``qerl.embedded``). ``spec`` / ``sft`` / ``band`` override fields of ``TinyModelSpec`` /
    ``SFTConfig`` / ``Band`` (the validation accuracy band the warm start must end in:
    ``low``, ``high``, ``on_miss: warn | error``)."""

    task: TaskParams = TaskParams()
    spec: dict[str, Any] = Field(default_factory=dict)
    sft: dict[str, Any] = Field(default_factory=dict)
    band: dict[str, Any] = Field(default_factory=dict)
    sft_size: int = Field(4000, ge=1)
    val_size: int = Field(200, ge=0)  # validation split for SFT early stopping (never the eval prompts)
    sft_seed: int = 1
    tokenizer_vocab_size: int = Field(384, ge=258)
    eval_max_new_tokens: int = Field(32, ge=1)
    correctness: dict[str, Any] = Field(default_factory=lambda: {"name": "reasoning_gym"})


class ModelParams(_Strict):
    """The base model: a local Hugging Face causal-LM directory."""

    path: str = "data/06_models/embedded_model"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"


class QuantParams(_Strict):
    """The frozen base's format. ``backend`` picks the CUDA FP4 matmul (``auto``: the fastest
    available; see ``qerl.kernels``)."""

    format: QuantFormat = "nvfp4"
    backend: Literal["auto", "humming", "triton", "torch"] = "auto"
    bnb_double_quant: bool = True
    on_indivisible: Literal["skip", "error"] = "skip"
    skip_modules: tuple[str, ...] = ("lm_head",)


class LoraParams(_Strict):
    """LoRA through peft. ``preset: paper`` is the QeRL paper's r=32, alpha=64 on all seven
    projections (it overrides r, alpha, dropout and target_modules)."""

    preset: Literal["paper"] | None = None
    r: int = Field(16, ge=1)
    alpha: float = Field(32, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: tuple[str, ...] = Field(ALL_PROJECTIONS, min_length=1)
    bias: Literal["none", "all", "lora_only"] = "none"

    @model_validator(mode="before")
    @classmethod
    def _expand_preset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = dict(data)
            if data.get("preset") == "default":
                data["preset"] = None
            if data.get("preset") == "paper":
                data.update(r=32, alpha=64, dropout=0.0, target_modules=ALL_PROJECTIONS)
        return data


class RolloutParams(_Strict):
    """Sampling of the G completions per prompt (``engine: auto`` = the fast engine on CUDA, the
    transformers one on CPU). ``kv_budget_gib``: run the batch in waves when its KV cache would
    exceed this (fast engine; ``null`` = whatever fits). ``single_weight_copy``: the fast engine
    holds the 4-bit weights once on the GPU -- humming's prepared copy only during a rollout, the
    trainer's parked in host memory meanwhile (``qerl.rollout.fast.residency``; for 32B and larger
    on one GPU)."""

    engine: Literal["auto", "hf", "fast"] = "auto"
    group_size: int = Field(8, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(32, ge=1)
    max_prompt_tokens: int = Field(64, ge=1)
    overlong_prompt: Literal["truncate", "drop"] = "truncate"
    kv_budget_gib: float | None = Field(None, gt=0)
    single_weight_copy: bool = False


class RewardFnParams(_Strict):
    name: str
    weight: float = 1.0
    kwargs: dict[str, Any] = Field(default_factory=dict)


class RewardParams(_Strict):
    functions: tuple[RewardFnParams, ...] = (
        RewardFnParams(name="reasoning_gym", weight=2.0),
        RewardFnParams(name="format", weight=1.0, kwargs={"reward": 0.2}),
    )
    on_error: Literal["raise", "zero"] = "raise"

    @model_validator(mode="after")
    def _buildable(self) -> RewardParams:
        """Every function exists and accepts its kwargs (built once, thrown away)."""
        from qerl.rewards.base import build_rewards

        try:
            build_rewards(self.specs(), "functions")
        except QerlConfigError as err:
            raise ValueError(f"@{err.field}: {err.problem}; fix: {err.fix}") from None
        return self

    def specs(self) -> list[dict[str, Any]]:
        """The reward functions as plain dicts (what ``qerl.rewards.build_rewards`` takes)."""
        return [f.model_dump() for f in self.functions]


class RLParams(_Strict):
    """The RL update. The loss terms are named as in the papers (see ``qerl.rl.objective``).

    ``minibatches``: optimizer steps per generation batch (TRL's steps_per_generation);
    ``micro_batch_tokens``: gradient accumulation inside each (``null``: one pass; ``auto``: sized
    from the free accelerator memory, or from ``memory_budget_gib`` when set); the accumulated
    gradient equals one pass over the union.
    ``old_logprobs``: the PPO ratio's denominator, the rollout engine's log-probs (``rollout``) or a
    no-grad trainer forward on the clean policy (``recompute``); ``rollout_is`` corrects the
    rollout/trainer mismatch with a truncated (or masked) importance weight capped at
    ``rollout_is_cap`` (TRL's modes).
    """

    run_name: str = Field("embedded", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    steps: int = Field(100, ge=1)
    prompts_per_step: int = Field(16, ge=1)
    loss_type: LossType = "dapo"
    eps_low: float = Field(0.2, ge=0, lt=1)
    eps_high: float = Field(0.28, ge=0)
    beta: float = Field(0.0, ge=0)
    track_kl: bool = True
    scale_by_std: bool = True
    dynamic_sampling: bool = False
    epochs: int = Field(1, ge=1)
    minibatches: int = Field(1, ge=1)
    micro_batch_tokens: int | Literal["auto"] | None = None
    memory_budget_gib: float | None = Field(None, gt=0)
    old_logprobs: Literal["rollout", "recompute"] = "recompute"
    rollout_is: RolloutIS = "token_truncate"
    rollout_is_cap: float = Field(3.0, gt=1)
    entropy_coef: float = Field(0.0, ge=0)
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_ratio: float = Field(0.0, ge=0, lt=1)
    lr_schedule: Literal["cosine", "constant"] = "constant"
    max_grad_norm: float = Field(1.0, gt=0)
    optimizer: Literal["adamw", "adamw8bit"] = "adamw"
    gradient_checkpointing: bool = False
    logprob_chunk_tokens: int = Field(1024, ge=1)
    max_bad_steps: int = Field(3, ge=1)
    save_every: int = Field(10, ge=1)
    adapter_every: int = Field(1, ge=1)
    resume: Literal["auto", "never"] = "auto"
    seed: int = 0

    @field_validator("micro_batch_tokens")
    @classmethod
    def _positive_tokens(cls, v: int | str | None) -> int | str | None:
        if isinstance(v, int) and v < 1:
            raise ValueError("must be >= 1, 'auto' or null")
        return v


class ControllerParams(_Strict):
    """The entropy-feedback controller (``noise.schedule: entropy_feedback``): sigma is multiplied by
    ``up`` while the moving average of the rollout entropy keeps improving, by ``down`` otherwise."""

    sigma_min: float = Field(1e-4, gt=0)
    sigma_max: float = Field(2e-2, gt=0)
    up: float = Field(1.2, gt=1)
    down: float = Field(0.9, gt=0, lt=1)
    window: int = Field(10, ge=1)
    tolerance: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _bounds(self) -> ControllerParams:
        if self.sigma_max < self.sigma_min:
            raise ValueError(f"sigma_max {self.sigma_max} is below sigma_min {self.sigma_min}")
        return self


class NoiseParams(_Strict):
    """AQN on the rollout policy's RMSNorm weights (see ``qerl.noise.schedules``)."""

    enabled: bool = True
    schedule: Schedule = "exponential"
    sigma_start: float = Field(1e-2, ge=0)
    sigma_end: float = Field(5e-4, ge=0)
    stages: int = Field(10, ge=2)
    controller: ControllerParams = ControllerParams()

    @model_validator(mode="after")
    def _geometric(self) -> NoiseParams:
        if self.schedule == "exponential" and self.sigma_start != self.sigma_end and min(self.sigma_start, self.sigma_end) <= 0:
            raise ValueError("sigma_start and sigma_end must be > 0 for the exponential schedule "
                             "(use a small value such as 1e-4, or schedule 'linear')")
        return self


class ReportParams(_Strict):
    """The noise report: KL(full precision || quantized) and entropies on a fixed probe set."""

    probe_size: int = Field(32, ge=1)
    formats: tuple[QuantFormat, ...] = FORMATS
    max_new_tokens: int = Field(32, ge=1)


class EvalParams(_Strict):
    """Held-out evaluation: a completion is correct when ``correctness`` (a reward function,
    unweighted) reaches ``threshold``."""

    k: int = Field(8, ge=1)
    temperature: float = Field(1.0, gt=0)
    max_new_tokens: int = Field(32, ge=1)
    max_prompts: int | None = Field(None, ge=1)
    correctness: dict[str, Any] = Field(default_factory=lambda: {"name": "reasoning_gym"})
    threshold: float = 1.0
    seed: int = 1234


class TrainParams(_Strict):
    """Everything ``qerl_train`` needs, as one validated block (``params:qerl``)."""

    model: ModelParams = ModelParams()
    quant: QuantParams = QuantParams()
    lora: LoraParams = LoraParams()
    rollout: RolloutParams = RolloutParams()
    rewards: RewardParams = RewardParams()
    rl: RLParams = RLParams()
    noise: NoiseParams = NoiseParams()
    report: ReportParams = ReportParams()
    eval: EvalParams = EvalParams()

    @model_validator(mode="after")
    def _cross_checks(self) -> TrainParams:
        if self.rollout.group_size < 2 and self.rl.loss_type != "pg_entropy":
            raise ValueError(f"@rollout.group_size: must be >= 2 for group-normalised advantages (loss_type "
                             f"{self.rl.loss_type!r}); fix: raise it or use rl.loss_type=pg_entropy")
        n = self.rl.prompts_per_step * self.rollout.group_size
        if n % self.rl.minibatches:
            raise ValueError(f"@rl.minibatches: {self.rl.minibatches} does not divide prompts_per_step x group_size = "
                             f"{n}; fix: choose a divisor of {n}")
        if self.rl.rollout_is != "none" and self.rl.old_logprobs != "recompute":
            raise ValueError(f"@rl.rollout_is: {self.rl.rollout_is} needs rl.old_logprobs=recompute (with the rollout's "
                             "own log-probs as the old policy the weight is always 1); fix: set rl.old_logprobs: "
                             "recompute or rl.rollout_is: none")
        return self

    def with_updates(self, **blocks: dict[str, Any]) -> TrainParams:
        """A validated copy with some fields of some blocks changed, e.g.
        ``p.with_updates(rl={"seed": 1}, quant={"format": "mxfp4"})``."""
        raw = self.model_dump()
        for block, fields in blocks.items():
            raw[block].update(fields)
        return TrainParams(**raw)


class VariantParams(_Strict):
    """One arm of the quantization study: a format, a noise schedule, a learning-rate multiplier,
    and optionally static Gaussian weight noise matched to a 4-bit format's error."""

    name: str
    format: QuantFormat = "nvfp4"
    noise: Schedule = "none"
    lr_scale: float = Field(1.0, gt=0)
    param_noise: Literal["nvfp4", "mxfp4"] | None = None
    rl: dict[str, Any] = Field(default_factory=dict)  # any other rl.* overrides of this arm


class StudyParams(_Strict):
    """The quantization study (``params:quant_study``): every variant x seed, same task and budget."""

    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int | None = Field(40, ge=1)  # null: each run keeps qerl.rl.steps
    reward_threshold: float = 1.0
    probe_size: int = Field(16, ge=1)
    eval_max_prompts: int | None = 100
    eval_k: int = Field(4, ge=1)
    variants: tuple[VariantParams, ...] = ()

    @model_validator(mode="after")
    def _unique_names(self) -> StudyParams:
        names = [v.name for v in self.variants]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"variant names must be unique, repeated: {dup}")
        return self


class ReplayParams(_Strict):
    """Single-node reruns (``kedro run --nodes=rl_loop.generate_rollouts``): which step of the
    configured run to replay (``null``: its last step)."""

    step: int | None = Field(None, ge=1)


__all__ = [
    "DataParams", "EvalParams", "LoraParams", "ModelParams", "NoiseParams", "QuantParams", "RLParams",
    "ReplayParams", "ReportParams", "RewardParams", "RolloutParams", "StudyParams", "TaskParams", "TinyModelParams",
    "TrainParams", "VariantParams",
]

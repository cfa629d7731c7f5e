"""Typed parameters. Kedro validates every ``params:`` block against these models before any node
runs (a node argument annotated with a pydantic model is converted by the Kedro context), so a typo
or a bad value fails fast with the field's name, before a model is loaded.

The core library has its own small dataclasses (``ObjectiveConfig``, ``NoiseConfig``,
``LoraSettings`` ...); the ``to_*`` methods below translate, so the core never depends on pydantic
or Kedro.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

FORMATS = ("none", "nf4", "fp4", "nvfp4", "mxfp4")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DataParams(_Strict):
    """Prompt sources and the split. Each source is validated by ``qerl.data.sources`` (its
    ``kind``: reasoning_gym, file or hf), which names ``data.sources[i].<field>`` in errors."""

    sources: list[dict[str, Any]]
    template: str = "plain"
    system_prompt: str | None = None
    eval_size: int | None = 100
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
    path: str = "data/06_models/embedded_model"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"


class QuantParams(_Strict):
    format: str = "nvfp4"
    bnb_double_quant: bool = True
    on_indivisible: Literal["skip", "error"] = "skip"
    skip_modules: list[str] = Field(default_factory=lambda: ["lm_head"])

    @field_validator("format")
    @classmethod
    def _known_format(cls, v: str) -> str:
        if v not in FORMATS:
            raise ValueError(f"unknown quant.format {v!r}; use one of {', '.join(FORMATS)}")
        return v


class LoraParams(_Strict):
    preset: Literal["default", "paper"] | None = None
    r: int = 16
    alpha: float = 32
    dropout: float = 0.0
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


class RolloutParams(_Strict):
    engine: Literal["auto", "hf", "fast"] = "auto"
    group_size: int = Field(8, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(32, ge=1)
    max_prompt_tokens: int = Field(256, ge=1)
    overlong_prompt: Literal["truncate", "drop"] = "truncate"


class RewardFnParams(_Strict):
    name: str
    weight: float = 1.0
    kwargs: dict[str, Any] = Field(default_factory=dict)


class RewardParams(_Strict):
    functions: list[RewardFnParams]
    on_error: Literal["raise", "zero"] = "raise"


class RLParams(_Strict):
    run_name: str = "embedded"
    steps: int = Field(60, ge=1)
    prompts_per_step: int = Field(16, ge=1)
    loss_type: str = "dapo"
    eps_low: float = 0.2
    eps_high: float = 0.28
    beta: float = 0.0
    track_kl: bool = True
    scale_by_std: bool = True
    dynamic_sampling: bool = False
    epochs: int = Field(1, ge=1)
    minibatches: int = Field(1, ge=1)
    entropy_coef: float = 0.0
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = 0.0
    warmup_ratio: float = Field(0.1, ge=0, lt=1)
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    max_grad_norm: float = Field(0.2, gt=0)
    optimizer: Literal["adamw", "adamw8bit"] = "adamw"
    gradient_checkpointing: bool = False
    max_bad_steps: int = Field(3, ge=1)
    save_every: int = Field(10, ge=1)
    resume: Literal["auto", "never"] = "auto"
    seed: int = 0


class NoiseParams(_Strict):
    enabled: bool = True
    schedule: str = "exponential"
    sigma_start: float = 1e-2
    sigma_end: float = 5e-4
    stages: int = 10
    controller: dict[str, Any] = Field(default_factory=dict)


class ReportParams(_Strict):
    probe_size: int = 16
    formats: list[str] = Field(default_factory=lambda: ["nvfp4"])
    max_new_tokens: int = 32

    @field_validator("formats")
    @classmethod
    def _known_formats(cls, v: list[str]) -> list[str]:
        bad = [f for f in v if f not in FORMATS]
        if bad:
            raise ValueError(f"unknown report.formats {bad}; use a subset of {', '.join(FORMATS)}")
        return v


class EvalParams(_Strict):
    """Held-out evaluation: a completion is correct when ``correctness`` (a reward function,
    unweighted) reaches ``threshold``."""

    k: int = Field(8, ge=1)
    temperature: float = Field(1.0, gt=0)
    max_new_tokens: int = Field(32, ge=1)
    max_prompts: int | None = None
    correctness: dict[str, Any] = Field(default_factory=lambda: {"name": "reasoning_gym"})
    threshold: float = 1.0
    seed: int = 1234


class TrainParams(_Strict):
    """Everything ``qerl_train`` needs, as one validated block (``params:qerl``)."""

    model: ModelParams = ModelParams()
    quant: QuantParams = QuantParams()
    lora: LoraParams = LoraParams()
    rollout: RolloutParams = RolloutParams()
    rewards: RewardParams
    rl: RLParams = RLParams()
    noise: NoiseParams = NoiseParams()
    report: ReportParams = ReportParams()
    eval: EvalParams = EvalParams()

    @model_validator(mode="after")
    def _cross_checks(self) -> TrainParams:
        if self.rollout.group_size < 2 and self.rl.loss_type != "pg_entropy":
            raise ValueError(
                "rollout.group_size must be >= 2 for group-normalised advantages "
                f"(loss_type {self.rl.loss_type!r}); raise it or use rl.loss_type=pg_entropy"
            )
        n = self.rl.prompts_per_step * self.rollout.group_size
        if n % self.rl.minibatches:
            raise ValueError(
                f"rl.minibatches={self.rl.minibatches} must divide prompts_per_step*group_size={n}"
            )
        return self

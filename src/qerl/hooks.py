"""Project hooks: every parameter validated before anything is built, leftovers of killed writes
cleaned, and quiet, deterministic, offline runs."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

from kedro.framework.hooks import hook_impl

log = logging.getLogger(__name__)

#: Loggers that flood the console at INFO (one line per node, dataset and weight file; MLflow's store
#: migrations and kedro-mlflow's set-up lines: qerl.tracking says in one line where the run goes).
QUIET = ("kedro.io.data_catalog", "kedro.runner", "kedro.pipeline.node", "kedro.framework.session.session",
         "kedro.io.core", "kedro.runner.sequential_runner", "transformers", "accelerate", "huggingface_hub",
         "kedro_mlflow", "mlflow", "alembic")

#: Warnings known to be harmless, by message: bitsandbytes' offline probe of an optional hub kernel,
#: OmegaConf resolver re-registration, Kedro's --pipeline deprecation, transformers' and peft's
#: deprecation notes, bitsandbytes' CPU fallbacks. (mlflow's note on kedro-mlflow's model class is
#: dropped by qerl.tracking: mlflow's own filter overrides these.)
HARMLESS_WARNINGS = (".*kernels-community.*", ".*register_new_resolver.*", ".*--pipeline.*deprecated.*",
                     ".*torch_dtype.*is deprecated.*", ".*gemv_4bit.*", ".*MatMul8bitLt.*",
                     ".*is_gradient_checkpointing.*deprecated.*")


class QerlHooks:
    """Parameter validation, crash recovery, thread count and known-harmless warnings."""

    @hook_impl
    def after_context_created(self, context: Any) -> None:
        from qerl.atomic import recover
        from qerl.train.distributed import is_main
        from qerl.validation import validate_all

        blocks = validate_all(dict(context.config_loader["parameters"]))  # one clear line on the first bad value
        if "qerl" in blocks:
            from qerl.kernels import resolve_backend

            resolve_backend(blocks["qerl"].quant.backend)  # an unavailable backend is refused up front
        if is_main():  # under torchrun only rank 0 touches data/
            recover(Path(context.project_path) / "data")
        threads = os.environ.get("QERL_NUM_THREADS")
        if threads:
            import torch

            torch.set_num_threads(int(threads))
        quiet_libraries()


#: Kedro's per-node progress lines. The runner logs them under its own module's name, which for
#: qerl.runner.LoopRunner is a qerl logger (INFO); they are dropped there, its own lines are kept.
KEDRO_PROGRESS = ("Completed node:", "Completed %d out of %d tasks", "Using synchronous mode")
RUNNER_LOGGER = "qerl.runner"


class KedroProgressFilter(logging.Filter):
    """Drops the :data:`KEDRO_PROGRESS` records (one or two per node: hundreds in a long run)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(KEDRO_PROGRESS))


def quiet_warnings() -> None:
    """Ignore the :data:`HARMLESS_WARNINGS` (``settings.py`` calls this first: plugins warn on import)."""
    for pattern in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)


def quiet_libraries() -> None:
    """Silence progress bars and warnings known to be harmless; Kedro's per-node lines are dropped."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
    runner = logging.getLogger(RUNNER_LOGGER)
    if not any(isinstance(f, KedroProgressFilter) for f in runner.filters):
        runner.addFilter(KedroProgressFilter())
    quiet_warnings()
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass

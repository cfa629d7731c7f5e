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

#: Loggers that flood the console at INFO (one line per node, dataset and weight file).
QUIET = ("kedro.io.data_catalog", "kedro.runner", "kedro.pipeline.node", "kedro.framework.session.session",
         "kedro.io.core", "kedro.runner.sequential_runner", "transformers", "accelerate", "huggingface_hub")


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


def quiet_libraries() -> None:
    """Silence progress bars and warnings known to be harmless; Kedro's per-node lines go to DEBUG."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
    # bitsandbytes tries to fetch an optional CPU kernel from the hub; offline it warns. Harmless.
    for pattern in (".*kernels-community.*", ".*register_new_resolver.*", ".*--pipeline.*deprecated.*",
                    ".*torch_dtype.*is deprecated.*", ".*gemv_4bit.*", ".*MatMul8bitLt.*",
                    ".*is_gradient_checkpointing.*deprecated.*"):
        warnings.filterwarnings("ignore", message=pattern)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass

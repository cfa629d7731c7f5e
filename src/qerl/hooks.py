"""Project hooks: quiet, deterministic, offline runs."""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

from kedro.framework.hooks import hook_impl

log = logging.getLogger(__name__)


class QerlHooks:
    """Thread count from ``QERL_NUM_THREADS`` and silenced known-harmless warnings."""

    @hook_impl
    def after_context_created(self, context: Any) -> None:
        import torch

        from qerl.pipelines import registry_params

        registry_params.remember(context.config_loader)

        threads = os.environ.get("QERL_NUM_THREADS")
        if threads:
            torch.set_num_threads(int(threads))
        # bitsandbytes tries to fetch an optional CPU kernel from the hub; offline it warns. Harmless.
        warnings.filterwarnings("ignore", message=".*kernels-community.*")
        warnings.filterwarnings("ignore", message=".*register_new_resolver.*")

"""Kedro project settings."""

from __future__ import annotations

import os

# No network, ever: no telemetry, no hub look-ups (a user can still override in their shell).
for _var in ("KEDRO_DISABLE_TELEMETRY", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")

from qerl.hooks import QerlHooks, quiet_warnings  # noqa: E402

quiet_warnings()  # before any plugin is imported (kedro-mlflow warns on import)

from qerl.config_loader import QerlConfigLoader  # noqa: E402
from qerl.runner import QerlSession  # noqa: E402
from qerl.tracking import PLUGIN_DISTS, tracking_hooks  # noqa: E402

# MLflow tracking (the `mlflow` extra; QERL_TRACKING=off turns it off): kedro-mlflow's own hook is
# replaced by qerl.tracking's wrapper of it, which logs flattened settings, per-step metrics and the
# run's artifacts (see that module). Without the extra, or switched off, it is not registered at all.
HOOKS = (QerlHooks(), *tracking_hooks())
DISABLE_HOOKS_FOR_PLUGINS = PLUGIN_DISTS

# `kedro run` uses qerl.runner.LoopRunner (it repeats the rl_loop namespace of qerl_train).
SESSION_CLASS = QerlSession

# OmegaConfigLoader + the embedded task preset (embedded_model.task.preset sets the data and qerl defaults).
CONFIG_LOADER_CLASS = QerlConfigLoader

# "soft": an env (local, gpu_paper, ...) overrides single nested keys instead of whole blocks.
CONFIG_LOADER_ARGS = {
    "base_env": "base",
    "default_run_env": "local",
    "merge_strategy": {"parameters": "soft", "catalog": "soft"},
}

"""Parameters that shape a pipeline (the number of unrolled RL steps, the study's variants) must be
known when Kedro builds the pipelines, which happens before nodes receive ``params:``.

The project hook ``after_context_created`` hands the run's config loader to :func:`remember`
(it already holds the run's env and ``--params``); pipelines read values with :func:`lookup`.
Without a context (e.g. ``kedro registry list``) the conf files are read directly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

_PARAMS: dict[str, Any] | None = None


def remember(config_loader: Any) -> None:
    """Keep the run's parameters (env + runtime ``--params`` applied)."""
    global _PARAMS
    try:
        _PARAMS = dict(config_loader["parameters"])
    except (KeyError, TypeError, ValueError):
        _PARAMS = None


def _from_conf(project_path: Path | None) -> dict[str, Any]:
    from kedro.config import OmegaConfigLoader

    from qerl.settings import CONFIG_LOADER_ARGS

    conf = Path(project_path or Path.cwd()) / "conf"
    if not conf.exists():
        return {}
    loader = OmegaConfigLoader(
        str(conf), base_env="base", default_run_env=os.environ.get("KEDRO_ENV", "local"),
        merge_strategy=CONFIG_LOADER_ARGS["merge_strategy"],
    )
    try:
        return dict(loader["parameters"])
    except (KeyError, ValueError):
        return {}


def lookup(path: str, default: Any, project_path: Path | None = None) -> Any:
    """The parameter at dotted ``path`` (e.g. ``qerl.rl.steps``), or ``default``."""
    node: Any = _PARAMS if _PARAMS is not None else _from_conf(project_path)
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node

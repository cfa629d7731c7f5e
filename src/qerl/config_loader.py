"""The project's config loader: Kedro's ``OmegaConfigLoader`` plus the embedded task preset.

``embedded_model.task.preset`` (``conf/base/parameters_embedded_tasks.yml``) picks the task; the
preset's ``data`` and ``qerl`` parts then become the defaults of the ``data`` and ``qerl`` blocks,
under every value the user set (in an env, ``conf/local`` or ``--params``: anything that differs
from ``conf/base``), so one parameter switches the prompts, the warm start and the RL settings
together (:func:`qerl.embedded.presets.apply_preset`).
"""

from __future__ import annotations

from typing import Any

from kedro.config import OmegaConfigLoader


class QerlConfigLoader(OmegaConfigLoader):
    """``OmegaConfigLoader`` whose ``parameters`` have the selected task preset applied."""

    def __getitem__(self, key: str) -> Any:
        value = super().__getitem__(key)
        if key != "parameters":
            return value
        from qerl.embedded.presets import apply_preset

        base = OmegaConfigLoader(conf_source=self.conf_source, base_env=self.base_env, default_run_env=self.base_env,
                                 merge_strategy=self.merge_strategy)["parameters"]
        return apply_preset(dict(value), dict(base))

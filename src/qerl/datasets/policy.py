"""The live policy as a catalog entry.

Within one run the policy stays resident: ``save`` keeps the object and every ``load`` returns
that same object (no copy, no reload between steps). ``save`` also persists what another process
needs to rebuild it (``qerl.train.policy.save_policy``), so a node that needs the policy can be
rerun alone (``kedro run --nodes=...``): there ``load`` rebuilds it from disk.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

from kedro.io.core import AbstractDataset, DatasetError

from qerl.errors import QerlConfigError


class PolicyDataset(AbstractDataset[Any, Any]):
    """Resident policy + on-disk spec/quantized base under ``path``."""

    def __init__(self, *, path: str, persist: bool = True, metadata: dict[str, Any] | None = None) -> None:
        self._path = PurePosixPath(path)
        self._persist = persist
        self._policy: Any = None
        self.metadata = metadata

    def load(self) -> Any:
        if self._policy is not None:
            return self._policy
        from qerl.train.policy import load_policy

        try:
            self._policy = load_policy(Path(self._path))
        except QerlConfigError as err:
            raise DatasetError(
                f"no policy at {self._path}: it is written by the setup_quantized_policy node of "
                "`kedro run --pipelines=qerl_train`; run that first"
            ) from err
        return self._policy

    def save(self, data: Any) -> None:
        self._policy = data
        if self._persist:
            from qerl.train.policy import save_policy

            save_policy(data, Path(self._path))

    def release(self) -> None:
        self._policy = None

    def _exists(self) -> bool:
        from qerl.train.policy import SPEC_FILE

        return self._policy is not None or (Path(self._path) / SPEC_FILE).exists()

    def _describe(self) -> dict[str, Any]:
        return {"path": str(self._path), "persist": self._persist, "resident": self._policy is not None}

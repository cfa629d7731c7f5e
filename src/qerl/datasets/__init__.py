"""Custom Kedro datasets: the live policy, the training state hand-off and skippable step tables."""

from qerl.datasets.hf_model import HFModelDataset
from qerl.datasets.policy import PolicyDataset
from qerl.datasets.step_table import SKIPPED, StepTableDataset, is_skipped
from qerl.datasets.train_state import TrainStateDataset

__all__ = ["SKIPPED", "HFModelDataset", "PolicyDataset", "StepTableDataset", "TrainStateDataset", "is_skipped"]

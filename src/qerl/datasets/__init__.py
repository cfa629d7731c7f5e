"""Custom Kedro datasets: the live policy, the checkpoint root and training-state hand-off, per-step
tables, atomic versioned tables and plots, and HF model directories."""

from qerl.datasets.checkpoints import CheckpointStoreDataset, ReplayHandle, TrainStateDataset
from qerl.datasets.hf_model import HFModelDataset
from qerl.datasets.policy import PolicyDataset
from qerl.datasets.step_tables import StepTablesDataset
from qerl.datasets.tables import CSVTable, FiguresDataset, ParquetTable

__all__ = [
    "CSVTable", "CheckpointStoreDataset", "FiguresDataset", "HFModelDataset", "ParquetTable", "PolicyDataset",
    "ReplayHandle", "StepTablesDataset", "TrainStateDataset",
]

"""toolgym.trainers: Episodes in, policy updates out (losses, FSDP2 trainer, checkpoints, weight sync).

The trainer never computes rewards or advantages; rollouts/ puts them in the Episodes.
"""

from .checkpoint import CheckpointManager, export_hf
from .config import CheckpointConfig, OptimizerConfig, TrainerConfig
from .losses import LossConfig, LossNormaliser, combine_metrics, finish_metrics, policy_loss, register_loss
from .trainer import Trainer
from .weight_sync import gather_weights, push_weights

__all__ = [
    "CheckpointConfig",
    "CheckpointManager",
    "LossConfig",
    "LossNormaliser",
    "OptimizerConfig",
    "Trainer",
    "TrainerConfig",
    "combine_metrics",
    "export_hf",
    "finish_metrics",
    "gather_weights",
    "policy_loss",
    "push_weights",
    "register_loss",
]

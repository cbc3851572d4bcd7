"""Training (tools/train.py): timm-style arguments and configs, checkpoints, resumable data order, the run."""
from .args import ConfigError, build_parser, config_keys, load_config, parse_args, validate_config
from .checkpoint import CheckpointKeeper, CheckpointWriteError, load_checkpoint, save_atomic
from .engine import NonFiniteLossError, TrainSetupError, all_reduce_grc_caches, epoch_label, run

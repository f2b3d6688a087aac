"""fsdpx_sync: receive fsdpx weight versions in Python (vLLM, SGLang, transformers rollouts), from the
synchronizer server or by following a checkpoint root."""

from .checkpoint import CheckpointWatcher
from .client import SyncClient, WeightVersion
from .checksum import crc32c
from .errors import SyncError

__all__ = ["SyncClient", "CheckpointWatcher", "WeightVersion", "SyncError", "crc32c"]
__version__ = "0.1.0"

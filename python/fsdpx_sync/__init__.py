"""fsdpx_sync: receive fsdpx weight versions in Python (vLLM, SGLang, transformers rollouts)."""

from .client import SyncClient, WeightVersion
from .checksum import crc32c
from .errors import SyncError

__all__ = ["SyncClient", "WeightVersion", "SyncError", "crc32c"]
__version__ = "0.1.0"

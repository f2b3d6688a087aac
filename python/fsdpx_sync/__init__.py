"""fsdpx_sync: receive fsdpx weight versions in Python (vLLM, SGLang, transformers rollouts), from the
synchronizer server or by following a checkpoint root; full or as deltas, each proven by its manifest."""

from .checkpoint import CheckpointWatcher
from .checksum import crc32c, tensor_crc32c
from .client import SyncClient, WeightVersion
from .delta import MANIFEST_NAME, EncodedVersion, Manifest, ManifestEntry, VersionStore, full_manifest, verify
from .engines import FlattenedTensorMetadata, flatten_buckets, unflatten_bucket
from .errors import SyncError

__all__ = ["SyncClient", "CheckpointWatcher", "WeightVersion", "SyncError", "crc32c", "tensor_crc32c", "Manifest",
           "ManifestEntry", "VersionStore", "EncodedVersion", "full_manifest", "verify", "MANIFEST_NAME",
           "FlattenedTensorMetadata", "flatten_buckets", "unflatten_bucket"]
__version__ = "0.2.0"

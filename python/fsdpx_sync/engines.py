"""What rollout engines take (neither engine is a dependency; tested against transformers models with
small fakes of their loading API, not against the engines themselves):

- vLLM: ``model.load_weights(weights: Iterable[Tuple[str, Tensor]])`` on each worker: plain pairs
  (``WeightVersion.for_vllm``).
- SGLang: ``update_weights_from_tensor(named_tensors, load_format=None | "flattened_bucket")``; with
  "flattened_bucket", one bucket per call: ``{"flattened_tensor": 1-D tensor, "metadata": [
  FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel), ...]}``, which SGLang turns
  back into tensors with ``flattened_tensor[start_idx:end_idx]`` reshaped to ``shape``
  (``WeightVersion.for_sglang``, ``flatten_buckets``, ``unflatten_bucket``).

SGLang's own ``FlattenedTensorBucket`` has two layouts: older releases concatenate the tensors of one
dtype in that dtype (indices in elements); newer ones (``supports_multi_dtypes``) concatenate the bytes
of any dtypes (indices in bytes, each slice viewed as its dtype). Buckets here are of one dtype, in
that dtype, indices in elements: both releases rebuild them the same way (a slice of a tensor of its own
dtype viewed as that dtype is itself). ``unflatten_bucket`` reads both layouts.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any, Callable, NamedTuple

import torch


class FlattenedTensorMetadata(NamedTuple):
    """SGLang's FlattenedTensorMetadata, field for field (attribute access, as SGLang reads it)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def _metadata_class() -> Callable[..., Any]:
    """SGLang's own class where SGLang is installed (its unpickler in the engine admits only its own
    and torch's classes), else this package's equivalent."""
    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata as theirs

        return theirs  # type: ignore[no-any-return]
    except Exception:
        return FlattenedTensorMetadata


def flatten_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = 512 << 20,
                    metadata_class: Callable[..., Any] | None = None) -> list[dict[str, Any]]:
    """Buckets of SGLang's "flattened_bucket" format: tensors grouped by dtype (in the order each dtype
    first appears, tensors in their order), each bucket at most ``bucket_bytes`` (a single larger tensor
    gets a bucket of its own): ``{"flattened_tensor": the tensors flattened and concatenated, 1-D, in
    their dtype, on their device, "metadata": [FlattenedTensorMetadata(name, shape, dtype, start_idx,
    end_idx, numel)]}``, indices in elements."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, not {bucket_bytes}")
    make = metadata_class or _metadata_class()
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named_tensors:
        by_dtype.setdefault(t.dtype, []).append((name, t))
    buckets: list[dict[str, Any]] = []
    for _dtype, tensors in by_dtype.items():
        group: list[tuple[str, torch.Tensor]] = []
        size = 0

        def close(group: list[tuple[str, torch.Tensor]]) -> None:
            flats = [t.detach().reshape(-1) for _, t in group]
            flat = torch.cat(flats) if len(flats) > 1 else flats[0].clone()
            meta, at = [], 0
            for name, t in group:
                meta.append(make(name=name, shape=t.shape, dtype=t.dtype, start_idx=at, end_idx=at + t.numel(),
                                 numel=t.numel()))
                at += t.numel()
            buckets.append({"flattened_tensor": flat, "metadata": meta})

        for name, t in tensors:
            nbytes = t.numel() * t.element_size()
            if group and size + nbytes > bucket_bytes:
                close(group)
                group, size = [], 0
            group.append((name, t))
            size += nbytes
        if group:
            close(group)
    return buckets


def _field(metadata: Any, key: str) -> Any:
    """A field of one tensor's metadata: a dict's item, or an attribute of SGLang's class or ours."""
    return metadata[key] if isinstance(metadata, dict) else getattr(metadata, key)


def unflatten_bucket(bucket: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a "flattened_bucket" bucket (views of its flattened tensor), as
    SGLang rebuilds them: of one dtype indexed in elements (``flatten_buckets``), or bytes of several
    dtypes indexed in bytes (SGLang's newer FlattenedTensorBucket)."""
    flat = bucket["flattened_tensor"]
    out = []
    for m in bucket["metadata"]:
        get = functools.partial(_field, m)
        piece = flat[get("start_idx") : get("end_idx")]
        if piece.dtype != get("dtype"):  # bytes of another dtype
            try:
                piece = piece.view(get("dtype"))
            except RuntimeError:  # at an offset that dtype cannot start at: copied, then viewed
                piece = piece.clone().view(get("dtype"))
        out.append((get("name"), piece.reshape(get("shape"))))
    return out

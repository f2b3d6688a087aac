"""fsdpx reads torch.save archives without LibTorch's unpickler (CTest: checkpoint_archive_python).

Archives written here by the venv's torch.save (pickle protocols 2 and 4): dicts of tensors of every dtype
fsdpx maps, views that share a storage (transposed, sliced, at an offset, expanded), scalars, empty tensors,
an nn.Parameter, a module's state_dict() (an OrderedDict with its _metadata) and plain values. What
fsdpx_archive_tool prints of each (fsdpx's own archive reader, checkpoint/detail/archive_reader.hpp) is what
torch.load(weights_only=True) makes: the same values, tensors of the same dtype, sizes, strides, offsets and
bytes, and the same storages shared. Archives whose pickle would run code are refused, naming the global.

    python -m pytest python_archive_test.py --tool <fsdpx_archive_tool> [--work <dir>]
"""

from __future__ import annotations

import collections
import io
import json
import pickle
import struct
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch


def describe(value: Any, storages: dict[int, int]) -> Any:
    """What fsdpx_archive_tool prints of a value (tests/checkpoint/archive_tool.cpp)."""
    if value is None:
        return {"none": None}
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    if isinstance(value, float):
        return {"float": struct.pack(">d", value).hex()}
    if isinstance(value, str):
        return {"str": value}
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        key = storages.setdefault(storage.data_ptr(), len(storages))
        return {
            "tensor": {
                "dtype": str(value.dtype).removeprefix("torch."),
                "sizes": list(value.shape),
                "strides": list(value.stride()),
                "offset": value.storage_offset(),
                "storage": key,
                "storage_bytes": storage.nbytes(),
                "requires_grad": value.requires_grad,
                "bytes": value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes().hex(),
            }
        }
    if isinstance(value, list):
        return {"list": [describe(v, storages) for v in value]}
    if isinstance(value, tuple):
        return {"tuple": [describe(v, storages) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[describe(k, storages), describe(v, storages)] for k, v in value.items()]}
    raise TypeError(f"no description of {type(value)}")


def run_tool(tool: str, path: Path) -> tuple[int, str]:
    done = subprocess.run([tool, str(path)], capture_output=True, text=True, timeout=60, check=False)
    return done.returncode, done.stdout.strip() + done.stderr.strip()


def every_kind() -> dict[str, Any]:
    torch.manual_seed(0)
    base = torch.randn(6, 8)
    values: dict[str, Any] = {
        "weight": base,
        "transposed": base.t(),
        "row": base[2],
        "column": base[:, 3],
        "strided": base[1::2, ::3],
        "expanded": torch.arange(4.0).expand(3, 4),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "empty_at_offset": base.view(-1)[48:48],
        "int_keys": {0: torch.arange(5), 7: {"exp_avg": torch.ones(3, dtype=torch.float64)}},
        "plain": [1, -5, 1 << 40, 0.25, float("inf"), "név", None, True, (1, "x"), {"lr": 1e-3}],
    }
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128, torch.uint16, torch.uint32,
              torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2]
    for dtype in dtypes:
        values[f"dtype_{dtype}"] = (torch.randn(3, 2) * 10).to(dtype)
    return values


@pytest.mark.parametrize("protocol", [2, 4])
def test_every_kind_reads_as_torch_reads_it(tool: str, work: Path, protocol: int) -> None:
    path = work / f"kinds_protocol{protocol}.pt"
    torch.save(every_kind(), path, pickle_protocol=protocol)
    code, out = run_tool(tool, path)
    assert code == 0, out
    # torch's weights_only unpickler reads protocol 2 only (FRAME is protocol 4's); the file is this test's own
    assert json.loads(out) == describe(torch.load(path, weights_only=protocol == 2), {})


def test_a_module_state_dict_and_a_parameter(tool: str, work: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.BatchNorm1d(3))
    state = model.state_dict()
    assert hasattr(state, "_metadata")  # an OrderedDict with attributes, BUILD in the pickle
    path = work / "state_dict.pt"
    torch.save({"model": state, "param": torch.nn.Parameter(torch.randn(2, 2)), "tied": [state["0.weight"]] * 3},
               path)
    code, out = run_tool(tool, path)
    assert code == 0, out
    expected = describe(torch.load(path, weights_only=True), {})
    assert json.loads(out) == expected
    assert expected["dict"][1][1]["tensor"]["requires_grad"] is True


def test_views_of_one_storage_read_it_once(tool: str, work: Path) -> None:
    base = torch.randn(1 << 20)  # 4 MiB, 2048 views: each names the storage again
    path = work / "views.pt"
    torch.save([base[i:i + 512] for i in range(0, 1 << 20, 512)], path)
    code, out = run_tool(tool, path)
    assert code == 0, out
    tensors = json.loads(out)["list"]
    assert len(tensors) == 2048 and {t["tensor"]["storage"] for t in tensors} == {0}


def replace_pickle(archive: Path, data: bytes, out: Path) -> None:
    """`archive` with its data.pkl replaced by `data` (a crafted file made from torch's own)."""
    with zipfile.ZipFile(archive) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, data if info.filename.endswith("/data.pkl") else src.read(info))


class RunsCode:
    def __init__(self, call: Any, args: tuple[Any, ...]) -> None:
        self.call, self.args = call, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.call, self.args


@pytest.mark.parametrize(("payload", "named"), [
    (RunsCode(print, ("ran",)), "print"),
    (RunsCode(eval, ("1",)), "eval"),
    (collections.Counter("ab"), "Counter"),
    ({"t": RunsCode(getattr, ("abc", "upper"))}, "getattr"),
])
def test_a_pickle_that_would_run_code_is_refused_naming_the_global(tool: str, work: Path, payload: Any,
                                                                   named: str) -> None:
    real = work / "real.pt"
    torch.save({"w": torch.ones(2)}, real)
    crafted = work / "crafted.pt"
    replace_pickle(real, pickle.dumps(payload, protocol=2), crafted)
    code, out = run_tool(tool, crafted)
    # protocol 2 names builtins as Python 2 did (__builtin__.print)
    assert code == 1 and f".{named}', which this file may not name" in out and str(crafted) in out, out


def test_a_pickle_nested_a_million_deep_is_refused_without_a_crash(tool: str, work: Path) -> None:
    real = work / "real.pt"
    torch.save({"w": torch.ones(2)}, real)
    levels = 1 << 20
    deep = io.BytesIO()
    deep.write(b"\x80\x02" + b"]" * levels + b"a" * (levels - 1) + b".")
    crafted = work / "deep.pt"
    replace_pickle(real, deep.getvalue(), crafted)
    code, out = run_tool(tool, crafted)
    assert code == 1 and "nests deeper than 100 levels" in out, out


@pytest.mark.parametrize(("last_epoch", "lr", "cause"), [
    (10, 1e-3, None),
    (1 << 62, 1e-3, "no integer last_epoch in [0, 2^40]"),
    (10, float("nan"), "a base_lrs entry is nan, not a finite lr >= 0"),
    (10, -1.0, "a base_lrs entry is -1, not a finite lr >= 0"),
])
def test_a_scheduler_state_is_checked_as_a_config_value_is(tool: str, work: Path, last_epoch: int, lr: float,
                                                          cause: str | None) -> None:
    """LightRFT's scheduler_state.pt (torch's LambdaLR.state_dict()), with values no run makes."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0).state_dict()
    state.update(last_epoch=last_epoch, base_lrs=[lr])
    state.pop("lr_lambdas", None)
    path = work / "scheduler_state.pt"
    torch.save(state, path)
    done = subprocess.run([tool, "scheduler", str(path)], capture_output=True, text=True, timeout=60, check=False)
    out = done.stdout + done.stderr
    if cause is None:
        assert done.returncode == 0, out
    else:
        assert done.returncode == 1 and cause in out and str(path) in out, out


@pytest.mark.parametrize(("state", "cause"), [
    ({"consumed_samples": 2560}, None),  # what LightRFT's trainer keeps
    ({"global_step": 10, "episode": 1, "data_loader_state_dict": {"epoch": 0}, "best": float("nan")}, None),
    ({"global_step": 11}, "its global_step is 11, its folder is step 10"),
    ({"consumed_samples": -1}, "its consumed_samples is -1, not an integer in [0, 2^48]"),
    ({"episode": 1 << 62}, f"its episode is {1 << 62}, not an integer in [0, 2^48]"),
    ({"global_step": 10.0}, "its global_step is 10., not an integer in [0, 2^48]"),
    ([1, 2], "it holds GenericList, not a dict"),
])
def test_a_client_state_is_checked_where_its_values_mean_something(tool: str, work: Path, state: Any,
                                                                  cause: str | None) -> None:
    """LightRFT's client_state.pt of a folder of step 10: its trainers' counters are checked, the rest is data."""
    path = work / "client_state.pt"
    torch.save(state, path)
    done = subprocess.run([tool, "client", str(path), "10"], capture_output=True, text=True, timeout=60,
                          check=False)
    out = done.stdout + done.stderr
    if cause is None:
        assert done.returncode == 0, out
    else:
        assert done.returncode == 1 and cause in out and str(path) in out, out

"""FSDPX_PROFILE=DIR: one training step under torch.profiler (host and CUDA activity), its Chrome trace
written to DIR/NAME.json, the counterpart of benchmarks/cuda_profile.hpp; benchmarks/trace_summary.py
reads both sides' traces."""
import os

import torch


def profile_step(name, step):
    """Runs `step` (which synchronizes the device at its end) once under the profiler when FSDPX_PROFILE
    names a folder; does nothing otherwise."""
    folder = os.environ.get("FSDPX_PROFILE")
    if not folder:
        return
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        step()
    os.makedirs(folder, exist_ok=True)
    prof.export_chrome_trace(os.path.join(folder, name + ".json"))

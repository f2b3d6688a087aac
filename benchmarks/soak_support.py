"""What the memory soaks share (rl_soak.py, sync_soak.py): a process's resident memory, the machine and the
build, for the CSV files' comment lines. Python 3 standard library only."""
import os
import platform
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_mib(pid):
    """VmRSS of process `pid` in MiB, or None once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def machine():
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    mem = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
    return f"{os.cpu_count()} x {cpu}, {mem / 2**20:.0f} GiB, {platform.platform()}"


def commit():
    try:
        sha = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout
        return sha.strip() + (" + uncommitted changes" if dirty.strip() else "")
    except OSError:
        return "?"

#!/usr/bin/env python3
"""Checks that fsdpx's headers include only downward (docs/architecture.md, "The layers").

    tools/check_layers.py [include_dir]      exit 1 and one line per upward include
    tools/check_layers.py --self-test        the checker itself: finds a planted upward include

Every header under include/fsdpx (and every .ipp implementation file) belongs to one layer (its
folder; the umbrella <fsdpx/fsdp.hpp> and fsdpx/impl/src.hpp are the top). A header may include headers of its
own layer and of the layers listed below it, nothing else. A header the table does not place is an error too,
so a new folder has to be given a layer. The torch-free layers (the pickle machine) include no LibTorch header,
directly or through the fsdpx headers they include. A forwarding header left at a moved header's old path may
include anything, and no header of the library includes it. No file of the library is longer than MAX_LINES:
one idea per file (docs/architecture.md, "One idea per file").
"""
import pathlib
import re
import sys
import tempfile

# layer: the layers it may include (besides itself). Bottom to top.
ALLOWED = {
    "base": set(),                                   # error.hpp, version.hpp, detail/
    "memory": {"base"},                              # host buffers: huge pages, the step-buffer cache
    "policies": {"base"},                            # compile-time tags and concepts, no code that runs
    "dist": {"base", "memory"},                      # communicators, meshes, launch environments
    "core": {"base", "memory", "policies", "dist"},  # units, the protocol, Fsdp, optimizers
    "hf": {"base", "memory", "policies", "dist", "core"},  # safetensors, model folders, a model's weights in and out
    "pickle": {"base"},                              # Python pickles read and written; torch-free
    "checkpoint": {"base", "memory", "policies", "dist", "core", "hf", "pickle"},
    # PyTorch Distributed Checkpoint: a room of its own above the checkpoint layer, whose format seam it fills
    "dcp": {"base", "memory", "policies", "dist", "core", "hf", "pickle", "checkpoint"},
    "sync": {"base", "memory", "policies", "dist", "core", "hf", "pickle", "checkpoint"},
    "models": {"base", "memory", "policies", "dist", "core", "hf", "pickle", "checkpoint"},
    # fsdp.hpp includes up to sync (not dcp); impl/src.hpp compiles every layer's .ipp files.
    "umbrella": {"base", "memory", "policies", "dist", "core", "hf", "pickle", "checkpoint", "dcp", "sync", "models"},
}

# Layers that compile without LibTorch: no <torch/...>, <ATen/...> or <c10/...>, nor an fsdpx header that has one.
TORCH_FREE = {"pickle"}
TORCH_INCLUDE = re.compile(r'^\s*#\s*include\s*<((?:torch|ATen|c10)/[^>]+)>', re.MULTILINE)

# Headers left at the path of one that moved, for one release: they forward to the new place (any layer).
FORWARDING = {
    "fsdpx/checkpoint/dcp_metadata.hpp",
    "fsdpx/checkpoint/dcp_reader.hpp",
    "fsdpx/checkpoint/dcp_writer.hpp",
}

# Top-level headers: the umbrella, and each layer's own one-include header.
TOP_LEVEL = {
    "error.hpp": "base",
    "version.hpp": "base",
    "policies.hpp": "policies",
    "dist.hpp": "dist",
    "checkpoint.hpp": "checkpoint",
    "dcp.hpp": "dcp",
    "sync.hpp": "sync",
    "models.hpp": "models",
    "fsdp.hpp": "umbrella",
}
FOLDERS = {"detail": "base", "memory": "memory", "policies": "policies", "dist": "dist", "core": "core",
           "hf": "hf", "pickle": "pickle", "checkpoint": "checkpoint", "dcp": "dcp", "sync": "sync",
           "models": "models", "impl": "umbrella"}  # impl/src.hpp: the separately compiled part, every layer's .ipp files

# Backends are peers inside dist: one backend's files never include another's. Only the launcher
# header, which picks how a world starts, knows several (dist/launch.hpp: NCCL bootstrapped over MPI).
# Each backend has one shape: its communicator header, its parts in detail/<name>_*.hpp, its
# definitions in impl/<name>.ipp and impl/<name>_*.ipp.
BACKENDS = {
    "mpi": ("fsdpx/dist/mpi.hpp", "fsdpx/dist/impl/mpi.ipp", "fsdpx/dist/impl/mpi_", "fsdpx/dist/detail/mpi_"),
    "nccl": ("fsdpx/dist/nccl.hpp", "fsdpx/dist/impl/nccl.ipp", "fsdpx/dist/impl/nccl_", "fsdpx/dist/detail/nccl_"),
}


def backend_of(relative):
    for name, prefixes in BACKENDS.items():
        if any(relative == p or (p.endswith("_") and relative.startswith(p)) for p in prefixes):
            return name
    return None


# A file longer than this holds more than one idea: split it by idea, not by size.
MAX_LINES = 600

INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](fsdpx/[^>"]+)[>"]', re.MULTILINE)


def layer_of(relative):
    """The layer of a header given as 'fsdpx/...', or None when the table does not place it."""
    parts = pathlib.PurePosixPath(relative).parts
    if len(parts) == 2:
        return TOP_LEVEL.get(parts[1])
    return FOLDERS.get(parts[1])


def torch_headers(include_dir, relative, seen=None):
    """The LibTorch headers `relative` includes, directly or through fsdpx headers, as 'via: <header>' lines."""
    seen = set() if seen is None else seen
    if relative in seen:
        return []
    seen.add(relative)
    path = include_dir / relative
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    found = [f"{relative} includes <{header}>" for header in TORCH_INCLUDE.findall(text)]
    for target in INCLUDE.findall(text):
        found += torch_headers(include_dir, target, seen)
    return found


def check(include_dir):
    include_dir = pathlib.Path(include_dir)
    problems = []
    # .ipp: implementations a header includes (or impl/src.hpp compiles once); in their folder's layer.
    headers = sorted([*include_dir.glob("fsdpx/**/*.hpp"), *include_dir.glob("fsdpx/**/*.ipp")])
    if not headers:
        return [f"no headers under {include_dir}/fsdpx"]
    for header in headers:
        relative = header.relative_to(include_dir).as_posix()
        mine = layer_of(relative)
        if mine is None:
            problems.append(f"{relative}: in no layer; give its folder one in tools/check_layers.py and "
                            "docs/architecture.md")
            continue
        lines = header.read_text(encoding="utf-8").count("\n")
        if lines > MAX_LINES:
            problems.append(f"{relative}: {lines} lines, more than {MAX_LINES}: it holds more than one idea; "
                            "give each its own file")
        if mine in TORCH_FREE:
            for found in torch_headers(include_dir, relative):
                problems.append(f"{relative} ({mine}) must compile without LibTorch, but {found}")
        for target in INCLUDE.findall(header.read_text(encoding="utf-8")):
            if target in FORWARDING:
                problems.append(f"{relative} includes {target}, a header kept only for programs that include its "
                                "old path: include the header it forwards to")
                continue
            if relative in FORWARDING:
                continue
            theirs = layer_of(target)
            if theirs is None:
                problems.append(f"{relative}: includes {target}, which is in no layer")
            elif theirs != mine and theirs not in ALLOWED[mine]:
                problems.append(f"{relative} ({mine}) includes {target} ({theirs}): {mine} may include only "
                                f"{', '.join(sorted(ALLOWED[mine])) or 'nothing of fsdpx'} besides itself")
            elif backend_of(relative) and backend_of(target) and backend_of(relative) != backend_of(target):
                problems.append(f"{relative} ({backend_of(relative)} backend) includes {target} "
                                f"({backend_of(target)} backend): backends are peers; a header that needs both "
                                "belongs with the launcher (dist/launch.hpp)")
    return problems


def self_test():
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        (root / "fsdpx/dist").mkdir(parents=True)
        (root / "fsdpx/core").mkdir(parents=True)
        (root / "fsdpx/error.hpp").write_text("#pragma once\n")
        (root / "fsdpx/core/unit.hpp").write_text("#include <fsdpx/dist/mesh.hpp>\n#include <fsdpx/error.hpp>\n")
        (root / "fsdpx/dist/mesh.hpp").write_text("#include <fsdpx/error.hpp>\n")
        assert check(root) == [], check(root)
        (root / "fsdpx/dist/mesh.hpp").write_text("#include <fsdpx/core/unit.hpp>\n")  # upward
        found = check(root)
        assert len(found) == 1 and "fsdpx/dist/mesh.hpp (dist) includes fsdpx/core/unit.hpp (core)" in found[0], found
        (root / "fsdpx/dist/mesh.hpp").write_text("#include <fsdpx/error.hpp>\n")
        (root / "fsdpx/dist/mpi.hpp").write_text("#include <fsdpx/error.hpp>\n")
        (root / "fsdpx/dist/nccl.hpp").write_text("#include <fsdpx/dist/mpi.hpp>\n")  # a peer backend
        found = check(root)
        assert len(found) == 1 and "backends are peers" in found[0], found
        (root / "fsdpx/dist/nccl.hpp").write_text("#include <fsdpx/error.hpp>\n")
        (root / "fsdpx/pickle").mkdir()
        (root / "fsdpx/pickle/pickle.hpp").write_text("#include <fsdpx/error.hpp>\n")
        assert check(root) == [], check(root)
        (root / "fsdpx/error.hpp").write_text("#pragma once\n#include <c10/util/Exception.h>\n")  # torch, below
        found = check(root)
        assert len(found) == 1 and "must compile without LibTorch" in found[0] and "c10/util" in found[0], found
        (root / "fsdpx/error.hpp").write_text("#pragma once\n")
        (root / "fsdpx/checkpoint").mkdir()
        (root / "fsdpx/dcp").mkdir()
        (root / "fsdpx/dcp/reader.hpp").write_text("#include <fsdpx/error.hpp>\n")
        (root / "fsdpx/checkpoint/dcp_reader.hpp").write_text("#include <fsdpx/dcp/reader.hpp>\n")  # forwarding
        assert check(root) == [], check(root)
        (root / "fsdpx/core/unit.hpp").write_text("#include <fsdpx/checkpoint/dcp_reader.hpp>\n")
        found = check(root)
        assert len(found) == 1 and "old path" in found[0], found
        (root / "fsdpx/core/unit.hpp").write_text("#include <fsdpx/error.hpp>\n")
        (root / "fsdpx/newlayer").mkdir()
        (root / "fsdpx/newlayer/x.hpp").write_text("\n")
        assert any("in no layer" in p for p in check(root))
        (root / "fsdpx/newlayer/x.hpp").unlink()
        (root / "fsdpx/newlayer").rmdir()
        (root / "fsdpx/core/unit.hpp").write_text("#include <fsdpx/error.hpp>\n" + "\n" * MAX_LINES)
        found = check(root)
        assert len(found) == 1 and f"{MAX_LINES + 1} lines, more than {MAX_LINES}" in found[0], found
    print("check_layers self-test: an upward include, a backend including another, LibTorch in a torch-free layer, "
          "an include of a forwarding header, an unplaced header and a file too long are found")


def main(argv):
    if argv[1:] == ["--self-test"]:
        self_test()
        return 0
    include_dir = argv[1] if len(argv) > 1 else pathlib.Path(__file__).resolve().parent.parent / "include"
    problems = check(include_dir)
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} problem(s) against the layer rule or the file length (docs/architecture.md)")
        return 1
    print(f"every header of {include_dir}/fsdpx includes only its own layer and those below it, "
          f"in at most {MAX_LINES} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

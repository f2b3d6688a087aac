#!/usr/bin/env python3
"""Checks that the training include, <fsdpx/fsdp.hpp>, pulls no networking: no Boost.Asio socket or TLS
header and no OpenSSL header reaches a translation unit that includes it, header-only, even where the
sync service is available (its header, <fsdpx/sync/service.hpp>, is a component of its own).

    tools/check_umbrella_includes.py --cxx <compiler> --includes "<dir;dir...>" --defines "<D;D=1...>"

The compiler lists every header the include reaches (-M); each match of FORBIDDEN is a line of the
failure. The same run on <fsdpx/sync/service.hpp> must find some: the check would otherwise prove nothing.
"""
import argparse
import re
import subprocess
import sys

FORBIDDEN = re.compile(r"(/boost/asio/ip/|/boost/asio/ssl|/boost/asio/ssl\.hpp|/openssl/)")


def reached_headers(cxx, includes, defines, header):
    args = [cxx, "-std=c++20", "-M", "-x", "c++", "-"]
    args += [f"-I{d}" for d in includes if d]
    args += [f"-D{d}" for d in defines if d]
    run = subprocess.run(args, input=f"#include <{header}>\n", capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"check_umbrella_includes: the compiler failed on <{header}>:\n{run.stderr[-4000:]}")
    return run.stdout.replace("\\\n", " ").split()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cxx", required=True)
    ap.add_argument("--includes", required=True, help="include directories, ';'-separated (CMake's list)")
    ap.add_argument("--defines", default="", help="compile definitions, ';'-separated")
    args = ap.parse_args()
    includes, defines = args.includes.split(";"), args.defines.split(";")

    umbrella = [h for h in reached_headers(args.cxx, includes, defines, "fsdpx/fsdp.hpp") if FORBIDDEN.search(h)]
    for h in umbrella:
        print(f"<fsdpx/fsdp.hpp> reaches a networking header: {h}")
    if any(d.split("=")[0] == "FSDPX_WITH_SYNC_SERVICE" for d in defines):
        service = [h for h in reached_headers(args.cxx, includes, defines, "fsdpx/sync/service.hpp")
                   if FORBIDDEN.search(h)]
        if not service:
            print("check_umbrella_includes: <fsdpx/sync/service.hpp> reaches no networking header either: "
                  "the pattern no longer matches what the service includes")
            return 1
        print(f"<fsdpx/sync/service.hpp> reaches {len(service)} networking headers (as it should)")
    if umbrella:
        return 1
    print("<fsdpx/fsdp.hpp> reaches no Boost.Asio networking, TLS or OpenSSL header")
    return 0


if __name__ == "__main__":
    sys.exit(main())

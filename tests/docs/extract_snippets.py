#!/usr/bin/env python3
"""Turns the C++ blocks of Markdown files into translation units, so that a snippet which drifts from
the API fails `make test` (the doc_snippet* CTest entries; docs/building.md, "The docs' code compiles").

Every ```cpp block carries a marker on the line before its fence, an HTML comment (not rendered):

    <!-- snippet: statements -->                    a function body, with the gpt context's names
    <!-- snippet: statements context=causal_lm -->  the same with another context's: causal_lm, dist,
                                                    unqualified (gpt's, and fsdpx's without fsdpx::)
    <!-- snippet: declarations check="X" -->        namespace scope; X (a C++ statement, e.g. a
                                                    static_assert) follows it in the same namespace
    <!-- snippet: statements nccl -->               needs the NCCL backend (FSDPX_WITH_NCCL and CUDA's
                                                    headers): compiled where the NCCL headers are found
    <!-- snippet: program run=2 -->                 a whole translation unit of its own, built and
                                                    run at 2 ranks (without run=: built, not run)

A context is a namespace of tests/docs/snippet_context.hpp: the names a fragment takes from the prose
around it (a model, an optimizer, a batch). A fragment's #include lines are hoisted to the top of its
unit. A block without a marker, or with an unknown one, becomes an #error naming the doc and line, so
the entry fails: nothing is skipped in silence.

    extract_snippets.py --out DIR [--root SRC] DOC.md...

writes DIR/fragments.cpp (every fragment of the docs, one namespace each: one unit, since each unit
costs the whole of fsdpx's headers), DIR/fragments_nccl.cpp (those marked nccl), DIR/<doc>_<n>.cpp for
each program, and DIR/programs.cmake, their list for CMake:
    set(FSDPX_DOC_SNIPPET_PROGRAMS "<doc>_<n>|<ranks, or 0>;...")
A file is rewritten only when its text changes, so an unchanged doc rebuilds nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from collections.abc import Callable

KINDS = ("statements", "declarations", "program")
CONTEXTS = ("gpt", "unqualified", "causal_lm", "dist")
MARKER = re.compile(r"^\s*<!--\s*snippet:(.*?)-->\s*$")


def doc_name(path: str) -> str:
    """README.md -> readme, docs/getting-started.md -> getting_started."""
    stem = os.path.splitext(os.path.basename(path))[0].lower()
    return re.sub(r"[^a-z0-9]+", "_", stem).strip("_")


class Snippet:
    def __init__(self, path: str, line: int, code: list[str]) -> None:
        self.path, self.line, self.code = path, line, code
        self.kind: str | None = None
        self.context = "gpt"
        self.run = 0
        self.check: str | None = None
        self.nccl = False
        self.error: str | None = None

    def parse_marker(self, text: str | None) -> None:
        if text is None:
            self.error = ("a ```cpp block without a snippet marker on the line before it "
                          "(<!-- snippet: statements|declarations|program ... -->: tests/docs/extract_snippets.py)")
            return
        try:
            words = shlex.split(text)
        except ValueError as e:
            self.error = f"an unreadable snippet marker ({e})"
            return
        if not words or words[0] not in KINDS:
            self.error = f"a snippet marker must start with one of {', '.join(KINDS)}, not {text.strip()!r}"
            return
        self.kind = words[0]
        for word in words[1:]:
            key, _, value = word.partition("=")
            if word == "nccl" and self.kind != "program":
                self.nccl = True
            elif key == "context" and value in CONTEXTS:
                self.context = value
            elif key == "run" and value.isdigit() and self.kind == "program":
                self.run = int(value)
            elif key == "check" and value and self.kind == "declarations":
                self.check = value
            else:
                self.error = f"snippet marker: {word!r} is not a context ({', '.join(CONTEXTS)}), nccl, " \
                             "a program's run=<ranks> or a declarations' check=\"...\""
                return


def read_snippets(path: str) -> list[Snippet]:
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    snippets: list[Snippet] = []
    i = 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(```+|~~~+)\s*(\S*)", lines[i])
        if not fence:
            i += 1
            continue
        indent, ticks, lang = fence.groups()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(ticks):
            end += 1
        if lang in ("cpp", "c++", "cxx"):
            prev = i - 1
            while prev >= 0 and not lines[prev].strip():
                prev -= 1
            marker = MARKER.match(lines[prev]) if prev >= 0 else None
            code = [line.removeprefix(indent) for line in lines[i + 1:end]]
            snippet = Snippet(path, i + 2, code)  # line of the block's first line, 1-based
            snippet.parse_marker(marker.group(1) if marker else None)
            snippets.append(snippet)
        i = end + 1
    return snippets


def c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def line_directive(snippet: Snippet, offset: int = 0) -> str:
    return f"#line {snippet.line + offset} {c_string(os.path.abspath(snippet.path))}"


def split_includes(snippet: Snippet) -> tuple[list[str], list[str]]:
    """The block's #include lines (hoisted) and its code, an #include's line left blank so that every
    other line keeps its doc line number."""
    includes = [text.strip() for text in snippet.code if text.lstrip().startswith("#include")]
    code = ["" if text.lstrip().startswith("#include") else text for text in snippet.code]
    return includes, code


def fragments_unit(docs: list[tuple[str, list[Snippet]]], display: Callable[[str], str]) -> str:
    """One translation unit for the fragments of every doc: each in a namespace of its own, its lines
    numbered as in its doc (#line), so a failure names the doc and line."""
    includes: list[str] = []
    body: list[str] = []
    for doc, snippets in docs:
        name = doc_name(doc)
        for index, s in enumerate(snippets, 1):
            if s.error:
                body += [line_directive(s, -1), f"#error {c_string(f'{display(doc)}:{s.line - 1}: {s.error}')}"]
                continue
            if s.kind == "program":
                continue
            hoisted, code = split_includes(s)
            includes += [i for i in hoisted if i not in includes]
            body += ["", f"namespace {name}_snippet_{index} {{", f"using namespace fsdpx_doc::{s.context};"]
            if s.kind == "statements":
                body.append("[[maybe_unused]] void snippet() {")
            body.append(line_directive(s))
            body += code
            if s.kind == "statements":
                body.append("}")
            if s.check:
                body += [line_directive(s, -1), s.check + ";"]
            body.append(f"}}  // namespace {name}_snippet_{index}")
    header = ["// Generated by tests/docs/extract_snippets.py: the docs' C++ fragments, compiled by a doc_snippets",
              "// CTest entry. Edit the docs, not this file.", '#include "snippet_context.hpp"'] + includes
    return "\n".join(header + body) + "\n"


def program_unit(doc: str, snippet: Snippet) -> str:
    return "\n".join([f"// Generated by tests/docs/extract_snippets.py from {doc}, line {snippet.line}.",
                      line_directive(snippet)] + snippet.code) + "\n"


def write_if_changed(path: str, text: str) -> None:
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return
    except FileNotFoundError:
        pass
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder of the generated translation units")
    parser.add_argument("--root", default=".", help="the docs' paths in messages are relative to it")
    parser.add_argument("docs", nargs="+")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    def display(doc: str) -> str:
        return os.path.relpath(doc, args.root)

    docs = [(doc, read_snippets(doc)) for doc in args.docs]
    by_needs: dict[bool, list[tuple[str, list[Snippet]]]] = {False: [], True: []}
    for doc, snippets in docs:
        for needs_nccl in (False, True):
            # A refused block goes to the unit every machine compiles.
            chosen = [s for s in snippets if (s.nccl and not s.error) == needs_nccl]
            by_needs[needs_nccl].append((doc, chosen))
    write_if_changed(os.path.join(args.out, "fragments.cpp"), fragments_unit(by_needs[False], display))
    write_if_changed(os.path.join(args.out, "fragments_nccl.cpp"), fragments_unit(by_needs[True], display))
    programs: list[str] = []
    for doc, snippets in docs:
        for index, s in enumerate(snippets, 1):
            if s.kind == "program" and not s.error:
                name = f"{doc_name(doc)}_{index}"
                write_if_changed(os.path.join(args.out, f"{name}.cpp"), program_unit(display(doc), s))
                programs.append(f"{name}|{s.run}")
    manifest = f'set(FSDPX_DOC_SNIPPET_PROGRAMS "{";".join(programs)}")\n'
    write_if_changed(os.path.join(args.out, "programs.cmake"), manifest)
    return 0


if __name__ == "__main__":
    sys.exit(main())

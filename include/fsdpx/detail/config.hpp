// Header-only or separately compiled, as Boost.Asio offers.
//
// By default fsdpx is header-only: every translation unit that includes an fsdpx header also compiles the
// out-of-line functions of every header it includes (their impl/*.ipp files: the unit protocol, the
// communicators, the checkpoint coordinator and readers, ...). A program with many translation units can
// compile those once:
//   - define FSDPX_SEPARATE_COMPILATION for every translation unit of the program, and
//   - compile one source file that includes <fsdpx/impl/src.hpp>.
// CMake does both: link fsdpx::separate (fsdpx's own build, add_subdirectory) or a library made by
// fsdpx_add_separate_library(<name>) (an installed package).
// The headers then hold declarations only for those parts; docs/benchmarks.md ("Compile time") says
// what each mode costs a translation unit.
#pragma once

#if defined(FSDPX_SEPARATE_COMPILATION)
#define FSDPX_DECL
#else
#define FSDPX_HEADER_ONLY 1
#define FSDPX_DECL inline
#endif

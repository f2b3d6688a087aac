// Owns the tests' precompiled header (see tests/CMakeLists.txt); compiles to nothing.

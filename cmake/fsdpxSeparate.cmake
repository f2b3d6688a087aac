# fsdpx_add_separate_library(<name>): a static library holding fsdpx's separately compiled part
# (<fsdpx/impl/src.hpp>: the checkpoint coordinator's thread pool and the weight-sync service, which
# need Boost.Asio and OpenSSL). Targets that link it get FSDPX_SEPARATE_COMPILATION, so their
# translation units see declarations only for those parts and compile faster (docs/benchmarks.md,
# "Compile time"). Every target of one program must agree: link it everywhere or nowhere.
function(fsdpx_add_separate_library name)
  set(_source ${CMAKE_CURRENT_BINARY_DIR}/${name}_src.cpp)
  file(CONFIGURE OUTPUT ${_source} CONTENT "#include <fsdpx/impl/src.hpp>\n")
  add_library(${name} STATIC EXCLUDE_FROM_ALL ${_source})
  # Position-independent, so that it links into shared libraries too (a Python extension, a plugin).
  set_target_properties(${name} PROPERTIES POSITION_INDEPENDENT_CODE ON)
  target_link_libraries(${name} PUBLIC fsdpx::fsdpx)
  target_compile_definitions(${name} PUBLIC FSDPX_SEPARATE_COMPILATION=1)
endfunction()

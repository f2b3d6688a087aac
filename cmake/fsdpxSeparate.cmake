# fsdpx_add_separate_library(<name> [SYNC_SERVICE]): a static library holding fsdpx's separately
# compiled part (<fsdpx/impl/src.hpp>: the out-of-line functions of every layer; with SYNC_SERVICE, the
# weight-sync TCP service's too, which needs fsdpx::sync_service: Boost.Asio and OpenSSL). Targets that
# link it get FSDPX_SEPARATE_COMPILATION, so their translation units see declarations only for those
# parts and compile faster (docs/benchmarks.md, "Compile time"). Every target of one program must agree:
# link it everywhere or nowhere.
function(fsdpx_add_separate_library name)
  cmake_parse_arguments(ARG "SYNC_SERVICE" "" "" ${ARGN})
  set(_source ${CMAKE_CURRENT_BINARY_DIR}/${name}_src.cpp)
  file(CONFIGURE OUTPUT ${_source} CONTENT "#include <fsdpx/impl/src.hpp>\n")
  add_library(${name} STATIC EXCLUDE_FROM_ALL ${_source})
  # Position-independent, so that it links into shared libraries too (a Python extension, a plugin).
  set_target_properties(${name} PROPERTIES POSITION_INDEPENDENT_CODE ON)
  if(ARG_SYNC_SERVICE)
    if(NOT TARGET fsdpx::sync_service)
      message(FATAL_ERROR "fsdpx_add_separate_library(${name} SYNC_SERVICE): this fsdpx has no sync service "
                          "(fsdpx::sync_service needs Boost and OpenSSL where fsdpx was configured)")
    endif()
    target_link_libraries(${name} PUBLIC fsdpx::sync_service)
  else()
    target_link_libraries(${name} PUBLIC fsdpx::fsdpx)
  endif()
  target_compile_definitions(${name} PUBLIC FSDPX_SEPARATE_COMPILATION=1)
endfunction()

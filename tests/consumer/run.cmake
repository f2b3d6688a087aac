# cmake -P run.cmake: install fsdpx from BUILD_DIR into a fresh prefix, run the installed fsdpx-merge
# (it must find LibTorch by itself), build the consumer project against the prefix with
# find_package(fsdpx CONFIG REQUIRED) and run it under mpiexec; then build the same program with fsdpx
# as a subproject (FetchContent, no find_package(Torch) in the parent) and run it too. Installed, the
# program is built twice: header-only, and with fsdpx compiled once (fsdpx_add_separate_library); as a
# subproject header-only, the light program (light.cpp: the umbrella's is built above; fsdpx::separate
# through add_subdirectory is how fsdpx's own build links).
# In: BUILD_DIR SOURCE_DIR WORK_DIR Torch_DIR MPIEXEC MPIEXEC_FLAGS (|-separated) TOOLS (ON: fsdpx-merge was built)
function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " cmd "${ARGN}")
    message(FATAL_ERROR "consumer test: '${cmd}' failed (${rc})")
  endif()
endfunction()
file(REMOVE_RECURSE ${WORK_DIR})
step(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix)
if(TOOLS)
  # No LD_LIBRARY_PATH: the installed tool finds libtorch through its RPATH.
  step(${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH ${WORK_DIR}/prefix/bin/fsdpx-merge --help)
endif()
# Release flags without optimization: what is tested is that the package builds, links and runs, and
# the optimizer is most of what compiling these translation units costs.
set(no_optimizer -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_FLAGS_RELEASE=-DNDEBUG")
step(${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer -B ${WORK_DIR}/build ${no_optimizer}
     -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DTorch_DIR=${Torch_DIR})
step(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
string(REPLACE "|" ";" flags "${MPIEXEC_FLAGS}")
step(${MPIEXEC} -n 2 ${flags} ${WORK_DIR}/build/consumer)
step(${MPIEXEC} -n 2 ${flags} ${WORK_DIR}/build/consumer_separate)
step(${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer/subproject -B ${WORK_DIR}/subproject ${no_optimizer}
     -DFSDPX_SOURCE_DIR=${SOURCE_DIR} -DTorch_DIR=${Torch_DIR})
step(${CMAKE_COMMAND} --build ${WORK_DIR}/subproject --target consumer)
step(${MPIEXEC} -n 2 ${flags} ${WORK_DIR}/subproject/consumer)

# cmake -P run.cmake: install fsdpx from BUILD_DIR into a fresh prefix, run the installed fsdpx-merge
# (it must find LibTorch by itself), build the consumer project against the prefix with
# find_package(fsdpx CONFIG REQUIRED) and run it under mpiexec; then build the same program with fsdpx
# as a subproject (FetchContent, no find_package(Torch) in the parent) and run it too. Each way, the
# program is built twice: header-only, and with fsdpx compiled once (fsdpx_add_separate_library,
# fsdpx::separate).
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
step(${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer -B ${WORK_DIR}/build -DCMAKE_BUILD_TYPE=Release
     -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DTorch_DIR=${Torch_DIR})
step(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
string(REPLACE "|" ";" flags "${MPIEXEC_FLAGS}")
step(${MPIEXEC} -n 2 ${flags} ${WORK_DIR}/build/consumer)
step(${MPIEXEC} -n 2 ${flags} ${WORK_DIR}/build/consumer_separate)
step(${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer/subproject -B ${WORK_DIR}/subproject -DCMAKE_BUILD_TYPE=Release
     -DFSDPX_SOURCE_DIR=${SOURCE_DIR} -DTorch_DIR=${Torch_DIR})
step(${CMAKE_COMMAND} --build ${WORK_DIR}/subproject --target consumer consumer_separate)
step(${MPIEXEC} -n 2 ${flags} ${WORK_DIR}/subproject/consumer)
step(${MPIEXEC} -n 2 ${flags} ${WORK_DIR}/subproject/consumer_separate)

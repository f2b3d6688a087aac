# cmake -P run.cmake: install fsdpx from BUILD_DIR into a fresh prefix, build the consumer project
# against it with find_package(fsdpx CONFIG REQUIRED), and run it under mpiexec.
# In: BUILD_DIR SOURCE_DIR WORK_DIR Torch_DIR MPIEXEC MPIEXEC_FLAGS (|-separated)
function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " cmd "${ARGN}")
    message(FATAL_ERROR "consumer test: '${cmd}' failed (${rc})")
  endif()
endfunction()
file(REMOVE_RECURSE ${WORK_DIR})
step(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix)
step(${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer -B ${WORK_DIR}/build -DCMAKE_BUILD_TYPE=Release
     -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DTorch_DIR=${Torch_DIR})
step(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
string(REPLACE "|" ";" flags "${MPIEXEC_FLAGS}")
step(${MPIEXEC} -n 2 ${flags} ${WORK_DIR}/build/consumer)

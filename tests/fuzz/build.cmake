# cmake -DBUILD_DIR=<dir> -DCXX=<clang++> -DTorch_DIR=<dir> -P build.cmake: configures and builds the fuzz
# harnesses (CMakeLists.txt here) in BUILD_DIR, and makes each harness's working corpus folder there (what
# fuzzing finds beyond the seeds in corpus/).
foreach(v BUILD_DIR CXX Torch_DIR)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "build.cmake needs -D${v}=...")
  endif()
endforeach()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${CMAKE_CURRENT_LIST_DIR} -B ${BUILD_DIR} -DCMAKE_CXX_COMPILER=${CXX}
                        -DTorch_DIR=${Torch_DIR} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring the fuzz harnesses failed")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR} -j 2 RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the fuzz harnesses failed")
endif()
foreach(harness pickle metadata archive commit_record)
  file(MAKE_DIRECTORY ${BUILD_DIR}/corpus_${harness})
endforeach()

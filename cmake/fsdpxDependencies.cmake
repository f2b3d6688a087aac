# fsdpx's dependencies, found the same way by the source tree and by the installed fsdpxConfig.cmake.
# In: FSDPX_WITH_NCCL (installed config: what the package was built with; source tree: unset = detect).
include(CMakeFindDependencyMacro)
list(APPEND CMAKE_MODULE_PATH "${CMAKE_CURRENT_LIST_DIR}")

find_dependency(Torch)
# The C API only: skip the deprecated MPI C++ bindings (found through the CXX language).
set(MPI_CXX_SKIP_MPICXX ON CACHE BOOL "fsdpx uses the MPI C API only")
find_dependency(MPI COMPONENTS CXX)
find_dependency(Boost 1.74 CONFIG)

# NCCL needs a LibTorch built with CUDA (c10_cuda) and nccl.h + libnccl.
if(NOT DEFINED FSDPX_WITH_NCCL)
  set(FSDPX_WITH_NCCL OFF)
  if(TARGET c10_cuda)
    find_package(CUDAToolkit QUIET)
    find_package(NCCL QUIET)
    if(CUDAToolkit_FOUND AND NCCL_FOUND)
      set(FSDPX_WITH_NCCL ON)
    endif()
  endif()
elseif(FSDPX_WITH_NCCL)
  find_dependency(CUDAToolkit)
  find_dependency(NCCL)
endif()

# fsdpx's dependencies, found the same way by the source tree and by the installed fsdpxConfig.cmake.
# In (installed config): FSDPX_WITH_MPI, FSDPX_WITH_NCCL, FSDPX_WITH_BOOST, FSDPX_WITH_OPENSSL as the package was built.
# In (source tree): unset = detect; set them ON/OFF to force.
include(CMakeFindDependencyMacro)
list(APPEND CMAKE_MODULE_PATH "${CMAKE_CURRENT_LIST_DIR}")

find_dependency(Torch HINTS ${FSDPX_TORCH_DIR_HINT})  # (the hint: the installed config's, see fsdpxConfig.cmake.in)
# JSON (commit records, safetensors headers, Hugging Face configs): header-only nlohmann/json.
find_dependency(nlohmann_json 3.10)
# zlib: weight sync's XOR-and-compress delta encoding (fsdpx/sync/delta.hpp); without it deltas travel
# sparse or whole, and a receiver refuses an XOR one saying why.
if(NOT DEFINED FSDPX_WITH_ZLIB)
  find_package(ZLIB QUIET)
  set(FSDPX_WITH_ZLIB OFF)
  if(ZLIB_FOUND)
    set(FSDPX_WITH_ZLIB ON)
  endif()
elseif(FSDPX_WITH_ZLIB)
  find_dependency(ZLIB)
endif()

# MPI: CPU collectives (mpirun/srun). The C API only: skip the deprecated C++ bindings.
set(MPI_CXX_SKIP_MPICXX ON CACHE BOOL "fsdpx uses the MPI C API only")
if(NOT DEFINED FSDPX_WITH_MPI)
  find_package(MPI QUIET COMPONENTS CXX)
  set(FSDPX_WITH_MPI OFF)
  if(MPI_CXX_FOUND)
    set(FSDPX_WITH_MPI ON)
  endif()
elseif(FSDPX_WITH_MPI)
  find_dependency(MPI COMPONENTS CXX)
endif()

# Boost (headers): Asio thread pools for the checkpoint coordinator.
if(NOT DEFINED FSDPX_WITH_BOOST)
  find_package(Boost 1.74 QUIET CONFIG)
  set(FSDPX_WITH_BOOST OFF)
  if(Boost_FOUND)
    set(FSDPX_WITH_BOOST ON)
  endif()
elseif(FSDPX_WITH_BOOST)
  find_dependency(Boost 1.74 CONFIG)
endif()

# OpenSSL (libcrypto, libssl): the synchronizer service's HMAC handshake and its optional TLS
# (fsdpx/sync/server.hpp, client.hpp).
if(NOT DEFINED FSDPX_WITH_OPENSSL)
  find_package(OpenSSL QUIET COMPONENTS Crypto SSL)
  set(FSDPX_WITH_OPENSSL OFF)
  if(OPENSSL_FOUND)
    set(FSDPX_WITH_OPENSSL ON)
  endif()
elseif(FSDPX_WITH_OPENSSL)
  find_dependency(OpenSSL COMPONENTS Crypto SSL)
endif()

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

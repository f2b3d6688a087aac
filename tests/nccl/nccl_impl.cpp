// The NCCL backend's out-of-line definitions, compiled for the compile check of a CPU-only LibTorch
// (tests/CMakeLists.txt): fsdpx::separate is built there without NCCL, so this translation unit is the
// one that compiles dist/impl/nccl.ipp.
#include <fsdpx/dist/impl/nccl.ipp>

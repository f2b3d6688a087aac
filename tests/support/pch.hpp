// Precompiled for every test target: the expensive third-party headers only.
#pragma once
#if defined(FSDPX_WITH_MPI)
#include <mpi.h>
#endif

#include <ATen/ATen.h>
#include <torch/nn.h>
#include <torch/optim.h>
#include <catch2/catch.hpp>

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

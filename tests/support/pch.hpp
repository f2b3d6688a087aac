// Precompiled for every test target: the expensive third-party headers only.
#pragma once
#if defined(FSDPX_WITH_MPI)
#include <mpi.h>
#endif

#include <ATen/ATen.h>
#include <torch/nn.h>
#include <torch/optim.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <catch2/catch.hpp>
#if defined(FSDPX_WITH_BOOST)
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/thread_pool.hpp>
#endif

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

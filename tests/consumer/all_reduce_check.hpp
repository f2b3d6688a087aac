// The consumer programs' first check (main.cpp, light.cpp): an all-reduce across the ranks gives the sum.
#pragma once

#include <cstdio>

#include <ATen/ATen.h>
#include <fsdpx/dist/mpi.hpp>

inline bool all_reduce_sums(fsdpx::dist::MpiCommunicator& world) {
  auto t = at::full({4}, world.rank() + 1.0f);
  world.all_reduce(t, fsdpx::dist::ReduceOp::sum);
  const float want = world.size() * (world.size() + 1) / 2.0f;
  if (!at::equal(t, at::full({4}, want))) {
    std::fprintf(stderr, "consumer: rank %d got a wrong sum\n", world.rank());
    return false;
  }
  return true;
}

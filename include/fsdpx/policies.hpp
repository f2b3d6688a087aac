// Every policy: mesh, mixed precision, offload, state dict, wrapping, activation checkpointing.
#pragma once

#include <fsdpx/policies/checkpoint.hpp>
#include <fsdpx/policies/mesh.hpp>
#include <fsdpx/policies/offload.hpp>
#include <fsdpx/policies/precision.hpp>
#include <fsdpx/policies/state_dict.hpp>
#include <fsdpx/policies/wrap.hpp>

// Every policy: mesh, mixed precision, offload, state dict, wrapping.
#pragma once

#include <fsdpx/policies/mesh.hpp>
#include <fsdpx/policies/offload.hpp>
#include <fsdpx/policies/precision.hpp>
#include <fsdpx/policies/state_dict.hpp>
#include <fsdpx/policies/wrap.hpp>

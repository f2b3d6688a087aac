// fsdpx's models: a Llama/Qwen2/Qwen3 decoder, and Hugging Face model folders in and out of it.
// Not part of <fsdpx/fsdp.hpp> (a program that trains its own model does not compile these).
#pragma once

#include <fsdpx/models/config.hpp>
#include <fsdpx/models/decoder.hpp>
#include <fsdpx/models/loss.hpp>
#include <fsdpx/models/packing.hpp>
#include <fsdpx/models/pretrained.hpp>

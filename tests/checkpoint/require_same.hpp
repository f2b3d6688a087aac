// Exact equality of two lists of named tensors (names, order, shapes, dtypes, values).
#pragma once

#include <catch2/catch.hpp>

#include "merge_fixture.hpp"

namespace merge_fixture {

inline void require_same(const NamedTensors& got, const NamedTensors& want) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    INFO(want[i].first);
    CHECK(got[i].first == want[i].first);
    CHECK(got[i].second.sizes() == want[i].second.sizes());
    CHECK(got[i].second.scalar_type() == want[i].second.scalar_type());
    CHECK(at::equal(got[i].second, want[i].second));
  }
}

}  // namespace merge_fixture

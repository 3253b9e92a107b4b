// A draft tree's chains (decode_layers.cpp's tree_chains; causal_attention.cpp's tree attention).
//
// Rows in depth-first order: row 0 the pending token, parents[t] the row before t on its path
// (-1 for row 0), each row at position start + its depth. A chain is a run of rows each the child
// of the one before; its path is the rows whose keys go to positions start, start + 1, ...: its
// ancestors, then its own rows. Chains are listed last first: chain 0, the drafter's first
// choices, is attended last, so the cache holds its keys after the verification.
#pragma once

#include <cstdint>
#include <vector>

struct TreeChain {
  int64_t first, end, depth;  // rows first..end-1, the first at depth `depth`
  std::vector<int64_t> path;  // the rows whose keys go to start, start + 1, ...: ancestors, then first..end-1
};

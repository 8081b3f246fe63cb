// The row shape every Hopper top-k sparse kernel is written for, DeepSeek's MLA: 576-column query
// and key rows, the first 512 columns of a key row being its value row, in 64-column tiles.
#pragma once

namespace jfa::sm90::sparse {

struct MlaRows {
  static constexpr int kDimQK = 576;
  static constexpr int kDimV = 512;
  static constexpr int kTiles = kDimQK / 64;  // 64-column tiles of a Q or key row
  static constexpr int kVTiles = kDimV / 64;  // of a dO or O row, and of a key row's value columns
};

}  // namespace jfa::sm90::sparse

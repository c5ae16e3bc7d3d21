// A plain-text table for human CLI output: columns padded to their widest cell, numbers
// right-aligned. Header-only (the CLI target compiles only model_options.cc and *_cmd.cc).
// Not thread-safe; build and print from one thread.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace hxfer::cli {

class Table {
 public:
  // `right[i]` right-aligns column i (numbers); missing entries mean left-aligned.
  explicit Table(std::vector<std::string> header, std::vector<bool> right = {})
      : right_(std::move(right)) {
    rows_.push_back(std::move(header));
  }

  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  bool empty() const { return rows_.size() <= 1; }

  // Prints every row with `indent` spaces before it; the last column is never padded.
  void print(std::FILE* out, int indent = 0) const {
    std::vector<size_t> width;
    for (const auto& row : rows_) {
      if (width.size() < row.size()) width.resize(row.size(), 0);
      for (size_t i = 0; i < row.size(); ++i) width[i] = std::max(width[i], row[i].size());
    }
    for (const auto& row : rows_) {
      std::string line(static_cast<size_t>(indent), ' ');
      for (size_t i = 0; i < row.size(); ++i) {
        const bool last = i + 1 == row.size();
        const size_t pad = width[i] - row[i].size();
        if (i < right_.size() && right_[i]) line.append(pad, ' ');
        line += row[i];
        if (!last && !(i < right_.size() && right_[i])) line.append(pad, ' ');
        if (!last) line += "  ";
      }
      while (!line.empty() && line.back() == ' ') line.pop_back();
      std::fprintf(out, "%s\n", line.c_str());
    }
  }

 private:
  std::vector<bool> right_;
  std::vector<std::vector<std::string>> rows_;
};

// "0-3,7,9-10": ascending ids with runs collapsed.
inline std::string formatIdList(const std::vector<uint32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size();) {
    size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    if (!s.empty()) s += ",";
    s += std::to_string(ids[i]);
    if (j > i) s += "-" + std::to_string(ids[j]);
    i = j + 1;
  }
  return s.empty() ? "-" : s;
}

}  // namespace hxfer::cli

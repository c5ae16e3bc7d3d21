// Small text helpers shared by the command line, the benchmarks and the engine.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace hxfer {

// "a,b,,c" -> {"a", "b", "c"}: the non-empty items between separators.
inline std::vector<std::string> splitList(std::string_view text, char separator = ',') {
  std::vector<std::string> out;
  size_t begin = 0;
  while (begin <= text.size()) {
    size_t end = text.find(separator, begin);
    if (end == std::string_view::npos) end = text.size();
    if (end > begin) out.emplace_back(text.substr(begin, end - begin));
    begin = end + 1;
  }
  return out;
}

}  // namespace hxfer

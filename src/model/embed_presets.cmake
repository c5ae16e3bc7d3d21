# Generates a C++ source that embeds every presets/<name>/config.json as a raw string literal,
# so the library needs no files at run time. Run at build time by src/model/CMakeLists.txt:
#   cmake -DPRESET_DIR=<dir> -DOUTPUT=<file.cc> -P embed_presets.cmake
file(GLOB configs "${PRESET_DIR}/*/config.json")
list(SORT configs)
set(delim "hxfer_json")
set(body "")
foreach(config IN LISTS configs)
  get_filename_component(dir "${config}" DIRECTORY)
  get_filename_component(name "${dir}" NAME)
  file(READ "${config}" text)
  string(FIND "${text}" ")${delim}\"" clash)
  if(NOT clash EQUAL -1)
    message(FATAL_ERROR "${config} contains the raw-string delimiter )${delim}\"")
  endif()
  string(APPEND body "    {\"${name}\", R\"${delim}(${text})${delim}\"},\n")
endforeach()
if(body STREQUAL "")
  message(FATAL_ERROR "no presets found under ${PRESET_DIR}")
endif()
set(content "// Generated from presets/*/config.json by src/model/embed_presets.cmake. Do not edit.
#include \"model/preset_data.h\"

namespace hxfer::internal {

const EmbeddedPreset kEmbeddedPresets[] = {
${body}};
const size_t kNumEmbeddedPresets = sizeof(kEmbeddedPresets) / sizeof(kEmbeddedPresets[0]);

}  // namespace hxfer::internal
")
file(WRITE "${OUTPUT}" "${content}")

# ctest's api_install_consumer: installs this build into a prefix, builds examples/cpp against
# it with find_package(hxfer) and runs it. -DBUILD=<build dir> -DSRC=<source dir>.
set(prefix ${BUILD}/consumer/prefix)
set(out ${BUILD}/consumer/build)
file(REMOVE_RECURSE ${BUILD}/consumer)
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD} --prefix ${prefix}
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SRC}/examples/cpp -B ${out} -G Ninja
                        -DCMAKE_PREFIX_PATH=${prefix} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring examples/cpp against the installed hxfer failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${out} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building examples/cpp against the installed hxfer failed: ${rc}")
endif()
execute_process(COMMAND ${out}/engine_pair RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "examples/cpp engine_pair failed: ${rc}")
endif()

# Fails when a Catch2 test name holds a ';'. catch_discover_tests turns each name
# into a CTest test through a CMake list, where ';' separates items: such a test
# becomes two CTest tests whose filters match nothing, and neither ever runs.
# Usage: cmake -DEXES="a;b" -P check_test_names.cmake (EXES joined with '|' on the command line).
string(REPLACE "|" ";" exes "${EXES}")
set(bad "")
set(checked 0)
foreach(exe IN LISTS exes)
  if(NOT EXISTS "${exe}")  # a build of some targets only (the sanitizer build): check what was built
    message(STATUS "not built, not checked: ${exe}")
    continue()
  endif()
  math(EXPR checked "${checked} + 1")
  execute_process(COMMAND "${exe}" --list-test-names-only OUTPUT_VARIABLE out RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0 AND out STREQUAL "")
    message(FATAL_ERROR "${exe} --list-test-names-only failed (${rc})")
  endif()
  # Catch lists one name per line; ';' in a name stays in the line (escaped for CMake here).
  string(REPLACE ";" "<SEMICOLON>" out "${out}")
  string(REPLACE "\n" ";" lines "${out}")
  foreach(line IN LISTS lines)
    if(line MATCHES "<SEMICOLON>")
      string(REPLACE "<SEMICOLON>" ";" line "${line}")
      string(APPEND bad "\n  ${exe}: ${line}")
    endif()
  endforeach()
endforeach()
if(bad)
  message(FATAL_ERROR "Catch2 test names with ';' (CTest would never run them; use ','):${bad}")
endif()
if(checked EQUAL 0)
  message(FATAL_ERROR "no test executable was built: ${EXES}")
endif()
message(STATUS "no test name holds ';' (${checked} executables)")

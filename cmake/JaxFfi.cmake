# Finds the XLA FFI headers shipped with the installed jaxlib
# (jax.ffi.include_dir()) and defines the interface target jaxoverlap::xla_ffi.
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c "import jax; print(jax.ffi.include_dir())"
  OUTPUT_VARIABLE JAXOVERLAP_XLA_FFI_INCLUDE_DIR
  OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE _jax_result)
if(NOT _jax_result EQUAL 0 OR NOT EXISTS "${JAXOVERLAP_XLA_FFI_INCLUDE_DIR}/xla/ffi/api/ffi.h")
  message(FATAL_ERROR "jaxoverlap: could not find the XLA FFI headers through "
                      "jax.ffi.include_dir() with ${Python_EXECUTABLE}; install jax>=0.11.2")
endif()
message(STATUS "jaxoverlap: XLA FFI headers in ${JAXOVERLAP_XLA_FFI_INCLUDE_DIR}")
add_library(jaxoverlap_xla_ffi INTERFACE)
target_include_directories(jaxoverlap_xla_ffi SYSTEM INTERFACE "${JAXOVERLAP_XLA_FFI_INCLUDE_DIR}")
add_library(jaxoverlap::xla_ffi ALIAS jaxoverlap_xla_ffi)

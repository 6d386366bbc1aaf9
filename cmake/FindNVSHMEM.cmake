# Finds NVSHMEM (>= 3.4) from $NVSHMEM_HOME, or from the nvidia-nvshmem-cu13
# wheel of the Python that builds the package.
#
# Defines NVSHMEM_FOUND, NVSHMEM_INCLUDE_DIR, NVSHMEM_LIB_DIR,
# NVSHMEM_DEVICE_LIBRARY (the static device archive, linked by full path: with
# -l:libnvshmem_device.a nvlink leaves device symbols undefined) and
# NVSHMEM_HOST_LIBRARY (libnvshmem_host.so.3 by its full name: the wheel has no
# unversioned symlink).
set(_nvshmem_hints "")
if(DEFINED ENV{NVSHMEM_HOME})
  list(APPEND _nvshmem_hints "$ENV{NVSHMEM_HOME}")
endif()
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
          "import importlib.util as u; s = u.find_spec('nvidia.nvshmem'); print(list(s.submodule_search_locations)[0] if s else '')"
  OUTPUT_VARIABLE _nvshmem_wheel_dir
  OUTPUT_STRIP_TRAILING_WHITESPACE
  ERROR_QUIET)
if(_nvshmem_wheel_dir)
  list(APPEND _nvshmem_hints "${_nvshmem_wheel_dir}")
endif()

find_path(NVSHMEM_INCLUDE_DIR nvshmem.h HINTS ${_nvshmem_hints} PATH_SUFFIXES include NO_DEFAULT_PATH)
find_file(NVSHMEM_DEVICE_LIBRARY libnvshmem_device.a HINTS ${_nvshmem_hints} PATH_SUFFIXES lib lib64 NO_DEFAULT_PATH)
find_file(NVSHMEM_HOST_LIBRARY NAMES libnvshmem_host.so.3 libnvshmem_host.so
          HINTS ${_nvshmem_hints} PATH_SUFFIXES lib lib64 NO_DEFAULT_PATH)
if(NVSHMEM_HOST_LIBRARY)
  get_filename_component(NVSHMEM_LIB_DIR "${NVSHMEM_HOST_LIBRARY}" DIRECTORY)
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NVSHMEM
  REQUIRED_VARS NVSHMEM_INCLUDE_DIR NVSHMEM_DEVICE_LIBRARY NVSHMEM_HOST_LIBRARY)

# Finds cuBLASLt (CUDA 13) from $CUBLAS_HOME, from the nvidia-cublas wheel of
# the Python that builds the package (nvidia/cu13/{include,lib}), or from the
# CUDA toolkit.
#
# Defines CUBLASLT_FOUND, CUBLASLT_INCLUDE_DIR, CUBLASLT_LIBRARY (linked by its
# full name: the wheel ships libcublasLt.so.13 without an unversioned
# symlink) and CUBLASLT_LIB_DIR.
set(_cublaslt_hints "")
if(DEFINED ENV{CUBLAS_HOME})
  list(APPEND _cublaslt_hints "$ENV{CUBLAS_HOME}")
endif()
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
          "import importlib.util as u; s = u.find_spec('nvidia.cu13'); print(list(s.submodule_search_locations)[0] if s else '')"
  OUTPUT_VARIABLE _cublaslt_wheel_dir
  OUTPUT_STRIP_TRAILING_WHITESPACE
  ERROR_QUIET)
if(_cublaslt_wheel_dir)
  list(APPEND _cublaslt_hints "${_cublaslt_wheel_dir}")
endif()
if(CUDAToolkit_LIBRARY_ROOT)
  list(APPEND _cublaslt_hints "${CUDAToolkit_LIBRARY_ROOT}")
endif()

find_path(CUBLASLT_INCLUDE_DIR cublasLt.h HINTS ${_cublaslt_hints} ${CUDAToolkit_INCLUDE_DIRS}
          PATH_SUFFIXES include NO_DEFAULT_PATH)
find_file(CUBLASLT_LIBRARY NAMES libcublasLt.so.13 libcublasLt.so
          HINTS ${_cublaslt_hints} ${CUDAToolkit_LIBRARY_DIR}
          PATH_SUFFIXES lib lib64 NO_DEFAULT_PATH)
if(CUBLASLT_LIBRARY)
  get_filename_component(CUBLASLT_LIB_DIR "${CUBLASLT_LIBRARY}" DIRECTORY)
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(CUBLASLT REQUIRED_VARS CUBLASLT_INCLUDE_DIR CUBLASLT_LIBRARY)

# MoetCubins.cmake -- build CUDA cubins with nvcc for the moet native packages (design.md, Kernels).
#
# No CUDA language support and no host compiler setup in CMake: nvcc is run as a tool, one
# invocation per architecture, and its outputs are plain files (package data). Include it, then
#
#   moet_add_cubins(NAME <name> SOURCE <file.cu> ARCHS 90a 100a 120a OUTPUT_DIR <dir>
#                   [OPTIONS <extra nvcc flags>...] [DEPENDS <files>...]
#                   [INSTALL_DESTINATION <dir relative to the install prefix>])
#
# which adds the target `<name>_cubins` (built by default) producing, for each arch XX,
#   <dir>/<name>.sm_XX.cubin      nvcc -cubin -gencode arch=compute_XX,code=sm_XX -O3 -Xptxas -v
#   <dir>/<name>.sm_XX.ptxas.log  nvcc's and ptxas's complete output (registers, spills, stack,
#                                 smem, "wgmma ... serialized" notes): what the SASS audit reads
#   <dir>/<name>.cubins.txt       written at configure time: one "<cubin> <log>" line per arch
# and sets <name>_CUBINS and <name>_PTXAS_LOGS in the caller's scope. `-gencode` and not
# `-arch=sm_90a`: the latter also runs an sm_90 (non-"a") pass that rejects wgmma.
#
# Reproducible output: nvcc runs in the source's folder on its bare file name (so __FILE__, and
# any diagnostic, carries no path of the build machine); no -lineinfo, no -G. A cubin then
# depends only on the source, the flags and the nvcc release (its .note.nv.tkinfo records the
# ptxas release and options, nothing else of the machine).
#
# nvcc: cache variable MOET_NVCC (default: `nvcc` on PATH, $CUDA_HOME/bin, $CUDA_PATH/bin,
# /usr/local/cuda/bin). MOET_NVCC_FOUND is TRUE when it was found; MOET_NVCC_VERSION holds its
# release ("13.0.88"). When it is not found, moet_add_cubins() adds nothing: callers decide what
# that means (moet-kernels ships no cubins and its ops use the torch reference).
#
# The same file in script mode (`cmake -P MoetCubins.cmake`) is the per-arch compile step the
# custom commands run: it captures nvcc's output into the log and prints it on failure.

# ---------------------------------------------------------------------------------------------
# Script mode: compile one cubin.
#   -DMOET_NVCC=... -DMOET_OPTIONS_FILE=... -DMOET_SOURCE_DIR=... -DMOET_SOURCE_NAME=...
#   -DMOET_CUBIN=... -DMOET_LOG=...
if(CMAKE_SCRIPT_MODE_FILE STREQUAL CMAKE_CURRENT_LIST_FILE)
  foreach(var MOET_NVCC MOET_OPTIONS_FILE MOET_SOURCE_DIR MOET_SOURCE_NAME MOET_CUBIN MOET_LOG)
    if(NOT DEFINED ${var})
      message(FATAL_ERROR "MoetCubins.cmake (script mode): ${var} is not set")
    endif()
  endforeach()
  file(REMOVE "${MOET_CUBIN}")
  execute_process(
    COMMAND "${MOET_NVCC}" --options-file "${MOET_OPTIONS_FILE}" -o "${MOET_CUBIN}"
            "${MOET_SOURCE_NAME}"
    WORKING_DIRECTORY "${MOET_SOURCE_DIR}"
    RESULT_VARIABLE rc
    OUTPUT_VARIABLE out
    ERROR_VARIABLE out)  # one stream, in order: ptxas -v writes to stderr
  file(WRITE "${MOET_LOG}" "${out}")
  if(NOT rc EQUAL 0)
    file(REMOVE "${MOET_CUBIN}")
    message(FATAL_ERROR "nvcc failed (${rc}) building ${MOET_CUBIN}:\n${out}")
  endif()
  # Warnings stay visible in the build output; the routine "ptxas info" lines only go to the log.
  string(REGEX MATCHALL "[^\n]*(warning|error)[^\n]*" warnings "${out}")
  foreach(w IN LISTS warnings)
    message(STATUS "${w}")
  endforeach()
  return()
endif()

include_guard(GLOBAL)

set(_MOET_CUBINS_MODULE "${CMAKE_CURRENT_LIST_FILE}")

# ---------------------------------------------------------------------------------------------
# Find nvcc (once per configure; the result is cached).
find_program(MOET_NVCC NAMES nvcc
             HINTS ENV CUDA_HOME ENV CUDA_PATH
             PATH_SUFFIXES bin
             PATHS /usr/local/cuda/bin
             DOC "nvcc used to build the moet cubins")
set(MOET_NVCC_FOUND FALSE)
set(MOET_NVCC_VERSION "")
if(MOET_NVCC)
  execute_process(COMMAND "${MOET_NVCC}" --version
                  OUTPUT_VARIABLE _moet_nvcc_out ERROR_VARIABLE _moet_nvcc_out
                  RESULT_VARIABLE _moet_nvcc_rc)
  if(_moet_nvcc_rc EQUAL 0 AND _moet_nvcc_out MATCHES "V([0-9]+\\.[0-9]+\\.[0-9]+)")
    set(MOET_NVCC_FOUND TRUE)
    set(MOET_NVCC_VERSION "${CMAKE_MATCH_1}")
  else()
    message(WARNING "moet: ${MOET_NVCC} --version failed or is not nvcc's; ignoring it")
  endif()
endif()

# ---------------------------------------------------------------------------------------------
function(moet_add_cubins)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "NAME;SOURCE;OUTPUT_DIR;INSTALL_DESTINATION"
                        "ARCHS;OPTIONS;DEPENDS")
  foreach(req NAME SOURCE ARCHS OUTPUT_DIR)
    if(NOT arg_${req})
      message(FATAL_ERROR "moet_add_cubins: ${req} is required")
    endif()
  endforeach()
  if(arg_UNPARSED_ARGUMENTS)
    message(FATAL_ERROR "moet_add_cubins: unexpected arguments: ${arg_UNPARSED_ARGUMENTS}")
  endif()
  set(${arg_NAME}_CUBINS "" PARENT_SCOPE)
  set(${arg_NAME}_PTXAS_LOGS "" PARENT_SCOPE)
  if(NOT MOET_NVCC_FOUND)
    return()
  endif()

  get_filename_component(source "${arg_SOURCE}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
  if(NOT EXISTS "${source}")
    message(FATAL_ERROR "moet_add_cubins(${arg_NAME}): ${source} does not exist")
  endif()
  get_filename_component(source_dir "${source}" DIRECTORY)
  get_filename_component(source_name "${source}" NAME)
  get_filename_component(out_dir "${arg_OUTPUT_DIR}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_BINARY_DIR}")
  # Local headers next to the source (none today): any change rebuilds.
  file(GLOB local_headers CONFIGURE_DEPENDS "${source_dir}/*.cuh" "${source_dir}/*.h")

  set(stamp "${CMAKE_CURRENT_BINARY_DIR}/moet_cubins/nvcc.stamp")
  file(CONFIGURE OUTPUT "${stamp}" CONTENT "${MOET_NVCC} ${MOET_NVCC_VERSION}\n" @ONLY)
  set(cubins "")
  set(logs "")
  set(index "")
  foreach(arch IN LISTS arg_ARCHS)
    if(NOT arch MATCHES "^[0-9]+[a-z]?$")
      message(FATAL_ERROR "moet_add_cubins: arch '${arch}' is not like 90a / 100a / 120a")
    endif()
    set(stem "${arg_NAME}.sm_${arch}")
    set(cubin "${out_dir}/${stem}.cubin")
    set(log "${out_dir}/${stem}.ptxas.log")
    # The flags live in an options file and nvcc's identity in a stamp, both written only when
    # they change: a flag change or another nvcc rebuilds, nothing else does.
    set(opts_file "${CMAKE_CURRENT_BINARY_DIR}/moet_cubins/${stem}.nvcc-options")
    set(opts -cubin -gencode "arch=compute_${arch},code=sm_${arch}" -O3 -std=c++17 -Xptxas -v
             ${arg_OPTIONS})
    list(JOIN opts "\n" opts_text)
    file(CONFIGURE OUTPUT "${opts_file}" CONTENT "${opts_text}\n" @ONLY)
    add_custom_command(
      OUTPUT "${cubin}" "${log}"
      COMMAND "${CMAKE_COMMAND}" -E make_directory "${out_dir}"
      COMMAND "${CMAKE_COMMAND}" "-DMOET_NVCC=${MOET_NVCC}" "-DMOET_OPTIONS_FILE=${opts_file}"
              "-DMOET_SOURCE_DIR=${source_dir}" "-DMOET_SOURCE_NAME=${source_name}"
              "-DMOET_CUBIN=${cubin}" "-DMOET_LOG=${log}" -P "${_MOET_CUBINS_MODULE}"
      DEPENDS "${source}" "${opts_file}" "${stamp}" "${_MOET_CUBINS_MODULE}" ${local_headers} ${arg_DEPENDS}
      COMMENT "nvcc ${source_name} -> ${stem}.cubin"
      VERBATIM)
    list(APPEND cubins "${cubin}")
    list(APPEND logs "${log}")
    string(APPEND index "${stem}.cubin ${stem}.ptxas.log\n")
  endforeach()
  # The index of what this call builds, for the SASS audit (packages/moet-kernels/tools/).
  file(CONFIGURE OUTPUT "${out_dir}/${arg_NAME}.cubins.txt" CONTENT "${index}")
  add_custom_target(${arg_NAME}_cubins ALL DEPENDS ${cubins})
  if(arg_INSTALL_DESTINATION)
    install(FILES ${cubins} DESTINATION "${arg_INSTALL_DESTINATION}")
  endif()
  set(${arg_NAME}_CUBINS "${cubins}" PARENT_SCOPE)
  set(${arg_NAME}_PTXAS_LOGS "${logs}" PARENT_SCOPE)
endfunction()

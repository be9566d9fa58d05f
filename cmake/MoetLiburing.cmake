# MoetLiburing.cmake -- find Debian's static liburing (liburing-dev) for the moet native packages.
#
#   option MOET_WITH_LIBURING (default ON): look for liburing; when it is not found the build
#   continues without io_uring (the pread engine is used at run time).
#
#   moet_link_liburing(<target>) links the static liburing into <target> with its symbols hidden
#   (-Wl,--exclude-libs,ALL) and defines MOET_HAVE_LIBURING=1 (or 0 when absent/disabled).
#   MOET_LIBURING_FOUND is set to TRUE/FALSE in the caller's scope.
include_guard(GLOBAL)

option(MOET_WITH_LIBURING "Build the io_uring engine against a static liburing" ON)

set(MOET_LIBURING_FOUND FALSE)
if(MOET_WITH_LIBURING)
  find_package(PkgConfig QUIET)
  if(PKG_CONFIG_FOUND)
    pkg_check_modules(MOET_PC_LIBURING QUIET liburing)
  endif()
  find_path(MOET_LIBURING_INCLUDE_DIR liburing.h HINTS ${MOET_PC_LIBURING_INCLUDE_DIRS})
  # Prefer the static archive: the wheel must not depend on liburing.so.
  find_library(MOET_LIBURING_STATIC NAMES liburing.a HINTS ${MOET_PC_LIBURING_LIBRARY_DIRS})
  if(MOET_LIBURING_INCLUDE_DIR AND MOET_LIBURING_STATIC)
    set(MOET_LIBURING_FOUND TRUE)
    if(NOT TARGET moet::liburing)
      add_library(moet::liburing STATIC IMPORTED GLOBAL)
      set_target_properties(moet::liburing PROPERTIES
        IMPORTED_LOCATION "${MOET_LIBURING_STATIC}"
        INTERFACE_INCLUDE_DIRECTORIES "${MOET_LIBURING_INCLUDE_DIR}")
    endif()
    message(STATUS "moet: io_uring enabled (static ${MOET_LIBURING_STATIC})")
  else()
    message(WARNING "moet: liburing not found (install Debian's liburing-dev); "
                    "building without io_uring, the pread engine will be used")
  endif()
else()
  message(STATUS "moet: io_uring disabled (MOET_WITH_LIBURING=OFF)")
endif()

function(moet_link_liburing target)
  if(MOET_LIBURING_FOUND)
    target_link_libraries(${target} PRIVATE moet::liburing)
    target_compile_definitions(${target} PRIVATE MOET_HAVE_LIBURING=1)
    if(CMAKE_SYSTEM_NAME STREQUAL "Linux")
      target_link_options(${target} PRIVATE "LINKER:--exclude-libs,ALL")
    endif()
  else()
    target_compile_definitions(${target} PRIVATE MOET_HAVE_LIBURING=0)
  endif()
endfunction()

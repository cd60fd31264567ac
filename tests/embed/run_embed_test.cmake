# The embed test (a ctest): installs a tensor_ops build tree's SDK into a
# fresh prefix, builds this directory's outside project against it with
# find_package(tensor_ops), and runs its programs.
#   cmake -DBUILD_DIR=<tensor_ops build> -DWORK_DIR=<scratch> -DCONFIG=<config>
#         -DGENERATOR=<generator> -DC_COMPILER=... -DCXX_COMPILER=...
#         [-DC_FLAGS=... -DCXX_FLAGS=... -DLINKER_FLAGS=...] -P run_embed_test.cmake
foreach(var BUILD_DIR WORK_DIR CONFIG GENERATOR C_COMPILER CXX_COMPILER)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_embed_test.cmake: -D${var}=... is required")
  endif()
endforeach()

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " cmd "${ARGN}")
    message(FATAL_ERROR "embed test: `${cmd}` failed (${rc})")
  endif()
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
set(prefix "${WORK_DIR}/prefix")
run(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${prefix}" --component tensor_ops_sdk --config "${CONFIG}")
# A plain build installs the usual layout; a Python build (the wheel's) all
# inside the package folder tensor_ops/, which is then the prefix to search.
set(root "${prefix}")
set(libdir lib)
if(EXISTS "${prefix}/tensor_ops/lib/cmake/tensor_ops")
  set(root "${prefix}/tensor_ops")
  set(libdir .)
endif()
# The package must be complete: config, version file, targets, headers, the core.
foreach(f lib/cmake/tensor_ops/tensor_opsConfig.cmake lib/cmake/tensor_ops/tensor_opsConfigVersion.cmake
    include/tensor_ops/tensor_ops.h include/tensor_ops/ops.h include/tensor_ops/plugin.h ${libdir}/libtensor_ops.so)
  if(NOT EXISTS "${root}/${f}")
    message(FATAL_ERROR "embed test: the install is missing ${f}")
  endif()
endforeach()
# Every backend plugin the build made lies beside the installed core.
file(GLOB plugins "${BUILD_DIR}/libtensor_ops_*.so")
foreach(p ${plugins})
  get_filename_component(name "${p}" NAME)
  if(NOT EXISTS "${root}/${libdir}/${name}")
    message(FATAL_ERROR "embed test: plugin ${name} was built but not installed beside libtensor_ops.so")
  endif()
endforeach()
run(${CMAKE_COMMAND} -S "${CMAKE_CURRENT_LIST_DIR}" -B "${WORK_DIR}/build" -G "${GENERATOR}"
  "-DCMAKE_BUILD_TYPE=${CONFIG}" "-DCMAKE_PREFIX_PATH=${root}" "-DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF"
  "-DCMAKE_C_COMPILER=${C_COMPILER}" "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}"
  "-DCMAKE_C_FLAGS=${C_FLAGS}" "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}" "-DCMAKE_EXE_LINKER_FLAGS=${LINKER_FLAGS}")
run(${CMAKE_COMMAND} --build "${WORK_DIR}/build" --config "${CONFIG}")
foreach(app embed_cpp embed_c)
  set(exe "${WORK_DIR}/build/${app}")
  if(NOT EXISTS "${exe}")
    set(exe "${WORK_DIR}/build/${CONFIG}/${app}")  # multi-config generators
  endif()
  run(${CMAKE_COMMAND} -E env --unset=TENSOR_OPS_PLUGIN_PATH "${exe}")
endforeach()

# The PTX of the CUDA sources checked for writes to the A registers of an in-flight wgmma
# (tests/ptx/check_wgmma_registers.py): a compiler-level hazard no CPU test would see, checked
# wherever nvcc is (CI included) since the GPU tests run only on the GPU machine.
if(KESTREL_CUDA)
  find_package(Python3 COMPONENTS Interpreter)
  if(Python3_FOUND)
    add_test(NAME ptx_wgmma_register_hazards
      COMMAND ${Python3_EXECUTABLE} ${CMAKE_SOURCE_DIR}/tests/ptx/check_wgmma_registers.py
              ${CMAKE_CUDA_COMPILER} ${CMAKE_SOURCE_DIR})
    set_tests_properties(ptx_wgmma_register_hazards PROPERTIES LABELS "cpu;ptx" TIMEOUT 300)
  endif()
endif()

// Capping the CUDA caching allocator of one device, as torch.cuda.set_per_process_memory_fraction
// does: an allocation that would take the device's allocated-by-this-process bytes beyond
// `fraction` of its total memory fails with CUDA's out-of-memory error, as on a smaller card.
//
// Compiled with DUALEDIT_CUDA_ALLOCATOR only when build.rs finds libtorch_cuda, libc10_cuda and
// the CUDA runtime headers; otherwise the function answers "not available" (0). Same return
// codes as memstats.cpp: 1 done, 0 not available, -1 error with the message in err.
#include <cstddef>
#include <cstring>
#include <exception>

#ifdef DUALEDIT_CUDA_ALLOCATOR
#include <c10/cuda/CUDACachingAllocator.h>
#endif

// 1 when this build caps each CUDA device on its own, 0 when it falls back to one fraction.
extern "C" int dualedit_cuda_cap_is_per_device() {
#ifdef DUALEDIT_CUDA_ALLOCATOR
  return 1;
#else
  return 0;
#endif
}

extern "C" int dualedit_cuda_set_memory_fraction(int device_index, double fraction, char* err, size_t err_len) {
#ifdef DUALEDIT_CUDA_ALLOCATOR
  try {
    c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction, static_cast<c10::DeviceIndex>(device_index));
    return 1;
  } catch (const std::exception& e) {
    if (err != nullptr && err_len > 0) {
      std::strncpy(err, e.what(), err_len - 1);
      err[err_len - 1] = '\0';
    }
    return -1;
  }
#else
  (void)device_index;
  (void)fraction;
  (void)err;
  (void)err_len;
  return 0;
#endif
}

// Caching-allocator statistics for the accelerator (CUDA on the machines dualedit targets).
//
// tch exposes none of torch.cuda.memory_stats; libtorch's at::accelerator API has them.
// Every entry point is noexcept towards Rust: errors become return codes, and on a
// machine without an accelerator the functions answer "none" without touching any
// device runtime.
#include <ATen/DeviceAccelerator.h>
#include <c10/core/AllocatorConfig.h>
#include <string>
#include <cstdint>
#include <cstring>
#include <exception>

namespace {
bool has_accelerator() {
  try {
    return at::accelerator::getAccelerator(false).has_value() &&
           at::accelerator::deviceCount() > 0;
  } catch (...) {
    return false;
  }
}

void write_error(const char* msg, char* err, size_t err_len) {
  if (err != nullptr && err_len > 0) {
    std::strncpy(err, msg, err_len - 1);
    err[err_len - 1] = '\0';
  }
}
}  // namespace

extern "C" {

// Number of accelerator devices (0 when there is none).
int dualedit_accelerator_count() {
  return has_accelerator() ? static_cast<int>(at::accelerator::deviceCount()) : 0;
}

// Fills out[0..4] with allocated current/peak and reserved current/peak bytes (aggregate pool).
// Returns 1 on success, 0 when there is no accelerator, -1 on error (message in err).
int dualedit_accelerator_stats(int device_index, int64_t* out, char* err, size_t err_len) {
  if (!has_accelerator()) return 0;
  try {
    const auto stats = at::accelerator::getDeviceStats(static_cast<c10::DeviceIndex>(device_index));
    const size_t agg = 0;  // StatType::AGGREGATE: all pools together
    out[0] = stats.allocated_bytes[agg].current;
    out[1] = stats.allocated_bytes[agg].peak;
    out[2] = stats.reserved_bytes[agg].current;
    out[3] = stats.reserved_bytes[agg].peak;
    return 1;
  } catch (const std::exception& e) {
    write_error(e.what(), err, err_len);
    return -1;
  } catch (...) {
    write_error("unknown error reading accelerator statistics", err, err_len);
    return -1;
  }
}

// Resets the peak statistics of one device. Same return codes as above.
int dualedit_accelerator_reset_peak(int device_index, char* err, size_t err_len) {
  if (!has_accelerator()) return 0;
  try {
    at::accelerator::resetPeakStats(static_cast<c10::DeviceIndex>(device_index));
    return 1;
  } catch (const std::exception& e) {
    write_error(e.what(), err, err_len);
    return -1;
  }
}

// Releases cached, unused blocks back to the device. Same return codes as above.
int dualedit_accelerator_empty_cache(char* err, size_t err_len) {
  if (!has_accelerator()) return 0;
  try {
    at::accelerator::emptyCache();
    return 1;
  } catch (const std::exception& e) {
    write_error(e.what(), err, err_len);
    return -1;
  }
}
}

// Total bytes of an accelerator device (the allocator's view: cudaMemGetInfo's total).
// Same return codes as above.
extern "C" int dualedit_accelerator_total_bytes(int device_index, int64_t* out, char* err, size_t err_len) {
  if (!has_accelerator()) return 0;
  try {
    const auto info = at::accelerator::getMemoryInfo(static_cast<c10::DeviceIndex>(device_index));
    *out = static_cast<int64_t>(info.second);
    return 1;
  } catch (const std::exception& e) {
    write_error(e.what(), err, err_len);
    return -1;
  }
}

// One memory fraction for every device of the accelerator's caching allocator, through its
// settings string (PYTORCH_CUDA_ALLOC_CONF's per_process_memory_fraction), which needs no
// CUDA headers: the fallback when memcap.cpp was built without them. Same return codes.
extern "C" int dualedit_accelerator_set_global_fraction(double fraction, char* err, size_t err_len) {
  if (!has_accelerator()) return 0;
  try {
    c10::CachingAllocator::setAllocatorSettings("per_process_memory_fraction:" + std::to_string(fraction));
    return 1;
  } catch (const std::exception& e) {
    write_error(e.what(), err, err_len);
    return -1;
  }
}

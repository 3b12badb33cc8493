// The DLPack ABI, the part a CPU consumer reads: the structs and constants as dlpack/include/dlpack/
// dlpack.h defines them (DLPack 1.3, https://dmlc.github.io/dlpack/latest/c_api.html), and the
// Python protocol's capsule names (https://dmlc.github.io/dlpack/latest/python_spec.html). The ABI
// is public and stable; it is written out here rather than vendored because it is this small.
#pragma once

#include <cstdint>

namespace simdnorm::dlpack {

// DLDeviceType: where the data lives. The two *Host kinds are pinned host memory, CPU-addressable.
enum DeviceType : int32_t { kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLROCMHost = 11 };

// DLDataTypeCode: the ones simdnorm reads (float16/32/64, bfloat16); the rest are named in messages.
enum DataTypeCode : uint8_t { kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLOpaqueHandle = 3, kDLBfloat = 4,
                              kDLComplex = 5, kDLBool = 6 };

struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};

struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

struct DLTensor {
  void* data;            // with byte_offset, the address of element (0, ..., 0)
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;        // ndim values
  int64_t* strides;      // ndim values in elements, or NULL: compact row-major
  uint64_t byte_offset;
};

// The legacy (pre-1.0) managed tensor: capsule name "dltensor".
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

struct DLPackVersion {
  uint32_t major;
  uint32_t minor;
};

constexpr uint32_t kMajorVersion = 1;  // the struct layout below; a higher major may change it
constexpr uint64_t kFlagReadOnly = 1ull << 0;  // DLPACK_FLAG_BITMASK_READ_ONLY: never write it

// The versioned (1.x) managed tensor: capsule name "dltensor_versioned". version comes first in
// every major version, so a consumer can read it before trusting the rest.
struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorVersioned* self);
  uint64_t flags;
  DLTensor dl_tensor;
};

// The C exchange API (DLPack 1.2 on, python_spec.html's __dlpack_c_exchange_api__): a capsule on the
// producer's type holding a table of C functions, so that a consumer reads a tensor without a
// Python call. Within a major version the table only grows at its end; prev_api chains to older
// majors. simdnorm takes the borrowed export (valid while the caller holds the object) and the
// owning one (the only one with flags: read-only). The pointers simdnorm does not call are void*.
struct ExchangeApiHeader {
  DLPackVersion version;
  ExchangeApiHeader* prev_api;
};

struct ExchangeApi {
  ExchangeApiHeader header;
  void* managed_tensor_allocator;
  int (*managed_tensor_from_py_object_no_sync)(void* py_object, DLManagedTensorVersioned** out);
  void* managed_tensor_to_py_object_no_sync;
  int (*dltensor_from_py_object_no_sync)(void* py_object, DLTensor* out);  // may be NULL
  void* current_work_stream;
};

constexpr const char* kExchangeApiAttribute = "__dlpack_c_exchange_api__";
constexpr const char* kExchangeApiCapsule = "dlpack_exchange_api";

// A consumer renames the capsule it takes ownership from, so that the producer's capsule
// destructor leaves the deleter to the consumer (python_spec.html, "Semantics").
constexpr const char* kCapsule = "dltensor";
constexpr const char* kUsedCapsule = "used_dltensor";
constexpr const char* kCapsuleVersioned = "dltensor_versioned";
constexpr const char* kUsedCapsuleVersioned = "used_dltensor_versioned";

}  // namespace simdnorm::dlpack

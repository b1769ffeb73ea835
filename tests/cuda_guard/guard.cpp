// A CUDA that is there for autograd and never runs a kernel: loaded into a CPU-only torch, fake CUDA
// tensors (FakeTensorMode, device "cuda") run backward, copies and optimizer steps. For the tests only
// (tests/cuda_guard/__init__.py builds it; tests/fake_cuda_checks.py runs under it); tpbench never
// loads it.
//
// What a CPU-only torch lacks, and what stands in:
// - a CUDA device guard ("PyTorch is not linked with support for cuda devices" on the first copy or
//   autograd node): torch's own FakeGuardImpl, which keeps a current device and stream per thread;
// - CUDA's accelerator hooks ("Cannot access accelerator device when none is available": autograd's
//   input buffers ask the accelerator for the current stream of a CUDA gradient): hooks saying CUDA is
//   built and available with one device. torch reads them once, while `import torch` initialises
//   torch._C, so this library must be loaded before torch (LD_PRELOAD);
// - DDP's CUDA timer (its reducer asserts it has one for the module's device): the host clock, as
//   DDP's CPU timer.
// torch.cuda stays unavailable (torch.cuda.is_available() is False): nothing here allocates.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>
#include <torch/csrc/distributed/c10d/reducer_timer.hpp>

namespace at {
namespace {

using FakeCUDAGuard = c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>;

struct FakeCUDAHooks final : CUDAHooksInterface {
  explicit FakeCUDAHooks(CUDAHooksArgs /*unused*/) {}
  void init() const override {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex /*unused*/) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
};

}  // namespace

C10_REGISTER_GUARD_IMPL(CUDA, FakeCUDAGuard);
// the name torch's getCUDAHooks() asks its registry for (REGISTER_CUDA_HOOKS would use the class's)
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", FakeCUDAHooks);

}  // namespace at

namespace c10d {
namespace {

struct HostTimer final : Timer {
  explicit HostTimer(c10::Device /*unused*/) {}
  std::optional<int64_t> measureDifference(Event start, Event end) override {
    auto from = getTimestamp(start), to = getTimestamp(end);
    if (!from || !to || *to < *from) {
      return std::nullopt;
    }
    return *to - *from;
  }
};

}  // namespace

C10_REGISTER_TYPED_CLASS(TimerRegistry, c10::kCUDA, HostTimer);

}  // namespace c10d

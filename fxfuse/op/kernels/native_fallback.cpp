// The fused op's NCCL fallback in C++: the per-call host work of `NcclPlan` without Python.
//
// Built and loaded by fxfuse/op/kernels/native_build.py; driven by fxfuse/op/kernels/native_fallback.py. Why it exists:
// outside CUDA graphs every fused site pays the op's host cost, and a Python kernel pays the
// dispatcher's conversion into Python plus one Python-to-C++ crossing per tensor operation it issues;
// the unfused code Inductor compiles issues the same all-reduce, wait and norm launch with less. Here
// the all-reduce, wait, output allocations, alignment copies and the launch of the add-RMSNorm kernel
// (Triton's compiled kernel, through the driver's cuLaunchKernel, once Python registered it with
// `fxfuse_native::register_norm_launch`) are C++ calls. Until a kernel is registered the launch goes
// back to Python, through the op `fxfuse::add_rmsnorm_into` (and so always on CPU, in tests).
//
// What runs is still decided in Python: `fxfuse_native::register_nccl` marks one call shape
// (group, tokens, hidden, dtypes) as "NCCL fallback" once Python has decided it, for the process group
// the name means at that moment (torch reuses a name after destroy_process_group + init_process_group:
// a call whose name now resolves to another group drops the registration and goes back to Python,
// which forgets everything it decided for the old group); calls of any other shape, or whose weight
// or residual does not fit x (shape, device), go to `fxfuse::allreduce_residual_rmsnorm_planned` (the Python kernel, which decides, and runs
// the other plans). `fxfuse_native::install()` makes `run_boxed` the CUDA kernel of the four overloads
// of `fxfuse::allreduce_residual_rmsnorm`; `fxfuse_native::run` is the same path as a plain op (tests
// drive it with CPU tensors and gloo).
//
// The all-reduce-only ops of tier (b) (`fxfuse::all_reduce`, `fxfuse::all_reduce_`) run here the same way:
// shapes Python registered with `fxfuse_native::register_all_reduce` (its NCCL plan) issue Inductor's own
// calls (`all_reduce_` and `wait_tensor`, on x itself for the in-place op, else on a contiguous copy),
// every other call goes back to `fxfuse::all_reduce_planned` / `all_reduce_planned_` in Python.
//
// Arithmetic is exactly the Python plan's: all-reduce sum into x's memory when x is donated,
// contiguous, 16-byte aligned and shares no memory with the residual or weight (else into a
// contiguous copy), then the add-RMSNorm kernel writing a
// fresh `residual_out` (or the reduced buffer itself when it is a copy) and a fresh `normed`.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <dlfcn.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/library.h>

#include <atomic>
#include <deque>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kAlignment = 16;
constexpr int8_t kNoResidual = -1;
// The weight dtype of an all-reduce-only op's shape key (it has no weight).
constexpr int8_t kAllReduceOnly = -2;

// Folds `parts` into `seed`: the hash of a key made of a few integers.
size_t combined_hash(size_t seed, std::initializer_list<int64_t> parts) {
  for (int64_t part : parts) seed = seed * 1000003u ^ std::hash<int64_t>()(part);
  return seed;
}

struct ShapeKey {
  std::string group;
  int64_t tokens;
  int64_t hidden;
  int8_t x_dtype;
  int8_t weight_dtype;
  int8_t residual_dtype;  // kNoResidual when the call has no residual

  bool operator==(const ShapeKey& other) const {
    return tokens == other.tokens && hidden == other.hidden && x_dtype == other.x_dtype &&
           weight_dtype == other.weight_dtype && residual_dtype == other.residual_dtype && group == other.group;
  }
};

struct ShapeKeyHash {
  size_t operator()(const ShapeKey& key) const {
    return combined_hash(std::hash<std::string>()(key.group), {key.tokens, key.hidden, key.x_dtype, key.weight_dtype,
                                                               key.residual_dtype});
  }
};

// A compiled add-RMSNorm kernel (Triton's), launched with the driver's cuLaunchKernel: which device,
// row width and dtypes (x, weight, residual: kNoResidual for the kernel without one) it was compiled for.
struct NormKey {
  int8_t device;
  int64_t hidden;
  int8_t x_dtype;
  int8_t weight_dtype;
  int8_t residual_dtype;

  bool operator==(const NormKey& other) const {
    return device == other.device && hidden == other.hidden && x_dtype == other.x_dtype &&
           weight_dtype == other.weight_dtype && residual_dtype == other.residual_dtype;
  }
};

struct NormKeyHash {
  size_t operator()(const NormKey& key) const {
    return combined_hash(std::hash<int64_t>()(key.hidden), {key.device, key.x_dtype, key.weight_dtype,
                                                            key.residual_dtype});
  }
};

// What fxfuse/op/kernels/triton_launch.py:driver_launch vouched for: the kernel takes (reduced, residual,
// weight, residual_out, normed pointers, int32 hidden, float32 eps) and at most two null scratch pointers.
struct NormLaunch {
  void* function;
  unsigned threads;
  unsigned shared_bytes;
};

// A shape Python decided to run as the NCCL fallback: its call counter's index, and the process group
// its name meant then (a weak reference: it keeps the group's address from being reused, not the group).
struct Registration {
  size_t counter;
  c10::weak_intrusive_ptr<c10d::ProcessGroup> group;
};

// Shapes Python decided to run as the NCCL fallback.
std::mutex registry_mutex;
std::unordered_map<ShapeKey, Registration, ShapeKeyHash> nccl_shapes;
// One counter per registration, in a deque so that they never move: a call bumps its counter
// through a pointer taken under the lock.
std::deque<std::atomic<int64_t>> call_counts;
std::vector<std::unique_ptr<torch::Library>> installed;
std::unordered_map<NormKey, NormLaunch, NormKeyHash> norm_launches;

using LaunchKernelFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                               void**, void**);

// The driver's cuLaunchKernel (libcuda is loaded by then: the kernel being launched came from it).
LaunchKernelFn launch_kernel_fn() {
  static const LaunchKernelFn fn = [] {
    void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    return driver ? reinterpret_cast<LaunchKernelFn>(dlsym(driver, "cuLaunchKernel")) : nullptr;
  }();
  return fn;
}

int8_t dtype_code(at::ScalarType dtype) { return static_cast<int8_t>(dtype); }

bool aligned_contiguous(const at::Tensor& t) {
  return t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data_ptr()) % kAlignment == 0;
}

// The byte addresses [first, end) that t's elements occupy (fxfuse.op.reference.memory_span).
std::pair<uintptr_t, uintptr_t> memory_span(const at::Tensor& t) {
  if (t.numel() == 0) return {0, 0};
  int64_t extent = 1;
  for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
  const auto start = reinterpret_cast<uintptr_t>(t.data_ptr());
  return {start, start + static_cast<uintptr_t>(extent * t.element_size())};
}

bool may_overlap(const at::Tensor& a, const std::optional<at::Tensor>& b) {
  if (!b.has_value()) return false;
  const auto [a_start, a_end] = memory_span(a);
  const auto [b_start, b_end] = memory_span(*b);
  return a_start < b_end && b_start < a_end;
}

at::Tensor aligned(const at::Tensor& t) {
  return aligned_contiguous(t) ? t : t.clone(at::MemoryFormat::Contiguous);
}

c10::OperatorHandle op_handle(const char* name, const char* overload) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
}

c10::DispatchKeySet backend_keys(const at::Tensor& t) {
  return c10::DispatchKeySet(t.is_cuda() ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU);
}

// The Python kernel that decides and runs every plan (shapes not registered here).
std::tuple<at::Tensor, at::Tensor> run_planned(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                               const at::Tensor& weight, double eps, const std::string& group,
                                               bool donated, double weight_offset, bool weight_in_fp32) {
  static const c10::OperatorHandle planned = op_handle("fxfuse::allreduce_residual_rmsnorm_planned", "");
  torch::jit::Stack stack{x, residual, weight, eps, group, donated, weight_offset, weight_in_fp32};
  planned.redispatchBoxed(backend_keys(x), &stack);
  return {stack[0].toTensor(), stack[1].toTensor()};
}

std::optional<NormLaunch> norm_launch_for(const NormKey& key) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto found = norm_launches.find(key);
  if (found == norm_launches.end()) return std::nullopt;
  return found->second;
}

// The add-RMSNorm kernel on the current stream of reduced's device, one program per row.
void launch_norm(const NormLaunch& launch, int64_t tokens, const at::Tensor& reduced, const at::Tensor& residual,
                 const at::Tensor& weight, const at::Tensor& residual_out, const at::Tensor& normed, double eps) {
  void* pointers[5] = {reduced.data_ptr(), residual.data_ptr(), weight.data_ptr(), residual_out.data_ptr(),
                       normed.data_ptr()};
  int32_t hidden = static_cast<int32_t>(reduced.size(-1));
  float eps32 = static_cast<float>(eps);
  void* null_scratch = nullptr;
  void* params[9] = {&pointers[0], &pointers[1], &pointers[2], &pointers[3], &pointers[4],
                     &hidden,      &eps32,       &null_scratch, &null_scratch};
  void* stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(reduced.device()).native_handle();
  const int status = launch_kernel_fn()(launch.function, static_cast<unsigned>(tokens), 1, 1, launch.threads, 1, 1,
                                        launch.shared_bytes, stream, params, nullptr);
  TORCH_CHECK(status == 0, "fxfuse: cuLaunchKernel of the add-RMSNorm kernel failed with CUresult ", status);
}

// The process group `name` means now, or null if none does.
c10::intrusive_ptr<c10d::ProcessGroup> current_group(const std::string& name) {
  try {
    return c10d::resolve_process_group(name);
  } catch (const std::exception&) {
    return {};
  }
}

// The counter of a registered shape whose group is still the one its name meant at registration;
// null otherwise (a stale registration is dropped: Python decides again).
std::atomic<int64_t>* counter_of(const ShapeKey& key) {
  const auto group = current_group(key.group);
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto found = nccl_shapes.find(key);
  if (found == nccl_shapes.end()) return nullptr;
  if (!group || found->second.group.lock().get() != group.get()) {
    nccl_shapes.erase(found);
    return nullptr;
  }
  return &call_counts[found->second.counter];
}

std::tuple<at::Tensor, at::Tensor> run_shape(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                             const at::Tensor& weight, double eps, const std::string& group,
                                             bool donated, double weight_offset, bool weight_in_fp32) {
  const int64_t hidden = x.dim() ? x.size(-1) : 0;
  const ShapeKey key{group, hidden ? x.numel() / hidden : 0, hidden, dtype_code(x.scalar_type()),
                     dtype_code(weight.scalar_type()),
                     residual.has_value() ? dtype_code(residual->scalar_type()) : kNoResidual};
  // Only the plain norm (the weight in x's dtype after the cast, a residual of x's dtype) runs here.
  const bool plain = weight_offset == 0.0 && !weight_in_fp32 &&
                     (!residual.has_value() || residual->scalar_type() == x.scalar_type());
  const bool fits = weight.dim() == 1 && weight.size(0) == hidden && weight.device() == x.device() &&
                    (!residual.has_value() || (residual->sizes() == x.sizes() && residual->device() == x.device()));
  std::atomic<int64_t>* counter = plain && fits && key.tokens != 0 ? counter_of(key) : nullptr;
  if (counter == nullptr) {  // Python decides (and raises on arguments that do not fit)
    return run_planned(x, residual, weight, eps, group, donated, weight_offset, weight_in_fp32);
  }
  static const c10::OperatorHandle all_reduce_ = op_handle("_c10d_functional::all_reduce_", "");
  static const c10::OperatorHandle wait_tensor = op_handle("_c10d_functional::wait_tensor", "");
  static const c10::OperatorHandle add_rmsnorm_into = op_handle("fxfuse::add_rmsnorm_into", "");

  const bool in_place = donated && aligned_contiguous(x) && !may_overlap(x, residual) && !may_overlap(x, weight);
  at::Tensor reduced = in_place ? x : x.clone(at::MemoryFormat::Contiguous);
  {
    torch::jit::Stack stack{reduced, std::string("sum"), group};
    all_reduce_.callBoxed(&stack);
    stack = {reduced};
    wait_tensor.callBoxed(&stack);
  }
  at::Tensor residual_out = in_place ? at::empty_like(reduced) : reduced;
  at::Tensor normed = at::empty_like(reduced);
  std::optional<at::Tensor> residual_in;
  if (residual.has_value()) residual_in = aligned(*residual);
  const at::Tensor weight_in = aligned(weight);
  std::optional<NormLaunch> launch;
  if (reduced.is_cuda() && launch_kernel_fn() != nullptr) {
    launch = norm_launch_for(
        {static_cast<int8_t>(reduced.get_device()), hidden, key.x_dtype, key.weight_dtype, key.residual_dtype});
  }
  if (launch.has_value()) {
    launch_norm(*launch, key.tokens, reduced, residual_in.value_or(reduced), weight_in, residual_out, normed, eps);
  } else {  // not compiled yet (or not launchable from here): the Python kernel launches it
    torch::jit::Stack stack{reduced, residual_in, weight_in, eps, residual_out, normed};
    add_rmsnorm_into.redispatchBoxed(backend_keys(reduced), &stack);
  }
  counter->fetch_add(1, std::memory_order_relaxed);
  return {normed, residual_out};
}

// The all-reduce-only op: Inductor's calls for a registered shape (into x when `in_place`), else Python's plan.
at::Tensor all_reduce_shape(const at::Tensor& x, const std::string& group, bool in_place) {
  const int64_t hidden = x.dim() ? x.size(-1) : 1;
  const ShapeKey key{group, hidden ? x.numel() / hidden : 0, hidden, dtype_code(x.scalar_type()), kAllReduceOnly,
                     kNoResidual};
  std::atomic<int64_t>* counter = key.tokens != 0 ? counter_of(key) : nullptr;
  if (counter == nullptr) {
    static const c10::OperatorHandle planned = op_handle("fxfuse::all_reduce_planned", "");
    static const c10::OperatorHandle planned_in_place = op_handle("fxfuse::all_reduce_planned_", "");
    torch::jit::Stack stack{x, group};
    (in_place ? planned_in_place : planned).redispatchBoxed(backend_keys(x), &stack);
    return in_place ? x : stack[0].toTensor();
  }
  static const c10::OperatorHandle all_reduce_ = op_handle("_c10d_functional::all_reduce_", "");
  static const c10::OperatorHandle wait_tensor = op_handle("_c10d_functional::wait_tensor", "");
  at::Tensor target = in_place && x.is_contiguous() ? x : x.clone(at::MemoryFormat::Contiguous);
  torch::jit::Stack stack{target, std::string("sum"), group};
  all_reduce_.callBoxed(&stack);
  stack = {target};
  wait_tensor.callBoxed(&stack);
  if (in_place && !target.is_same(x)) x.copy_(target);
  counter->fetch_add(1, std::memory_order_relaxed);
  return in_place ? x : target;
}

template <bool in_place>
void all_reduce_boxed(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  // Arguments: x, group_name.
  auto args = torch::jit::last(*stack, 2);
  const at::Tensor x = args[0].toTensor();
  const std::string group = args[1].toStringRef();
  torch::jit::drop(*stack, 2);
  at::Tensor reduced = all_reduce_shape(x, group, in_place);
  if (!in_place) stack->emplace_back(std::move(reduced));
}

template <bool donated>
void run_boxed(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  // Arguments: x, residual (None or Tensor), weight, eps (float, or a 0-dim CPU tensor), group_name,
  // weight_offset, weight_in_fp32.
  auto args = torch::jit::last(*stack, 7);
  const at::Tensor x = args[0].toTensor();
  std::optional<at::Tensor> residual;
  if (!args[1].isNone()) residual = args[1].toTensor();
  const at::Tensor weight = args[2].toTensor();
  const double eps = args[3].isTensor() ? args[3].toTensor().item<double>() : args[3].toDouble();
  const std::string group = args[4].toStringRef();
  const double weight_offset = args[5].toDouble();
  const bool weight_in_fp32 = args[6].toBool();
  torch::jit::drop(*stack, 7);
  auto [normed, residual_out] = run_shape(x, residual, weight, eps, group, donated, weight_offset, weight_in_fp32);
  stack->emplace_back(std::move(normed));
  stack->emplace_back(std::move(residual_out));
}

// Registers `key` for the process group its name means now; returns its call counter's index (the
// existing one when the same group registered it before).
int64_t register_key(const ShapeKey& key) {
  const auto group_now = current_group(key.group);
  TORCH_CHECK(group_now, "fxfuse: no process group is named ", key.group);
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto found = nccl_shapes.find(key);
  if (found != nccl_shapes.end() && found->second.group.lock().get() == group_now.get()) {
    return static_cast<int64_t>(found->second.counter);
  }
  call_counts.emplace_back(0);
  const size_t index = call_counts.size() - 1;
  nccl_shapes.insert_or_assign(key, Registration{index, c10::weak_intrusive_ptr<c10d::ProcessGroup>(group_now)});
  return static_cast<int64_t>(index);
}

int64_t register_nccl(std::string group, int64_t tokens, int64_t hidden, at::ScalarType x_dtype,
                      at::ScalarType weight_dtype, std::optional<at::ScalarType> residual_dtype) {
  const ShapeKey key{group, tokens, hidden, dtype_code(x_dtype), dtype_code(weight_dtype),
                     residual_dtype.has_value() ? dtype_code(*residual_dtype) : kNoResidual};
  return register_key(key);
}

int64_t register_all_reduce(std::string group, int64_t tokens, int64_t hidden, at::ScalarType dtype) {
  const ShapeKey key{group, tokens, hidden, dtype_code(dtype), kAllReduceOnly, kNoResidual};
  return register_key(key);
}

void register_norm_launch(int64_t device, int64_t hidden, at::ScalarType x_dtype, at::ScalarType weight_dtype,
                          std::optional<at::ScalarType> residual_dtype, int64_t function, int64_t threads,
                          int64_t shared_bytes) {
  const NormKey key{static_cast<int8_t>(device), hidden, dtype_code(x_dtype), dtype_code(weight_dtype),
                    residual_dtype.has_value() ? dtype_code(*residual_dtype) : kNoResidual};
  std::lock_guard<std::mutex> lock(registry_mutex);
  norm_launches[key] = {reinterpret_cast<void*>(function), static_cast<unsigned>(threads),
                        static_cast<unsigned>(shared_bytes)};
}

void forget(std::optional<std::string> group) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (auto it = nccl_shapes.begin(); it != nccl_shapes.end();) {
    it = (!group.has_value() || it->first.group == *group) ? nccl_shapes.erase(it) : std::next(it);
  }
}

std::vector<int64_t> counts() {
  std::lock_guard<std::mutex> lock(registry_mutex);
  std::vector<int64_t> out;
  out.reserve(call_counts.size());
  for (const auto& count : call_counts) out.push_back(count.load(std::memory_order_relaxed));
  return out;
}

void reset_counts() {
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (auto& count : call_counts) count.store(0, std::memory_order_relaxed);
}

void install() {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto library =
      std::make_unique<torch::Library>(torch::Library::IMPL, "fxfuse", c10::DispatchKey::CUDA, __FILE__, __LINE__);
  library->impl("allreduce_residual_rmsnorm", torch::CppFunction::makeFromBoxedFunction<&run_boxed<false>>());
  library->impl("allreduce_residual_rmsnorm.tensor_eps", torch::CppFunction::makeFromBoxedFunction<&run_boxed<false>>());
  library->impl("allreduce_residual_rmsnorm.donate_x", torch::CppFunction::makeFromBoxedFunction<&run_boxed<true>>());
  library->impl("allreduce_residual_rmsnorm.donate_x_tensor_eps",
                torch::CppFunction::makeFromBoxedFunction<&run_boxed<true>>());
  library->impl("all_reduce", torch::CppFunction::makeFromBoxedFunction<&all_reduce_boxed<false>>());
  library->impl("all_reduce_", torch::CppFunction::makeFromBoxedFunction<&all_reduce_boxed<true>>());
  installed.push_back(std::move(library));
}

// `fxfuse_native::run`: the same path called directly (tests drive it with CPU tensors).
std::tuple<at::Tensor, at::Tensor> run(at::Tensor x, std::optional<at::Tensor> residual, at::Tensor weight, double eps,
                                       std::string group, bool donated, double weight_offset, bool weight_in_fp32) {
  return run_shape(x, residual, weight, eps, group, donated, weight_offset, weight_in_fp32);
}

// `fxfuse_native::run_all_reduce`: the all-reduce-only path called directly (tests drive it with CPU tensors).
at::Tensor run_all_reduce(at::Tensor x, std::string group, bool in_place) { return all_reduce_shape(x, group, in_place); }

}  // namespace

TORCH_LIBRARY(fxfuse_native, m) {
  m.def("install() -> ()", &install);
  m.def("register_nccl(str group_name, int tokens, int hidden, ScalarType x_dtype, ScalarType weight_dtype, "
        "ScalarType? residual_dtype) -> int",
        &register_nccl);
  m.def("register_norm_launch(int device, int hidden, ScalarType x_dtype, ScalarType weight_dtype, "
        "ScalarType? residual_dtype, int function, int threads, int shared_bytes) -> ()",
        &register_norm_launch);
  m.def("register_all_reduce(str group_name, int tokens, int hidden, ScalarType dtype) -> int", &register_all_reduce);
  m.def("forget(str? group_name) -> ()", &forget);
  m.def("call_counts() -> int[]", &counts);
  m.def("reset_counts() -> ()", &reset_counts);
  m.def("run(Tensor x, Tensor? residual, Tensor weight, float eps, str group_name, bool x_donated, "
        "float weight_offset=0., bool weight_in_fp32=False) -> (Tensor, Tensor)",
        &run);
  m.def("run_all_reduce(Tensor x, str group_name, bool in_place) -> Tensor", &run_all_reduce);
}

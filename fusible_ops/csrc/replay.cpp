// Replay of a recorded fused call: one C++ autograd node whose forward and backward allocate
// their tensors and launch the recorded Triton binaries straight through the CUDA driver, with no
// Python on the per-call path (see fusible_ops/replay.py, which records and builds the recipes).
//
// What must hold (the recorder checks it before building a recipe):
// * every launch of the recorded call went through a cached binary (no compile, no autotune); its
//   other work was allocations, views and ATen ops whose output shapes and values do not depend on
//   tensor data read on the host or on a random generator (replayed through the dispatcher, below
//   autograd);
// * a recipe's integers, floats and grids are functions of the inputs' sizes, strides, dtypes and
//   device, which run() checks against the recording (it declines, returning an empty list, on any
//   difference), and of the 16-byte alignment class of every input pointer (checked too);
// * launches need no profile scratch memory (global scratch, e.g. TMA descriptors made on the
//   device, gets a fresh buffer per launch), one CTA per program, no cooperative / PDL launch (each
//   binary's parameters are checked with cuFuncGetParamInfo where the driver has it).

#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#ifndef FO_NO_CUDA  // (defined only for a syntax check on a machine without CUDA headers)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <dlfcn.h>

#include <array>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

using LaunchFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                         void**, void**);
using ParamInfoFn = int (*)(void*, size_t, size_t*, size_t*);

void* libcuda() {
  static void* lib = [] {
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    return h ? h : dlopen("libcuda.so.1", RTLD_NOW);
  }();
  TORCH_CHECK(lib != nullptr, "fusible_ops replay: cannot open libcuda.so.1");
  return lib;
}

using ErrorStringFn = int (*)(int, const char**);

// A failed launch: an error the context already holds from earlier work (a device-side assert, an
// illegal address: codes 700-719) is left to surface at the next synchronization, as CUDA reports
// asynchronous errors and as the Python path's launches leave it; any other error raises now.
void check_launch(int err) {
  if (err == 0 || (err >= 700 && err <= 719)) return;
  static ErrorStringFn str = reinterpret_cast<ErrorStringFn>(dlsym(libcuda(), "cuGetErrorString"));
  const char* msg = nullptr;
  if (str != nullptr) str(err, &msg);
  TORCH_CHECK(false, "fusible_ops replay: cuLaunchKernel failed with CUDA error ", err, " (", msg ? msg : "?", ")");
}

LaunchFn cu_launch() {
  static LaunchFn fn = reinterpret_cast<LaunchFn>(dlsym(libcuda(), "cuLaunchKernel"));
  TORCH_CHECK(fn != nullptr, "fusible_ops replay: libcuda has no cuLaunchKernel");
  return fn;
}

// A tensor's geometry as recorded: what an input must match, or what an allocation makes.
struct Geometry {
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
  int64_t align;  // inputs: data_ptr % 16 at recording (-1: not read through a pointer); else 0

  bool matches(const at::Tensor& t) const {
    if (t.scalar_type() != dtype || t.sizes() != at::IntArrayRef(sizes)) return false;
    if (t.strides() != at::IntArrayRef(strides)) return false;
    return align < 0 || static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == align;
  }
};

// One launch: fixed parameter bytes (8 per parameter) with the pointers filled in per call.
struct Launch {
  void* fn;
  unsigned grid[3];
  unsigned threads, shared;
  std::vector<uint64_t> values;               // per kernel parameter (scalars set, pointers 0)
  std::vector<std::array<int64_t, 3>> ptrs;   // (parameter index, slot, byte offset)
  int64_t scratch_param = -1;                 // global scratch: its parameter, and bytes per launch
  int64_t scratch_bytes = 0;
};

// A tensor handed out (an output or a gradient) or passed to an ATen op: a slot, or a view of one.
struct Result {
  int64_t slot;  // -1: none (an undefined gradient)
  bool view;
  std::vector<int64_t> sizes, strides;
  int64_t offset;  // elements
};

// One ATen op: its arguments as recorded, with the tensors taken from slots per call.
struct OpCall {
  std::optional<c10::OperatorHandle> handle;
  std::vector<c10::IValue> args;                       // (tensor positions hold None)
  std::vector<std::pair<size_t, Result>> tensors;      // (argument position, slot or view)
  std::vector<bool> new_outputs;                       // per return: a new slot (else an alias of one)
};

// One step: a launch, or an ATen op.
struct Step {
  bool is_op;
  Launch launch;
  OpCall op;
};

// One direction's work: slots [given..., allocations..., op outputs...], then the steps in order.
// An allocation is made just before the first step that uses it, and a slot that is neither handed
// out nor saved is released after the last step that uses it (stream-ordered, as the Python path
// frees its temporaries), so a replayed call's peak memory is the Python path's.
struct Program {
  std::vector<Geometry> allocs;
  std::vector<Step> steps;
  std::vector<std::vector<int64_t>> make, release;  // per step: slots made before it / released after it
  std::vector<int64_t> late;                         // allocations no step uses (made after the steps)
};

struct Recipe {
  int64_t device;
  std::vector<Geometry> inputs;   // forward slots [0, n_inputs)
  std::vector<std::pair<int64_t, int64_t>> aliases;  // (j, i): input j was input i when recorded
  Program fwd;
  std::vector<Result> outputs;    // forward slots
  std::vector<int64_t> saved;     // forward slots the backward reads (its slots after the grads)
  std::vector<Geometry> grads;    // each output's gradient as the backward was recorded with
  Program bwd;
  std::vector<Result> input_grads;  // backward slots, one per input
};

at::Tensor hand_out(const std::vector<at::Tensor>& slots, const Result& r) {
  const at::Tensor& t = slots[r.slot];
  return r.view ? t.as_strided(r.sizes, r.strides, t.storage_offset() + r.offset) : t;
}

void run_op(const OpCall& op, std::vector<at::Tensor>& slots) {
  torch::jit::Stack stack(op.args);
  for (const auto& [pos, r] : op.tensors) stack[pos] = hand_out(slots, r);
  {
    at::AutoDispatchBelowADInplaceOrView below;  // (as inside an autograd function: no history)
    op.handle->callBoxed(&stack);
  }
  TORCH_CHECK(stack.size() == op.new_outputs.size(), "fusible_ops replay: an op returned ", stack.size(), " values");
  for (size_t j = 0; j < stack.size(); ++j)
    if (op.new_outputs[j]) slots.push_back(stack[j].toTensor());
}

void run_program(const Program& p, std::vector<at::Tensor>& slots, const at::TensorOptions& opts, void* stream) {
  const int64_t base = static_cast<int64_t>(slots.size());
  auto make = [&](int64_t slot) {
    const Geometry& g = p.allocs[slot - base];
    slots[slot] = at::empty_strided(g.sizes, g.strides, opts.dtype(g.dtype));
  };
  slots.resize(base + p.allocs.size());
  LaunchFn launch = cu_launch();
  uint64_t values[64];
  void* params[64];
  for (size_t k = 0; k < p.steps.size(); ++k) {
    const Step& s = p.steps[k];
    for (int64_t a : p.make[k]) make(a);
    if (s.is_op) {
      run_op(s.op, slots);
      for (int64_t f : p.release[k]) slots[f] = at::Tensor();
      continue;
    }
    const Launch& l = s.launch;
    size_t n = l.values.size();
    std::memcpy(values, l.values.data(), n * sizeof(uint64_t));
    for (const auto& q : l.ptrs)
      values[q[0]] = reinterpret_cast<uint64_t>(slots[q[1]].data_ptr()) + static_cast<uint64_t>(q[2]);
    at::Tensor scratch;  // (back to the caching allocator after the launch: stream-ordered reuse)
    if (l.scratch_param >= 0) {
      scratch = at::empty({l.scratch_bytes}, opts.dtype(at::kByte));
      values[l.scratch_param] = reinterpret_cast<uint64_t>(scratch.data_ptr());
    }
    for (size_t i = 0; i < n; ++i) params[i] = &values[i];
    check_launch(launch(l.fn, l.grid[0], l.grid[1], l.grid[2], l.threads, 1, 1, l.shared, stream, params, nullptr));
    for (int64_t f : p.release[k]) slots[f] = at::Tensor();
  }
  for (int64_t a : p.late) make(a);
}

void* current_stream(int64_t device) {
#ifndef FO_NO_CUDA
  return at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
#else
  return nullptr;
#endif
}

struct ReplayBackward : public Node {
  std::shared_ptr<const Recipe> recipe;
  std::vector<SavedVariable> saved;
  at::TensorOptions opts;

  std::string name() const override { return "FusibleReplayBackward"; }

  void release_variables() override {
    for (auto& s : saved) s.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    const Recipe& r = *recipe;
#ifndef FO_NO_CUDA
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(r.device));
#endif
    std::vector<at::Tensor> slots;
    slots.reserve(r.grads.size() + saved.size() + r.bwd.allocs.size());
    for (size_t i = 0; i < r.grads.size(); ++i) {
      const Geometry& g = r.grads[i];
      at::Tensor d = i < grads.size() ? grads[i] : at::Tensor();
      if (!d.defined()) {
        d = at::zeros(g.sizes, opts.dtype(g.dtype));
      } else if (!g.matches(d)) {  // recorded with a fresh contiguous gradient: give it one
        d = d.to(g.dtype).contiguous();
        if (!g.matches(d)) d = d.clone(at::MemoryFormat::Contiguous);
        TORCH_CHECK(g.matches(d), "fusible_ops replay: gradient ", i, " has sizes ", d.sizes(),
                    ", the recording ", at::IntArrayRef(g.sizes));
      }
      slots.push_back(std::move(d));
    }
    for (auto& s : saved) slots.push_back(s.unpack());
    run_program(r.bwd, slots, opts, current_stream(r.device));
    variable_list out;
    out.reserve(r.input_grads.size());
    for (const auto& g : r.input_grads) out.push_back(g.slot < 0 ? at::Tensor() : hand_out(slots, g));
    return out;
  }
};

// A new node, held as this torch's autograd holds nodes (std::shared_ptr up to 2.12, then
// c10::intrusive_ptr): the branch not taken is never instantiated.
using NodeRef = decltype(torch::autograd::Edge::function);

template <typename Ref = NodeRef>
auto make_node() {
  if constexpr (std::is_same_v<Ref, std::shared_ptr<Node>>) {
    return std::make_shared<ReplayBackward>();
  } else {
    return c10::make_intrusive<ReplayBackward>();
  }
}

// The forward of a recorded call on ``inputs`` (the recording's order); an empty list when the
// inputs differ from the recording in anything run() checks (the caller takes the Python path).
std::vector<at::Tensor> run(const std::shared_ptr<const Recipe>& rp, const std::vector<at::Tensor>& inputs) {
  const Recipe& r = *rp;
  if (inputs.size() != r.inputs.size()) return {};
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    if (!t.is_cuda() || t.layout() != at::kStrided || t.key_set().has(c10::DispatchKey::Python)) return {};
    if (t.get_device() != r.device || !r.inputs[i].matches(t)) return {};
  }
  for (const auto& [j, i] : r.aliases)  // (the recording read both through input i's pointer)
    if (inputs[j].data_ptr() != inputs[i].data_ptr()) return {};
#ifndef FO_NO_CUDA
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(r.device));
#endif
  at::TensorOptions opts = inputs[0].options().requires_grad(false);
  std::vector<at::Tensor> slots(inputs.begin(), inputs.end());
  slots.reserve(inputs.size() + r.fwd.allocs.size());
  run_program(r.fwd, slots, opts, current_stream(r.device));
  std::vector<at::Tensor> outs;
  outs.reserve(r.outputs.size());
  for (const auto& o : r.outputs) outs.push_back(hand_out(slots, o));
  if (at::GradMode::is_enabled() && torch::autograd::compute_requires_grad(inputs)) {
    auto node = make_node();
    node->recipe = rp;
    node->opts = opts;
    node->set_next_edges(torch::autograd::collect_next_edges(inputs));
    for (auto& o : outs) torch::autograd::set_history(o, node);
    node->saved.reserve(r.saved.size());
    for (int64_t s : r.saved) {  // an output is saved as one (no reference cycle through its grad_fn)
      size_t k = 0;
      while (k < r.outputs.size() && (r.outputs[k].view || r.outputs[k].slot != s)) ++k;
      if (k < r.outputs.size()) {
        node->saved.emplace_back(outs[k], true);
      } else {
        node->saved.emplace_back(slots[s], false);
      }
    }
  }
  return outs;
}

// --- building a recipe from Python (once per recorded geometry) --------------------------------

at::ScalarType dtype_of(const py::handle& h) { return h.cast<at::Tensor>().scalar_type(); }

std::vector<int64_t> ints(const py::handle& h) { return h.cast<std::vector<int64_t>>(); }

Geometry geometry(const py::handle& h) {  // (sizes, strides, dtype example tensor, align)
  auto t = h.cast<py::sequence>();
  return Geometry{ints(t[0]), ints(t[1]), dtype_of(t[2]), t[3].cast<int64_t>()};
}

std::vector<Geometry> geometries(const py::list& l) {
  std::vector<Geometry> out;
  for (auto h : l) out.push_back(geometry(h));
  return out;
}

Result result(const py::handle& h) {  // (slot, view, sizes, strides, offset)
  auto t = h.cast<py::sequence>();
  return Result{t[0].cast<int64_t>(), t[1].cast<bool>(), ints(t[2]), ints(t[3]), t[4].cast<int64_t>()};
}

OpCall op_call(const py::sequence& t) {  // ("op", name, overload, values, tensors, new_outputs)
  OpCall op;
  auto name = t[1].cast<std::string>();
  auto overload = t[2].cast<std::string>();
  op.handle = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
  const auto& schema = op.handle->schema();
  auto values = t[3].cast<py::list>();
  TORCH_CHECK(values.size() == schema.arguments().size(), "fusible_ops replay: ", name, " takes ",
              schema.arguments().size(), " arguments");
  std::vector<bool> is_tensor(values.size(), false);
  for (auto h : t[4].cast<py::list>()) {
    auto e = h.cast<py::sequence>();
    size_t pos = e[0].cast<size_t>();
    TORCH_CHECK(pos < values.size(), "bad tensor position");
    is_tensor[pos] = true;
    op.tensors.emplace_back(pos, result(e[1]));
  }
  for (size_t i = 0; i < values.size(); ++i)
    op.args.push_back(is_tensor[i] ? c10::IValue() : torch::jit::toIValue(values[i], schema.arguments()[i].type()));
  op.new_outputs = t[5].cast<std::vector<bool>>();
  TORCH_CHECK(op.new_outputs.size() == schema.returns().size(), "fusible_ops replay: ", name, " returns ",
              schema.returns().size(), " values");
  return op;
}

std::vector<std::vector<int64_t>> int_lists(const py::handle& h) {
  std::vector<std::vector<int64_t>> out;
  for (auto e : h.cast<py::list>()) out.push_back(ints(e));
  return out;
}

Program program(const py::list& allocs, const py::list& steps, const py::tuple& life) {
  Program p;
  p.allocs = geometries(allocs);
  TORCH_CHECK(life.size() == 3, "lifetimes: (make, release, late)");
  p.make = int_lists(life[0]);
  p.release = int_lists(life[1]);
  p.late = ints(life[2]);
  TORCH_CHECK(p.make.size() == steps.size() && p.release.size() == steps.size(), "one lifetime entry per step");
  for (auto h : steps) {  // ("op", ...) or (fn, (gx, gy, gz), threads, shared, values, ptrs)
    auto t = h.cast<py::sequence>();
    Step s{false, {}, {}};
    if (py::isinstance<py::str>(t[0])) {
      s.is_op = true;
      s.op = op_call(t);
      p.steps.push_back(std::move(s));
      continue;
    }
    Launch& l = s.launch;
    l.fn = reinterpret_cast<void*>(t[0].cast<uint64_t>());
    auto grid = ints(t[1]);
    TORCH_CHECK(grid.size() == 3, "grid needs 3 entries");
    for (int i = 0; i < 3; ++i) l.grid[i] = static_cast<unsigned>(grid[i]);
    l.threads = t[2].cast<unsigned>();
    l.shared = t[3].cast<unsigned>();
    l.values = t[4].cast<std::vector<uint64_t>>();
    TORCH_CHECK(l.values.size() <= 64, "fusible_ops replay: more than 64 kernel parameters");
    if (t.size() > 6) {
      auto sc = ints(t[6]);  // (parameter index, bytes)
      TORCH_CHECK(sc.size() == 2 && sc[0] >= 0 && sc[0] < static_cast<int64_t>(l.values.size()) && sc[1] > 0,
                  "bad scratch entry");
      l.scratch_param = sc[0];
      l.scratch_bytes = sc[1];
    }
    for (auto q : t[5].cast<py::list>()) {
      auto v = ints(q);
      TORCH_CHECK(v.size() == 3 && v[0] >= 0 && v[0] < static_cast<int64_t>(l.values.size()), "bad pointer entry");
      l.ptrs.push_back({v[0], v[1], v[2]});
    }
    p.steps.push_back(std::move(s));
  }
  return p;
}

std::vector<Result> results(const py::list& l) {
  std::vector<Result> out;
  for (auto h : l) out.push_back(result(h));
  return out;
}

// Every slot a step reads exists when it runs (op outputs become slots as the ops run); the
// lifetimes make allocations only and release only slots past the given ones.
int64_t check_slots(const Program& p, size_t given, const char* what) {
  const int64_t g = static_cast<int64_t>(given), a = g + static_cast<int64_t>(p.allocs.size());
  int64_t n = a;
  for (size_t k = 0; k < p.steps.size(); ++k) {
    const Step& s = p.steps[k];
    for (int64_t m : p.make[k]) TORCH_CHECK(m >= g && m < a, "fusible_ops replay: ", what, " made slot out of range");
    if (!s.is_op) {
      for (const auto& q : s.launch.ptrs)
        TORCH_CHECK(q[1] >= 0 && q[1] < n, "fusible_ops replay: ", what, " slot out of range");
    } else {
      for (const auto& e : s.op.tensors)
        TORCH_CHECK(e.second.slot >= 0 && e.second.slot < n, "fusible_ops replay: ", what, " op slot out of range");
      for (bool b : s.op.new_outputs) n += b;
    }
    for (int64_t f : p.release[k])
      TORCH_CHECK(f >= g && f < n, "fusible_ops replay: ", what, " released slot out of range");
  }
  for (int64_t m : p.late) TORCH_CHECK(m >= g && m < a, "fusible_ops replay: ", what, " late slot out of range");
  return n;
}

void check_results(const std::vector<Result>& res, int64_t n, const char* what) {
  for (const auto& r : res) TORCH_CHECK(r.slot < n, "fusible_ops replay: ", what, " result slot out of range");
}

std::shared_ptr<const Recipe> make_recipe(int64_t device, const py::list& inputs, const py::list& fwd_allocs,
                                          const py::list& fwd_launches, const py::tuple& fwd_life,
                                          const py::list& outputs, const std::vector<int64_t>& saved,
                                          const py::list& grads, const py::list& bwd_allocs,
                                          const py::list& bwd_launches, const py::tuple& bwd_life,
                                          const py::list& input_grads, const py::list& aliases) {
  auto r = std::make_shared<Recipe>();
  r->device = device;
  for (auto h : aliases) {
    auto v = ints(h);
    TORCH_CHECK(v.size() == 2 && v[1] < v[0] && v[0] < static_cast<int64_t>(inputs.size()), "bad alias entry");
    r->aliases.emplace_back(v[0], v[1]);
  }
  r->inputs = geometries(inputs);
  r->fwd = program(fwd_allocs, fwd_launches, fwd_life);
  r->outputs = results(outputs);
  r->saved = saved;
  r->grads = geometries(grads);
  r->bwd = program(bwd_allocs, bwd_launches, bwd_life);
  r->input_grads = results(input_grads);
  TORCH_CHECK(!r->outputs.empty() && r->outputs.size() == r->grads.size(), "one recorded gradient per output");
  TORCH_CHECK(r->input_grads.size() == r->inputs.size(), "one gradient entry per input");
  int64_t n_fwd = check_slots(r->fwd, r->inputs.size(), "forward");
  check_results(r->outputs, n_fwd, "forward");
  for (int64_t s : r->saved) TORCH_CHECK(s >= 0 && s < n_fwd, "saved slot out of range");
  check_results(r->input_grads, check_slots(r->bwd, r->grads.size() + r->saved.size(), "backward"), "backward");
  return r;
}

// (offset, size) of each parameter of a loaded kernel, as the driver reports them; None where the
// driver has no cuFuncGetParamInfo (CUDA < 12.4).
py::object param_info(uint64_t fn) {
  static ParamInfoFn info = reinterpret_cast<ParamInfoFn>(dlsym(libcuda(), "cuFuncGetParamInfo"));
  if (info == nullptr) return py::none();
  py::list out;
  for (size_t i = 0; i < 256; ++i) {
    size_t off = 0, size = 0;
    if (info(reinterpret_cast<void*>(fn), i, &off, &size) != 0) break;
    out.append(py::make_tuple(off, size));
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Recipe, std::shared_ptr<Recipe>>(m, "Recipe");
  m.def("make_recipe", [](int64_t device, py::list inputs, py::list fwd_allocs, py::list fwd_launches,
                          py::tuple fwd_life, py::list outputs, std::vector<int64_t> saved, py::list grads,
                          py::list bwd_allocs, py::list bwd_launches, py::tuple bwd_life, py::list input_grads,
                          py::list aliases) {
    return std::const_pointer_cast<Recipe>(make_recipe(device, inputs, fwd_allocs, fwd_launches, fwd_life, outputs,
                                                       saved, grads, bwd_allocs, bwd_launches, bwd_life, input_grads,
                                                       aliases));
  });
  m.def("run", [](const std::shared_ptr<Recipe>& r, const std::vector<at::Tensor>& inputs) { return run(r, inputs); });
  m.def("param_info", &param_info);
}

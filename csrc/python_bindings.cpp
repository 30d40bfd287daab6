// pybind11 module `turboquant._core`: the torch-free core (presets, slot layout, Lloyd-Max
// solver, codebooks, Hadamard matrices) for Python. The ops themselves are torch ops.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>

#include "turboquant/hadamard.h"
#include "turboquant/lloyd_max.h"
#include "turboquant/preset.h"

namespace py = pybind11;
using namespace turboquant;

namespace {

py::dict layout_dict(const SlotLayout& l) {
  py::dict d;
  d["head_dim"] = l.head_dim;
  d["key_format"] = l.key_format == KeyFormat::kFp8 ? "fp8_e4m3" : "lloyd_max";
  d["key_bits"] = l.key_bits;
  d["value_bits"] = l.value_bits;
  d["key_data_bytes"] = l.key_data_bytes;
  d["key_norm_offset"] = l.key_norm_offset;
  d["key_packed_size"] = l.key_packed_size;
  d["value_data_offset"] = l.value_data_offset;
  d["value_data_bytes"] = l.value_data_bytes;
  d["value_scale_offset"] = l.value_scale_offset;
  d["value_zero_offset"] = l.value_zero_offset;
  d["value_packed_size"] = l.value_packed_size;
  d["slot_size"] = l.slot_size;
  d["slot_size_aligned"] = l.slot_size_aligned;
  return d;
}

py::dict lloyd_max_dict(const LloydMaxResult& r) {
  py::dict d;
  d["levels"] = r.levels;
  d["thresholds"] = r.thresholds;
  d["mse"] = r.mse;
  d["iterations"] = r.iterations;
  d["last_change"] = r.last_change;
  return d;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "turboquant torch-free core: presets, slot layout, Lloyd-Max codebooks, Hadamard";
  py::register_exception<std::invalid_argument>(m, "InvalidArgument", PyExc_ValueError);

  m.def("preset_names", [] {
    std::vector<std::string> names;
    for (const Preset& p : all_presets()) names.push_back(p.name);
    return names;
  });
  m.def("preset_info", [](const std::string& name) {
    const Preset& p = parse_preset(name);
    py::dict d;
    d["name"] = p.name;
    d["key_format"] = p.key_format == KeyFormat::kFp8 ? "fp8_e4m3" : "lloyd_max";
    d["key_bits"] = p.key_bits;
    d["value_bits"] = p.value_bits;
    d["norm_correction"] = p.norm_correction;
    return d;
  }, py::arg("preset"));
  m.attr("max_head_dim") = kMaxHeadDim;
  m.def("slot_layout", [](const std::string& preset, int head_dim) {
    return layout_dict(slot_layout(parse_preset(preset), head_dim));
  }, py::arg("preset"), py::arg("head_dim"), "Byte layout of one slot (raises ValueError if unsupported).");
  m.def("lloyd_max_gaussian", [](int bits, double tolerance) {
    return lloyd_max_dict(solve_lloyd_max_gaussian(bits, tolerance));
  }, py::arg("bits"), py::arg("tolerance") = 1e-12, "Converged Lloyd-Max quantizer of N(0, 1).");
  m.def("lloyd_max_sphere", [](int bits, int head_dim, double tolerance) {
    return lloyd_max_dict(solve_lloyd_max_sphere(bits, head_dim, tolerance));
  }, py::arg("bits"), py::arg("head_dim"), py::arg("tolerance") = 1e-12,
     "Lloyd-Max quantizer of one coordinate of a random unit vector in R^head_dim (option 'sphere').");
  m.def("gaussian_fixed_point_residual", &gaussian_fixed_point_residual, py::arg("levels"));
  m.def("codebook", [](int bits, int head_dim) {
    const Codebook& cb = gaussian_codebook(bits, head_dim);
    std::vector<float> c(cb.centroid, cb.centroid + cb.levels);
    std::vector<float> t(cb.midpoint, cb.midpoint + cb.levels - 1);
    return py::make_tuple(c, t);
  }, py::arg("bits"), py::arg("head_dim"), "fp32 (centroids, midpoints) the presets use at head_dim.");
  m.def("hadamard", &orthonormal_hadamard, py::arg("head_dim"),
        "Row-major orthonormal Sylvester Hadamard matrix H_D / sqrt(D) as a flat list.");
}

// Lloyd-Max solver: alternate the nearest-neighbour condition (thresholds at midpoints) and the
// centroid condition (each level the conditional mean of its cell) until nothing moves.
#include "turboquant/lloyd_max.h"

#include <cmath>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

namespace turboquant {
namespace {

constexpr double kInvSqrt2 = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;

double pdf(double x) { return std::isinf(x) ? 0.0 : kInvSqrt2Pi * std::exp(-0.5 * x * x); }

// Phi(b) - Phi(a) without cancellation in the tails.
double cdf_diff(double a, double b) {
  if (a >= 0.0) return 0.5 * (std::erfc(a * kInvSqrt2) - std::erfc(b * kInvSqrt2));
  if (b <= 0.0) return 0.5 * (std::erfc(-b * kInvSqrt2) - std::erfc(-a * kInvSqrt2));
  return 1.0 - 0.5 * std::erfc(-a * kInvSqrt2) - 0.5 * std::erfc(b * kInvSqrt2);
}

double x_pdf(double x) { return std::isinf(x) ? 0.0 : x * pdf(x); }

struct Cell {
  double mass, first, second;  // int phi, int x phi, int x^2 phi over the cell
};

Cell gaussian_cell(double a, double b) {
  const double mass = cdf_diff(a, b);
  return {mass, pdf(a) - pdf(b), mass + x_pdf(a) - x_pdf(b)};
}

std::vector<double> midpoints(const std::vector<double>& levels) {
  std::vector<double> t(levels.size() - 1);
  for (size_t i = 0; i + 1 < levels.size(); ++i) t[i] = 0.5 * (levels[i] + levels[i + 1]);
  return t;
}

void check_bits(int bits) {
  if (bits < 1 || bits > 4) {
    throw std::invalid_argument("turboquant: Lloyd-Max bits must be in 1..4, got " +
                                std::to_string(bits));
  }
}

// Generic iteration given a function returning the cells' moments for thresholds (lo, hi).
template <typename CellFn>
LloydMaxResult iterate(int bits, double support, double tolerance, int max_iterations,
                       CellFn cell) {
  check_bits(bits);
  const int n = 1 << bits;
  LloydMaxResult r;
  r.levels.resize(n);
  for (int i = 0; i < n; ++i) r.levels[i] = support * (-1.0 + (2.0 * i + 1.0) / n);  // uniform
  for (r.iterations = 1; r.iterations <= max_iterations; ++r.iterations) {
    const std::vector<double> t = midpoints(r.levels);
    double change = 0.0;
    for (int i = 0; i < n; ++i) {
      const double lo = i == 0 ? -INFINITY : t[i - 1];
      const double hi = i == n - 1 ? INFINITY : t[i];
      const Cell c = cell(lo, hi);
      const double next = c.mass > 0.0 ? c.first / c.mass : r.levels[i];
      change = std::max(change, std::fabs(next - r.levels[i]));
      r.levels[i] = next;
    }
    r.last_change = change;
    if (change < tolerance) break;
  }
  r.thresholds = midpoints(r.levels);
  r.mse = 0.0;
  for (int i = 0; i < n; ++i) {
    const double lo = i == 0 ? -INFINITY : r.thresholds[i - 1];
    const double hi = i == n - 1 ? INFINITY : r.thresholds[i];
    const Cell c = cell(lo, hi);
    const double y = r.levels[i];
    r.mse += c.second - 2.0 * y * c.first + y * y * c.mass;
  }
  return r;
}

}  // namespace

LloydMaxResult solve_lloyd_max_gaussian(int bits, double tolerance, int max_iterations) {
  return iterate(bits, 3.0, tolerance, max_iterations, gaussian_cell);
}

double gaussian_fixed_point_residual(const std::vector<double>& levels) {
  const std::vector<double> t = midpoints(levels);
  const int n = static_cast<int>(levels.size());
  double worst = 0.0;
  for (int i = 0; i < n; ++i) {
    const Cell c = gaussian_cell(i == 0 ? -INFINITY : t[i - 1], i == n - 1 ? INFINITY : t[i]);
    worst = std::max(worst, std::fabs(c.first / c.mass - levels[i]));
  }
  return worst;
}

LloydMaxResult solve_lloyd_max_sphere(int bits, int head_dim, double tolerance,
                                      int max_iterations) {
  if (head_dim < 3) throw std::invalid_argument("turboquant: sphere codebook needs head_dim >= 3");
  // Density f(t) ~ (1 - t^2)^((D-3)/2) on [-1, 1]: tabulate cumulative moments once on a fine
  // grid (Simpson per panel), then cells read them by linear interpolation.
  const int panels = 1 << 16;
  const double exponent = 0.5 * (head_dim - 3);
  std::vector<double> m0(panels + 1, 0.0), m1(panels + 1, 0.0), m2(panels + 1, 0.0);
  auto f = [&](double t) { return std::pow(std::max(0.0, 1.0 - t * t), exponent); };
  const double h = 2.0 / panels;
  for (int k = 0; k < panels; ++k) {
    const double a = -1.0 + k * h, m = a + 0.5 * h, b = a + h;
    const double fa = f(a), fm = f(m), fb = f(b);
    m0[k + 1] = m0[k] + h / 6.0 * (fa + 4 * fm + fb);
    m1[k + 1] = m1[k] + h / 6.0 * (a * fa + 4 * m * fm + b * fb);
    m2[k + 1] = m2[k] + h / 6.0 * (a * a * fa + 4 * m * m * fm + b * b * fb);
  }
  const double total = m0[panels];
  auto at = [&](const std::vector<double>& m, double t) {
    if (!(t > -1.0)) return 0.0;
    if (!(t < 1.0)) return m[panels];
    const double x = (t + 1.0) / h;
    const int k = std::min(panels - 1, static_cast<int>(x));
    return m[k] + (x - k) * (m[k + 1] - m[k]);
  };
  auto cell = [&](double lo, double hi) {
    return Cell{(at(m0, hi) - at(m0, lo)) / total, (at(m1, hi) - at(m1, lo)) / total,
                (at(m2, hi) - at(m2, lo)) / total};
  };
  // Start uniform over +-3 standard deviations (1/sqrt(D) each), kept inside [-1, 1]: a level
  // starting past the support (D < 9) has an empty cell and would never move.
  const double support = std::min(1.0, 3.0 / std::sqrt(static_cast<double>(head_dim)));
  return iterate(bits, support, tolerance, max_iterations, cell);
}

const Codebook& gaussian_codebook(int bits, int head_dim) {
  static std::mutex mutex;
  static std::map<std::pair<int, int>, Codebook> cache;
  check_bits(bits);
  if (head_dim <= 0) throw std::invalid_argument("turboquant: head_dim must be positive");
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find({bits, head_dim});
  if (it != cache.end()) return it->second;
  const LloydMaxResult r = solve_lloyd_max_gaussian(bits);
  Codebook cb;
  cb.bits = bits;
  cb.levels = 1 << bits;
  const double inv_sqrt_d = 1.0 / std::sqrt(static_cast<double>(head_dim));
  for (int i = 0; i < cb.levels; ++i) cb.centroid[i] = static_cast<float>(r.levels[i] * inv_sqrt_d);
  // Thresholds are midpoints of the fp32 centroids, so bucketing matches the stored codebook.
  for (int i = 0; i + 1 < cb.levels; ++i) cb.midpoint[i] = 0.5f * (cb.centroid[i] + cb.centroid[i + 1]);
  return cache.emplace(std::make_pair(bits, head_dim), cb).first->second;
}

}  // namespace turboquant

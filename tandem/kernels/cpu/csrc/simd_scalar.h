// Portable 4-lane "vector" of plain floats: the fallback on any CPU, auto-vectorised where possible.
#pragma once

#include <cmath>

#include "tandem_cpu.h"

namespace tandem {
namespace {

struct VScalar {
  static constexpr int W = 4;
  struct reg {
    float x[W];
  };
  template <class F>
  static reg map(F f) {
    reg r;
    for (int i = 0; i < W; ++i) r.x[i] = f(i);
    return r;
  }
  static reg zero() { return set1(0.f); }
  static reg set1(float v) {
    return map([&](int) { return v; });
  }
  template <class T>
  static reg load(const T* p) {
    return map([&](int i) { return to_f32(p[i]); });
  }
  static void store(float* p, reg a) {
    for (int i = 0; i < W; ++i) p[i] = a.x[i];
  }
  static reg add(reg a, reg b) {
    return map([&](int i) { return a.x[i] + b.x[i]; });
  }
  static reg sub(reg a, reg b) {
    return map([&](int i) { return a.x[i] - b.x[i]; });
  }
  static reg mul(reg a, reg b) {
    return map([&](int i) { return a.x[i] * b.x[i]; });
  }
  static reg fma(reg a, reg b, reg c) {
    return map([&](int i) { return a.x[i] * b.x[i] + c.x[i]; });
  }
  static reg max(reg a, reg b) {
    return map([&](int i) { return max_num(a.x[i], b.x[i]); });
  }
  static reg min(reg a, reg b) {
    return map([&](int i) { return min_num(a.x[i], b.x[i]); });
  }
  // any storage type through to_f32, 8-bit codes included (natural order)
  template <class T>
  static void load2(const T* p, reg& lo, reg& hi) {
    lo = load(p);
    hi = load(p + W);
  }
  template <class T>
  static int perm(int i) {
    return i;  // natural order
  }
  static float reduce_add(reg a) { return (a.x[0] + a.x[1]) + (a.x[2] + a.x[3]); }
  static void reduce4(reg a, reg b, reg c, reg d, float* out) {
    out[0] = reduce_add(a), out[1] = reduce_add(b), out[2] = reduce_add(c), out[3] = reduce_add(d);
  }
  static float reduce_max(reg a) { return max_num(max_num(a.x[0], a.x[1]), max_num(a.x[2], a.x[3])); }
  static reg exp2(reg a) {
    return map([&](int i) { return std::exp2(a.x[i]); });
  }
};

}  // namespace
}  // namespace tandem

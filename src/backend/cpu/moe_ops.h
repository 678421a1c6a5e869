// The mixture-of-experts ops of the two CPU backends (Backend::moe_route_forward and the row
// gathers, scatters, dots and sigmoid beside it): the reference loops (f32 and f64, f64
// arithmetic) in moe_reference.cc and the fast backend's f32 loops in moe_cpu.cc, written
// independently so that backend_moe_ops_test holds one to the other. Each entry runs the
// op's shared check (backend/op_checks.h) first.
#pragma once

#include "backend/backend.h"

namespace foldpar {

namespace moe_reference {
void route_forward(const Tensor& logits, bool normalize, Tensor& probs, Tensor& weights, Tensor& experts);
void route_backward(const Backend::MoeRouteGrad& g, Tensor& d_logits);
void gather_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst);
void scatter_add_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst);
void rows_dot(const Tensor& a, const Tensor& b, Tensor& out);
void sigmoid_forward(const Tensor& x, Tensor& y);
void sigmoid_backward(const Tensor& y, const Tensor& dy, Tensor& dx);
}  // namespace moe_reference

namespace moe_cpu {
void route_forward(const Tensor& logits, bool normalize, Tensor& probs, Tensor& weights, Tensor& experts);
void route_backward(const Backend::MoeRouteGrad& g, Tensor& d_logits);
void gather_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst);
void scatter_add_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst);
void rows_dot(const Tensor& a, const Tensor& b, Tensor& out);
void sigmoid_forward(const Tensor& x, Tensor& y);
void sigmoid_backward(const Tensor& y, const Tensor& dy, Tensor& dx);
}  // namespace moe_cpu

}  // namespace foldpar

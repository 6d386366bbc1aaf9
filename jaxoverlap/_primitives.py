"""The primitives behind the public ops, and the lowering that reads the plan.

Problem:
  Inside ``shard_map`` an op sees only its own shard; which devices, processes
  and nodes share its collective is known only when JAX lowers the program,
  from the mesh. So the public ops do not choose how they run: each binds one
  primitive carrying the caller's ``Request``, and the choice is made at
  lowering.

Algorithm:
  One primitive per op, with an abstract evaluation that gives the pure-JAX
  expression's type (shape, dtype and varying manual axes), a batching rule
  for ``jax.vmap`` and a JVP rule for second-order reverse mode (below). The lowering rule, registered for every platform, asks
  ``jaxoverlap.dispatch.plan_lowering`` for the plan and emits what it says:
  the ``jaxoverlap._xla`` implementation (through ``mlir.lower_fun``) or the
  FFI custom call of ``jaxoverlap._cuda``. Nothing else is decided here.

  Batching: all_reduce folds the batch into its message (it is elementwise);
  the GEMM ops fold a batched ``x`` into a leading dimension when ``w`` is not
  batched, and loop over the batch (``lax.map``) when it is.

Example:
  >>> y = bind_all_reduce(x, Request("all_reduce", "tp"), num_ranks=2)  # in shard_map
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo
from jax.interpreters import ad, batching, mlir

from jaxoverlap import _cuda, _xla, dispatch, names
from jaxoverlap.dispatch import Request

__all__ = ["bind_all_reduce", "bind_all_gather_matmul", "bind_matmul_reduce_scatter",
           "bind_matmul_all_reduce", "bind_all_reduce_rms_norm"]


def _with_vma(aval, shape, vma):
  out = aval.update(shape=tuple(shape))
  mat = out.manual_axis_type
  return out.update_manual_axis_type(mat.update(varying=frozenset(vma)))


def _vma(aval) -> frozenset:
  return frozenset(aval.manual_axis_type.varying)


def _lower_xla(fn, ctx, *args, multiple_results: bool):
  """Lowers the pure-JAX implementation ``fn`` in place of the primitive."""
  return mlir.lower_fun(fn, multiple_results=multiple_results)(ctx, *args)


def _mesh_axes(ctx) -> tuple[str, ...]:
  """The mesh's axis names in order, for the rings of ``jaxoverlap._xla``."""
  mesh = getattr(ctx.module_context.axis_context, "mesh", None)
  return tuple(getattr(mesh, "axis_names", ()) or ())


# ---------------------------------------------------------------------------- all_reduce

all_reduce_p = Primitive("jaxoverlap_all_reduce")


def _all_reduce_abstract_eval(x, *, request, num_ranks):
  del num_ranks
  # Like psum: the result is the same on every rank of the axis.
  return _with_vma(x, x.shape, _vma(x) - set(names.axis_names(request.axis_name)))


def _all_reduce_lowering(ctx, x, *, request, num_ranks):
  plan = dispatch.plan_lowering(ctx, request, num_ranks)
  if plan.backend == names.XLA:
    return _lower_xla(functools.partial(_xla.all_reduce, axis_name=request.axis_name,
                                        algorithm=plan.algorithm, mesh_axes=_mesh_axes(ctx)),
                      ctx, x, multiple_results=False)
  if plan.inter_node == names.XLA:
    return _lower_xla(functools.partial(_all_reduce_over_xla, plan=plan), ctx, x,
                      multiple_results=False)
  return _cuda.all_reduce(ctx, x, plan)


def _all_reduce_over_xla(x, *, plan):
  """The hierarchical all-reduce whose inter-node step is XLA's (traced in a lowering).

  The kernels' intra-node reduce-scatter leaves each GPU its fp32 shard, XLA's
  all-reduce sums the shard over the same-local-rank GPUs of the other
  processes, and the kernels' all-gather rebuilds the message (NVRAR, arXiv
  2511.09557 sec. 4, with NCCL between the nodes).
  """
  flat = x.reshape(-1)
  outs = []
  for start, length, shard in plan.pieces:
    s = _cuda.reduce_scatter_stage(lax.slice(flat, (start,), (start + length,)), plan, shard)
    s = node_psum_p.bind(s, node_groups=plan.node_groups)
    outs.append(_cuda.all_gather_stage(s, plan, length, flat.dtype))
  return (outs[0] if len(outs) == 1 else jax.numpy.concatenate(outs)).reshape(x.shape)


# XLA's all-reduce over explicit groups of devices (``plan.node_groups``: mesh
# positions), which lax.psum does not take inside shard_map. The result keeps
# the operand's type: the sum is over some devices of the axis, not all.
node_psum_p = Primitive("jaxoverlap_node_psum")
node_psum_p.def_abstract_eval(lambda x, *, node_groups: x)


def _node_psum_lowering(ctx, x, *, node_groups):
  (aval,) = ctx.avals_in
  new_channel = getattr(ctx.module_context, "new_channel", None)
  op = hlo.AllReduceOp(
      [x.type], [x],
      replica_groups=ir.DenseIntElementsAttr.get(np.asarray(node_groups, dtype=np.int64)),
      channel_handle=hlo.ChannelHandle.get(new_channel() if new_channel else 1,
                                           mlir.DEVICE_TO_DEVICE_TYPE),
      use_global_device_ids=ir.BoolAttr.get(True))
  scalar = ir.RankedTensorType.get([], mlir.dtype_to_ir_type(aval.dtype))
  block = op.regions[0].blocks.append(scalar, scalar)
  with ir.InsertionPoint(block):
    hlo.return_([hlo.add(*block.arguments)])
  return op.results


mlir.register_lowering(node_psum_p, _node_psum_lowering)


def _all_reduce_batch(args, dims, *, request, num_ranks):
  (x,), (d,) = args, dims
  # Elementwise over the ranks: the batch is part of the message.
  return all_reduce_p.bind(x, request=request, num_ranks=num_ranks), d


all_reduce_p.def_abstract_eval(_all_reduce_abstract_eval)
mlir.register_lowering(all_reduce_p, _all_reduce_lowering)
batching.primitive_batchers[all_reduce_p] = _all_reduce_batch


def bind_all_reduce(x, request: Request, num_ranks: int):
  """``psum(x)`` as planned; ``x`` must already be varying over the axis."""
  return all_reduce_p.bind(x, request=request, num_ranks=num_ranks)


# ---------------------------------------------------------------------------- GEMM ops


def _gemm_batch(prim, args, dims, *, request, num_ranks):
  """Batching of the GEMM ops: fold a batched x with a shared w, else loop."""
  x, w = args
  dx, dw = dims
  if dw is None:  # w shared by the batch: the batch is one more leading dimension of x
    x = jax.numpy.moveaxis(x, dx, 0)
    if request.dim is not None:
      request = dataclasses.replace(request, dim=request.dim + 1)
    out = prim.bind(x, w, request=request, num_ranks=num_ranks)
  else:
    size = w.shape[dw]
    w = jax.numpy.moveaxis(w, dw, 0)
    x = (jax.numpy.broadcast_to(x, (size,) + x.shape) if dx is None
         else jax.numpy.moveaxis(x, dx, 0))
    out = lax.map(lambda xw: prim.bind(xw[0], xw[1], request=request, num_ranks=num_ranks),
                  (x, w))
  return out, ([0] * len(out) if prim.multiple_results else 0)


def _emit_fused(ctx, args, plan, xla_fn, *, multiple_results, gathered=False):
  if plan.backend == names.XLA:
    return _lower_xla(xla_fn, ctx, *args, multiple_results=multiple_results)
  return _cuda.fused(ctx, args, plan, gathered=gathered)


# all_gather_matmul: outputs (AG(x) @ w,) or (AG(x) @ w, AG(x)) with request.gathered.

all_gather_matmul_p = Primitive("jaxoverlap_all_gather_matmul")
all_gather_matmul_p.multiple_results = True


def _ag_shapes(x_shape, n, dim, num_ranks):
  gathered = list(x_shape)
  gathered[dim] *= num_ranks
  out = list(gathered)
  out[-1] = n
  return tuple(out), tuple(gathered)


def _ag_abstract_eval(x, w, *, request, num_ranks):
  out_shape, g_shape = _ag_shapes(x.shape, w.shape[1], request.dim, num_ranks)
  outs = [_with_vma(x, out_shape, _vma(x))]
  if request.gathered:
    outs.append(_with_vma(x, g_shape, _vma(x)))
  return outs


def _ag_lowering(ctx, x, w, *, request, num_ranks):
  plan = dispatch.plan_lowering(ctx, request, num_ranks)

  def xla(x, w):
    y, xg = _xla.all_gather_matmul(x, w, request.axis_name, request.dim, plan.algorithm,
                                   _mesh_axes(ctx))
    return (y, xg) if request.gathered else (y,)

  return _emit_fused(ctx, (x, w), plan, xla, multiple_results=True, gathered=request.gathered)


all_gather_matmul_p.def_abstract_eval(_ag_abstract_eval)
mlir.register_lowering(all_gather_matmul_p, _ag_lowering)
batching.primitive_batchers[all_gather_matmul_p] = functools.partial(_gemm_batch,
                                                                     all_gather_matmul_p)


def bind_all_gather_matmul(x, w, request: Request, num_ranks: int):
  """``(AG(x) @ w, AG(x) or None)`` as planned; x and w share their varying axes."""
  outs = all_gather_matmul_p.bind(x, w, request=request, num_ranks=num_ranks)
  return outs[0], (outs[1] if request.gathered else None)


# matmul_reduce_scatter

matmul_reduce_scatter_p = Primitive("jaxoverlap_matmul_reduce_scatter")


def _rs_abstract_eval(x, w, *, request, num_ranks):
  out = list(x.shape[:-1]) + [w.shape[1]]
  out[request.dim] //= num_ranks
  return _with_vma(x, out, _vma(x))


def _rs_lowering(ctx, x, w, *, request, num_ranks):
  plan = dispatch.plan_lowering(ctx, request, num_ranks)
  def xla(x, w):
    return _xla.matmul_reduce_scatter(x, w, request.axis_name, request.dim, plan.algorithm,
                                      _mesh_axes(ctx))

  return _emit_fused(ctx, (x, w), plan, xla, multiple_results=False)


matmul_reduce_scatter_p.def_abstract_eval(_rs_abstract_eval)
mlir.register_lowering(matmul_reduce_scatter_p, _rs_lowering)
batching.primitive_batchers[matmul_reduce_scatter_p] = functools.partial(
    _gemm_batch, matmul_reduce_scatter_p)


def bind_matmul_reduce_scatter(x, w, request: Request, num_ranks: int):
  """``psum_scatter(x @ w)`` as planned; x and w share their varying axes."""
  return matmul_reduce_scatter_p.bind(x, w, request=request, num_ranks=num_ranks)


# matmul_all_reduce

matmul_all_reduce_p = Primitive("jaxoverlap_matmul_all_reduce")


def _ar_abstract_eval(x, w, *, request, num_ranks):
  del num_ranks
  out = tuple(x.shape[:-1]) + (w.shape[1],)
  return _with_vma(x, out, _vma(x) - set(names.axis_names(request.axis_name)))


def _ar_lowering(ctx, x, w, *, request, num_ranks):
  plan = dispatch.plan_lowering(ctx, request, num_ranks)
  if plan.backend == names.XLA:
    return _lower_xla(lambda x, w: _xla.matmul_all_reduce(x, w, request.axis_name,
                                                          plan.algorithm, _mesh_axes(ctx)),
                      ctx, x, w, multiple_results=False)
  if plan.algorithm == names.UNFUSED:
    # The GEMM, then the all-reduce of its output as its own plan says.
    sub = plan.all_reduce
    if sub.backend == names.XLA:  # one lowering of both (a context lowers one function)
      return _lower_xla(
          lambda x, w: _xla.all_reduce(_xla.matmul(x, w).astype(x.dtype), request.axis_name,
                                       sub.algorithm, _mesh_axes(ctx)),
          ctx, x, w, multiple_results=False)
    (y,) = _lower_xla(lambda x, w: _xla.matmul(x, w).astype(x.dtype), ctx, x, w,
                      multiple_results=False)
    # y is typed as the GEMM's per-rank result (varying, like x), not as the
    # all-reduced output: psum of a value typed invariant would scale it.
    y_aval = _with_vma(ctx.avals_out[0], ctx.avals_out[0].shape, _vma(ctx.avals_in[0]))
    return _cuda.all_reduce(ctx.replace(avals_in=[y_aval]), y, sub)
  return _cuda.fused(ctx, (x, w), plan)


matmul_all_reduce_p.def_abstract_eval(_ar_abstract_eval)
mlir.register_lowering(matmul_all_reduce_p, _ar_lowering)
batching.primitive_batchers[matmul_all_reduce_p] = functools.partial(_gemm_batch,
                                                                     matmul_all_reduce_p)


def bind_matmul_all_reduce(x, w, request: Request, num_ranks: int):
  """``psum(x @ w)`` as planned; x and w share their varying axes."""
  return matmul_all_reduce_p.bind(x, w, request=request, num_ranks=num_ranks)


# ---------------------------------------------------------------------------- all_reduce_rms_norm

# Outputs (h, y): h = residual + psum(p), y = rms_norm(h) * weight.
all_reduce_rms_norm_p = Primitive("jaxoverlap_all_reduce_rms_norm")
all_reduce_rms_norm_p.multiple_results = True


def _norm_abstract_eval(p, residual, weight, *, request, num_ranks, eps):
  del num_ranks, eps
  # As the pure expression: psum(p) is invariant over the axis; the residual
  # and the weight bring their own varying axes.
  h_vma = (_vma(p) - set(names.axis_names(request.axis_name))) | _vma(residual)
  return [_with_vma(p, p.shape, h_vma), _with_vma(p, p.shape, h_vma | _vma(weight))]


def _norm_lowering(ctx, p, residual, weight, *, request, num_ranks, eps):
  plan = dispatch.plan_lowering(ctx, request, num_ranks)
  if plan.algorithm == names.UNFUSED and plan.all_reduce.backend == names.XLA:
    plan = plan.all_reduce  # the policy handed the all-reduce to XLA: the pure expression
  if plan.backend == names.XLA:
    return _lower_xla(
        lambda p, r, w: _xla.all_reduce_rms_norm(p, r, w, request.axis_name, eps,
                                                 plan.algorithm, _mesh_axes(ctx)),
        ctx, p, residual, weight, multiple_results=True)
  if plan.algorithm == names.UNFUSED:
    # The CUDA all-reduce of p, then the residual add and the norm in XLA.
    p_aval = ctx.avals_in[0]
    s_aval = _with_vma(p_aval, p_aval.shape,
                       _vma(p_aval) - set(names.axis_names(request.axis_name)))
    (s,) = _cuda.all_reduce(ctx.replace(avals_in=[p_aval], avals_out=[s_aval]), p,
                            plan.all_reduce)
    return _lower_xla(lambda s, r, w: _xla.rms_norm_tail(s, r, w, eps),
                      ctx.replace(avals_in=[s_aval, *ctx.avals_in[1:]]), s, residual, weight,
                      multiple_results=True)
  return _cuda.all_reduce_rms_norm(ctx, p, residual, weight, plan, eps)


def _norm_batch(args, dims, *, request, num_ranks, eps):
  p, r, w = args
  dp, dr, dw = dims
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)

  def lead(a, d):
    return (jax.numpy.broadcast_to(a, (size,) + a.shape) if d is None
            else jax.numpy.moveaxis(a, d, 0))

  p, r = lead(p, dp), lead(r, dr)
  if dw is None:  # rows are independent: the batch is one more leading dimension
    outs = all_reduce_rms_norm_p.bind(p, r, w, request=request, num_ranks=num_ranks, eps=eps)
  else:
    w = jax.numpy.moveaxis(w, dw, 0)
    outs = lax.map(lambda a: all_reduce_rms_norm_p.bind(*a, request=request,
                                                        num_ranks=num_ranks, eps=eps),
                   (p, r, w))
  return outs, [0, 0]


all_reduce_rms_norm_p.def_abstract_eval(_norm_abstract_eval)
mlir.register_lowering(all_reduce_rms_norm_p, _norm_lowering)
batching.primitive_batchers[all_reduce_rms_norm_p] = _norm_batch


# ---------------------------------------------------------------------------- differentiation
#
# The public ops are jax.custom_vjp functions: first-order reverse mode runs
# their own backward passes and never reaches these rules. Differentiating
# that backward pass again (grad of grad, jacrev of grad, jax.hessian) meets
# the primitives under a JVP, and JAX then needs a JVP rule whose tangent it
# can transpose. Each rule below binds the primitive for the primal (as
# planned) and gives the tangent as the op's pure-JAX expression, linear in
# the tangents (the ops are linear in x and bilinear in (x, w)): XLA's
# collectives, not the CUDA kernels, carry the second-order terms.

def _tangents(tangents):
  """The tangents with symbolic zeros instantiated (typed like their primals)."""
  return [ad.instantiate_zeros(t) if type(t) is ad.Zero else t for t in tangents]


def _all_reduce_jvp(primals, tangents, *, request, num_ranks):
  (x,), (t,) = primals, _tangents(tangents)
  out = all_reduce_p.bind(x, request=request, num_ranks=num_ranks)
  return out, _xla.all_reduce(t, request.axis_name, names.COLLECTIVE)


def _ag_jvp(primals, tangents, *, request, num_ranks):
  (x, w), (tx, tw) = primals, _tangents(tangents)
  # AG(x) @ w is bilinear: d = AG(tx) @ w + AG(x) @ tw; AG(x) comes with the primal.
  y, xg = all_gather_matmul_p.bind(x, w, request=dataclasses.replace(request, gathered=True),
                                   num_ranks=num_ranks)
  ty, txg = _xla.all_gather_matmul(tx, w, request.axis_name, request.dim, names.COLLECTIVE)
  ty = (ty.astype(jax.numpy.float32) + _xla.matmul(xg, tw)).astype(y.dtype)
  return ([y, xg], [ty, txg]) if request.gathered else ([y], [ty])


def _rs_jvp(primals, tangents, *, request, num_ranks):
  (x, w), (tx, tw) = primals, _tangents(tangents)
  out = matmul_reduce_scatter_p.bind(x, w, request=request, num_ranks=num_ranks)
  rs = functools.partial(_xla.matmul_reduce_scatter, axis_name=request.axis_name,
                         scatter_dimension=request.dim, algorithm=names.COLLECTIVE)
  return out, rs(tx, w) + rs(x, tw)


def _ar_jvp(primals, tangents, *, request, num_ranks):
  (x, w), (tx, tw) = primals, _tangents(tangents)
  out = matmul_all_reduce_p.bind(x, w, request=request, num_ranks=num_ranks)
  ar = functools.partial(_xla.matmul_all_reduce, axis_name=request.axis_name,
                         algorithm=names.COLLECTIVE)
  return out, ar(tx, w) + ar(x, tw)


def _norm_jvp(primals, tangents, *, request, num_ranks, eps):
  (p, residual, weight), (tp, tr, tw) = primals, _tangents(tangents)
  h, y = all_reduce_rms_norm_p.bind(p, residual, weight, request=request, num_ranks=num_ranks,
                                    eps=eps)
  th = tr + _xla.all_reduce(tp, request.axis_name, names.COLLECTIVE)
  _, ty = jax.jvp(lambda h, w: _xla.rms_norm_tail(jax.numpy.zeros_like(h), h, w, eps)[1],
                  (h, weight), (th, tw))
  return [h, y], [th, ty]


ad.primitive_jvps[all_reduce_p] = _all_reduce_jvp
ad.primitive_jvps[all_gather_matmul_p] = _ag_jvp
ad.primitive_jvps[matmul_reduce_scatter_p] = _rs_jvp
ad.primitive_jvps[matmul_all_reduce_p] = _ar_jvp
ad.primitive_jvps[all_reduce_rms_norm_p] = _norm_jvp


def bind_all_reduce_rms_norm(p, residual, weight, request: Request, num_ranks: int,
                             eps: float):
  """``(h, y)`` of ``residual + psum(p)`` as planned; ``p`` must be varying over the axis."""
  return all_reduce_rms_norm_p.bind(p, residual, weight, request=request,
                                    num_ranks=num_ranks, eps=float(eps))

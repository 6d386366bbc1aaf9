"""Flax NNX tensor-parallel and sequence-parallel layers on jaxoverlap's ops.

Problem:
  Megatron-LM tensor parallelism (TP, arXiv 1909.08053) splits each MLP and
  attention block into a column-parallel GEMM (weight sharded on its output
  features) and a row-parallel GEMM (weight sharded on its input features),
  with one all-reduce per block in the forward pass and one in the backward
  pass. Sequence parallelism (SP, arXiv 2205.05198) shards the activations
  between blocks on the sequence, turning each all-reduce into an all-gather
  before the column GEMM and a reduce-scatter after the row GEMM. Done with
  plain XLA collectives, this communication is exposed.

Algorithm:
  Every layer is thin: its parameters carry ``out_sharding`` metadata from the
  logical-axis rules of a ``ParallelConfig`` (so ``nnx.get_partition_spec``
  gives their specs and sharded init places them), and ``__call__`` runs the
  per-rank computation inside ``jax.shard_map`` on global (jit-level) arrays,
  calling jaxoverlap's functional ops for every collective next to a GEMM:

  ======================  ==========================  ==========================
  layer                   without SP                  with SP
  ======================  ==========================  ==========================
  ColumnParallelLinear    local GEMM; backward        ``all_gather_matmul``
                          ``all_reduce`` of dx        (seq, dimension 1)
  RowParallelLinear       ``matmul_all_reduce``       ``matmul_reduce_scatter``
                                                      (seq, dimension 1)
  ======================  ==========================  ==========================

  Gradients of replicated parameters (norm scales, row biases, and every
  parameter over ``dp``) are summed by JAX's own transposes of ``shard_map``
  (``psum`` over the axes the parameter is replicated on). With
  ``config.mesh=None`` the same modules run unsharded with plain ``jnp`` ops.

  ``ParallelAttention`` and ``TransformerBlock`` also take grouped-query
  attention (``num_kv_heads``), rotary position embeddings (``rope_theta``)
  and a KV cache for decoding (``init_cache``, ``decode=True``), and
  ``ParallelConfig.row_reduction="all_reduce"`` names the all-reduce after
  each row-parallel GEMM: with SwiGLU and RMSNorm, a Llama-style decoder for
  tensor-parallel decode (benchmarks/decode.py builds one).

Example (8 devices):
  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxoverlap.nnx import ParallelConfig, TransformerBlock
  >>> mesh = jax.make_mesh((2, 4), ("dp", "tp"),
  ...                      axis_types=(jax.sharding.AxisType.Auto,) * 2)
  >>> config = ParallelConfig(mesh=mesh, sequence_parallel=True)
  >>> @nnx.jit
  ... def create():
  ...   return TransformerBlock(512, 8, 2048, config=config, rngs=nnx.Rngs(0))
  >>> block = create()                        # parameters sharded as annotated
  >>> x_bsd = jnp.zeros((8, 128, 512))
  >>> y_bsd = nnx.jit(lambda m, x: m(x))(block, x_bsd)
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
from collections.abc import Sequence
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes
from jax import lax

from jaxoverlap import _checks, collectives, names
from jaxoverlap.collectives import all_reduce, all_reduce_rms_norm
from jaxoverlap.nnx.config import ParallelConfig
from jaxoverlap.overlap import all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "RMSNorm",
    "LayerNorm",
    "ParallelMLP",
    "ParallelAttention",
    "TransformerBlock",
    "apply_blocks",
]

Dtype = Any
Initializer = Callable[..., jax.Array]

_default_kernel_init = nnx.initializers.lecun_normal()
_ACTIVATIONS = ("gelu", "swiglu")
_NORMS = ("rms", "layer")


# ----------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------


def _param_init(init: Initializer, config: ParallelConfig, names: tuple[str | None, ...]):
  """Wraps ``init`` with the ``out_sharding`` metadata of logical ``names``.

  Without a mesh the initializer is returned as is (no sharding metadata, so
  unsharded models never need a mesh context).
  """
  if config.mesh is None:
    return init
  return nnx.with_partitioning(init, tuple(config.spec(*names)), mesh=config.mesh)


def _shard_map(fn: Callable, config: ParallelConfig, in_specs, out_specs,
               check_vma: bool = True) -> Callable:
  """``fn`` inside ``jax.shard_map`` on ``config.mesh``; ``fn`` itself without a mesh."""
  if config.mesh is None:
    return fn
  return jax.shard_map(fn, mesh=config.mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=check_vma)


def _matmul(x: jax.Array, w: jax.Array, min_rows: int = 1) -> jax.Array:
  """Local ``x @ w`` with fp32 accumulation, returned in ``x.dtype``.

  Fewer than ``min_rows`` rows (the dimensions of ``x`` but the last) are
  repeated, whole, until there are at least ``min_rows`` for the product, and
  the copies are cut off after it (``ParallelConfig.min_matmul_rows``). Copies
  rather than zero rows: XLA fuses the broadcast into the GEMM, where it ran a
  zero pad as a kernel of its own (docs/decode.md).
  """
  rows = math.prod(x.shape[:-1])
  if rows >= min_rows or rows == 0:  # no rows: nothing to copy, nothing to compute
    return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
  copies = -(-min_rows // rows)
  x_ck = jnp.broadcast_to(x.reshape(1, rows, x.shape[-1]), (copies, rows, x.shape[-1]))
  x_rk = x_ck.reshape(copies * rows, x.shape[-1])
  y_rn = jnp.matmul(x_rk, w, preferred_element_type=jnp.float32)[:rows]
  return y_rn.reshape(*x.shape[:-1], w.shape[-1]).astype(x.dtype)


def _check_sizes(layer: str, **sizes):
  """Raises ValueError unless every size is a positive int (None: not given, skipped)."""
  for name, value in sizes.items():
    if value is None:
      continue
    try:  # ints, NumPy integers and 0-d integer arrays; not floats, strings or bools
      n = None if isinstance(value, (bool, np.bool_)) else operator.index(value)
    except TypeError:
      n = None
    if n is None or n <= 0:
      raise ValueError(f"{layer}: {name} must be a positive int, got {value!r}")


def _check_divisible(what: str, value: int, by: int, by_what: str):
  if value % by:
    raise ValueError(f"{what}={value} must be divisible by {by_what}={by}")


def _check_config(layer: str, config) -> None:
  if not isinstance(config, ParallelConfig):
    raise TypeError(
        f"{layer}: config must be a jaxoverlap.nnx.ParallelConfig (ParallelConfig(mesh) for "
        f"a mesh, ParallelConfig(mesh=None) to run unsharded), got {type(config).__name__}")


def _check_kernel_axes(layer: str, kernel_axes) -> None:
  if (not isinstance(kernel_axes, Sequence) or isinstance(kernel_axes, str)
      or len(kernel_axes) != 2):
    raise ValueError(f"{layer}: kernel_axes names the kernel's two axes, (in, out); got "
                     f"{kernel_axes!r}")


def _check_rank3(x: jax.Array, layer: str, letters: str):
  if x.ndim != 3:
    raise ValueError(f"{layer} expects x: [{', '.join(letters)}], got shape {x.shape}")


def _check_activation_shape(x: jax.Array, config: ParallelConfig, layer: str):
  """Batch divisible by dp; sequence divisible by tp under SP."""
  if config.mesh is None:
    return
  if config.mesh_axis("batch") is not None:
    _check_divisible(f"{layer}: batch size", x.shape[0], config.dp_size, "dp size")
  if config.sequence_parallel:
    _check_divisible(
        f"{layer}: sequence length (sequence_parallel=True)", x.shape[1], config.tp_size,
        "tp size")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _copy_to_tp(x, axis_name, backend, algorithm, protocol):
  """Megatron's ``f``: identity forward, ``all_reduce`` of the gradient backward.

  ``x`` is replicated over ``axis_name``; the result is typed as varying over
  it so it can meet a tp-sharded weight.
  """
  del backend, algorithm, protocol
  return lax.pcast(x, axis_name, to="varying")


# The rules call the bodies, not the custom_vjp functions (``_copy_to_tp``, the
# public ``all_reduce``): under forward over reverse (``jax.hessian``, a
# Hessian-vector product) the rules run with tangents, which a custom_vjp refuses.
def _copy_to_tp_fwd(x, axis_name, backend, algorithm, protocol):
  return lax.pcast(x, axis_name, to="varying"), None


def _copy_to_tp_bwd(axis_name, backend, algorithm, protocol, _, g):
  return (collectives.all_reduce_in_rule(g, axis_name, backend=backend, algorithm=algorithm,
                                         protocol=protocol),)


_copy_to_tp.defvjp(_copy_to_tp_fwd, _copy_to_tp_bwd)


# ----------------------------------------------------------------------------
# Linear layers
# ----------------------------------------------------------------------------


def _linear_inputs(layer: ColumnParallelLinear | RowParallelLinear, x: jax.Array,
                   name: str, letters: str) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """Checks a linear layer's input; returns ``(x, kernel, bias)`` in the compute dtype.

  Args:
    layer: the ColumnParallelLinear or RowParallelLinear being applied.
    x: its rank-3 input, whose last dimension must be ``layer.in_features``.
    name: the layer's name in error messages.
    letters: the names of x's dimensions in error messages (e.g. "bsd").

  Returns:
    ``x``, the kernel and the bias (None without one), promoted to
    ``layer.dtype`` (or to their common dtype when it is None).

  Raises:
    ValueError: ``x`` is not rank 3, its last dimension is not
      ``layer.in_features``, or its shape does not fit the mesh
      (``_check_activation_shape``).
  """
  x = jnp.asarray(x)  # as flax's layers: lists and NumPy arrays too
  _check_rank3(x, name, letters)
  if x.shape[-1] != layer.in_features:
    raise ValueError(
        f"{name}: x has {x.shape[-1]} features, expected "
        f"in_features={layer.in_features}")
  _check_activation_shape(x, layer.config, name)
  bias = layer.bias[...] if layer.bias is not None else None
  return nnx_dtypes.promote_dtype((x, layer.kernel[...], bias), dtype=layer.dtype)


def _init_linear(layer, in_features, out_features, *, config, use_bias, dtype, param_dtype,
                 kernel_axes, kernel_init, bias_init, rngs):
  """Sets the attributes and creates the parameters shared by the TP linear layers."""
  layer.in_features = in_features
  layer.out_features = out_features
  layer.config = config
  layer.use_bias = use_bias
  layer.dtype = dtype
  layer.param_dtype = param_dtype
  layer.kernel_axes = tuple(kernel_axes)
  layer.kernel = nnx.Param(
      _param_init(kernel_init, config, layer.kernel_axes)(
          rngs.params(), (in_features, out_features), param_dtype))
  layer.bias = (
      nnx.Param(
          _param_init(bias_init, config, layer.kernel_axes[1:])(
              rngs.params(), (out_features,), param_dtype))
      if use_bias else None)


class ColumnParallelLinear(nnx.Module):
  """Column-parallel linear layer: ``y = x @ w + bias``, ``w`` sharded on its output.

  Shapes are global (jit-level); ``d = in_features``, ``f = out_features``.

  * Without SP: ``x: [b, s, d]`` replicated over tp (``b`` sharded over dp)
    -> ``y: [b, s, f]`` sharded on ``f`` over tp. Forward: a local GEMM, no
    communication. Backward: ``all_reduce`` of ``dx`` over tp (Megatron's
    ``f`` operator).
  * With SP: ``x: [b, s, d]`` sharded on ``s`` over tp -> ``y: [b, s, f]``
    sharded on ``f`` over tp (full sequence), through
    ``all_gather_matmul(x, w, tp, gather_dimension=1)``; its backward is a
    ``matmul_reduce_scatter`` (Megatron-SP's ``g``).

  Parameters: ``kernel: [d, f]`` (``kernel_axes``, default ``("embed",
  "mlp")``: sharded on ``f`` over tp) and ``bias: [f]`` (sharded over tp).
  dtypes: f32, bf16, f16; GEMMs accumulate in fp32.

  Source: Megatron-LM (arXiv 1909.08053, section 3) and Megatron-SP
  (arXiv 2205.05198, section 4.2.2).
  """

  def __init__(
      self,
      in_features: int,
      out_features: int,
      *,
      config: ParallelConfig,
      use_bias: bool = True,
      dtype: Dtype | None = None,
      param_dtype: Dtype = jnp.float32,
      kernel_init: Initializer = _default_kernel_init,
      bias_init: Initializer = nnx.initializers.zeros_init(),
      kernel_axes: tuple[str, str] = ("embed", "mlp"),
      rngs: nnx.Rngs,
  ):
    """Creates the layer.

    Args:
      in_features: ``d``, the input features (replicated).
      out_features: ``f``, the output features; divisible by the tp size.
      config: the mesh and layout.
      use_bias: add a bias of shape ``[f]``.
      dtype: compute dtype; None promotes the input and parameter dtypes.
      param_dtype: parameter dtype.
      kernel_init: initializer of ``kernel: [d, f]``.
      bias_init: initializer of ``bias: [f]``.
      kernel_axes: logical names of the kernel axes; the first must map to
        no mesh axis, the second to ``config.tp_axis``.
      rngs: random number streams for the initializers.

    Raises:
      TypeError: ``config`` is not a ``ParallelConfig``.
      ValueError: a size is not a positive int, ``out_features`` is not
        divisible by the tp size, ``kernel_axes`` are not two names, or they do
        not map to (None, tp).
    """
    _check_config("ColumnParallelLinear", config)
    _check_kernel_axes("ColumnParallelLinear", kernel_axes)
    _check_sizes("ColumnParallelLinear", in_features=in_features, out_features=out_features)
    _check_divisible("ColumnParallelLinear: out_features", out_features, config.tp_size,
                     "tp size")
    if config.mesh is not None and (
        config.mesh_axis(kernel_axes[0]) is not None
        or config.mesh_axis(kernel_axes[1]) != config.tp_axis):
      raise ValueError(
          f"ColumnParallelLinear: kernel_axes={kernel_axes} must map to (None, "
          f"{config.tp_axis!r}), got ({config.mesh_axis(kernel_axes[0])!r}, "
          f"{config.mesh_axis(kernel_axes[1])!r})")
    _init_linear(self, in_features, out_features, config=config, use_bias=use_bias, dtype=dtype,
                 param_dtype=param_dtype, kernel_axes=kernel_axes, kernel_init=kernel_init,
                 bias_init=bias_init, rngs=rngs)

  def __call__(self, x_bsd: jax.Array) -> jax.Array:
    """Applies the layer.

    Args:
      x_bsd: ``[b, s, d]``; sharded on ``s`` over tp with SP, else replicated
        over tp; ``b`` sharded over dp.

    Returns:
      ``[b, s, f]`` sharded on ``f`` over tp (``b`` over dp), in the compute
      dtype.

    Raises:
      ValueError: ``x_bsd`` is not rank 3, its last dimension is not ``d``,
        ``b`` is not divisible by the dp size, or (SP) ``s`` not by the tp size.
      TypeError: on a mesh, a forward-mode tangent on ``x_bsd`` (without SP
        the gradient is an ``all_reduce``, with SP the op is
        ``all_gather_matmul``: reverse-mode rules only); ``jax.hessian`` and
        Hessian-vector products (forward over reverse) work.
    """
    x_bsd = jnp.asarray(x_bsd)  # as flax's layers: lists and NumPy arrays too
    x_bsd, w_df, bias = _linear_inputs(self, x_bsd, "ColumnParallelLinear", "bsd")
    cfg = self.config

    def local(x_bsd, w_df, *bias_f):
      if cfg.mesh is None:
        y_bsf = _matmul(x_bsd, w_df, cfg.min_matmul_rows)
      elif cfg.sequence_parallel:
        y_bsf = all_gather_matmul(
            x_bsd, w_df, cfg.tp_axis, gather_dimension=1, backend=cfg.backend,
            algorithm=cfg.algorithm_for(names.ALL_GATHER_MATMUL), transport=cfg.transport)
      else:
        # Its gradient is an all_reduce, reverse mode only; in eager shard_map forward mode
        # would fail inside JAX ("unhashable type"), so say what failed.
        _checks.refuse_forward_mode("ColumnParallelLinear", x_bsd)
        x_bsd = _copy_to_tp(x_bsd, cfg.tp_axis, cfg.backend, cfg.all_reduce_algorithm,
                            cfg.all_reduce_protocol)
        y_bsf = _matmul(x_bsd, w_df, cfg.min_matmul_rows)
      if bias_f:
        y_bsf = y_bsf + bias_f[0]
      return y_bsf

    out_axis = self.kernel_axes[1]
    in_specs = (cfg.spec("batch", "seq", "embed"), cfg.spec(*self.kernel_axes))
    args = (x_bsd, w_df)
    if bias is not None:
      in_specs += (cfg.spec(out_axis),)
      args += (bias,)
    return _shard_map(local, cfg, in_specs, cfg.spec("batch", None, out_axis))(*args)


class RowParallelLinear(nnx.Module):
  """Row-parallel linear layer: ``y = x @ w + bias``, ``w`` sharded on its input.

  Shapes are global (jit-level); ``f = in_features``, ``d = out_features``.

  * Without SP: ``x: [b, s, f]`` sharded on ``f`` over tp -> ``y: [b, s, d]``
    replicated over tp, through ``matmul_all_reduce(x, w, tp)`` (Megatron's
    ``g``); backward: a local GEMM for ``dx``. ``config.row_reduction``
    chooses the sum: ``"all_reduce"`` runs the local GEMM, then
    ``all_reduce`` (``config.all_reduce_algorithm``, ``all_reduce_protocol``);
    ``"none"`` leaves each rank its partial sum (wrong results: a benchmark's
    floor).
  * With SP: ``x: [b, s, f]`` sharded on ``f`` over tp -> ``y: [b, s, d]``
    sharded on ``s`` over tp, through
    ``matmul_reduce_scatter(x, w, tp, scatter_dimension=1)``; its backward is
    an ``all_gather_matmul``.

  The bias is added once, after the reduction. Parameters: ``kernel: [f, d]``
  (``kernel_axes``, default ``("mlp", "embed")``: sharded on ``f`` over tp)
  and ``bias: [d]`` (replicated). dtypes: f32, bf16, f16; GEMMs accumulate in
  fp32.

  Source: Megatron-LM (arXiv 1909.08053, section 3) and Megatron-SP
  (arXiv 2205.05198, section 4.2.2).
  """

  def __init__(
      self,
      in_features: int,
      out_features: int,
      *,
      config: ParallelConfig,
      use_bias: bool = True,
      dtype: Dtype | None = None,
      param_dtype: Dtype = jnp.float32,
      kernel_init: Initializer = _default_kernel_init,
      bias_init: Initializer = nnx.initializers.zeros_init(),
      kernel_axes: tuple[str, str] = ("mlp", "embed"),
      rngs: nnx.Rngs,
  ):
    """Creates the layer.

    Args:
      in_features: ``f``, the input features; divisible by the tp size.
      out_features: ``d``, the output features (replicated).
      config: the mesh and layout.
      use_bias: add a bias of shape ``[d]`` after the reduction.
      dtype: compute dtype; None promotes the input and parameter dtypes.
      param_dtype: parameter dtype.
      kernel_init: initializer of ``kernel: [f, d]``.
      bias_init: initializer of ``bias: [d]``.
      kernel_axes: logical names of the kernel axes; the first must map to
        ``config.tp_axis``, the second to no mesh axis.
      rngs: random number streams for the initializers.

    Raises:
      TypeError: ``config`` is not a ``ParallelConfig``.
      ValueError: a size is not a positive int, ``in_features`` is not
        divisible by the tp size, ``kernel_axes`` are not two names, or they do
        not map to (tp, None).
    """
    _check_config("RowParallelLinear", config)
    _check_kernel_axes("RowParallelLinear", kernel_axes)
    _check_sizes("RowParallelLinear", in_features=in_features, out_features=out_features)
    _check_divisible("RowParallelLinear: in_features", in_features, config.tp_size, "tp size")
    if config.mesh is not None and (
        config.mesh_axis(kernel_axes[0]) != config.tp_axis
        or config.mesh_axis(kernel_axes[1]) is not None):
      raise ValueError(
          f"RowParallelLinear: kernel_axes={kernel_axes} must map to ({config.tp_axis!r}, "
          f"None), got ({config.mesh_axis(kernel_axes[0])!r}, "
          f"{config.mesh_axis(kernel_axes[1])!r})")
    _init_linear(self, in_features, out_features, config=config, use_bias=use_bias, dtype=dtype,
                 param_dtype=param_dtype, kernel_axes=kernel_axes, kernel_init=kernel_init,
                 bias_init=bias_init, rngs=rngs)

  def __call__(self, x_bsf: jax.Array) -> jax.Array:
    """Applies the layer.

    Args:
      x_bsf: ``[b, s, f]`` sharded on ``f`` over tp (full sequence), ``b``
        sharded over dp.

    Returns:
      ``[b, s, d]``: sharded on ``s`` over tp with SP, else replicated over
      tp; ``b`` over dp; in the compute dtype.

    Raises:
      ValueError: ``x_bsf`` is not rank 3, its last dimension is not ``f``,
        ``b`` is not divisible by the dp size, or (SP) ``s`` not by the tp size.
      TypeError: on a mesh, a forward-mode tangent (``matmul_all_reduce`` and
        ``matmul_reduce_scatter`` have reverse-mode rules only; forward over
        reverse works).
    """
    x_bsf = jnp.asarray(x_bsf)  # as flax's layers: lists and NumPy arrays too
    x_bsf, w_fd, bias = _linear_inputs(self, x_bsf, "RowParallelLinear", "bsf")
    cfg = self.config

    def local(x_bsf, w_fd, *bias_d):
      if cfg.mesh is None:
        y_bsd = _matmul(x_bsf, w_fd, cfg.min_matmul_rows)
      elif cfg.sequence_parallel:
        y_bsd = matmul_reduce_scatter(
            x_bsf, w_fd, cfg.tp_axis, scatter_dimension=1, backend=cfg.backend,
            algorithm=cfg.algorithm_for(names.MATMUL_REDUCE_SCATTER), transport=cfg.transport)
      elif cfg.row_reduction == "matmul_all_reduce":
        # algorithm_for: "auto" for a name only the fused norm has ("one_shot", fuse_norm).
        y_bsd = matmul_all_reduce(
            x_bsf, w_fd, cfg.tp_axis, backend=cfg.backend,
            algorithm=cfg.algorithm_for(names.MATMUL_ALL_REDUCE), transport=cfg.transport)
      else:
        y_bsd = _matmul(x_bsf, w_fd, cfg.min_matmul_rows)
        if cfg.row_reduction == "all_reduce":
          y_bsd = all_reduce(y_bsd, cfg.tp_axis, backend=cfg.backend,
                             algorithm=cfg.all_reduce_algorithm,
                             protocol=cfg.all_reduce_protocol)
      if bias_d:
        y_bsd = y_bsd + bias_d[0]
      return y_bsd

    in_axis = self.kernel_axes[0]
    in_specs = (cfg.spec("batch", None, in_axis), cfg.spec(*self.kernel_axes))
    args = (x_bsf, w_fd)
    if bias is not None:
      in_specs += (cfg.spec(self.kernel_axes[1]),)
      args += (bias,)
    # "none" returns each rank's partial sum as if it were the replicated sum:
    # the type check would (rightly) refuse it.
    floor = cfg.row_reduction == "none" and not cfg.sequence_parallel
    return _shard_map(local, cfg, in_specs, cfg.spec("batch", "seq", "embed"),
                      check_vma=not floor)(*args)

  def partial(self, x_bsf: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """Each tp rank's partial product, unreduced, for a fused reduction after the layer.

    Args:
      x_bsf: ``[b, s, f]`` sharded on ``f`` over tp (no SP).

    Returns:
      ``(p_tbsd, bias)``: ``p_tbsd: [tp, b, s, d]`` whose entry ``t`` (sharded
      on its first axis over tp) is rank ``t``'s ``x_shard @ w_shard`` in the
      compute dtype (their sum is the layer's output less the bias), and the
      bias ``[d]`` or None.

    Raises:
      ValueError: as ``__call__``.
    """
    x_bsf, w_fd, bias = _linear_inputs(self, x_bsf, "RowParallelLinear", "bsf")
    cfg = self.config
    in_axis = self.kernel_axes[0]
    in_specs = (cfg.spec("batch", None, in_axis), cfg.spec(*self.kernel_axes))
    out_spec = jax.sharding.PartitionSpec(cfg.tp_axis, *cfg.spec("batch", None, "embed"))
    p = _shard_map(lambda x, w: _matmul(x, w, cfg.min_matmul_rows)[None], cfg, in_specs,
                   out_spec)(x_bsf, w_fd)
    return p, bias


# ----------------------------------------------------------------------------
# Norms
# ----------------------------------------------------------------------------


def _check_norm_input(x: jax.Array, norm: RMSNorm | LayerNorm, layer: str):
  """A norm's input: rank 3, ``norm.num_features`` features, a shape that fits the mesh."""
  _check_rank3(x, layer, "bsd")
  if x.shape[-1] != norm.num_features:
    raise ValueError(f"{layer}: x has {x.shape[-1]} features, expected "
                     f"num_features={norm.num_features}")
  _check_activation_shape(x, norm.config, layer)


class RMSNorm(nnx.Module):
  """RMS normalization over the features, on activations in their TP/SP layout.

  ``x: [b, s, d]`` -> ``[b, s, d]``, laid out as the activations between
  blocks: sharded on ``s`` over tp with SP, else replicated over tp. Per-token,
  so it needs no communication; the gradient of ``scale: [d]`` (replicated) is
  summed over dp (and tp under SP) by JAX. Statistics in fp32.

  Source: Zhang & Sennrich, "Root Mean Square Layer Normalization", NeurIPS
  2019 (arXiv 1910.07467).
  """

  def __init__(
      self,
      num_features: int,
      *,
      config: ParallelConfig,
      epsilon: float = 1e-6,
      dtype: Dtype | None = None,
      param_dtype: Dtype = jnp.float32,
      rngs: nnx.Rngs,
  ):
    """Creates the norm.

    Args:
      num_features: ``d``.
      config: the mesh and layout.
      epsilon: added to the mean square.
      dtype: compute dtype; None promotes the input and parameter dtypes.
      param_dtype: parameter dtype.
      rngs: unused (no random initializers); kept for a uniform signature.

    Raises:
      TypeError: ``config`` is not a ``ParallelConfig``.
      ValueError: ``num_features`` is not a positive int.
    """
    _check_config("RMSNorm", config)
    del rngs
    _check_sizes("RMSNorm", num_features=num_features)
    self.num_features = num_features
    self.config = config
    self.epsilon = epsilon
    self.dtype = dtype
    self.scale = nnx.Param(
        _param_init(nnx.initializers.ones_init(), config, ("embed",))(
            jax.random.key(0), (num_features,), param_dtype))

  def __call__(self, x_bsd: jax.Array) -> jax.Array:
    """Normalizes ``x_bsd: [b, s, d]``; returns ``[b, s, d]`` in the same layout.

    Raises:
      ValueError: ``x_bsd`` is not rank 3, its last dimension is not
        ``num_features``, ``b`` is not divisible by the dp size, or (SP) ``s``
        not by the tp size.
    """
    x_bsd = jnp.asarray(x_bsd)  # as flax's layers: lists and NumPy arrays too
    _check_norm_input(x_bsd, self, "RMSNorm")
    x_bsd, scale_d = nnx_dtypes.promote_dtype((x_bsd, self.scale[...]), dtype=self.dtype)
    eps = self.epsilon

    def local(x_bsd, scale_d):
      x32 = x_bsd.astype(jnp.float32)
      ms = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
      return (x32 * lax.rsqrt(ms + eps) * scale_d.astype(jnp.float32)).astype(x_bsd.dtype)

    act = self.config.spec("batch", "seq", "embed")
    return _shard_map(local, self.config, (act, self.config.spec("embed")), act)(x_bsd, scale_d)


class LayerNorm(nnx.Module):
  """Layer normalization over the features, on activations in their TP/SP layout.

  As ``RMSNorm`` (layout, no communication, fp32 statistics), with mean
  subtraction and a ``bias: [d]``.

  Source: Ba, Kiros & Hinton, "Layer Normalization" (arXiv 1607.06450).
  """

  def __init__(
      self,
      num_features: int,
      *,
      config: ParallelConfig,
      epsilon: float = 1e-6,
      dtype: Dtype | None = None,
      param_dtype: Dtype = jnp.float32,
      rngs: nnx.Rngs,
  ):
    """Creates the norm.

    Args:
      num_features: ``d``.
      config: the mesh and layout.
      epsilon: added to the variance.
      dtype: compute dtype; None promotes the input and parameter dtypes.
      param_dtype: parameter dtype.
      rngs: unused (no random initializers); kept for a uniform signature.

    Raises:
      TypeError: ``config`` is not a ``ParallelConfig``.
      ValueError: ``num_features`` is not a positive int.
    """
    _check_config("LayerNorm", config)
    del rngs
    _check_sizes("LayerNorm", num_features=num_features)
    self.num_features = num_features
    self.config = config
    self.epsilon = epsilon
    self.dtype = dtype
    self.scale = nnx.Param(
        _param_init(nnx.initializers.ones_init(), config, ("embed",))(
            jax.random.key(0), (num_features,), param_dtype))
    self.bias = nnx.Param(
        _param_init(nnx.initializers.zeros_init(), config, ("embed",))(
            jax.random.key(0), (num_features,), param_dtype))

  def __call__(self, x_bsd: jax.Array) -> jax.Array:
    """Normalizes ``x_bsd: [b, s, d]``; returns ``[b, s, d]`` in the same layout.

    Raises:
      ValueError: ``x_bsd`` is not rank 3, its last dimension is not
        ``num_features``, ``b`` is not divisible by the dp size, or (SP) ``s``
        not by the tp size.
    """
    x_bsd = jnp.asarray(x_bsd)  # as flax's layers: lists and NumPy arrays too
    _check_norm_input(x_bsd, self, "LayerNorm")
    x_bsd, scale_d, bias_d = nnx_dtypes.promote_dtype(
        (x_bsd, self.scale[...], self.bias[...]), dtype=self.dtype)
    eps = self.epsilon

    def local(x_bsd, scale_d, bias_d):
      x32 = x_bsd.astype(jnp.float32)
      mean = jnp.mean(x32, axis=-1, keepdims=True)
      var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
      y = (x32 - mean) * lax.rsqrt(var + eps)
      y = y * scale_d.astype(jnp.float32) + bias_d.astype(jnp.float32)
      return y.astype(x_bsd.dtype)

    act = self.config.spec("batch", "seq", "embed")
    vec = self.config.spec("embed")
    return _shard_map(local, self.config, (act, vec, vec), act)(x_bsd, scale_d, bias_d)


# ----------------------------------------------------------------------------
# MLP, attention, block
# ----------------------------------------------------------------------------


class ParallelMLP(nnx.Module):
  """Megatron MLP: column-parallel -> activation -> row-parallel.

  ``x: [b, s, d]`` -> ``[b, s, d]``, both in the layout between blocks
  (sharded on ``s`` over tp with SP, else replicated over tp). The hidden
  activation ``[b, s, f]`` is sharded on ``f`` over tp and the activation is
  applied per shard. Collectives: without SP, one ``matmul_all_reduce``
  forward and one ``all_reduce`` backward; with SP, ``all_gather_matmul`` and
  ``matmul_reduce_scatter`` (and their transposes backward).

  ``activation="gelu"``: ``up: [d, f]``, ``gelu(x @ up) @ down``.
  ``activation="swiglu"``: ``up: [d, 2f]`` holding gate and up columns
  interleaved per hidden unit (column ``2i`` is the gate and ``2i + 1`` the up
  projection of unit ``i``), so each tp shard holds whole units and the layout
  does not depend on the tp size; ``silu(gate) * up`` then ``down: [f, d]``.

  Source: Megatron-LM (arXiv 1909.08053, section 3, figure 3a); SwiGLU from
  Shazeer, "GLU Variants Improve Transformer" (arXiv 2002.05202).
  """

  def __init__(
      self,
      num_features: int,
      mlp_features: int,
      *,
      config: ParallelConfig,
      activation: str = "gelu",
      use_bias: bool = True,
      dtype: Dtype | None = None,
      param_dtype: Dtype = jnp.float32,
      kernel_init: Initializer = _default_kernel_init,
      rngs: nnx.Rngs,
  ):
    """Creates the MLP.

    Args:
      num_features: ``d``.
      mlp_features: ``f``, the hidden features; divisible by the tp size.
      config: the mesh and layout.
      activation: ``"gelu"`` or ``"swiglu"``.
      use_bias: biases on both linear layers.
      dtype: compute dtype; None promotes the input and parameter dtypes.
      param_dtype: parameter dtype.
      kernel_init: initializer of both kernels.
      rngs: random number streams for the initializers.

    Raises:
      TypeError: ``config`` is not a ``ParallelConfig``.
      ValueError: a size is not a positive int, unknown ``activation``, or
        ``mlp_features`` not divisible by the tp size.
    """
    _check_config("ParallelMLP", config)
    _check_sizes("ParallelMLP", num_features=num_features, mlp_features=mlp_features)
    if activation not in _ACTIVATIONS:
      raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
    _check_divisible("ParallelMLP: mlp_features", mlp_features, config.tp_size, "tp size")
    self.config = config
    self.activation = activation
    width = 2 * mlp_features if activation == "swiglu" else mlp_features
    common = dict(config=config, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                  kernel_init=kernel_init, rngs=rngs)
    self.up = ColumnParallelLinear(num_features, width, kernel_axes=("embed", "mlp"), **common)
    self.down = RowParallelLinear(mlp_features, num_features, kernel_axes=("mlp", "embed"),
                                  **common)

  def __call__(self, x_bsd: jax.Array, *, partial: bool = False):
    """Applies the MLP to ``x_bsd: [b, s, d]``; returns ``[b, s, d]`` in the same layout.

    ``partial=True``: returns the down projection's unreduced partial products
    and bias instead (``RowParallelLinear.partial``), for a reduction fused
    with what follows (``TransformerBlock``'s ``config.fuse_norm``).

    Raises:
      ValueError: ``x_bsd`` is not rank 3, its last dimension is not ``d``,
        ``b`` is not divisible by the dp size, or (SP) ``s`` not by the tp
        size (``ColumnParallelLinear``, the up projection, names itself).
      TypeError: on a mesh, a forward-mode tangent on ``x_bsd``
        (``ColumnParallelLinear``, ``RowParallelLinear``; forward over reverse
        works).
    """
    x_bsd = jnp.asarray(x_bsd)  # as flax's layers: lists and NumPy arrays too
    h_bsf = self.up(x_bsd)
    if self.activation == "gelu":
      act = lambda h: jax.nn.gelu(h)
    else:
      def act(h):
        h = h.reshape(*h.shape[:-1], h.shape[-1] // 2, 2)
        return jax.nn.silu(h[..., 0]) * h[..., 1]
    hidden = self.config.spec("batch", None, "mlp")
    h_bsf = _shard_map(act, self.config, (hidden,), hidden)(h_bsf)
    return self.down.partial(h_bsf) if partial else self.down(h_bsf)


def _rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding, rotate-half form (GPT-NeoX, Llama), computed in fp32.

  Args:
    x: ``[b, s, ..., k]`` queries or keys, ``k`` even; index ``i`` of the
      sequence dimension is at position ``positions[i]``.
    positions: ``[s]`` integer positions.
    theta: the frequency base: features ``j`` and ``j + k / 2`` turn by the
      angle ``position * theta ** (-2 j / k)``, ``j < k / 2``.

  Returns:
    The rotated ``x``, in its dtype.
  """
  half = x.shape[-1] // 2
  inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / x.shape[-1])
  angle = positions.astype(jnp.float32)[:, None] * inv_freq  # [s, k / 2]
  angle = angle.reshape((1, angle.shape[0]) + (1,) * (x.ndim - 3) + (half,))
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _attention(q_bsngk: jax.Array, k_btnk: jax.Array, v_btnk: jax.Array,
               positions_s: jax.Array) -> jax.Array:
  """Causal softmax attention of grouped queries over keys at positions ``0 .. t - 1``.

  Args:
    q_bsngk: ``[b, s, n, g, k]``: ``n`` key/value heads with ``g`` query heads each.
    k_btnk, v_btnk: ``[b, t, n, k]``.
    positions_s: ``[s]``: query ``i`` sees the keys at positions ``<= positions_s[i]``.

  Returns:
    ``[b, s, n * g * k]`` (heads in ``(n, g)`` order) in the dtype of ``q``;
    logits and softmax in fp32.
  """
  head_dim = q_bsngk.shape[-1]
  logits = jnp.einsum("bsngk,btnk->bngst", q_bsngk, k_btnk, preferred_element_type=jnp.float32)
  logits = logits / math.sqrt(head_dim)
  visible_st = jnp.arange(k_btnk.shape[1])[None, :] <= positions_s[:, None]
  logits = jnp.where(visible_st, logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("bngst,btnk->bsngk", probs, v_btnk.astype(jnp.float32))
  return out.reshape(*out.shape[:2], math.prod(out.shape[2:])).astype(q_bsngk.dtype)


def _attention_cudnn(q_b1ngk: jax.Array, k_btnk: jax.Array, v_btnk: jax.Array,
                     index: jax.Array) -> jax.Array:
  """``_attention`` of one query token at position ``index``, as one cuDNN kernel.

  ``jax.nn.dot_product_attention(implementation="cudnn")`` over the query heads
  ``(n, g)`` flattened n-major (query head ``i`` uses key/value head
  ``i // g``, as in ``_attention``); the keys at positions above ``index``
  are masked by ``key_value_seq_lengths = index + 1``. Returns
  ``[b, 1, n * g * k]`` in the dtype of ``q``.
  """
  b, s, n, g, k = q_b1ngk.shape
  lengths = jnp.full((b,), index + 1, jnp.int32)
  out = jax.nn.dot_product_attention(q_b1ngk.reshape(b, s, n * g, k), k_btnk, v_btnk,
                                     key_value_seq_lengths=lengths, implementation="cudnn")
  return out.reshape(b, s, n * g * k).astype(q_b1ngk.dtype)


class ParallelAttention(nnx.Module):
  """Causal self-attention, heads sharded over tp: multi-head or grouped-query, RoPE, KV cache.

  ``x: [b, s, d]`` -> ``[b, s, d]``, both in the layout between blocks
  (sharded on ``s`` over tp with SP, else replicated over tp). The ``h``
  query heads share ``n = num_kv_heads`` key/value heads, ``g = h / n`` each
  (grouped-query attention; ``n = h`` is multi-head attention).

  * ``qkv``: a ``ColumnParallelLinear`` ``[d, n * (g + 2) * k]`` whose
    columns are laid out KV-head-major, ``[n, g + 2, k]``: per KV head its
    ``g`` query heads, its key and its value. Each tp shard thus holds
    ``n / tp`` whole groups; for ``g = 1`` this is Megatron's fused QKV
    layout ``[h, 3, k]``. Query head ``i`` is column block ``(i // g, i % g)``
    and uses KV head ``i // g``.
  * ``rope_theta``: queries and keys are turned by their positions (RoPE,
    rotate-half form, in fp32) before the scores.
  * The core (causal softmax, fp32 logits) runs locally on each head shard,
    over the full sequence.
  * ``out``: a ``RowParallelLinear`` ``[h * k, d]`` (rows in query-head order).

  Decoding, as with ``flax.nnx.MultiHeadAttention``: ``init_cache`` creates
  the ``nnx.Cache`` variables ``cached_key`` and ``cached_value``
  ``[b, max_length, n, k]`` (``n`` sharded over tp, ``b`` over dp) and
  ``cache_index`` (int32 scalar: the position of the next token, the same
  for every sequence). ``__call__(x, decode=True)`` takes ``s >= 1`` tokens at
  positions ``cache_index .. cache_index + s - 1`` (a prompt, then one token
  per step), writes their keys and values into the cache, lets each attend to
  the cached positions up to its own, and advances ``cache_index`` by ``s``.
  The scores span all ``max_length`` cached positions under a mask (static
  shapes: every step costs the same).

  Collectives: as ``ParallelMLP`` (without SP, ``matmul_all_reduce``
  forward and ``all_reduce`` backward; with SP, ``all_gather_matmul`` and
  ``matmul_reduce_scatter``).

  Source: Megatron-LM (arXiv 1909.08053, section 3, figure 3b); grouped-query
  attention (Ainslie et al., arXiv 2305.13245, section 2.2); RoPE (Su et al.,
  arXiv 2104.09864, sections 3.2.2 and 3.4.2: the general form and its
  element-wise computation).
  """

  def __init__(
      self,
      num_features: int,
      num_heads: int,
      *,
      config: ParallelConfig,
      head_features: int | None = None,
      num_kv_heads: int | None = None,
      rope_theta: float | None = None,
      use_bias: bool = True,
      dtype: Dtype | None = None,
      param_dtype: Dtype = jnp.float32,
      kernel_init: Initializer = _default_kernel_init,
      rngs: nnx.Rngs,
  ):
    """Creates the attention layer.

    Args:
      num_features: ``d``.
      num_heads: ``h``, the query heads; divisible by the tp size.
      config: the mesh and layout.
      head_features: ``k``; None means ``d // h``.
      num_kv_heads: ``n``, the key/value heads; divides ``h`` and is divisible
        by the tp size. None means ``h`` (multi-head attention).
      rope_theta: the RoPE frequency base (e.g. 10000, or 500000 as in Llama
        3); None: no position embedding here.
      use_bias: biases on the qkv and output projections.
      dtype: compute dtype; None promotes the input and parameter dtypes.
      param_dtype: parameter dtype.
      kernel_init: initializer of both kernels.
      rngs: random number streams for the initializers.

    Raises:
      TypeError: ``config`` is not a ``ParallelConfig``.
      ValueError: a size is not a positive int, ``num_heads`` not divisible
        by the tp size or by ``num_kv_heads``, ``num_kv_heads`` not
        divisible by the tp size, ``head_features`` is None and ``d`` not
        divisible by ``h``, or RoPE with an odd ``head_features``.
    """
    _check_config("ParallelAttention", config)
    _check_sizes("ParallelAttention", num_features=num_features, num_heads=num_heads,
                 head_features=head_features, num_kv_heads=num_kv_heads)
    _check_divisible("ParallelAttention: num_heads", num_heads, config.tp_size, "tp size")
    if head_features is None:
      _check_divisible("ParallelAttention: num_features", num_features, num_heads, "num_heads")
      head_features = num_features // num_heads
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    _check_divisible("ParallelAttention: num_heads", num_heads, num_kv_heads, "num_kv_heads")
    _check_divisible("ParallelAttention: num_kv_heads", num_kv_heads, config.tp_size, "tp size")
    if rope_theta is not None and head_features % 2:
      raise ValueError(f"ParallelAttention: RoPE needs an even head_features, got {head_features}")
    self.config = config
    self.num_heads = num_heads
    self.num_kv_heads = num_kv_heads
    self.head_features = head_features
    self.rope_theta = rope_theta
    self.dtype = dtype
    self.param_dtype = param_dtype
    common = dict(config=config, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                  kernel_init=kernel_init, rngs=rngs)
    group = num_heads // num_kv_heads
    self.qkv = ColumnParallelLinear(
        num_features, num_kv_heads * (group + 2) * head_features, kernel_axes=("embed", "heads"),
        **common)
    self.out = RowParallelLinear(
        num_heads * head_features, num_features, kernel_axes=("heads", "embed"), **common)

  def init_cache(self, input_shape: tuple[int, ...], dtype: Dtype | None = None) -> None:
    """Creates an empty KV cache (``cache_index`` 0) for ``__call__(x, decode=True)``.

    Args:
      input_shape: ``(b, max_length, ...)``: the batch and the longest
        sequence (prompt and generated tokens) the cache holds.
      dtype: the cache's dtype; None: the compute dtype, else the parameter
        dtype.

    Raises:
      ValueError: ``input_shape`` has fewer than two entries, ``b`` or
        ``max_length`` is not a positive int, or ``b`` is not divisible by
        the dp size.
    """
    cfg = self.config
    if not isinstance(input_shape, (tuple, list)) or len(input_shape) < 2:
      raise ValueError("ParallelAttention.init_cache: input_shape must be (batch, max_length, "
                       f"...), got {input_shape!r}")
    _check_sizes("ParallelAttention.init_cache", batch=input_shape[0],
                 max_length=input_shape[1])
    b, max_length = int(input_shape[0]), int(input_shape[1])
    if cfg.mesh is not None and cfg.mesh_axis("batch") is not None:
      _check_divisible("ParallelAttention.init_cache: batch size", b, cfg.dp_size, "dp size")

    def zeros(shape, dtype, spec):
      if cfg.mesh is None:
        return jnp.zeros(shape, dtype)
      # Made in place, each shard on its device: global arrays, also across processes.
      return jax.jit(functools.partial(jnp.zeros, shape, dtype),
                     out_shardings=jax.sharding.NamedSharding(cfg.mesh, spec))()

    shape = (b, max_length, self.num_kv_heads, self.head_features)
    dtype = dtype or self.dtype or self.param_dtype
    self.cached_key = nnx.Cache(zeros(shape, dtype, cfg.spec("batch", None, "heads", "kv")))
    self.cached_value = nnx.Cache(zeros(shape, dtype, cfg.spec("batch", None, "heads", "kv")))
    self.cache_index = nnx.Cache(zeros((), jnp.int32, cfg.spec()))

  def _check_decode(self, x_bsd: jax.Array) -> bool:
    """``__call__``'s decode checks, from ``x_bsd``'s shape and dtype and the cache alone;
    whether the step runs cuDNN's attention. Raises as ``__call__`` documents."""
    if getattr(self, "cache_index", None) is None:
      raise ValueError("ParallelAttention: decode=True needs a KV cache; call "
                       "init_cache(input_shape) first")
    _check_rank3(x_bsd, "ParallelAttention", "bsd")
    (b, s), (cache_b, max_length) = x_bsd.shape[:2], self.cached_key.shape[:2]
    if b != cache_b:
      raise ValueError(f"ParallelAttention: x has batch size {b}, the KV cache {cache_b}")
    try:
      start = int(self.cache_index[...])
    except TypeError:  # traced: not known before the program runs
      start = 0
    if start + s > max_length:
      raise ValueError(f"ParallelAttention: {s} tokens from position {start} do not fit in "
                       f"the KV cache of max_length {max_length}")

    dtype = jnp.dtype(self.qkv.dtype) if self.qkv.dtype is not None else jnp.result_type(
        x_bsd.dtype, self.qkv.kernel[...].dtype,
        *(() if self.qkv.bias is None else (self.qkv.bias[...].dtype,)))  # qkv's output
    cudnn = self.config.attention_implementation == "cudnn" and s == 1
    platform = (self.config.mesh.devices.flat[0].platform if self.config.mesh is not None
                else jax.default_backend())
    if cudnn and platform != "gpu":
      raise ValueError("ParallelAttention: attention_implementation='cudnn' runs cuDNN's fused "
                       f"attention, which needs NVIDIA GPUs; this model runs on {platform!r} "
                       "(use attention_implementation='xla')")
    if cudnn and dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
      raise ValueError("ParallelAttention: attention_implementation='cudnn' needs bfloat16 or "
                       f"float16 activations, got {dtype.name}")
    if cudnn and self.cached_key.dtype != dtype:
      raise ValueError("ParallelAttention: attention_implementation='cudnn' reads the KV cache "
                       f"in the activations' dtype ({dtype.name}); the cache "
                       f"is {jnp.dtype(self.cached_key.dtype).name} (init_cache's dtype)")
    return cudnn

  def __call__(self, x_bsd: jax.Array, *, decode: bool = False, partial: bool = False):
    """Applies attention to ``x_bsd: [b, s, d]``; returns ``[b, s, d]`` in the same layout.

    Args:
      x_bsd: the input.
      decode: attend over the KV cache (``init_cache``) from position
        ``cache_index`` on, and advance it by ``s``; else causal attention
        within ``x_bsd`` (positions ``0 .. s - 1``).
      partial: return the output projection's unreduced partial products and
        bias (``RowParallelLinear.partial``) instead of the output, for a
        reduction fused with what follows (``TransformerBlock``'s
        ``config.fuse_norm``).

    Raises:
      ValueError: decode without a cache, a batch other than the cache's, or
        (where ``cache_index`` is known, i.e. outside jit) more tokens than
        the cache has room for. Under jit, tokens past ``max_length`` are not
        detected (``lax.dynamic_update_slice`` clamps the position). A decode
        step of one token with ``attention_implementation="cudnn"`` (config)
        off NVIDIA GPUs, in a dtype other than bfloat16 or float16, or with a
        KV cache of another dtype.
    """
    x_bsd = jnp.asarray(x_bsd)  # as flax's layers: lists and NumPy arrays too
    if decode:  # before the projection: a refused call runs nothing, also outside jit
      cudnn = self._check_decode(x_bsd)
    qkv_bsn = self.qkv(x_bsd)  # n = kv heads * (g + 2) * k, sharded over tp
    group, theta = self.num_heads // self.num_kv_heads, self.rope_theta
    head_dim = self.head_features

    def split(qkv_bsn, positions_s):
      # The local kv heads spelled out: -1 cannot be inferred for an empty batch or sequence.
      kv_heads = qkv_bsn.shape[-1] // ((group + 2) * head_dim)
      qkv = qkv_bsn.reshape(*qkv_bsn.shape[:2], kv_heads, group + 2, head_dim)
      q, k, v = qkv[..., :group, :], qkv[..., group, :], qkv[..., group + 1, :]
      if theta is not None:
        q, k = _rope(q, positions_s, theta), _rope(k, positions_s, theta)
      return q, k, v

    heads = self.config.spec("batch", None, "heads")
    if not decode:
      def core(qkv_bsn):
        positions = jnp.arange(qkv_bsn.shape[1])
        return _attention(*split(qkv_bsn, positions), positions)

      attn_bsn = _shard_map(core, self.config, (heads,), heads)(qkv_bsn)  # n = h * k
      return self.out.partial(attn_bsn) if partial else self.out(attn_bsn)

    def cached_core(qkv_bsn, ck_btnk, cv_btnk, index):
      positions = index + jnp.arange(qkv_bsn.shape[1], dtype=index.dtype)
      q, k, v = split(qkv_bsn, positions)
      ck_btnk = lax.dynamic_update_slice(ck_btnk, k.astype(ck_btnk.dtype), (0, index, 0, 0))
      cv_btnk = lax.dynamic_update_slice(cv_btnk, v.astype(cv_btnk.dtype), (0, index, 0, 0))
      if cudnn:
        return _attention_cudnn(q, ck_btnk, cv_btnk, index), ck_btnk, cv_btnk
      return _attention(q, ck_btnk, cv_btnk, positions), ck_btnk, cv_btnk

    cache = self.config.spec("batch", None, "heads", "kv")
    index = self.cache_index[...]
    attn_bsn, self.cached_key[...], self.cached_value[...] = _shard_map(
        cached_core, self.config, (heads, cache, cache, self.config.spec()),
        (heads, cache, cache))(qkv_bsn, self.cached_key[...], self.cached_value[...], index)
    self.cache_index[...] = index + x_bsd.shape[1]
    return self.out.partial(attn_bsn) if partial else self.out(attn_bsn)


class TransformerBlock(nnx.Module):
  """Pre-norm transformer block: ``x + attn(norm(x))``, then ``+ mlp(norm(.))``.

  ``x: [b, s, d]`` -> ``[b, s, d]``. With SP, ``x``, the norms and the
  residual adds are sharded on ``s`` over tp; without SP they are replicated
  over tp. ``b`` is sharded over dp. Per block and direction, the collectives
  are those of ``ParallelAttention`` plus those of ``ParallelMLP``. With
  ``num_kv_heads``, ``rope_theta``, ``activation="swiglu"`` and ``norm="rms"``
  it is a Llama-style block; ``init_cache`` and ``decode=True`` decode with
  the attention's KV cache.

  Source: Megatron-LM (arXiv 1909.08053, section 3, figure 3) and Megatron-SP
  (arXiv 2205.05198, section 4.2.2, figure 5).
  """

  def __init__(
      self,
      num_features: int,
      num_heads: int,
      mlp_features: int,
      *,
      config: ParallelConfig,
      head_features: int | None = None,
      num_kv_heads: int | None = None,
      rope_theta: float | None = None,
      activation: str = "gelu",
      norm: str = "rms",
      use_bias: bool = False,
      epsilon: float = 1e-6,
      dtype: Dtype | None = None,
      param_dtype: Dtype = jnp.float32,
      kernel_init: Initializer = _default_kernel_init,
      rngs: nnx.Rngs,
  ):
    """Creates the block.

    Args:
      num_features: ``d``.
      num_heads: ``h``; divisible by the tp size.
      mlp_features: ``f``; divisible by the tp size.
      config: the mesh and layout.
      head_features: ``k``; None means ``d // h``.
      num_kv_heads: key/value heads of the attention (``ParallelAttention``);
        None: ``h``.
      rope_theta: RoPE frequency base of the attention; None: no RoPE.
      activation: ``"gelu"`` or ``"swiglu"``.
      norm: ``"rms"`` (RMSNorm) or ``"layer"`` (LayerNorm).
      use_bias: biases on the linear layers.
      epsilon: the norms' epsilon.
      dtype: compute dtype; None promotes the input and parameter dtypes.
      param_dtype: parameter dtype.
      kernel_init: initializer of every kernel.
      rngs: random number streams for the initializers.

    Raises:
      TypeError: ``config`` is not a ``ParallelConfig``.
      ValueError: a size is not a positive int, unknown ``norm`` or
        ``activation``, ``config.fuse_norm`` with ``norm="layer"`` or with
        ``epsilon`` not positive, or sizes not divisible as the sub-layers
        require.
    """
    _check_config("TransformerBlock", config)
    _check_sizes("TransformerBlock", num_features=num_features, num_heads=num_heads,
                 mlp_features=mlp_features, head_features=head_features,
                 num_kv_heads=num_kv_heads)
    if norm not in _NORMS:
      raise ValueError(f"norm must be one of {_NORMS}, got {norm!r}")
    if config.fuse_norm and norm != "rms":
      raise ValueError(f"config.fuse_norm fuses an RMSNorm; this block's norm is {norm!r}")
    if config.fuse_norm and not _fusable_epsilon(epsilon):
      # all_reduce_rms_norm's eps is a positive Python float; say so here, not at the first call.
      raise ValueError(f"TransformerBlock: config.fuse_norm needs epsilon, the fused norm's "
                       f"eps, as a positive finite number (a Python or NumPy scalar, not an "
                       f"array), got epsilon={epsilon!r}")
    self.config = config
    self.epsilon = epsilon
    norm_cls = RMSNorm if norm == "rms" else LayerNorm
    norm_kw = dict(config=config, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype,
                   rngs=rngs)
    common = dict(config=config, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                  kernel_init=kernel_init, rngs=rngs)
    self.attn_norm = norm_cls(num_features, **norm_kw)
    self.attn = ParallelAttention(num_features, num_heads, head_features=head_features,
                                  num_kv_heads=num_kv_heads, rope_theta=rope_theta, **common)
    self.mlp_norm = norm_cls(num_features, **norm_kw)
    self.mlp = ParallelMLP(num_features, mlp_features, activation=activation, **common)

  def init_cache(self, input_shape: tuple[int, ...], dtype: Dtype | None = None) -> None:
    """Creates the attention's KV cache for decoding (``ParallelAttention.init_cache``).

    Args:
      input_shape: ``(b, max_length)`` or ``(b, max_length, ...)``: the batch
        and the most tokens the cache holds.
      dtype: the cache's dtype; None: the block's ``dtype``, else its
        ``param_dtype``.

    Raises:
      ValueError: as ``ParallelAttention.init_cache``.
    """
    self.attn.init_cache(input_shape, dtype)

  def __call__(self, x_bsd: jax.Array, *, decode: bool = False, normed: jax.Array | None = None,
               next_norm: RMSNorm | LayerNorm | None = None
               ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Applies the block to ``x_bsd: [b, s, d]``; returns ``[b, s, d]`` in the same layout.

    Args:
      x_bsd: the input.
      decode: the attention runs on its KV cache (``ParallelAttention``).
      normed: ``self.attn_norm(x_bsd)``, where the caller has it (the previous
        block's ``next_norm``); the block then does not compute it.
      next_norm: a norm of the block's output for what follows it: the next
        block's ``attn_norm`` (pass the result as its ``normed``) or a final
        norm. With ``config.fuse_norm`` the MLP's reduction, the residual add
        and this norm run as one ``all_reduce_rms_norm``, as the attention's
        reduction does with ``mlp_norm``; a chain of blocks then ends every
        row-parallel layer with one fused op (two a block).

    Returns:
      The output, or ``(output, next_norm(output))`` with ``next_norm``.

    Raises:
      ValueError: the sub-layers' (``x_bsd`` not rank 3, not ``d`` features,
        ``b`` or (SP) ``s`` not divisible by the dp or tp size) and, with
        ``decode``, ``ParallelAttention``'s (no cache, another batch, no room);
        ``config.fuse_norm`` (on a mesh) with a ``next_norm`` that is not an
        ``RMSNorm``, of another width, with an ``epsilon`` that is not a
        positive finite scalar (these before any work), or with a norm that
        computes in a dtype other than the activations'
        (``_reduce_residual_norm``).
      TypeError: on a mesh, a forward-mode tangent (the parallel linear
        layers').
    """
    x_bsd = jnp.asarray(x_bsd)  # as flax's layers: lists and NumPy arrays too
    if normed is not None and jnp.shape(normed) != x_bsd.shape:
      raise ValueError(f"TransformerBlock: normed has shape {jnp.shape(normed)}, x "
                       f"{x_bsd.shape}; normed is attn_norm(x), of x's shape")
    if not (self.config.fuse_norm and self.config.mesh is not None):
      x_bsd = x_bsd + self.attn(self.attn_norm(x_bsd) if normed is None else normed,
                                decode=decode)
      x_bsd = x_bsd + self.mlp(self.mlp_norm(x_bsd))
      return x_bsd if next_norm is None else (x_bsd, next_norm(x_bsd))
    if next_norm is not None:  # before any work: a refused call runs nothing
      _check_fused_norm(next_norm, self.attn_norm.num_features, "next_norm")
    if normed is None:
      normed = self.attn_norm(x_bsd)
    x_bsd, normed = self._reduce_residual_norm(
        self.attn(normed, decode=decode, partial=True), x_bsd, self.mlp_norm)
    if next_norm is None:
      return x_bsd + self.mlp(normed)
    return self._reduce_residual_norm(self.mlp(normed, partial=True), x_bsd, next_norm,
                                      "next_norm")

  def _reduce_residual_norm(self, partial, x_bsd: jax.Array, norm: RMSNorm,
                            role: str = "mlp_norm"):
    """``h = x + the sum of the partials`` and ``norm(h)`` through one ``all_reduce_rms_norm``.

    ``partial``: a row-parallel layer's ``(p_tbsd, bias)`` (its ``partial``
    output). ``role``: which norm ``norm`` is ("mlp_norm", the block's own, or
    "next_norm", the caller's), for the error message. The all-reduce of the
    partials, the residual add and the RMSNorm run as one op (one kernel on backend "cuda"). A bias joins the
    residual before the sum. Computed in the dtype of ``x + layer(...)`` (the
    norm's scale cast to it), the dtype the unfused norm computes in when its
    ``dtype`` is that dtype, or None with a scale no wider.

    Raises:
      ValueError: the unfused norm would compute in another dtype (its
        ``dtype``, or the promotion of the activations and a wider scale).
    """
    cfg = self.config
    p_tbsd, bias = partial
    dtype = jnp.result_type(x_bsd.dtype, p_tbsd.dtype)
    norm_dtype = jnp.dtype(norm.dtype or jnp.result_type(dtype, norm.scale[...].dtype))
    if norm_dtype != jnp.dtype(dtype):
      which = "next_norm" if role == "next_norm" else "the block's mlp_norm"
      remedy = (f"give next_norm dtype={jnp.dtype(dtype).name}" if role == "next_norm" else
                f"feed the block activations in {norm_dtype.name} (the residual stream in "
                f"the block's dtype, e.g. x.astype(jnp.{norm_dtype.name}))")
      raise ValueError(
          f"config.fuse_norm: the fused norm computes in the activations' dtype "
          f"({jnp.dtype(dtype).name}), {which} (an RMSNorm) in "
          f"{norm_dtype.name} (its dtype, or its scale's "
          f"{jnp.dtype(norm.scale[...].dtype).name} promoted with the activations); {remedy}, "
          f"or turn fuse_norm off")
    residual = x_bsd.astype(dtype)
    if bias is not None:
      residual = residual + bias.astype(dtype)
    scale = norm.scale[...].astype(dtype)
    eps, tp = norm.epsilon, cfg.tp_axis
    # The reduction's algorithm as the config names it, where the fused op has it
    # (collective, ppermute, one_shot, unfused); "auto" otherwise (ParallelConfig.fuse_norm).
    algorithm = cfg.algorithm_for(names.ALL_REDUCE_RMS_NORM)

    def local(p_tbsd, residual_bsd, scale_d):
      return all_reduce_rms_norm(p_tbsd[0].astype(dtype), residual_bsd, scale_d, tp, eps=eps,
                                 backend=cfg.backend, algorithm=algorithm)

    act = cfg.spec("batch", "seq", "embed")
    p_spec = jax.sharding.PartitionSpec(tp, *cfg.spec("batch", None, "embed"))
    return _shard_map(local, cfg, (p_spec, act, cfg.spec("embed")), (act, act))(
        p_tbsd, residual, scale)


def _fusable_epsilon(epsilon) -> bool:
  """Whether ``epsilon`` can be ``all_reduce_rms_norm``'s eps: a positive finite scalar."""
  return (isinstance(epsilon, numbers.Real) and not isinstance(epsilon, bool)
          and 0 < epsilon < math.inf)


def _check_fused_norm(norm, num_features: int, role: str) -> None:
  """Refuses a norm that ``config.fuse_norm`` cannot fuse after a block of ``num_features``.

  ``role`` names the norm in the message (``next_norm``, or ``apply_blocks``'s
  ``final_norm``): the errors would otherwise surface later, after the attention
  ran, as ``all_reduce_rms_norm``'s own.

  Raises:
    ValueError: ``norm`` is not a ``jaxoverlap.nnx.RMSNorm``, has another
      ``num_features``, or an ``epsilon`` that is not a positive finite scalar.
  """
  if not isinstance(norm, RMSNorm):
    kind = type(norm)
    raise ValueError(
        "config.fuse_norm fuses a jaxoverlap.nnx.RMSNorm into the reduction before it; "
        f"{role} is a {kind.__module__}.{kind.__qualname__}. Pass "
        "jaxoverlap.nnx.RMSNorm(num_features, config=config) (flax's nnx.RMSNorm is not "
        "fused), or turn fuse_norm off")
  if norm.num_features != num_features:
    raise ValueError(f"{role}: an RMSNorm of num_features={norm.num_features} after a block of "
                     f"{num_features} features")
  if not _fusable_epsilon(norm.epsilon):
    raise ValueError(f"config.fuse_norm needs {role}.epsilon, the fused norm's eps, as a "
                     "positive finite number (a Python or NumPy scalar, not an array), got "
                     f"epsilon={norm.epsilon!r}")


def apply_blocks(blocks: Sequence[TransformerBlock], x_bsd: jax.Array,
                 final_norm: RMSNorm | LayerNorm | None, *, decode: bool = False) -> jax.Array:
  """``final_norm(blocks[-1](... blocks[0](x_bsd)))``, each block handing the next its norm.

  Every block gets the next block's ``attn_norm`` (the last one
  ``final_norm``) as its ``next_norm`` and passes the result on as the next
  block's ``normed``. The value is that of calling the blocks one after the
  other and then the norm; with ``config.fuse_norm`` every row-parallel
  layer's reduction then runs as one ``all_reduce_rms_norm`` with the
  residual add and the norm after it, two a block, where calling the blocks
  one by one fuses only the attention's.

  Args:
    blocks: the blocks, in order (at least one).
    x_bsd: ``[b, s, d]``, the first block's input.
    final_norm: the norm after the last block (an ``RMSNorm`` of the blocks'
      width with ``fuse_norm``), or None: no norm after the last block (its
      MLP's reduction then runs alone).
    decode: passed to every block (``TransformerBlock``).

  Returns:
    ``[b, s, d]``: the final norm of the last block's output (with
    ``final_norm=None``, the output itself).

  Raises:
    TypeError: ``final_norm`` is neither None nor callable.
    ValueError: no blocks; ``fuse_norm`` (on a mesh) with a ``final_norm``
      that is not an ``RMSNorm``, of another width or with an ``epsilon`` that
      is not a positive finite scalar, or that computes in a dtype other than
      the activations' (``TransformerBlock.__call__``).

  Source: the all-reduce after each row-parallel layer (Megatron-LM, arXiv
  1909.08053, section 3) fused with the residual add and the RMSNorm after it
  (``jaxoverlap.all_reduce_rms_norm``; RMSNorm: arXiv 1910.07467), as
  TensorRT-LLM's and FlashInfer's all-reduce fusions do for decode.
  """
  if len(blocks) == 0:
    raise ValueError("apply_blocks needs at least one block")
  if final_norm is not None and not callable(final_norm):
    raise TypeError(f"apply_blocks: final_norm must be a norm (jaxoverlap.nnx.RMSNorm or "
                    f"LayerNorm) or None, got {type(final_norm).__name__}")
  last = blocks[-1]
  if final_norm is not None and last.config.fuse_norm and last.config.mesh is not None:
    _check_fused_norm(final_norm, last.attn_norm.num_features, "apply_blocks: final_norm")
  normed = None
  for i, block in enumerate(blocks):
    nxt = blocks[i + 1].attn_norm if i + 1 < len(blocks) else final_norm
    out = block(x_bsd, decode=decode, normed=normed, next_norm=nxt)
    if nxt is None:  # the last block, without a final norm
      return out
    x_bsd, normed = out
  return normed

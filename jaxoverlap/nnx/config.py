"""ParallelConfig: the mesh, its axes and the logical-axis rules of the NNX layers.

Problem:
  One model definition should run tensor parallel (TP), tensor + sequence
  parallel (SP), data parallel or on a single device, without changing the
  layer code. The layers need to know which mesh axis shards what.

Algorithm:
  A frozen dataclass holds the mesh (or ``None`` for unsharded, single-device
  execution with plain ``jnp`` ops), the names of the data-parallel and
  tensor-parallel mesh axes, whether activations are sequence parallel, the
  backend and algorithm handed to the functional ops, and the rules that map
  logical axis names to mesh axes. Parameters take their ``out_sharding``
  metadata from these rules, and the layers take their ``shard_map`` specs from
  the same rules, so the two always agree.

  Logical names (shape letters in brackets):

  ========  ===============================  ================================
  name      meaning                          mesh axis (default rules)
  ========  ===============================  ================================
  batch     batch [b]                        ``dp_axis``
  seq       sequence of activations [s]      ``tp_axis`` with SP, else None
  embed     model features [d]               None
  mlp       MLP hidden features [f]          ``tp_axis``
  heads     attention heads [h] (query and   ``tp_axis``
            key/value heads)
  kv        head features [k]                None
  vocab     vocabulary                       ``tp_axis``
  ========  ===============================  ================================

Example:
  >>> mesh = jax.make_mesh((2, 4), ("dp", "tp"),
  ...                      axis_types=(jax.sharding.AxisType.Auto,) * 2)
  >>> config = ParallelConfig(mesh=mesh, sequence_parallel=True)
  >>> config.spec("batch", "seq", "embed")
  P('dp', 'tp', None)
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import PartitionSpec

from jaxoverlap import names as op_names

__all__ = ["LOGICAL_AXES", "ROW_REDUCTIONS", "ParallelConfig"]

# Logical axis names the layers use. Rules may name others (for user layers).
LOGICAL_AXES = ("batch", "seq", "embed", "mlp", "heads", "kv", "vocab")

# How a row-parallel layer without SP sums its partial products over tp
# (``ParallelConfig.row_reduction``).
ROW_REDUCTIONS = ("matmul_all_reduce", "all_reduce", "none")
ATTENTION_IMPLEMENTATIONS = ("xla", "cudnn")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
  """How the NNX layers of ``jaxoverlap.nnx`` are laid out on a device mesh.

  Attributes:
    mesh: the device mesh, or None for unsharded single-device execution with
      plain ``jnp`` ops (the reference the sharded model is compared with). Its
      axes must be of type ``jax.sharding.AxisType.Auto`` (on jax 0.11
      ``jax.make_mesh`` defaults to Explicit; pass
      ``axis_types=(jax.sharding.AxisType.Auto,) * n``).
    dp_axis: the data-parallel mesh axis (shards the batch), or None when the
      mesh has none.
    tp_axis: the tensor-parallel mesh axis (shards weights, Megatron-LM
      arXiv 1909.08053).
    sequence_parallel: if True, activations outside the attention core and the
      MLP hidden layer are sharded on the sequence over ``tp_axis``
      (Megatron-SP, arXiv 2205.05198); all-reduces become all-gather +
      reduce-scatter pairs fused with the adjacent GEMMs.
    backend: ``"auto" | "xla" | "cuda"``, passed to every functional op
      (another value raises ``ValueError`` here).
    algorithm: passed to the overlap ops (``all_gather_matmul``,
      ``matmul_reduce_scatter``, ``matmul_all_reduce``): ``"auto"``,
      ``"collective"`` or ``"ppermute"`` (backend "xla"), ``"fused"``
      (backend "cuda"); see ``jaxoverlap.names``.
    transport: passed to the overlap ops: ``"auto"``, ``"copy_engine"`` or
      ``"nvshmem"`` (backend "cuda").
    all_reduce_algorithm: passed to ``all_reduce``: the backward all-reduce
      of column-parallel layers without SP and, with
      ``row_reduction="all_reduce"``, the forward all-reduce of row-parallel
      layers. ``"auto"``, ``"collective"`` (``lax.psum``) or ``"ppermute"``
      (backend "xla"), ``"one_shot"``, ``"two_shot"`` or ``"hierarchical"``
      (backend "cuda").
    all_reduce_protocol: passed to ``all_reduce`` with it: ``"auto"``,
      ``"ll"``, ``"simple"`` or ``"lamport"`` (one_shot, two_shot; backend "cuda").
    row_reduction: how a row-parallel layer without SP sums its partial
      products over tp (one of ``ROW_REDUCTIONS``; with SP the sum is always
      ``matmul_reduce_scatter``'s):

      * ``"matmul_all_reduce"`` (default): ``matmul_all_reduce`` with
        ``backend``, ``algorithm`` and ``transport``, which may fuse the GEMM
        with its all-reduce.
      * ``"all_reduce"``: the local GEMM, then ``all_reduce`` with
        ``backend``, ``all_reduce_algorithm`` and ``all_reduce_protocol``: the
        all-reduce named directly, as tensor-parallel decode wants it (two
        small all-reduces per layer and token, NVRAR arXiv 2511.09557).
      * ``"none"``: the local GEMM only; each rank keeps its partial sum, so
        the results are WRONG. The model's compute without its forward
        all-reduces: the floor a benchmark measures the all-reduces against.
    fuse_norm: ``TransformerBlock`` only (``norm="rms"``, no SP): the
      attention's row-parallel reduction, the residual add and the MLP's
      RMSNorm run as one ``all_reduce_rms_norm`` (on backend "cuda" one kernel
      where it fuses; the pattern after each row-parallel layer in decode) instead of
      the row-parallel layer's own reduction, the add and the norm. Its
      ``algorithm`` is ``all_reduce_algorithm`` (row_reduction "all_reduce")
      or ``algorithm`` (row_reduction "matmul_all_reduce") where the fused op
      has that name ("collective", "ppermute", "one_shot"), else "auto"; on
      backend "cuda", "auto" fuses rows of at most 8 KiB and runs wider ones
      as the all-reduce then the norm (``all_reduce_rms_norm``), and
      "one_shot" forces the fused kernel. Needs a row reduction:
      ``row_reduction="none"`` is refused. Blocks chained through
      ``next_norm`` (``jaxoverlap.nnx.apply_blocks``) fuse the MLP's
      reduction too, with the next block's or the final norm.
    min_matmul_rows: the layers' local GEMMs pad their rows, all dimensions
      of ``x`` but the last, with zeros to at least this many and drop the
      padding from the product; values and gradients are those of the
      unpadded product. The local GEMMs are ``ColumnParallelLinear``'s without
      SP and ``RowParallelLinear``'s with ``row_reduction`` "all_reduce" or
      "none"; the fused ops (``matmul_all_reduce``, the SP ops) are not
      padded. XLA (jax 0.11.2 on H200) compiles a
      product of one row into kernels that read the weights at about 2.4
      TB/s, where four rows read them at the HBM roofline: one TP=2 rank's
      32-layer decode step at batch 1 takes 3.88 ms per token unpadded and
      2.66 ms with 4 (docs/decode.md). 1 (the default) never pads; 2 is the
      measured setting for decode at batch 1 (as fast as 4 there, and it
      leaves batches 2-3 alone, where 4 cost 4%).
    attention_implementation: ``ParallelAttention``'s core in a decode step
      of one token (``decode=True``, one new token per sequence): ``"xla"``
      (the default) the softmax expression of ``layers._attention``, which XLA
      compiles into several kernels a layer; ``"cudnn"``
      ``jax.nn.dot_product_attention(implementation="cudnn")``, one cuDNN
      fused attention kernel, the cached positions beyond the token masked by
      ``key_value_seq_lengths``. cuDNN needs NVIDIA GPUs, bfloat16 or float16
      activations and a KV cache of the same dtype (a ``ValueError`` at the
      first one-token step otherwise). Prompts, several tokens at once and
      training run the XLA expression either way.
    logical_axis_rules: pairs ``(logical name, mesh axis or None)``. None (the
      default) derives them from ``dp_axis``, ``tp_axis`` and
      ``sequence_parallel`` as in the module docstring. Given rules replace
      the defaults name by name; the names the layers rely on must keep their
      required mapping (``mlp`` and ``heads`` on ``tp_axis``, ``embed`` and
      ``kv`` unsharded, ``seq`` on ``tp_axis`` exactly when SP), ``batch``
      may be ``dp_axis`` or None.
  """

  mesh: jax.sharding.Mesh | None = None
  dp_axis: str | None = "dp"
  tp_axis: str = "tp"
  sequence_parallel: bool = False
  backend: str = "auto"
  algorithm: str = "auto"
  transport: str = "auto"
  all_reduce_algorithm: str = "auto"
  all_reduce_protocol: str = "auto"
  row_reduction: str = "matmul_all_reduce"
  fuse_norm: bool = False
  min_matmul_rows: int = 1
  attention_implementation: str = "xla"
  logical_axis_rules: tuple[tuple[str, str | None], ...] | None = None

  def __post_init__(self):
    if self.backend not in op_names.BACKENDS:
      raise ValueError(f"backend must be one of {op_names.BACKENDS}, got {self.backend!r}")
    if self.row_reduction not in ROW_REDUCTIONS:
      raise ValueError(
          f"row_reduction must be one of {ROW_REDUCTIONS}, got {self.row_reduction!r}")
    if not isinstance(self.min_matmul_rows, int) or self.min_matmul_rows < 1:
      raise ValueError(f"min_matmul_rows must be an int >= 1, got {self.min_matmul_rows!r}")
    if self.attention_implementation not in ATTENTION_IMPLEMENTATIONS:
      raise ValueError(f"attention_implementation must be one of {ATTENTION_IMPLEMENTATIONS}, "
                       f"got {self.attention_implementation!r}")
    if self.fuse_norm and self.row_reduction == "none":
      raise ValueError("fuse_norm fuses the attention's all-reduce with the residual add and "
                       "the norm; row_reduction='none' leaves the all-reduces out")
    if self.fuse_norm and self.sequence_parallel:
      raise ValueError("fuse_norm fuses the all-reduce of a row-parallel layer; with "
                       "sequence_parallel=True the layers reduce-scatter instead")
    rules = dict(self._default_rules())
    if self.logical_axis_rules is not None:
      for pair in self.logical_axis_rules:
        if len(pair) != 2:
          raise ValueError(
              f"logical_axis_rules must hold (logical name, mesh axis) pairs, got {pair!r}")
        rules[pair[0]] = pair[1]
    object.__setattr__(self, "logical_axis_rules", tuple(rules.items()))
    if self.mesh is None:
      return
    names = tuple(self.mesh.axis_names)
    if self.tp_axis not in names:
      raise ValueError(f"tp_axis={self.tp_axis!r} is not an axis of the mesh {names}")
    if self.dp_axis is not None and self.dp_axis not in names:
      raise ValueError(
          f"dp_axis={self.dp_axis!r} is not an axis of the mesh {names}; pass dp_axis=None "
          "for a mesh without a data-parallel axis")
    if self.dp_axis == self.tp_axis:
      raise ValueError(f"dp_axis and tp_axis must differ, both are {self.tp_axis!r}")
    explicit = [
        n for n, t in zip(names, self.mesh.axis_types) if t != jax.sharding.AxisType.Auto
    ]
    if explicit:
      raise ValueError(
          f"mesh axes {explicit} are not of type AxisType.Auto ({self.mesh.axis_types}); "
          f"build the mesh with axis_types=(jax.sharding.AxisType.Auto,) * {len(names)}")
    required = {
        "embed": None,
        "kv": None,
        "mlp": self.tp_axis,
        "heads": self.tp_axis,
        "seq": self.tp_axis if self.sequence_parallel else None,
    }
    for name, axis in required.items():
      if rules[name] != axis:
        raise ValueError(
            f"logical axis {name!r} must map to {axis!r} (sequence_parallel="
            f"{self.sequence_parallel}), got {rules[name]!r}")
    if rules["batch"] not in (self.dp_axis, None):
      raise ValueError(
          f"logical axis 'batch' must map to dp_axis={self.dp_axis!r} or None, "
          f"got {rules['batch']!r}")
    for name, axis in rules.items():
      if axis is not None and axis not in names:
        raise ValueError(f"logical axis {name!r} maps to {axis!r}, not an axis of {names}")

  def _default_rules(self) -> tuple[tuple[str, str | None], ...]:
    tp = self.tp_axis
    return (
        ("batch", self.dp_axis),
        ("seq", tp if self.sequence_parallel else None),
        ("embed", None),
        ("mlp", tp),
        ("heads", tp),
        ("kv", None),
        ("vocab", tp),
    )

  @property
  def is_sharded(self) -> bool:
    """True when a mesh is set (layers run inside ``shard_map``)."""
    return self.mesh is not None

  @property
  def tp_size(self) -> int:
    """Number of ranks on ``tp_axis`` (1 without a mesh)."""
    return 1 if self.mesh is None else self.mesh.shape[self.tp_axis]

  @property
  def dp_size(self) -> int:
    """Number of ranks on ``dp_axis`` (1 without a mesh or dp axis)."""
    if self.mesh is None or self.dp_axis is None:
      return 1
    return self.mesh.shape[self.dp_axis]

  def mesh_axis(self, name: str | None) -> str | None:
    """The mesh axis that logical axis ``name`` maps to (None: replicated).

    Raises:
      ValueError: ``name`` has no rule.
    """
    if name is None:
      return None
    rules = dict(self.logical_axis_rules)
    if name not in rules:
      raise ValueError(f"no logical-axis rule for {name!r}; rules: {self.logical_axis_rules}")
    return rules[name]

  def spec(self, *names: str | None) -> PartitionSpec:
    """The ``PartitionSpec`` of an array whose axes have the logical ``names``.

    Without a mesh, every axis is replicated (an empty-axis spec).
    """
    if self.mesh is None:
      return PartitionSpec(*([None] * len(names)))
    return PartitionSpec(*(self.mesh_axis(n) for n in names))

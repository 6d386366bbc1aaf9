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

Example (8 devices):
  >>> import jax
  >>> from jaxoverlap.nnx import ParallelConfig
  >>> mesh = jax.make_mesh((2, 4), ("dp", "tp"),
  ...                      axis_types=(jax.sharding.AxisType.Auto,) * 2)
  >>> config = ParallelConfig(mesh=mesh, sequence_parallel=True)
  >>> config.spec("batch", "seq", "embed")
  P('dp', 'tp', None)
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import PartitionSpec

from jaxoverlap import names as op_names
from jaxoverlap._checks import as_int as _as_int

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
      arXiv 1909.08053, section 3).
    sequence_parallel: if True, activations outside the attention core and the
      MLP hidden layer are sharded on the sequence over ``tp_axis``
      (Megatron-SP, arXiv 2205.05198, section 4.2.2); all-reduces become
      all-gather + reduce-scatter pairs fused with the adjacent GEMMs.
    backend: ``"auto" | "xla" | "cuda"``, passed to every functional op
      (another value raises ``ValueError`` here).
    algorithm: passed to the overlap ops (``all_gather_matmul`` and
      ``matmul_reduce_scatter`` with SP, else ``matmul_all_reduce``) and, with
      ``fuse_norm``, to ``all_reduce_rms_norm``: ``"auto"``, ``"collective"``
      or ``"ppermute"`` (backend "xla"), ``"fused"`` (backend "cuda", every
      overlap op), ``"unfused"`` (backend "cuda": ``matmul_all_reduce``'s
      GEMM, then the CUDA ``all_reduce``; with ``fuse_norm`` also
      ``all_reduce_rms_norm``'s) or, with ``fuse_norm``, ``"one_shot"``
      (``all_reduce_rms_norm``'s fused kernel; ``matmul_all_reduce`` then
      runs ``"auto"``). A name must belong to at least one op the config
      passes it to (``algorithm_for``), on ``backend`` unless that is
      "auto"; see ``jaxoverlap.names``.
    transport: passed to the overlap ops: ``"auto"``, ``"copy_engine"`` or
      ``"nvshmem"`` (backend "cuda").
    all_reduce_algorithm: passed to ``all_reduce``: the backward all-reduce
      of column-parallel layers without SP and, with
      ``row_reduction="all_reduce"``, the forward all-reduce of row-parallel
      layers. ``"auto"``, ``"collective"`` (``lax.psum``) or ``"ppermute"``
      (backend "xla"), ``"one_shot"``, ``"two_shot"`` or ``"hierarchical"``
      (backend "cuda").
    all_reduce_protocol: passed to ``all_reduce`` with it: ``"auto"``,
      ``"ll"``, ``"simple"`` or ``"lamport"`` (backend "cuda"; ``"lamport"``
      with ``"one_shot"`` and ``"two_shot"`` only).
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
      has that name ("collective", "ppermute", "one_shot", "unfused"), else
      "auto" (``algorithm_for``); on backend "cuda", "auto" fuses rows of at
      most 8 KiB and runs wider ones as the all-reduce then the norm
      (``all_reduce_rms_norm``), and "one_shot" forces the fused kernel
      ("one_shot", a name ``matmul_all_reduce`` lacks, leaves the MLP's
      ``matmul_all_reduce`` on "auto" where a block has no ``next_norm``).
      Needs a row reduction: ``row_reduction="none"`` is refused. Blocks
      chained through ``next_norm`` (``jaxoverlap.nnx.apply_blocks``) fuse
      the MLP's reduction too, with the next block's or the final norm.
    min_matmul_rows: the layers' local GEMMs repeat their rows, all
      dimensions of ``x`` but the last, until there are at least this many,
      and drop the copies from the product; values and gradients are those of
      the unpadded product. The local GEMMs are ``ColumnParallelLinear``'s without
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

  Raises:
    TypeError: ``mesh`` is neither a ``jax.sharding.Mesh`` nor None, or
      ``sequence_parallel`` or ``fuse_norm`` is not a bool.
    ValueError: ``backend``, ``algorithm``, ``transport``,
      ``all_reduce_algorithm``, ``all_reduce_protocol``, ``row_reduction`` or
      ``attention_implementation`` is not one of its names (the message lists
      them), or contradicts ``backend``; ``min_matmul_rows`` is not an
      integer >= 1; ``fuse_norm`` with ``sequence_parallel`` or
      ``row_reduction="none"``; an axis missing from the mesh, mesh axes not
      of type ``AxisType.Auto``, or logical-axis rules that break the
      layers' layout.

  Source: tensor parallelism from Megatron-LM (arXiv 1909.08053, section 3),
  sequence parallelism from Megatron-SP (arXiv 2205.05198, section 4.2.2);
  the fused ops (``overlap``) from CommFuse (arXiv 2604.24013), the decode
  all-reduces from NVRAR (arXiv 2511.09557).
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
    if self.mesh is not None and not isinstance(self.mesh, jax.sharding.Mesh):
      raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got "
                      f"{type(self.mesh).__name__} {self.mesh!r}")
    for name in ("sequence_parallel", "fuse_norm"):
      value = getattr(self, name)
      if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
      object.__setattr__(self, name, bool(value))
    if self.backend not in op_names.BACKENDS:
      raise ValueError(f"backend must be one of {op_names.BACKENDS}, got {self.backend!r}")
    if self.row_reduction not in ROW_REDUCTIONS:
      raise ValueError(
          f"row_reduction must be one of {ROW_REDUCTIONS}, got {self.row_reduction!r}")
    rows = _as_int(self.min_matmul_rows)
    if rows is None or rows < 1:
      raise ValueError(f"min_matmul_rows must be an int >= 1, got {self.min_matmul_rows!r}")
    object.__setattr__(self, "min_matmul_rows", rows)
    if self.attention_implementation not in ATTENTION_IMPLEMENTATIONS:
      raise ValueError(f"attention_implementation must be one of {ATTENTION_IMPLEMENTATIONS}, "
                       f"got {self.attention_implementation!r}")
    if self.fuse_norm and self.row_reduction == "none":
      raise ValueError("fuse_norm fuses the attention's all-reduce with the residual add and "
                       "the norm; row_reduction='none' leaves the all-reduces out")
    if self.fuse_norm and self.sequence_parallel:
      raise ValueError("fuse_norm fuses the all-reduce of a row-parallel layer; with "
                       "sequence_parallel=True the layers reduce-scatter instead")
    self._check_algorithms()
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

  def _algorithm_ops(self) -> tuple[str, ...]:
    """The ops the layers pass ``algorithm`` to under this config."""
    if self.sequence_parallel:
      return (op_names.ALL_GATHER_MATMUL, op_names.MATMUL_REDUCE_SCATTER)
    if self.row_reduction == "matmul_all_reduce":
      return ((op_names.MATMUL_ALL_REDUCE, op_names.ALL_REDUCE_RMS_NORM) if self.fuse_norm
              else (op_names.MATMUL_ALL_REDUCE,))
    return op_names.FUSED_OPS  # no layer passes it on; any overlap op's name is kept

  def _check_algorithms(self) -> None:
    """Checks algorithm, transport, all_reduce_algorithm and all_reduce_protocol.

    Raises:
      ValueError: a value that is not a str, or not a name of the ops it is
        passed to (on ``backend``, unless that is "auto"); the message lists
        the valid names.
    """
    auto = op_names.AUTO
    on = None if self.backend == auto else self.backend
    for key in ("algorithm", "transport", "all_reduce_algorithm", "all_reduce_protocol"):
      if not isinstance(getattr(self, key), str):
        raise ValueError(f"{key} must be a str, got {getattr(self, key)!r}")

    ops = self._algorithm_ops()
    valid = {op: op_names.algorithms(op, on) for op in ops}
    if self.algorithm != auto and not any(self.algorithm in v for v in valid.values()):
      renamed = [r for r in (op_names.renamed_value(op, self.algorithm) for op in ops) if r]
      others = [op for op in op_names.FUSED_OPS + (op_names.ALL_REDUCE_RMS_NORM,)
                if op not in ops and self.algorithm in op_names.algorithms(op, on)]
      hint = ""
      if renamed:
        hint = f" (now spelled {renamed[0]})"
      elif others == [op_names.ALL_REDUCE_RMS_NORM]:
        hint = (" (all_reduce_rms_norm's: passed to it with fuse_norm=True and "
                "row_reduction='matmul_all_reduce'; the all-reduces of "
                "row_reduction='all_reduce' take all_reduce_algorithm)")
      elif others:
        hint = f" (an algorithm of {', '.join(others)}, which this config does not use)"
      listed = "; ".join(f"{op}: {', '.join(map(repr, v))}" for op, v in valid.items())
      raise ValueError(
          f"algorithm={self.algorithm!r} is not an algorithm of the ops this config passes it "
          f"to{hint}; valid: 'auto' or, on backend {self.backend!r}, {listed}")

    transports = tuple(dict.fromkeys(
        t for op in ops if op in op_names.FUSED_OPS for t in op_names.transports(op)))
    if self.transport != auto:
      if self.transport not in transports:
        raise ValueError(f"transport={self.transport!r} is unknown; valid: 'auto', "
                         f"{', '.join(map(repr, transports))} (backend 'cuda')")
      if self.backend == op_names.XLA:
        raise ValueError(f"transport={self.transport!r} applies to backend 'cuda' only; "
                         "backend='xla' was given")

    ar = op_names.ALL_REDUCE
    alg = self.all_reduce_algorithm
    if alg != auto and alg not in op_names.algorithms(ar, on):
      renamed = op_names.renamed_value(ar, alg)  # e.g. "algorithm='one_shot', protocol='ll'"
      hint = ("" if renamed is None else
              " (now spelled all_reduce_" + renamed.replace(", ", ", all_reduce_") + ")")
      raise ValueError(
          f"all_reduce_algorithm={alg!r} is not an algorithm of all_reduce{hint}; valid: "
          f"'auto' or, on backend {self.backend!r}, "
          f"{', '.join(map(repr, op_names.algorithms(ar, on)))}")
    protocol = self.all_reduce_protocol
    if protocol != auto:
      if protocol not in op_names.protocols():
        raise ValueError(f"all_reduce_protocol={protocol!r} is unknown; valid: 'auto', "
                         f"{', '.join(map(repr, op_names.protocols()))} (backend 'cuda')")
      if (self.backend == op_names.XLA
          or op_names.backend_of_algorithm(ar, alg) == op_names.XLA):
        raise ValueError(f"all_reduce_protocol={protocol!r} applies to backend 'cuda' only "
                         f"(backend={self.backend!r}, all_reduce_algorithm={alg!r})")
      if alg != auto and protocol not in op_names.protocols(alg):
        raise ValueError(f"all_reduce_protocol={protocol!r}: all_reduce_algorithm={alg!r} has "
                         f"{', '.join(map(repr, op_names.protocols(alg)))}")

  def algorithm_for(self, op: str) -> str:
    """The algorithm the layers pass to ``op`` (one of ``jaxoverlap.names.OPS``).

    ``all_reduce_rms_norm`` (``fuse_norm``): ``all_reduce_algorithm`` with
    ``row_reduction="all_reduce"``, else ``algorithm``, where the op has that
    name, else "auto". ``all_reduce``: ``all_reduce_algorithm``. The overlap
    ops: ``algorithm`` where the op has that name, else "auto" (a name of
    another op the config passes it to, e.g. ``"one_shot"``, which only
    ``all_reduce_rms_norm`` has).

    Raises:
      ValueError: an unknown op.
    """
    if op == op_names.ALL_REDUCE:
      return self.all_reduce_algorithm
    named = (self.all_reduce_algorithm
             if op == op_names.ALL_REDUCE_RMS_NORM and self.row_reduction == "all_reduce"
             else self.algorithm)
    return named if named in op_names.algorithms(op) else op_names.AUTO

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

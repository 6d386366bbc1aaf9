"""NNX tensor/sequence-parallel layers against the same modules run unsharded.

Each test builds a layer on a (dp, tp) mesh of simulated host devices and the
same layer with ``mesh=None`` (plain ``jnp`` ops on one device), loads the same
fresh random parameter values into both, and compares every element of the
forward output and of the gradients of ``sum(out * r)`` (``r`` random) with
respect to every parameter and to the input. Grouped-query attention and RoPE
are also checked against a float64 NumPy attention written here (keys and
values repeated per query head, RoPE in its concatenated-frequency form), and
the KV-cache decode path (prompt, then one token per step) against the
unsharded module and against the full-sequence forward pass.
"""

import itertools
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxoverlap.nnx import (
    ROW_REDUCTIONS,
    ColumnParallelLinear,
    LayerNorm,
    ParallelAttention,
    ParallelConfig,
    ParallelMLP,
    RMSNorm,
    RowParallelLinear,
    TransformerBlock,
    apply_blocks,
    layers,
)

AUTO = jax.sharding.AxisType.Auto
B, S, D, H, F = 4, 8, 32, 4, 64
_seed = itertools.count(1000)


@pytest.fixture(autouse=True)
def _seed_from_test_id(request):
  """Each test's draws start from its own id, whatever ran before it (trial 45: a module-wide
  counter made a test's inputs depend on how many tests came first)."""
  global _seed
  _seed = itertools.count(zlib.crc32(request.node.nodeid.encode()))


def _key():
  """A fresh key for every draw (each test and call gets new values)."""
  return jax.random.key(next(_seed))


def _mesh(dp, tp):
  return jax.make_mesh((dp, tp), ("dp", "tp"), axis_types=(AUTO, AUTO),
                       devices=jax.devices()[:dp * tp])


def _tol(dtype):
  eps = float(jnp.finfo(dtype).eps)
  return dict(rtol=max(eps ** (2 / 3), 2e-5), atol=max(eps ** (2 / 3), 2e-5))


def _params(model):
  return nnx.state(model, nnx.Param)


def _random_params(model, key):
  """Fresh random values (numpy) for every parameter of ``model``, as a pure dict."""
  pure = nnx.to_pure_dict(_params(model))
  leaves, treedef = jax.tree.flatten(pure)
  out = []
  for i, a in enumerate(leaves):
    scale = 1.0 / np.sqrt(a.shape[0]) if a.ndim == 2 else 0.5
    v = scale * jax.random.normal(jax.random.fold_in(key, i), a.shape, jnp.float32)
    out.append(np.asarray(v.astype(a.dtype)))
  return jax.tree.unflatten(treedef, out)


def _load(model, pure):
  """Puts the values of ``pure`` into ``model``'s parameters, keeping their shardings."""
  state = _params(model)
  shardings = jax.tree.map(lambda a: a.sharding, nnx.to_pure_dict(state))
  nnx.replace_by_pure_dict(state, jax.tree.map(jax.device_put, pure, shardings))
  nnx.update(model, state)


def _make_pair(build, config):
  """The sharded module (created under nnx.jit) and its unsharded twin, same values."""
  sharded = nnx.jit(lambda: build(config))()
  ref = build(ParallelConfig(mesh=None))
  pure = _random_params(sharded, _key())
  _load(sharded, pure)
  _load(ref, pure)
  return sharded, ref


def _forward_and_grads(model, x, r):
  graphdef, state = nnx.split(model)

  def loss(state, x):
    y = nnx.merge(graphdef, state)(x)
    return jnp.sum(y.astype(jnp.float32) * r), y

  (_, y), (g_state, g_x) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
      state, x)
  return y, nnx.to_pure_dict(g_state), g_x


def _assert_tree_close(got, want, tol, what):
  got_leaves = jax.tree_util.tree_flatten_with_path(got)[0]
  want_leaves = jax.tree.leaves(want)
  assert len(got_leaves) == len(want_leaves)
  for (path, g), w in zip(got_leaves, want_leaves):
    np.testing.assert_allclose(
        np.asarray(g, np.float32), np.asarray(w, np.float32), **tol,
        err_msg=f"{what} {jax.tree_util.keystr(path)}")


def _check_against_reference(build, config, x_shape, dtype=jnp.float32, tol=None):
  sharded, ref = _make_pair(build, config)
  x = jax.random.normal(_key(), x_shape, jnp.float32).astype(dtype)
  # Outliers: a few large entries per call.
  x = x.at[0, 0, 0].set(8.0).at[-1, -1, -1].set(-8.0)
  y_ref = ref(x)
  r = jax.random.normal(_key(), y_ref.shape, jnp.float32)
  y, g_params, g_x = _forward_and_grads(sharded, x, r)
  y_want, g_params_want, g_x_want = _forward_and_grads(ref, x, r)
  tol = tol or _tol(dtype)
  assert y.shape == y_want.shape and y.dtype == y_want.dtype
  _assert_tree_close(y, y_want, tol, "output")
  _assert_tree_close(g_x, g_x_want, tol, "grad x")
  _assert_tree_close(g_params, g_params_want, tol, "grad")
  return y


MESHES = {"dp2-tp2": (2, 2), "dp2-tp4": (2, 4), "dp1-tp4": (1, 4)}


# ----------------------------------------------------------------------------
# TransformerBlock
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["collective", "ppermute"])
@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
@pytest.mark.parametrize("mesh_id", ["dp2-tp2", "dp2-tp4"])
def test_transformer_block_matches_unsharded(mesh_id, sp, algorithm):
  mesh = _mesh(*MESHES[mesh_id])
  config = ParallelConfig(mesh=mesh, sequence_parallel=sp, backend="xla", algorithm=algorithm,
                          all_reduce_algorithm=algorithm)
  # Cover both activations and both norms across the parametrization.
  activation, norm = ("gelu", "layer") if mesh_id == "dp2-tp2" else ("swiglu", "rms")
  build = lambda c: TransformerBlock(D, H, F, config=c, activation=activation, norm=norm,
                                     use_bias=True, rngs=nnx.Rngs(0))
  y = _check_against_reference(build, config, (B, S, D))
  spec = P("dp", "tp") if sp else P("dp")
  assert y.sharding.is_equivalent_to(NamedSharding(mesh, spec), y.ndim), y.sharding


def test_transformer_block_bf16():
  """bf16 compute, sharded against unsharded, each leaf against bf16's own error.

  The two differ by the order of float32 sums and by where bf16 rounds, so neither is exact:
  each leaf of the sharded run (output, input and parameter gradients) must be within twice
  the unsharded bf16 run's own distance from the same model in float32, plus half a bf16 ulp
  of the leaf's largest value. A fixed atol/rtol failed a quarter of the seeds on gradients
  that cancel (a bias's gradient, a sum over 32 rows: trial 45).
  """
  mesh = _mesh(2, 2)
  config = ParallelConfig(mesh=mesh, sequence_parallel=True, backend="xla",
                          algorithm="ppermute")
  build = lambda c, dtype=jnp.bfloat16: TransformerBlock(D, H, F, config=c, dtype=dtype,
                                                         use_bias=True, rngs=nnx.Rngs(0))
  sharded, ref = _make_pair(build, config)
  exact = build(ParallelConfig(mesh=None), jnp.float32)
  _load(exact, nnx.to_pure_dict(_params(ref)))
  x = jax.random.normal(_key(), (B, S, D), jnp.float32).astype(jnp.bfloat16)
  x = x.at[0, 0, 0].set(8.0).at[-1, -1, -1].set(-8.0)
  r = jax.random.normal(_key(), (B, S, D), jnp.float32)
  got, want, exact = (jax.tree.leaves(_forward_and_grads(m, x, r))
                      for m in (sharded, ref, exact))
  assert len(got) == len(want) == len(exact) == 2 + len(jax.tree.leaves(_params(ref)))
  ulp = float(jnp.finfo(jnp.bfloat16).eps)
  for i, (g, w, e) in enumerate(zip(got, want, exact)):
    assert g.shape == w.shape and g.dtype == w.dtype, (i, g.shape, g.dtype, w.shape, w.dtype)
    g, w, e = (np.asarray(a, np.float64) for a in (g, w, e))
    own = np.max(np.abs(w - e))  # what bf16 costs the unsharded model
    err = np.max(np.abs(g - w))
    assert err <= 2 * own + 0.5 * ulp * np.max(np.abs(e)), (
        f"leaf {i} {g.shape}: sharded differs from unsharded by {err:.3g}, where bf16 alone "
        f"moves the unsharded model {own:.3g} from float32")


# ----------------------------------------------------------------------------
# Single layers
# ----------------------------------------------------------------------------

LAYERS = {
    "column": (lambda c: ColumnParallelLinear(D, F, config=c, rngs=nnx.Rngs(0)), D),
    "row": (lambda c: RowParallelLinear(F, D, config=c, rngs=nnx.Rngs(0)), F),
    "mlp-gelu": (lambda c: ParallelMLP(D, F, config=c, activation="gelu", rngs=nnx.Rngs(0)),
                 D),
    "mlp-swiglu": (lambda c: ParallelMLP(D, F, config=c, activation="swiglu",
                                         rngs=nnx.Rngs(0)), D),
    "attention": (lambda c: ParallelAttention(D, H, config=c, rngs=nnx.Rngs(0)), D),
}


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_layer_matches_unsharded(layer, sp):
  build, in_features = LAYERS[layer]
  # Alternate meshes and algorithms across layers to cover both cheaply.
  mesh_id = "dp1-tp4" if layer in ("column", "mlp-swiglu", "attention") else "dp2-tp2"
  algorithm = "collective" if sp else "ppermute"
  mesh = _mesh(*MESHES[mesh_id])
  config = ParallelConfig(mesh=mesh, sequence_parallel=sp, backend="xla", algorithm=algorithm,
                          all_reduce_algorithm=algorithm)
  y = _check_against_reference(build, config, (B, S, in_features))
  # Column output: features sharded over tp (full sequence); others: the
  # layout between blocks.
  if layer == "column":
    spec = P("dp", None, "tp")
  else:
    spec = P("dp", "tp") if sp else P("dp")
  assert y.sharding.is_equivalent_to(NamedSharding(mesh, spec), y.ndim), y.sharding


@pytest.mark.parametrize("norm_cls", [RMSNorm, LayerNorm], ids=["rms", "layer"])
def test_norm_matches_unsharded_sp(norm_cls):
  config = ParallelConfig(mesh=_mesh(2, 4), sequence_parallel=True, backend="xla")
  build = lambda c: norm_cls(D, config=c, rngs=nnx.Rngs(0))
  _check_against_reference(build, config, (B, S, D))


def test_rank_encoded_row_parallel():
  """Readable case: input shard of tp rank i is all (i + 1); w all ones.

  Without SP every output element is sum over f of x = sum_i (i + 1) * f / tp.
  """
  tp = 4
  config = ParallelConfig(mesh=_mesh(1, tp), backend="xla", algorithm="ppermute")
  layer = nnx.jit(lambda: RowParallelLinear(
      F, D, config=config, use_bias=False, kernel_init=nnx.initializers.ones_init(),
      rngs=nnx.Rngs(0)))()
  x = jnp.repeat(jnp.arange(1, tp + 1, dtype=jnp.float32), F // tp)
  x = jnp.broadcast_to(x, (B, S, F))
  y = nnx.jit(lambda m, x: m(x))(layer, x)
  np.testing.assert_array_equal(np.asarray(y), np.full((B, S, D), (F // tp) * 10.0))


# ----------------------------------------------------------------------------
# Sharded init and metadata
# ----------------------------------------------------------------------------


def test_sharded_init_places_params_as_annotated():
  mesh = _mesh(2, 4)
  config = ParallelConfig(mesh=mesh, sequence_parallel=True)
  block = nnx.jit(lambda: TransformerBlock(D, H, F, config=config, activation="swiglu",
                                           use_bias=True, rngs=nnx.Rngs(0)))()
  state = _params(block)
  specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
  values = nnx.to_pure_dict(state)
  want = {
      ("attn", "qkv", "kernel"): P(None, "tp"),
      ("attn", "qkv", "bias"): P("tp"),
      ("attn", "out", "kernel"): P("tp", None),
      ("attn", "out", "bias"): P(None),
      ("mlp", "up", "kernel"): P(None, "tp"),
      ("mlp", "up", "bias"): P("tp"),
      ("mlp", "down", "kernel"): P("tp", None),
      ("mlp", "down", "bias"): P(None),
      ("attn_norm", "scale"): P(None),
      ("mlp_norm", "scale"): P(None),
  }
  got = {tuple(k.key for k in path): spec
         for path, spec in jax.tree_util.tree_flatten_with_path(
             specs, is_leaf=lambda s: isinstance(s, P))[0]}
  assert got == want
  for path, spec in want.items():
    v = values
    for k in path:
      v = v[k]
    assert isinstance(v.sharding, NamedSharding), (path, v.sharding)
    assert v.sharding.mesh == mesh
    assert v.sharding.is_equivalent_to(NamedSharding(mesh, spec), v.ndim), (path, v.sharding)
  # Shard shapes: the column kernel holds f / tp columns, the row kernel f / tp rows.
  assert values["mlp"]["up"]["kernel"].addressable_shards[0].data.shape == (D, 2 * F // 4)
  assert values["mlp"]["down"]["kernel"].addressable_shards[0].data.shape == (F // 4, D)
  assert values["attn"]["qkv"]["kernel"].addressable_shards[0].data.shape == (D, 3 * D // 4)


def test_unsharded_params_have_no_sharding_metadata():
  block = TransformerBlock(D, H, F, config=ParallelConfig(mesh=None), rngs=nnx.Rngs(0))
  for _, var in nnx.iter_graph(block):
    if isinstance(var, nnx.Param):
      assert not var.get_metadata().get("out_sharding")


def test_same_seed_gives_same_values_sharded_and_unsharded():
  config = ParallelConfig(mesh=_mesh(2, 2), sequence_parallel=True)
  build = lambda c: ParallelMLP(D, F, config=c, rngs=nnx.Rngs(7))
  sharded = nnx.jit(lambda: build(config))()
  ref = build(ParallelConfig())
  _assert_tree_close(nnx.to_pure_dict(_params(sharded)), nnx.to_pure_dict(_params(ref)),
                     dict(rtol=0, atol=0), "init")


# ----------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------


def test_config_rejects_explicit_mesh():
  mesh = jax.make_mesh((2, 2), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Explicit,) * 2,
                       devices=jax.devices()[:4])
  with pytest.raises(ValueError, match="AxisType.Auto"):
    ParallelConfig(mesh=mesh)


def test_config_rejects_missing_axes_and_bad_rules():
  mesh = _mesh(2, 2)
  with pytest.raises(ValueError, match="tp_axis='model' is not an axis"):
    ParallelConfig(mesh=mesh, tp_axis="model")
  with pytest.raises(ValueError, match="dp_axis='data' is not an axis"):
    ParallelConfig(mesh=mesh, dp_axis="data")
  with pytest.raises(ValueError, match="logical axis 'mlp' must map to 'tp'"):
    ParallelConfig(mesh=mesh, logical_axis_rules=(("mlp", None),))
  with pytest.raises(ValueError, match="logical axis 'seq' must map to 'tp'"):
    ParallelConfig(mesh=mesh, sequence_parallel=True, logical_axis_rules=(("seq", None),))
  config = ParallelConfig(mesh=mesh, logical_axis_rules=(("batch", None), ("vocab", None)))
  assert config.spec("batch", "seq", "embed") == P(None, None, None)


def test_layers_reject_bad_sizes():
  config = ParallelConfig(mesh=_mesh(1, 4), sequence_parallel=True)
  with pytest.raises(ValueError, match="num_heads=2 must be divisible by tp size=4"):
    ParallelAttention(D, 2, config=config, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="out_features=6 must be divisible by tp size=4"):
    ColumnParallelLinear(D, 6, config=config, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="activation must be one of"):
    ParallelMLP(D, F, config=config, activation="relu", rngs=nnx.Rngs(0))
  layer = ColumnParallelLinear(D, F, config=config, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"sequence length \(sequence_parallel=True\)=6 must"):
    layer(jnp.zeros((B, 6, D)))
  with pytest.raises(ValueError, match="expects x: \\[b, s, d\\]"):
    layer(jnp.zeros((B, D)))


@pytest.mark.parametrize("bad", [-4, 0, 8.0, True, "8"])
def test_layers_reject_sizes_that_are_not_positive_ints(bad):
  """Before any parameter is made, with the layer and the argument named (JAX's own errors for
  a negative or float shape named neither)."""
  kw = dict(config=ParallelConfig(mesh=_mesh(1, 2)), rngs=nnx.Rngs(0))
  cases = [
      ("ColumnParallelLinear", "in_features", lambda v: ColumnParallelLinear(v, F, **kw)),
      ("ColumnParallelLinear", "out_features", lambda v: ColumnParallelLinear(D, v, **kw)),
      ("RowParallelLinear", "in_features", lambda v: RowParallelLinear(v, D, **kw)),
      ("RowParallelLinear", "out_features", lambda v: RowParallelLinear(F, v, **kw)),
      ("RMSNorm", "num_features", lambda v: RMSNorm(v, **kw)),
      ("LayerNorm", "num_features", lambda v: LayerNorm(v, **kw)),
      ("ParallelMLP", "mlp_features", lambda v: ParallelMLP(D, v, **kw)),
      ("ParallelAttention", "head_features",
       lambda v: ParallelAttention(D, 2, head_features=v, **kw)),
      ("TransformerBlock", "num_heads", lambda v: TransformerBlock(D, v, F, **kw)),
  ]
  for layer, arg, make in cases:
    with pytest.raises(ValueError, match=f"{layer}: {arg} must be a positive int, got {bad!r}"):
      make(bad)


@pytest.mark.parametrize("norm_cls", [RMSNorm, LayerNorm])
@pytest.mark.parametrize("sharded", [False, True], ids=["unsharded", "tp"])
def test_norms_check_the_feature_width(norm_cls, sharded):
  """A wrong feature width names the norm, where JAX's broadcasting error named nothing."""
  config = ParallelConfig(mesh=_mesh(1, 2) if sharded else None)
  norm = norm_cls(D, config=config, rngs=nnx.Rngs(0))
  name = norm_cls.__name__
  for width in (D - 1, D + 1, 1):
    with pytest.raises(ValueError, match=re.escape(
        f"{name}: x has {width} features, expected num_features={D}")):
      norm(jnp.zeros((B, S, width)))
  x = jax.random.normal(_key(), (B, S, D), jnp.float32)
  assert norm(x).shape == (B, S, D)  # the right width still runs



def test_layers_exports_what_the_package_exports():
  from jaxoverlap import nnx as jnnx
  from jaxoverlap.nnx import config as config_module, layers

  assert "apply_blocks" in layers.__all__
  assert set(jnnx.__all__) == set(layers.__all__) | set(config_module.__all__)
  for name in layers.__all__:
    assert getattr(layers, name) is getattr(jnnx, name)


# ----------------------------------------------------------------------------
# ParallelConfig: names, types, the mesh
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("kw,msg", [
    (dict(algorithm="one_shot"),
     "algorithm='one_shot' is not an algorithm of the ops this config passes it to "
     "(all_reduce_rms_norm's: passed to it with fuse_norm=True"),
    (dict(algorithm="fuse"),
     "algorithm='fuse' is not an algorithm of the ops this config passes it to; valid: 'auto' "
     "or, on backend 'auto', matmul_all_reduce: 'collective', 'ppermute', 'fused', 'unfused'"),
    (dict(algorithm="copy_engine"), "now spelled algorithm='fused', transport='copy_engine'"),
    (dict(algorithm="unfused", sequence_parallel=True),
     "(an algorithm of matmul_all_reduce, all_reduce_rms_norm, which this config does not use)"
     "; valid: 'auto' or, on backend 'auto', all_gather_matmul: 'collective', 'ppermute', "
     "'fused'; matmul_reduce_scatter: 'collective', 'ppermute', 'fused'"),
    (dict(algorithm="ppermute", backend="cuda"),
     "valid: 'auto' or, on backend 'cuda', matmul_all_reduce: 'fused', 'unfused'"),
    (dict(algorithm="fused", backend="xla", fuse_norm=True),
     "matmul_all_reduce: 'collective', 'ppermute'; all_reduce_rms_norm: 'collective', "
     "'ppermute'"),
    (dict(transport="peer"),
     "transport='peer' is unknown; valid: 'auto', 'copy_engine', 'nvshmem' (backend 'cuda')"),
    (dict(transport="nvshmem", backend="xla"),
     "transport='nvshmem' applies to backend 'cuda' only; backend='xla' was given"),
    (dict(all_reduce_algorithm="fused"),
     "all_reduce_algorithm='fused' is not an algorithm of all_reduce; valid: 'auto' or, on "
     "backend 'auto', 'collective', 'ppermute', 'one_shot', 'two_shot', 'hierarchical'"),
    (dict(all_reduce_algorithm="one_shot_ll"),
     "now spelled all_reduce_algorithm='one_shot', all_reduce_protocol='ll'"),
    (dict(all_reduce_algorithm="collective", backend="cuda"),
     "on backend 'cuda', 'one_shot', 'two_shot', 'hierarchical'"),
    (dict(all_reduce_protocol="ll8"),
     "all_reduce_protocol='ll8' is unknown; valid: 'auto', 'll', 'simple', 'lamport'"),
    (dict(all_reduce_protocol="lamport", all_reduce_algorithm="hierarchical"),
     "all_reduce_protocol='lamport': all_reduce_algorithm='hierarchical' has 'll', 'simple'"),
    (dict(all_reduce_protocol="ll", all_reduce_algorithm="collective"),
     "all_reduce_protocol='ll' applies to backend 'cuda' only"),
    (dict(all_reduce_protocol="simple", backend="xla"),
     "all_reduce_protocol='simple' applies to backend 'cuda' only"),
    (dict(algorithm=None), "algorithm must be a str, got None"),
])
def test_config_checks_the_names_against_the_vocabulary(kw, msg):
  """Every name field is checked when the config is made; the message lists the valid names."""
  with pytest.raises(ValueError, match=re.escape(msg)):
    ParallelConfig(mesh=_mesh(1, 2), dp_axis=None, **kw)


@pytest.mark.parametrize("kw", [
    dict(algorithm="fused", transport="nvshmem"),
    dict(algorithm="unfused", backend="cuda"),
    dict(algorithm="fused", sequence_parallel=True, transport="copy_engine"),
    dict(algorithm="ppermute", backend="xla", sequence_parallel=True),
    dict(algorithm="one_shot", fuse_norm=True),
    dict(algorithm="unfused", fuse_norm=True, backend="cuda"),
    dict(algorithm="fused", row_reduction="all_reduce"),
    dict(all_reduce_algorithm="two_shot", all_reduce_protocol="lamport", backend="cuda"),
    dict(all_reduce_algorithm="hierarchical", all_reduce_protocol="simple"),
    dict(all_reduce_protocol="ll"),
    dict(all_reduce_algorithm="ppermute", backend="xla", row_reduction="all_reduce",
         fuse_norm=True),
])
def test_config_accepts_every_valid_combination(kw):
  config = ParallelConfig(mesh=_mesh(1, 2), dp_axis=None, **kw)
  for key, value in kw.items():
    assert getattr(config, key) == value


def test_config_checks_types_and_the_mesh():
  with pytest.raises(TypeError, match="sequence_parallel must be a bool, got str 'False'"):
    ParallelConfig(sequence_parallel="False")
  with pytest.raises(TypeError, match="sequence_parallel must be a bool, got int 1"):
    ParallelConfig(sequence_parallel=1)
  with pytest.raises(TypeError, match="fuse_norm must be a bool, got str 'True'"):
    ParallelConfig(fuse_norm="True")
  with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh or None, got str 'abc'"):
    ParallelConfig(mesh="abc")
  with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh or None, got tuple"):
    ParallelConfig(mesh=(2, 4))
  config = ParallelConfig(mesh=_mesh(1, 2), sequence_parallel=np.bool_(True))
  assert config.sequence_parallel is True and config.spec("seq") == P("tp")


def test_config_min_matmul_rows_takes_numpy_integers_not_bools():
  for value in (np.int64(3), np.int32(3), np.uint8(3), 3):
    config = ParallelConfig(min_matmul_rows=value)
    assert config.min_matmul_rows == 3 and type(config.min_matmul_rows) is int
  for bad in (True, np.bool_(True), 0, -1, 2.0, np.float32(2), "2"):
    with pytest.raises(ValueError, match=re.escape(
        f"min_matmul_rows must be an int >= 1, got {bad!r}")):
      ParallelConfig(min_matmul_rows=bad)


# ----------------------------------------------------------------------------
# Grouped-query attention, RoPE, the row-parallel reduction, decoding
# ----------------------------------------------------------------------------

KV, THETA = 2, 10000.0


def _numpy_attention(x, p, num_heads, num_kv_heads, theta, positions):
  """float64 reference: GQA by repeating each KV head, RoPE as x cos + rotate_half(x) sin."""
  x = np.asarray(x, np.float64)
  w = {k: np.asarray(v, np.float64) for k, v in p.items()}
  b, s, _ = x.shape
  g = num_heads // num_kv_heads
  qkv = (x @ w["qkv_kernel"] + w["qkv_bias"]).reshape(b, s, num_kv_heads, g + 2, -1)
  k_dim = qkv.shape[-1]
  q = qkv[:, :, :, :g].reshape(b, s, num_heads, k_dim)  # head i: kv head i // g
  keys = np.repeat(qkv[:, :, :, g], g, axis=2)
  values = np.repeat(qkv[:, :, :, g + 1], g, axis=2)
  if theta is not None:
    inv = theta ** (-np.arange(0, k_dim, 2) / k_dim)
    ang = np.asarray(positions, np.float64)[:, None] * np.concatenate([inv, inv])
    cos, sin = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
    rot = lambda a: np.concatenate([-a[..., k_dim // 2:], a[..., :k_dim // 2]], -1)  # noqa: E731
    q, keys = q * cos + rot(q) * sin, keys * cos + rot(keys) * sin
  scores = np.einsum("bshk,bthk->bhst", q, keys) / np.sqrt(k_dim)
  scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  out = np.einsum("bhst,bthk->bshk", probs, values).reshape(b, s, -1)
  return out @ w["out_kernel"] + w["out_bias"]


@pytest.mark.parametrize("num_kv_heads, theta", [(KV, THETA), (H, THETA), (KV, None)],
                         ids=["gqa-rope", "mha-rope", "gqa"])
def test_gqa_rope_attention_matches_numpy(num_kv_heads, theta):
  """Sharded (tp 2) and unsharded layers on the same weights against the float64 reference."""
  mesh = _mesh(2, 2)
  config = ParallelConfig(mesh=mesh, backend="xla", algorithm="ppermute")
  build = lambda c: ParallelAttention(D, H, config=c, num_kv_heads=num_kv_heads,  # noqa: E731
                                      rope_theta=theta, rngs=nnx.Rngs(0))
  y = _check_against_reference(build, config, (B, S, D))  # values and gradients
  layer = build(ParallelConfig())
  _load(layer, _random_params(layer, _key()))
  x = jax.random.normal(_key(), (B, S, D), jnp.float32)
  pure = nnx.to_pure_dict(_params(layer))
  p = {f"{a}_{b}": v for a in ("qkv", "out") for b, v in pure[a].items()}
  assert p["qkv_kernel"].shape == (D, num_kv_heads * (H // num_kv_heads + 2) * (D // H))
  np.testing.assert_allclose(np.asarray(layer(x)),
                             _numpy_attention(x, p, H, num_kv_heads, theta, np.arange(S)),
                             rtol=2e-5, atol=2e-5)
  assert y.shape == (B, S, D)


def _decoder_pair(config, num_layers):
  """(sharded, unsharded) stacks of Llama-style blocks with the same random weights."""
  build = lambda c: nnx.List([  # noqa: E731
      TransformerBlock(D, H, F, config=c, num_kv_heads=KV, rope_theta=THETA,
                       activation="swiglu", norm="rms", use_bias=False, rngs=nnx.Rngs(i))
      for i in range(num_layers)])
  return _make_pair(build, config)


def _run(blocks, x, decode):
  @nnx.jit
  def f(blocks, x):
    for block in blocks:
      x = block(x, decode=decode)
    return x

  return f(blocks, x)


@pytest.mark.parametrize("row_reduction, algorithm", [("all_reduce", "ppermute"),
                                                      ("matmul_all_reduce", "collective")])
def test_sharded_decode_equals_unsharded(row_reduction, algorithm):
  """Prompt of 5, then 3 single tokens: every output, the caches and their layout."""
  mesh = _mesh(1, 2)
  config = ParallelConfig(mesh=mesh, dp_axis=None, backend="xla", algorithm=algorithm,
                          all_reduce_algorithm=algorithm, row_reduction=row_reduction)
  sharded, ref = _decoder_pair(config, num_layers=2 if algorithm == "collective" else 1)
  b, max_len = 3, 12
  for model in (sharded, ref):
    for block in model:
      block.init_cache((b, max_len, D))
  x = jax.random.normal(_key(), (b, 8, D), jnp.float32)
  full = _run(ref, x, decode=False)
  tol = _tol(jnp.float32)
  for lo, hi in ((0, 5), (5, 6), (6, 7), (7, 8)):
    got, want = _run(sharded, x[:, lo:hi], True), _run(ref, x[:, lo:hi], True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tol, err_msg=f"{lo}:{hi}")
    np.testing.assert_allclose(np.asarray(want), np.asarray(full[:, lo:hi]), **tol,
                               err_msg=f"decode {lo}:{hi} against the full sequence")
  for got, want in zip(sharded, ref):
    attn = got.attn
    assert int(attn.cache_index[...]) == int(want.attn.cache_index[...]) == 8
    for name in ("cached_key", "cached_value"):
      cache = getattr(attn, name)[...]
      assert cache.shape == (b, max_len, KV, D // H)
      assert cache.sharding.is_equivalent_to(NamedSharding(mesh, P(None, None, "tp")), 4)
      np.testing.assert_allclose(np.asarray(cache), np.asarray(getattr(want.attn, name)[...]),
                                 **tol, err_msg=name)
    np.testing.assert_array_equal(np.asarray(attn.cached_key[...])[:, 8:], 0.0)


def test_row_reduction_all_reduce_values_and_gradients():
  config = ParallelConfig(mesh=_mesh(2, 2), backend="xla", row_reduction="all_reduce",
                          all_reduce_algorithm="ppermute")
  build = lambda c: ParallelMLP(D, F, config=c, activation="swiglu", rngs=nnx.Rngs(0))  # noqa
  _check_against_reference(build, config, (B, S, D))


def test_row_reduction_none_leaves_each_rank_its_partial_sum():
  """Rank-encoded: tp rank i's input shard is all (i + 1), w all ones."""
  tp = 4
  config = ParallelConfig(mesh=_mesh(1, tp), backend="xla", row_reduction="none")
  layer = nnx.jit(lambda: RowParallelLinear(
      F, D, config=config, use_bias=False, kernel_init=nnx.initializers.ones_init(),
      rngs=nnx.Rngs(0)))()
  x = jnp.broadcast_to(jnp.repeat(jnp.arange(1, tp + 1, dtype=jnp.float32), F // tp), (B, S, F))
  y = nnx.jit(lambda m, x: m(x))(layer, x)
  ranks = {d: i for i, d in enumerate(config.mesh.devices.flat)}
  for shard in y.addressable_shards:
    want = (ranks[shard.device] + 1) * (F // tp)
    np.testing.assert_array_equal(np.asarray(shard.data), np.full((B, S, D), float(want)))


def test_decode_errors_and_new_options():
  config = ParallelConfig(mesh=_mesh(1, 4), dp_axis=None)
  with pytest.raises(ValueError, match="row_reduction must be one of"):
    ParallelConfig(row_reduction="psum")
  assert ROW_REDUCTIONS == ("matmul_all_reduce", "all_reduce", "none")
  with pytest.raises(ValueError, match="num_heads=8 must be divisible by num_kv_heads=3"):
    ParallelAttention(D, 8, config=ParallelConfig(), num_kv_heads=3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="num_kv_heads=2 must be divisible by tp size=4"):
    ParallelAttention(D, 8, config=config, num_kv_heads=2, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="RoPE needs an even head_features, got 5"):
    ParallelAttention(D, 4, config=config, head_features=5, rope_theta=THETA, rngs=nnx.Rngs(0))
  layer = ParallelAttention(D, H, config=ParallelConfig(), rope_theta=THETA, rngs=nnx.Rngs(0))
  x = jnp.zeros((2, 3, D))
  with pytest.raises(ValueError, match="needs a KV cache; call init_cache"):
    layer(x, decode=True)
  for bad, msg in [((2,), r"input_shape must be \(batch, max_length, ...\), got \(2,\)"),
                   ((0, 4), "batch must be a positive int, got 0"),
                   ((2, 4.0), "max_length must be a positive int, got 4.0")]:
    with pytest.raises(ValueError, match=msg):
      layer.init_cache(bad)
  with pytest.raises(ValueError, match="input_shape must be .*, got 2$"):  # trial 30 F7
    layer.init_cache(2)
  layer.init_cache((2, 4, D))
  assert layer.cached_key[...].dtype == jnp.float32 and int(layer.cache_index[...]) == 0
  layer(x, decode=True)
  with pytest.raises(ValueError, match="2 tokens from position 3 do not fit"):
    layer(x[:, :2], decode=True)
  with pytest.raises(ValueError, match="x has batch size 1, the KV cache 2"):
    layer(x[:1, :1], decode=True)
  # Trial 30 F3: the checks come before the QKV projection, which ran first (outside jit).
  projected = []
  real_qkv = layer.qkv
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(layer, "qkv", lambda x: projected.append(1) or real_qkv(x))
    with pytest.raises(ValueError, match="x has batch size 4, the KV cache 2"):
      layer(jnp.zeros((4, 1, D)), decode=True)
    with pytest.raises(ValueError, match="ParallelAttention expects x: \\[b, s, d\\]"):
      layer(jnp.zeros((2, D)), decode=True)
  assert not projected
  with pytest.raises(ValueError, match="attention_implementation must be one of"):
    ParallelConfig(attention_implementation="flash")
  with pytest.raises(ValueError, match="backend must be one of .*got 'gpu'"):
    ParallelConfig(backend="gpu")
  cudnn = ParallelAttention(D, H, config=ParallelConfig(attention_implementation="cudnn"),
                            rngs=nnx.Rngs(0))
  cudnn.init_cache((2, 4, D))
  with pytest.raises(ValueError, match="'cudnn' runs cuDNN's fused attention, which needs "
                                       "NVIDIA GPUs; this model runs on 'cpu'"):
    cudnn(x[:, :1], decode=True)
  cudnn(x[:, :2], decode=True)  # a prompt runs the XLA expression
  # The dtype checks come next: reach them by reporting a GPU backend (mesh=None asks JAX).
  cudnn16 = ParallelAttention(D, H, config=ParallelConfig(attention_implementation="cudnn"),
                              dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  cudnn16.init_cache((2, 4, D), dtype=jnp.float32)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(ValueError, match="needs bfloat16 or float16 activations, got float32"):
      cudnn(x[:, :1], decode=True)
    with pytest.raises(ValueError, match="reads the KV cache in the activations' dtype "
                                         r"\(bfloat16\); the cache is float32"):
      cudnn16(x[:, :1].astype(jnp.bfloat16), decode=True)


# ----------------------------------------------------------------------------
# fuse_norm: the attention's reduction + residual + the MLP's RMSNorm in one op
# ----------------------------------------------------------------------------


def _fused_and_unfused(mesh, use_bias, **block_kw):
  """Sharded blocks with fuse_norm on and off (row_reduction "all_reduce"), same values."""
  common = dict(mesh=mesh, dp_axis="dp" if "dp" in mesh.axis_names else None,
                backend="xla", row_reduction="all_reduce", all_reduce_algorithm="collective")
  build = lambda c: TransformerBlock(D, H, F, config=c, num_kv_heads=KV, rope_theta=THETA,  # noqa
                                     activation="swiglu", norm="rms", use_bias=use_bias,
                                     rngs=nnx.Rngs(0), **block_kw)
  fused = nnx.jit(lambda: build(ParallelConfig(fuse_norm=True, **common)))()
  unfused = nnx.jit(lambda: build(ParallelConfig(**common)))()
  pure = _random_params(fused, _key())
  _load(fused, pure)
  _load(unfused, pure)
  return fused, unfused


@pytest.mark.parametrize("use_bias", [False, True], ids=["nobias", "bias"])
def test_fuse_norm_block_equals_the_unfused_block(use_bias):
  """Outputs and every gradient equal the unfused block's (f32: up to summation order)."""
  fused, unfused = _fused_and_unfused(_mesh(2, 2), use_bias)
  x = jax.random.normal(_key(), (B, S, D), jnp.float32).at[0, 0, 0].set(8.0)
  r = jax.random.normal(_key(), (B, S, D), jnp.float32)
  y, g_params, g_x = _forward_and_grads(fused, x, r)
  y_want, g_params_want, g_x_want = _forward_and_grads(unfused, x, r)
  tol = dict(rtol=1e-5, atol=1e-5)
  _assert_tree_close(y, y_want, tol, "output")
  _assert_tree_close(g_x, g_x_want, tol, "grad x")
  _assert_tree_close(g_params, g_params_want, tol, "grad")
  # The fused path really ran: one all_reduce_rms_norm per block.
  graphdef, state = nnx.split(fused)
  text = str(jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, x))
  assert text.count("jaxoverlap_all_reduce_rms_norm") == 1, text.count("all_reduce_rms_norm")


def test_fuse_norm_block_matches_unsharded_bf16():
  config = ParallelConfig(mesh=_mesh(2, 2), backend="xla", row_reduction="all_reduce",
                          fuse_norm=True)
  build = lambda c: TransformerBlock(D, H, F, config=c, dtype=jnp.bfloat16,  # noqa: E731
                                     activation="swiglu", norm="rms", rngs=nnx.Rngs(0))
  _check_against_reference(build, config, (B, S, D), dtype=jnp.bfloat16,
                           tol=dict(rtol=6e-2, atol=6e-2))


def test_fuse_norm_decode_equals_unsharded():
  mesh = _mesh(1, 2)
  config = ParallelConfig(mesh=mesh, dp_axis=None, backend="xla", fuse_norm=True)
  sharded, ref = _decoder_pair(config, num_layers=2)
  b, max_len = 3, 8
  for model in (sharded, ref):
    for block in model:
      block.init_cache((b, max_len, D))
  x = jax.random.normal(_key(), (b, 6, D), jnp.float32)
  tol = _tol(jnp.float32)
  for lo, hi in ((0, 4), (4, 5), (5, 6)):
    got, want = _run(sharded, x[:, lo:hi], True), _run(ref, x[:, lo:hi], True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tol, err_msg=f"{lo}:{hi}")


class _Chain(nnx.Module):
  """Blocks and a final RMSNorm; ``chain``: through apply_blocks, else one block after another."""

  def __init__(self, config, num_layers, chain, use_bias=False):
    self.chain = chain
    self.blocks = nnx.List([
        TransformerBlock(D, H, F, config=config, num_kv_heads=KV, rope_theta=THETA,
                         activation="swiglu", norm="rms", use_bias=use_bias, epsilon=0.25,
                         rngs=nnx.Rngs(i))
        for i in range(num_layers)])
    # Epsilons far apart, so that a norm computed with another's epsilon shows.
    self.final_norm = RMSNorm(D, config=config, epsilon=0.5, rngs=nnx.Rngs(0))

  def __call__(self, x, decode=False):
    if self.chain:
      return apply_blocks(self.blocks, x, self.final_norm, decode=decode)
    for block in self.blocks:
      x = block(x, decode=decode)
    return self.final_norm(x)


@pytest.mark.parametrize("use_bias", [False, True], ids=["nobias", "bias"])
def test_fuse_norm_chain_equals_the_unfused_blocks(use_bias):
  """Blocks chained through next_norm: two fused ops a block, values and grads unchanged."""
  common = dict(mesh=_mesh(2, 2), backend="xla", row_reduction="all_reduce",
                all_reduce_algorithm="collective")
  chained = nnx.jit(lambda: _Chain(ParallelConfig(fuse_norm=True, **common), 3, True,
                                   use_bias))()
  plain = nnx.jit(lambda: _Chain(ParallelConfig(**common), 3, False, use_bias))()
  unfused_chained = nnx.jit(lambda: _Chain(ParallelConfig(**common), 3, True, use_bias))()
  pure = _random_params(chained, _key())
  for m in (chained, plain, unfused_chained):
    _load(m, pure)
  x = jax.random.normal(_key(), (B, S, D), jnp.float32).at[0, 0, 0].set(8.0)
  r = jax.random.normal(_key(), (B, S, D), jnp.float32)
  y_want, g_params_want, g_x_want = _forward_and_grads(plain, x, r)
  tol = dict(rtol=1e-5, atol=1e-5)
  for name, model in (("fused", chained), ("unfused, chained", unfused_chained)):
    y, g_params, g_x = _forward_and_grads(model, x, r)
    _assert_tree_close(y, y_want, tol, f"{name}: output")
    _assert_tree_close(g_x, g_x_want, tol, f"{name}: grad x")
    _assert_tree_close(g_params, g_params_want, tol, f"{name}: grad")
  graphdef, state = nnx.split(chained)
  text = str(jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, x))
  assert text.count("jaxoverlap_all_reduce_rms_norm") == 6, text.count("all_reduce_rms_norm")


def test_fuse_norm_chain_decodes_as_unsharded():
  mesh = _mesh(1, 2)
  config = ParallelConfig(mesh=mesh, dp_axis=None, backend="xla", row_reduction="all_reduce",
                          fuse_norm=True)
  chained = nnx.jit(lambda: _Chain(config, 2, True))()
  ref = _Chain(ParallelConfig(mesh=None), 2, False)
  _load(ref, pure := _random_params(chained, _key()))
  _load(chained, pure)
  b, max_len = 3, 8
  for model in (chained, ref):
    for block in model.blocks:
      block.init_cache((b, max_len, D))
  x = jax.random.normal(_key(), (b, 6, D), jnp.float32)
  step = nnx.jit(lambda m, x: m(x, decode=True))
  for lo, hi in ((0, 4), (4, 5), (5, 6)):
    got, want = step(chained, x[:, lo:hi]), step(ref, x[:, lo:hi])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **_tol(jnp.float32),
                               err_msg=f"{lo}:{hi}")


def test_fuse_norm_refusals():
  with pytest.raises(ValueError, match="fuse_norm fuses the all-reduce of a row-parallel layer"):
    ParallelConfig(mesh=_mesh(2, 2), sequence_parallel=True, fuse_norm=True)
  with pytest.raises(ValueError, match="config.fuse_norm fuses an RMSNorm; this block's norm is "
                                       "'layer'"):
    TransformerBlock(D, H, F, config=ParallelConfig(mesh=None, fuse_norm=True), norm="layer",
                     rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="row_reduction='none' leaves the all-reduces out"):
    ParallelConfig(mesh=_mesh(2, 2), row_reduction="none", fuse_norm=True)
  config = ParallelConfig(mesh=_mesh(1, 2), dp_axis=None, backend="xla", fuse_norm=True)
  block = nnx.jit(lambda: TransformerBlock(D, H, F, config=config, norm="rms",
                                           rngs=nnx.Rngs(0)))()
  with pytest.raises(ValueError, match="fuses a jaxoverlap.nnx.RMSNorm into the reduction before "
                                       "it; next_norm is a jaxoverlap.nnx.layers.LayerNorm"):
    block(jnp.zeros((B, S, D)), next_norm=LayerNorm(D, config=config, rngs=nnx.Rngs(0)))
  # Trial 18: flax's own RMSNorm was reported as "a RMSNorm", which the message said it wants.
  with pytest.raises(ValueError, match=r"next_norm is a flax\.nnx\..*RMSNorm\. Pass "
                                       r"jaxoverlap\.nnx\.RMSNorm\(num_features, config=config\) "
                                       r"\(flax's nnx\.RMSNorm is not fused\)"):
    block(jnp.zeros((B, S, D)), next_norm=nnx.RMSNorm(D, rngs=nnx.Rngs(0)))
  for eps in (0.0, jnp.float32(1e-6)):  # trial 22: a 0-d array was told "needs epsilon > 0"
    with pytest.raises(ValueError, match=r"TransformerBlock: config.fuse_norm needs epsilon, "
                                         r"the fused norm's eps, as a positive finite number "
                                         r"\(a Python or NumPy scalar, not an array\)"):
      TransformerBlock(D, H, F, config=config, epsilon=eps, rngs=nnx.Rngs(0))
  TransformerBlock(D, H, F, config=config, epsilon=np.float32(1e-6), rngs=nnx.Rngs(0))
  TransformerBlock(D, H, F, config=ParallelConfig(mesh=None), epsilon=0.0, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="apply_blocks needs at least one block"):
    apply_blocks([], jnp.zeros((B, S, D)), RMSNorm(D, config=config, rngs=nnx.Rngs(0)))
  # A norm that computes in another dtype than the activations (the unfused one would).
  bf16 = nnx.jit(lambda: TransformerBlock(D, H, F, config=config, norm="rms", dtype=jnp.bfloat16,
                                          rngs=nnx.Rngs(0)))()
  wide = RMSNorm(D, config=config, dtype=jnp.float32, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="the fused norm computes in the activations' dtype "
                                       r"\(bfloat16\), next_norm \(an RMSNorm\) in float32"):
    bf16(jnp.zeros((B, S, D), jnp.bfloat16), next_norm=wide)
  # Trial 18: the block's own norm (bf16 compute) with float32 activations: the advice applies.
  with pytest.raises(ValueError, match=r"the block's mlp_norm \(an RMSNorm\) in bfloat16 .*feed "
                                       r"the block activations in bfloat16 .*"
                                       r"x\.astype\(jnp\.bfloat16\)\), or turn fuse_norm off"):
    bf16(jnp.zeros((B, S, D), jnp.float32))
  # ... and a next_norm of the caller's is named as such, with its own remedy (trial 22).
  with pytest.raises(ValueError, match=r"next_norm \(an RMSNorm\) in float32 .*; give "
                                       r"next_norm dtype=bfloat16, or turn fuse_norm off"):
    bf16(jnp.zeros((B, S, D), jnp.bfloat16), next_norm=wide)
  assert bf16(jnp.zeros((B, S, D), jnp.bfloat16)).dtype == jnp.bfloat16


@pytest.mark.parametrize("fuse_norm", [False, True], ids=["unfused", "fuse_norm"])
def test_apply_blocks_without_a_final_norm(fuse_norm):
  """Trial 30 F1: final_norm=None split the last block's [b, s, d] output along the batch
  (batch 2: one batch element came back, no error). None now means no final norm."""
  config = ParallelConfig(mesh=_mesh(1, 2), dp_axis=None, backend="xla", fuse_norm=fuse_norm)
  blocks = nnx.jit(lambda: _Chain(config, 2, True))().blocks
  x = jax.random.normal(_key(), (2, S, D), jnp.float32)
  got = apply_blocks(blocks, x, None)
  want = blocks[1](blocks[0](x))
  assert got.shape == (2, S, D)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **_tol(jnp.float32))
  with pytest.raises(TypeError, match="final_norm must be a norm .* or None, got int"):
    apply_blocks(blocks, x, 3)


def test_fuse_norm_checks_the_callers_norm_before_any_work(monkeypatch):
  """Trial 30 F2: a next_norm or final_norm of another width or a bad epsilon was refused
  after the attention ran, in the words of all_reduce_rms_norm (eps, weight, p), an op the
  caller never called. Now before any work, naming the norm."""
  config = ParallelConfig(mesh=_mesh(1, 2), dp_axis=None, backend="xla", fuse_norm=True)
  blocks = nnx.jit(lambda: _Chain(config, 2, True))().blocks
  ran = []
  monkeypatch.setattr(ParallelAttention, "__call__", lambda *a, **k: ran.append(1))
  x = jnp.zeros((B, S, D))
  for norm, says in (
      (RMSNorm(D // 2, config=config, rngs=nnx.Rngs(0)),
       rf"final_norm: an RMSNorm of num_features={D // 2} after a block of {D} features"),
      (RMSNorm(D, config=config, epsilon=0.0, rngs=nnx.Rngs(0)),
       r"needs apply_blocks: final_norm.epsilon, the fused norm's eps, as a positive finite "
       r"number \(a Python or NumPy scalar, not an array\), got epsilon=0.0"),
      (RMSNorm(D, config=config, epsilon=jnp.float32(1e-6), rngs=nnx.Rngs(0)),
       r"final_norm.epsilon, .* not an array")):
    with pytest.raises(ValueError, match=says):
      apply_blocks(blocks, x, norm)
    with pytest.raises(ValueError, match=says.replace("apply_blocks: final_norm", "next_norm")
                       .replace("final_norm", "next_norm")):
      blocks[0](x, next_norm=norm)
  assert not ran
  with pytest.raises(ValueError, match=rf"normed has shape \({B}, 2, {D}\), x \({B}, {S}, {D}\)"):
    blocks[0](x, normed=x[:, :2])


@pytest.mark.parametrize("row_reduction,key,algorithm,want", [
    ("all_reduce", "all_reduce_algorithm", "ppermute", "ppermute"),
    ("all_reduce", "all_reduce_algorithm", "collective", "collective"),
    ("matmul_all_reduce", "algorithm", "ppermute", "ppermute"),
    ("matmul_all_reduce", "algorithm", "auto", "collective"),  # xla's default
])
def test_fuse_norm_follows_the_configured_algorithm(row_reduction, key, algorithm, want):
  """The fused op runs the algorithm the config names for the reduction it replaces."""
  import jaxoverlap

  config = ParallelConfig(mesh=_mesh(2, 2), backend="xla", row_reduction=row_reduction,
                          fuse_norm=True, **{key: algorithm})
  block = nnx.jit(lambda: TransformerBlock(D, H, F, config=config, activation="swiglu",
                                           norm="rms", rngs=nnx.Rngs(0)))()
  jaxoverlap.clear_decisions()
  graphdef, state = nnx.split(block)
  x = jax.random.normal(_key(), (B, S, D), jnp.float32)
  jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, x)
  (plan,) = jaxoverlap.decisions("all_reduce_rms_norm")
  assert plan.algorithm == want, plan.summary()


def _requested_algorithms(block, x):
  """(op, algorithm) of every jaxoverlap op the block's forward pass binds, in trace order."""
  graphdef, state = nnx.split(block)
  text = str(jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, x))
  return re.findall(r"request=Request\(op='(\w+)'[^)]*?algorithm='(\w+)'", text)


@pytest.mark.parametrize("dp_axis", [None, "dp"])
def test_fuse_norm_one_shot_goes_to_the_fused_norm_only(dp_axis):
  """algorithm="one_shot" reaches all_reduce_rms_norm; the MLP's matmul_all_reduce gets "auto".

  A block without next_norm reduces its MLP with matmul_all_reduce, which has no "one_shot"
  (it raised "matmul_all_reduce: algorithm='one_shot' is unknown").
  """
  mesh = _mesh(1, 2) if dp_axis is None else _mesh(2, 2)
  config = ParallelConfig(mesh=mesh, dp_axis=dp_axis, algorithm="one_shot", fuse_norm=True)
  assert config.algorithm_for("all_reduce_rms_norm") == "one_shot"
  assert config.algorithm_for("matmul_all_reduce") == "auto"
  block = nnx.jit(lambda: TransformerBlock(D, H, F, config=config, activation="swiglu",
                                           norm="rms", rngs=nnx.Rngs(0)))()
  x = jax.random.normal(_key(), (B, S, D), jnp.float32)
  assert _requested_algorithms(block, x) == [("all_reduce_rms_norm", "one_shot"),
                                             ("matmul_all_reduce", "auto")]
  # A name both have goes to both.
  config = ParallelConfig(mesh=mesh, dp_axis=dp_axis, algorithm="ppermute", fuse_norm=True)
  block = nnx.jit(lambda: TransformerBlock(D, H, F, config=config, norm="rms",
                                           rngs=nnx.Rngs(0)))()
  assert _requested_algorithms(block, x) == [("all_reduce_rms_norm", "ppermute"),
                                             ("matmul_all_reduce", "ppermute")]


# ----------------------------------------------------------------------------
# min_matmul_rows
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("row_reduction", ["all_reduce", "matmul_all_reduce"])
@pytest.mark.parametrize("rows", [1, 3])
def test_min_matmul_rows_pads_short_products_only(rows, row_reduction):
  """A block of 1 or 3 rows padded to 5: outputs and gradients equal the unsharded block's."""
  config = ParallelConfig(mesh=_mesh(1, 2), dp_axis=None, backend="xla",
                          row_reduction=row_reduction, min_matmul_rows=5)
  build = lambda c: TransformerBlock(D, H, F, config=c, num_kv_heads=KV,  # noqa: E731
                                     activation="swiglu", norm="rms", rngs=nnx.Rngs(0))
  _check_against_reference(build, config, (1, rows, D))
  # The padding (whole copies of the rows: 5 x 1 or 2 x 3) is there for short products only.
  layer = nnx.jit(lambda: ColumnParallelLinear(D, F, config=config, rngs=nnx.Rngs(0)))()
  graphdef, state = nnx.split(layer)
  copies = -(-5 // rows)
  for shape, padded in (((1, rows, D), True), ((1, 5, D), False)):
    jaxpr = str(jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(
        state, jnp.zeros(shape, jnp.float32)))
    copied = re.search(rf"f32\[{copies},{rows},{D}\](\{{[^}}]*\}})? = broadcast_in_dim", jaxpr)
    assert bool(copied) == padded, (shape, jaxpr)
    assert " pad[" not in jaxpr, jaxpr


def test_min_matmul_rows_leaves_empty_products_alone():
  x, w = jnp.zeros((0, 1, D), jnp.float32), jnp.ones((D, 4), jnp.float32)
  assert layers._matmul(x, w, 4).shape == (0, 1, 4)  # noqa: SLF001


def test_min_matmul_rows_decode_equals_unsharded():
  """Single-token decode steps of batch 1 padded to 4 rows equal the unpadded reference."""
  config = ParallelConfig(mesh=_mesh(1, 2), dp_axis=None, backend="xla",
                          row_reduction="all_reduce", min_matmul_rows=4)
  sharded, ref = _decoder_pair(config, num_layers=2)
  for model in (sharded, ref):
    for block in model:
      block.init_cache((1, 6, D))
  x = jax.random.normal(_key(), (1, 5, D), jnp.float32)
  for lo, hi in ((0, 2), (2, 3), (3, 4), (4, 5)):
    got, want = _run(sharded, x[:, lo:hi], True), _run(ref, x[:, lo:hi], True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **_tol(jnp.float32),
                               err_msg=f"{lo}:{hi}")


@pytest.mark.parametrize("bad", [0, -1, 2.0, None])
def test_min_matmul_rows_refuses_bad_values(bad):
  with pytest.raises(ValueError, match="min_matmul_rows must be an int >= 1"):
    ParallelConfig(min_matmul_rows=bad)


def test_forward_mode_through_the_layers_names_the_layer():
  """jax.jvp through a sharded block, eagerly: the layer and the way out, not JAX's internals."""
  block = nnx.jit(lambda: TransformerBlock(D, H, F, config=ParallelConfig(mesh=_mesh(2, 2)),
                                           rngs=nnx.Rngs(0)))()
  graphdef, state = nnx.split(block)
  x = jnp.ones((B, S, D))
  with pytest.raises(TypeError, match="ColumnParallelLinear: forward-mode differentiation .* "
                                      "use jax.grad, jax.vjp or jax.jacrev"):
    jax.jvp(lambda x: nnx.merge(graphdef, state)(x), (x,), (x,))


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_hessian_and_hessian_vector_product_match_the_unsharded_model(sp):
  """Trial 18: without SP the column layer's rule called the custom_vjp functions, which refuse
  the tangents of forward over reverse: jax.hessian and HVPs failed on the default layout."""
  config = ParallelConfig(_mesh(1, 2), backend="xla", sequence_parallel=sp)
  sharded, ref = _make_pair(lambda c: ParallelMLP(8, 16, config=c, rngs=nnx.Rngs(0)), config)
  x = jax.random.normal(_key(), (2, 4, 8), jnp.float32)

  def hessian(model):
    return jax.jit(jax.hessian(lambda x: jnp.sum(jnp.tanh(model(x)) ** 2)))(x)

  _assert_tree_close(hessian(sharded), hessian(ref), dict(rtol=1e-4, atol=1e-5), "hessian")

  def hvp(model):
    graphdef, state = nnx.split(model)
    loss = lambda s: jnp.sum(jnp.tanh(nnx.merge(graphdef, s)(x)) ** 2)
    v = jax.tree.map(lambda a: jnp.cos(jnp.arange(a.size, dtype=a.dtype).reshape(a.shape)),
                     state)
    return nnx.to_pure_dict(jax.jit(lambda s, v: jax.jvp(jax.grad(loss), (s,), (v,))[1])(
        state, v))

  _assert_tree_close(hvp(sharded), hvp(ref), dict(rtol=1e-4, atol=1e-5), "hvp")


@pytest.mark.parametrize("build", [
    lambda c: ColumnParallelLinear(D, F, config=c, rngs=nnx.Rngs(0)),
    lambda c: RowParallelLinear(F, D, config=c, rngs=nnx.Rngs(0)),
    lambda c: RMSNorm(D, config=c, rngs=nnx.Rngs(0)),
    lambda c: LayerNorm(D, config=c, rngs=nnx.Rngs(0)),
    lambda c: ParallelMLP(D, F, config=c, rngs=nnx.Rngs(0)),
    lambda c: ParallelAttention(D, H, config=c, rngs=nnx.Rngs(0)),
    lambda c: TransformerBlock(D, H, F, config=c, rngs=nnx.Rngs(0)),
], ids=["column", "row", "rms", "layer", "mlp", "attention", "block"])
def test_config_of_another_type_is_refused_by_name(build):
  """Trial 18: config=None or the mesh itself gave an AttributeError naming neither."""
  for config, got in ((None, "NoneType"), (_mesh(1, 2), "Mesh")):
    with pytest.raises(TypeError, match=r"config must be a jaxoverlap\.nnx\.ParallelConfig "
                                        rf"\(ParallelConfig\(mesh\) .*\), got {got}"):
      build(config)


@pytest.mark.parametrize("layer", [ColumnParallelLinear, RowParallelLinear])
@pytest.mark.parametrize("axes", [("embed",), ("embed", "mlp", "kv"), "em"])
def test_kernel_axes_of_another_length_are_refused(layer, axes):
  """Trial 18: one name gave an IndexError, three a deep sharding error."""
  with pytest.raises(ValueError, match=rf"{layer.__name__}: kernel_axes names the kernel's two "
                                       r"axes, \(in, out\)"):
    layer(D, F, kernel_axes=axes, config=ParallelConfig(mesh=_mesh(1, 2)), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("shape", [(2, 0, D), (0, 4, D)], ids=["empty-sequence", "empty-batch"])
@pytest.mark.parametrize("mesh", [None, (1, 2)], ids=["unsharded", "tp2"])
def test_attention_and_block_on_empty_inputs(shape, mesh):
  """Trial 18: an empty batch or sequence raised ZeroDivisionError in the qkv reshape."""
  config = ParallelConfig(mesh=None if mesh is None else _mesh(*mesh), dp_axis=None,
                          backend="xla")
  for build in (lambda: ParallelAttention(D, H, config=config, rngs=nnx.Rngs(0)),
                lambda: TransformerBlock(D, H, F, config=config, rngs=nnx.Rngs(0))):
    y = nnx.jit(build)()(jnp.ones(shape, jnp.float32))
    assert y.shape == shape


def test_inputs_as_lists_are_taken_as_flax_takes_them():
  """Trial 18: a Python list gave AttributeError: 'list' object has no attribute 'ndim'."""
  config = ParallelConfig(mesh=None)
  x = np.random.default_rng(0).standard_normal((1, 2, D)).astype(np.float32)
  for layer in (ColumnParallelLinear(D, F, config=config, rngs=nnx.Rngs(0)),
                RMSNorm(D, config=config, rngs=nnx.Rngs(0)),
                TransformerBlock(D, H, F, config=config, rngs=nnx.Rngs(0))):
    np.testing.assert_allclose(np.asarray(layer(x.tolist())), np.asarray(layer(jnp.asarray(x))),
                               rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------
# The local maths against float64 NumPy (the tests above compare the sharded layers with
# the same classes unsharded, where a wrong activation or norm is its own reference)
# ----------------------------------------------------------------------------


def _np_gelu(x):  # jax.nn.gelu's default, the tanh approximation
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _np_mlp(x, p, activation):
  h = x @ p["up"]["kernel"] + p["up"]["bias"]
  if activation == "gelu":
    a = _np_gelu(h)
  else:  # columns 2i (gate) and 2i + 1 (up) of unit i
    gate, up = h[..., 0::2], h[..., 1::2]
    a = gate / (1 + np.exp(-gate)) * up
  return a @ p["down"]["kernel"] + p["down"]["bias"]


def _np_norm(x, p, kind, eps=1e-6):
  if kind == "rms":
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * p["scale"]
  c = x - x.mean(-1, keepdims=True)
  return c / np.sqrt(np.mean(c * c, -1, keepdims=True) + eps) * p["scale"] + p["bias"]


LOCAL_MATHS = {
    "mlp-gelu": (lambda c: ParallelMLP(D, F, config=c, activation="gelu", rngs=nnx.Rngs(0)),
                 lambda x, p: _np_mlp(x, p, "gelu")),
    "mlp-swiglu": (lambda c: ParallelMLP(D, F, config=c, activation="swiglu", rngs=nnx.Rngs(0)),
                   lambda x, p: _np_mlp(x, p, "swiglu")),
    "rms": (lambda c: RMSNorm(D, config=c, rngs=nnx.Rngs(0)), lambda x, p: _np_norm(x, p, "rms")),
    "layer": (lambda c: LayerNorm(D, config=c, rngs=nnx.Rngs(0)),
              lambda x, p: _np_norm(x, p, "layer")),
}


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
@pytest.mark.parametrize("layer", list(LOCAL_MATHS))
def test_layer_maths_match_float64_numpy(layer, sp):
  """Sharded (dp 2 x tp 2) layer on fresh random weights (biases included) against float64."""
  build, want_fn = LOCAL_MATHS[layer]
  config = ParallelConfig(mesh=_mesh(2, 2), sequence_parallel=sp, backend="xla")
  model = nnx.jit(lambda: build(config))()
  pure = _random_params(model, _key())
  _load(model, pure)
  x = jax.random.normal(_key(), (B, S, D), jnp.float32) * 2.0 + 0.5  # a mean for LayerNorm
  got = np.asarray(nnx.jit(lambda m, x: m(x))(model, x), np.float64)
  p64 = jax.tree.map(lambda a: np.asarray(a, np.float64), pure)
  want = want_fn(np.asarray(x, np.float64), p64)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())

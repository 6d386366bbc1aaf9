"""The dispatcher on CPU: plans for each topology, and what the lowerings emit.

``jaxoverlap.dispatch.make_plan`` is a function of the request, the operand
shapes, the mesh and the runtime's facts, so every choice is checked here with
simulated facts: one process per device (``runtime.pe_of_device`` returns the
device id), PEs grouped into nodes by ``ranks_per_node``, and the kernels'
limits. With the facts patched in, ``jax.jit(...).lower`` runs the real
lowering rules on CPU and the emitted custom calls (target and attributes) are
checked in the module text; nothing is compiled or run. The kernels
themselves are tested on GPUs (tests/gpu).
"""

import ast
import json
import logging
import os
import pathlib
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxoverlap
from _helpers import make_mesh
from jaxoverlap import _checks, _ffi, dispatch, names, overlap, reference, runtime, tuning
from jaxoverlap.dispatch import Request
from jaxoverlap.tuning import policy

BF16 = jnp.bfloat16
F32 = jnp.float32
MIB = 1 << 20
LIMITS = {"max_group_size": 8, "max_nodes": 64, "max_pes": 512, "max_chunks": 32,
          "max_blocks": 128}

needs_extension = pytest.mark.skipif(_ffi.unavailable_reason() is not None,
                                     reason="the CUDA extension is not built")


def facts(ranks_per_node=4, overlap_slot_bytes=1 << 30, unavailable=None, pe=0,
          transport="nvshmem", **kw):
  return runtime.Facts(unavailable=unavailable, transport=transport, pe=pe, num_pes=8,
                       ranks_per_node=ranks_per_node, slot_bytes=64 * MIB,
                       ll_slot_bytes=2 * MIB, overlap_slot_bytes=overlap_slot_bytes,
                       limits=LIMITS, **{"lamport_slot_bytes": 16 * MIB, **kw})


@pytest.fixture(autouse=True)
def _no_tuning_file(monkeypatch, tmp_path):
  monkeypatch.setenv("JAXOVERLAP_TUNING_FILE", str(tmp_path / "none.json"))
  monkeypatch.delenv("JAXOVERLAP_FUSED_CMD_BUFFER", raising=False)


@pytest.fixture
def one_process_per_device(monkeypatch):
  """PE = device id, as with one process per GPU."""
  monkeypatch.setattr(runtime, "pe_of_device", lambda d: d.id)


@pytest.fixture
def cuda_runtime(monkeypatch, one_process_per_device):
  """The runtime as on a node of 4 GPUs, for lowerings."""
  state = {"facts": facts()}
  monkeypatch.setattr(runtime, "facts", lambda: state["facts"])
  return state


class A:
  def __init__(self, shape, dtype=BF16):
    self.shape, self.dtype = tuple(shape), jnp.dtype(dtype)


def plan(request, shapes, mesh_shape=(4,), axes=("tp",), dtype=BF16, **fkw):
  mesh = make_mesh(mesh_shape, axes)
  return dispatch.make_plan(request, [A(s, dtype) for s in shapes], mesh, facts(**fkw))


# ---------------------------------------------------------------------------- all_reduce


def test_all_reduce_one_node_picks_a_kernel_and_protocol(one_process_per_device):
  p = plan(Request("all_reduce", "tp"), [(4096,)])
  assert (p.backend, p.algorithm, p.protocol, p.transport) == ("cuda", "one_shot", "ll",
                                                               "nvshmem")
  assert (p.num_ranks, p.ranks_per_node, p.num_nodes) == (4, 4, 1)
  assert p.groups == ((0, 1, 2, 3),)
  assert p.reason("algorithm").startswith("cost model (no tuning file at")
  assert p.reason("protocol") == "with the algorithm: " + p.reason("algorithm")


@pytest.mark.parametrize("op,shapes", [
    ("all_reduce", [(4096,)]), ("all_gather_matmul", [(64, 256), (256, 128)]),
    ("matmul_reduce_scatter", [(256, 64), (64, 512)]),
    ("all_reduce_rms_norm", [(2, 4096), (2, 4096), (4096,)])])
def test_a_group_with_an_unreachable_pair_runs_on_xla(one_process_per_device, op, shapes):
  """GPUs of one node without peer access (PCIe without P2P): the kernels raised when they
  ran, even under backend="auto". The plan now leaves every such group to XLA (or raises under
  backend="cuda") before any kernel runs, whichever group holds the pair."""
  mesh_shape, axes = (2, 4), ("dp", "tp")
  for pairs in (((1, 2),), ((6, 5),)):  # in this PE's group (0-3), in the other one (4-7)
    p = plan(Request(op, "tp"), shapes, mesh_shape, axes, unreachable_pairs=pairs)
    assert p.backend == "xla", p.summary()
    a, b = pairs[0]
    assert p.reason("backend") == (
        f"auto: PE {a} cannot load/store PE {b}'s memory (no NVLink or PCIe peer access between "
        f"their GPUs), and both are on node {a // 4} of the group "
        f"{(0, 1, 2, 3) if a < 4 else (4, 5, 6, 7)} over 'tp' (ranks_per_node=4), whose "
        "intra-node steps need it; set JAXOVERLAP_RANKS_PER_NODE to a size whose blocks of "
        "consecutive ranks reach each other (1 on any machine)")
    with pytest.raises(ValueError, match=f"backend='cuda' was requested, but PE {a} cannot"):
      plan(Request(op, "tp", backend="cuda"), shapes, mesh_shape, axes, unreachable_pairs=pairs)
  # A pair of two groups of the axis (and two nodes): the kernels run.
  p = plan(Request(op, "tp"), shapes, mesh_shape, axes, unreachable_pairs=((0, 4),))
  assert p.backend == "cuda", p.summary()
  # A pair of one group on two nodes: not this check's (the inter-node steps use puts where a
  # peer is not reachable; the fused ops refuse groups across nodes for their own reason).
  p = plan(Request(op, "tp"), shapes, mesh_shape, axes, ranks_per_node=2,
           unreachable_pairs=((1, 2),))
  assert "cannot load/store" not in p.summary(), p.summary()


def test_plan_reason_refuses_a_name_that_is_not_a_choice(one_process_per_device):
  p = plan(Request("all_reduce", "tp"), [(4096,)])
  with pytest.raises(ValueError, match="'bakend' is not a choice; one of"):
    p.reason("bakend")
  assert p.reason("chunks") is None  # a choice this op does not make
  with pytest.raises(ValueError, match=r"reasons for unknown choices \['why_not'\]"):
    dataclasses_replace(p, why=p.why + (("why_not", "a typo in a planner"),))


@pytest.mark.parametrize("algorithm,rpn,nbytes,protocol", [
    ("one_shot", 4, 8 << 10, "ll"), ("one_shot", 4, 1 << 20, "ll"),
    ("one_shot", 4, (1 << 20) + 16, "simple"), ("two_shot", 4, 16, "simple"),
    ("hierarchical", 2, 1 << 20, "ll"), ("hierarchical", 2, (1 << 20) + 16, "simple")])
def test_all_reduce_protocol_rule(one_process_per_device, algorithm, rpn, nbytes, protocol):
  """A requested algorithm without a protocol takes the size rule measured on one host:
  within a node, and across nodes emulated on one host."""
  p = plan(Request("all_reduce", "tp", algorithm=algorithm), [(nbytes // 2,)],
           ranks_per_node=rpn, emulated_nodes=rpn < 4)
  assert p.protocol == protocol
  assert p.reason("protocol").startswith("rule: LL for small messages")
  assert policy.protocol_for(algorithm, nbytes, rpn) == protocol


@pytest.mark.parametrize("nbytes", [64 << 10, 256 << 10, 1 << 20, 8 << 20])
def test_hierarchical_protocol_across_real_nodes_is_the_models(one_process_per_device, nbytes):
  """Across real nodes the one-host rule (LL while the shard is <= 512 KiB) does not apply:
  at 1 MiB over 2 nodes x 2 it gave LL, 62.9 us in the model against 40.0 for simple."""
  p = plan(Request("all_reduce", "tp", algorithm="hierarchical"), [(nbytes // 2,)],
           ranks_per_node=2)
  best = min((tuning.predict_us("hierarchical", proto, nbytes, 2, 2, 2), proto)
             for proto in ("ll", "simple"))
  assert p.protocol == best[1]
  assert p.reason("protocol").startswith("cost model across nodes (no tuning file at")
  if nbytes in (256 << 10, 1 << 20):
    assert policy.protocol_for("hierarchical", nbytes, 2) == "ll" and p.protocol == "simple"


def test_emulated_node_records_never_decide_for_real_nodes(one_process_per_device, tmp_path,
                                                           monkeypatch):
  """A table's records of nodes emulated on one host (NVLink between them, as the shipped
  H200 table's 2-node records) decide for emulated nodes only; real nodes get the model."""
  recs = [{"op": "all_reduce", "impl": impl, "dtype": "bfloat16", "bytes": b, "shape": [b // 2],
           "world": 4, "ranks_per_node": 2, "time_us": us, "emulated_nodes": True}
          for b in (8192, 1 << 20) for impl, us in (("xla:psum", 3.0),
                                                    ("jaxoverlap:hierarchical_ll", 9.0))]
  path = tmp_path / "table.json"
  path.write_text(json.dumps(tuning.make_result(recs, machine="test", command="pytest",
                                                method="fake")))
  monkeypatch.setenv("JAXOVERLAP_TUNING_FILE", str(path))
  monkeypatch.setattr(runtime, "tuning_table", lambda: (str(path), json.loads(path.read_text())))
  emulated = plan(Request("all_reduce", "tp"), [(4096,)], ranks_per_node=2, emulated_nodes=True)
  assert emulated.backend == "xla"  # the table's psum (3 us) beats its kernel (9 us)
  assert "nodes emulated on one host" in emulated.reason("backend")
  real = plan(Request("all_reduce", "tp"), [(4096,)], ranks_per_node=2)
  assert (real.backend, real.algorithm) == ("cuda", "hierarchical")
  assert real.reason("algorithm").startswith(
      f"cost model (no measurements for 2 ranks/node x 2 real nodes in {path})")


def test_all_reduce_across_nodes_is_hierarchical(one_process_per_device):
  p = plan(Request("all_reduce", "tp"), [(4096,)], ranks_per_node=2)
  assert (p.algorithm, p.ranks_per_node, p.num_nodes) == ("hierarchical", 2, 2)
  assert p.protocol == "ll"


def test_all_reduce_lamport_is_one_shots(one_process_per_device):
  p = plan(Request("all_reduce", "tp", protocol="lamport"), [(4096,)])
  assert (p.algorithm, p.protocol, p.reason("protocol")) == ("one_shot", "lamport", "requested")
  with pytest.raises(ValueError, match=re.escape(
      "all_reduce: protocol='lamport' was requested, but the policy chose algorithm "
      "'hierarchical', which has only ('ll', 'simple')")):
    plan(Request("all_reduce", "tp", protocol="lamport"), [(4096,)], ranks_per_node=2)
  with pytest.raises(ValueError, match=re.escape(
      "all_reduce: algorithm='hierarchical' has no protocol 'lamport'; valid: ('ll', 'simple')")):
    _checks.check_options("all_reduce", backend="auto", algorithm="hierarchical",
                          protocol="lamport")


def test_all_reduce_lamport_without_slots_raises_at_lowering(one_process_per_device):
  with pytest.raises(ValueError, match=re.escape(
      "all_reduce: protocol 'lamport' (requested) has no slots in this runtime: its heap leaves "
      "no room")):
    plan(Request("all_reduce", "tp", algorithm="one_shot", protocol="lamport"), [(4096,)],
         lamport_slot_bytes=0)


def test_all_reduce_one_shot_across_nodes_raises(one_process_per_device):
  with pytest.raises(ValueError, match=re.escape(
      "all_reduce: algorithm 'one_shot' needs the whole group on one node, but the group over "
      "'tp' spans 2 nodes (ranks_per_node=2); use 'hierarchical' or 'auto'")):
    plan(Request("all_reduce", "tp", algorithm="one_shot"), [(4096,)], ranks_per_node=2)


def test_all_reduce_hands_large_messages_to_psum(one_process_per_device):
  p = plan(Request("all_reduce", "tp"), [(128 * MIB,)], ranks_per_node=2)
  assert (p.backend, p.algorithm) == ("xla", "collective")
  assert p.reason("backend").startswith(
      "auto policy hands the call to lax.psum (NCCL): cost model (no tuning file at ")
  assert "psum's" in p.reason("backend") and "beats the fastest kernel" in p.reason("backend")


def test_all_reduce_requested_choices(one_process_per_device):
  p = plan(Request("all_reduce", "tp", backend="cuda", algorithm="two_shot"), [(4096,)])
  assert (p.algorithm, p.protocol) == ("two_shot", "simple")
  assert p.reason("backend") == "requested" and p.reason("algorithm") == "requested"
  p = plan(Request("all_reduce", "tp", protocol="simple"), [(16,)])
  assert (p.algorithm, p.protocol, p.reason("protocol")) == ("one_shot", "simple", "requested")


def test_all_reduce_measured_table_decides(one_process_per_device, monkeypatch):
  table = json.load(open(pathlib.Path(jaxoverlap.__file__).parent / "tuning_tables" /
                         "all_reduce-NVIDIA_H200.json"))
  monkeypatch.setattr(runtime, "tuning_table", lambda: ("shipped.json", table))
  p = plan(Request("all_reduce", "x"), [(4096,)], mesh_shape=(2,), axes=("x",),
           ranks_per_node=2)
  assert p.backend == "cuda" and p.reason("algorithm").startswith("measured (shipped.json")


def test_all_reduce_takes_the_records_of_the_runtimes_transport(one_process_per_device,
                                                                 monkeypatch):
  """Two process models measured differently: the plan follows its runtime's transport."""
  table = json.load(open(pathlib.Path(jaxoverlap.__file__).parent / "tuning_tables" /
                         "all_reduce-NVIDIA_H200.json"))
  times = {"nvshmem": {"xla:psum": 14.0, "jaxoverlap:one_shot_ll": 7.0,
                       "jaxoverlap:one_shot_lamport": 7.4},
           "peer": {"xla:psum": 12.0, "jaxoverlap:one_shot_ll": 9.0,
                    "jaxoverlap:one_shot_lamport": 3.0}}  # all records: Lamport's median wins
  table["records"] = [{"op": "all_reduce", "impl": impl, "dtype": "bfloat16", "bytes": 8192,
                       "shape": [4096], "world": 4, "ranks_per_node": 4, "time_us": us,
                       "transport": transport}
                      for transport, by_impl in times.items() for impl, us in by_impl.items()]
  monkeypatch.setattr(runtime, "tuning_table", lambda: ("two.json", table))
  p = plan(Request("all_reduce", "tp"), [(4096,)])
  assert (p.transport, p.algorithm, p.protocol) == ("nvshmem", "one_shot", "ll")
  assert p.reason("algorithm") == (
      "measured (two.json, the records of transport 'nvshmem', at 8192 bytes)")


def test_devices_sharing_a_process_fall_back_or_raise():
  """All CPU devices live in this one process: the NVSHMEM runtime cannot take the group."""
  p = plan(Request("all_reduce", "tp"), [(4096,)])
  assert p.backend == "xla" and "share processes" in p.reason("backend")
  with pytest.raises(ValueError, match="all_reduce: backend='cuda' was requested, but the "
                                       "NVSHMEM runtime takes one GPU per process"):
    plan(Request("all_reduce", "tp", backend="cuda"), [(4096,)])


def test_unavailable_runtime_falls_back_or_raises(one_process_per_device):
  why = "jaxoverlap.initialize() has not been called in this process"
  p = plan(Request("all_reduce", "tp"), [(4096,)], unavailable=why)
  assert p.backend == "xla" and p.reason("backend") == "auto: " + why
  with pytest.raises(RuntimeError, match=re.escape("backend='cuda' was requested, but " + why)):
    plan(Request("all_reduce", "tp", backend="cuda"), [(4096,)], unavailable=why)


def test_empty_operands_run_the_xla_expression(one_process_per_device):
  p = plan(Request("all_reduce", "tp", backend="cuda"), [(0, 16)])
  assert p.backend == "xla" and p.reason("backend").startswith("empty operands")
  p = plan(Request("all_gather_matmul", "tp", backend="cuda", chunks=2, dim=0),
           [(0, 16), (16, 8)])
  assert p.backend == "xla"


def test_two_axes_groups(one_process_per_device):
  p = plan(Request("all_reduce", "tp"), [(4096,)], mesh_shape=(2, 4), axes=("dp", "tp"))
  assert p.groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and p.num_ranks == 4
  p = plan(Request("all_reduce", ("tp", "dp")), [(4096,)], mesh_shape=(2, 4), axes=("dp", "tp"),
           ranks_per_node=8)
  # Ranks ordered with the last named axis fastest, as lax.axis_index does.
  assert p.groups == ((0, 4, 1, 5, 2, 6, 3, 7),)


# ---------------------------------------------------------------------------- fused ops


AG, RS, AR = "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"


def test_fused_plan_has_its_geometry_and_chunks(one_process_per_device):
  p = plan(Request(AG, "tp", dim=1), [(2, 16, 64), (64, 32)])
  assert (p.backend, p.algorithm, p.transport, p.precision) == ("cuda", "fused", "copy_engine",
                                                                "default")
  g = p.geometry
  assert (g.outer, g.rows, g.k, g.n) == (2, 16, 64, 32)
  assert g.payload_bytes == 2 * 16 * 64 * 2 and g.pieces == 2
  assert p.chunks == policy.fused_chunks(AG, g.chunk_bytes, g.pieces, g.gemm_flops)
  assert p.reason("transport").startswith("default")
  p = plan(Request(RS, "tp", dim=0, chunks=20, transport="nvshmem"), [(16, 64), (64, 32)])
  assert (p.chunks, p.transport) == (4, "nvshmem")
  assert p.reason("chunks") == "requested 20, at most 4 pieces"


def test_fused_chunks_above_the_kernels_limit(one_process_per_device):
  with pytest.raises(ValueError, match="chunks=33 exceeds the kernels' limit of 32"):
    plan(Request(RS, "tp", dim=0, chunks=33), [(256, 64), (64, 32)])
  at_limit = plan(Request(RS, "tp", dim=0, chunks=32), [(256, 64), (64, 32)])  # 64 rows a rank
  assert (at_limit.chunks, at_limit.reason("chunks")) == (32, "requested")


def test_fused_slot_too_small_raises_even_with_auto(one_process_per_device):
  with pytest.raises(ValueError, match=re.escape(
      "all_gather_matmul: this call needs 2048 bytes of fused-op slot per sender, but the slot "
      "has 1024 bytes; raise overlap_heap_bytes")):
    plan(Request(AG, "tp", dim=0), [(16, 64), (64, 8)], overlap_slot_bytes=1024)


def test_fused_group_across_nodes(one_process_per_device):
  p = plan(Request(AG, "tp", dim=0), [(16, 64), (64, 8)], ranks_per_node=2)
  assert p.backend == "xla" and "run within one node" in p.reason("backend")
  with pytest.raises(ValueError, match="the fused kernels run within one node"):
    plan(Request(AG, "tp", backend="cuda", dim=0), [(16, 64), (64, 8)], ranks_per_node=2)


def test_scatter_last_dimension(one_process_per_device):
  p = plan(Request(RS, "tp", dim=1), [(8, 64), (64, 32)])
  assert p.backend == "xla" and "but the last" in p.reason("backend")
  with pytest.raises(ValueError, match=re.escape(
      "matmul_reduce_scatter: backend='cuda' was requested, but the kernel scatters any output "
      "dimension but the last (scatter_dimension=1 is the last)")):
    plan(Request(RS, "tp", backend="cuda", dim=1), [(8, 64), (64, 32)])
  with pytest.raises(ValueError, match="transport='nvshmem' \\(backend 'cuda'\\) was requested"):
    plan(Request(RS, "tp", transport="nvshmem", dim=1), [(8, 64), (64, 32)])


def test_matmul_all_reduce_fused_or_unfused(one_process_per_device):
  small = plan(Request(AR, "tp"), [(8, 64), (64, 32)])
  assert (small.backend, small.algorithm) == ("cuda", "unfused")
  assert "under 33554432" in small.reason("algorithm")
  sub = small.all_reduce
  assert (sub.op, sub.backend, sub.shapes) == ("all_reduce", "cuda", ((8, 32),))
  d = json.loads(json.dumps(small.as_dict()))  # plain data, the sub-plan too
  assert d["all_reduce"]["why"]["algorithm"] == sub.reason("algorithm")
  assert d["all_reduce"]["axis_name"] == "tp" and d["all_reduce"]["shapes"] == [[8, 32]]
  rows = policy.FUSED_ALL_REDUCE_MIN_BYTES // (2 * 256)
  big = plan(Request(AR, "tp"), [(rows, 64), (64, 256)])
  assert (big.algorithm, big.all_reduce) == ("fused", None)
  odd = plan(Request(AR, "tp", chunks=2), [(rows + 1, 64), (64, 256)])
  assert odd.algorithm == "unfused" and "do not divide" in odd.reason("algorithm")
  assert odd.reason("chunks") == "chunks=2 is unused: the call runs unfused"
  with pytest.raises(ValueError, match=re.escape(
      "matmul_all_reduce: algorithm='fused' needs the rows of x (all leading dimensions, 6) to "
      "divide by the size 4 of axis 'tp'")):
    plan(Request(AR, "tp", algorithm="fused"), [(6, 64), (64, 32)])


def test_fused_command_buffer_and_precision(one_process_per_device):
  p = plan(Request(AG, "tp", dim=0), [(8, 64), (64, 8)], dtype=F32, fused_command_buffer=True)
  assert p.command_buffer and p.precision == "default"
  with jax.default_matmul_precision("highest"):
    p = plan(Request(AG, "tp", dim=0), [(8, 64), (64, 8)], dtype=F32)
  assert p.precision == "highest"


def test_xla_requests_are_plain(one_process_per_device):
  p = plan(Request(AG, "tp", algorithm="ppermute", dim=0), [(8, 64), (64, 8)])
  assert (p.backend, p.algorithm, p.groups) == ("xla", "ppermute", None)
  assert p.reason("backend") == "algorithm 'ppermute' belongs to backend 'xla'"
  p = plan(Request(AG, "tp", backend="xla", dim=0), [(8, 64), (64, 8)])
  assert (p.algorithm, p.reason("algorithm")) == ("collective", "default of backend 'xla'")



# ---------------------------------------------------------------------------- a group of one rank

ONE_RANK = "a group of one rank: nothing to communicate (the xla expression, no kernel)"
_ONE_RANK_CASES = {
    # op: (shapes, the CUDA-only choices it takes)
    AG: ([(16, 64), (64, 8)], dict(algorithm="fused", transport="nvshmem", chunks=2, dim=0)),
    RS: ([(16, 64), (64, 8)], dict(algorithm="fused", transport="copy_engine", chunks=2, dim=0)),
    AR: ([(16, 64), (64, 8)], dict(algorithm="fused", chunks=2)),
    "all_reduce": ([(4096,)], dict(algorithm="one_shot", protocol="ll")),
    "all_reduce_rms_norm": ([(4, 512), (4, 512), (512,)], dict(algorithm="one_shot")),
}


@pytest.mark.parametrize("op", list(_ONE_RANK_CASES))
@pytest.mark.parametrize("ask", ["auto", "cuda", "cuda_only_choices"])
def test_a_group_of_one_rank_plans_the_xla_expression(one_process_per_device, op, ask):
  """Over one rank every op runs the xla expression, whatever was asked, as empty operands do.

  The CUDA kernels assume peers (the fused ones would wait on a slot no rank writes).
  """
  shapes, cuda_only = _ONE_RANK_CASES[op]
  dim = {"dim": cuda_only["dim"]} if "dim" in cuda_only else {}
  kw = {"auto": dim, "cuda": dict(dim, backend="cuda"), "cuda_only_choices": cuda_only}[ask]
  p = plan(Request(op, "tp", **kw), shapes, mesh_shape=(4, 1), axes=("dp", "tp"))
  assert (p.backend, p.algorithm, p.num_ranks) == ("xla", "collective", 1), p.summary()
  assert p.reason("backend") == ONE_RANK
  assert (p.groups, p.protocol, p.transport, p.chunks) == (None, None, None, None)
  # Trial 30 F5: the CUDA choices it does not use are said, each in its own reason.
  for key, value in cuda_only.items() if ask == "cuda_only_choices" else ():
    if key != "dim":
      said = p.reason(key)
      assert said is not None and said.startswith(f"{key}={value!r} requested, not used: the "
                                                  f"call runs on backend 'xla' ({ONE_RANK})"), said
  if ask != "cuda_only_choices":
    assert p.reason("algorithm") == "default of backend 'xla'"
  # The same call over two ranks still plans the kernels.
  p = plan(Request(op, "tp", **kw), shapes, mesh_shape=(2, 2), axes=("dp", "tp"))
  assert p.backend == "cuda" and p.num_ranks == 2, p.summary()


@pytest.mark.parametrize("backend", ["auto", "cuda"])
def test_a_group_of_one_rank_runs_and_equals_the_reference(cuda_runtime, rng, backend):
  """With the runtime up (simulated), a tp axis of one rank runs on CPU: no custom call."""
  mesh = make_mesh((4, 1), ("dp", "tp"))
  x = rng.standard_normal((4, 6, 16)).astype(np.float32)  # each dp rank's [6, 16]
  w = rng.standard_normal((16, 12)).astype(np.float32)
  gemm_kw = {} if backend == "auto" else dict(algorithm="fused", chunks=2)
  ar_kw = {} if backend == "auto" else dict(algorithm="one_shot", protocol="ll")

  def body(x, w):
    x = x[0]
    outs = (overlap.all_gather_matmul(x, w, "tp", backend=backend, **gemm_kw),
            overlap.matmul_reduce_scatter(x, w, "tp", backend=backend, **gemm_kw),
            overlap.matmul_all_reduce(x, w, "tp", backend=backend, **gemm_kw),
            jaxoverlap.all_reduce(x, "tp", backend=backend, **ar_kw))
    return tuple(o[None] for o in outs)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P("dp"),
                            check_vma=False))
  jaxoverlap.clear_decisions()
  assert "custom_call @jaxoverlap" not in f.lower(x, w).as_text()
  ag, rs, ar, s = f(x, w)
  product = np.einsum("bik,kn->bin", x.astype(np.float64), w.astype(np.float64))
  for name, got, want in (("all_gather_matmul", ag, product), ("matmul_reduce_scatter", rs,
                                                               product),
                          ("matmul_all_reduce", ar, product), ("all_reduce", s, x)):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5,
                               err_msg=name)
  plans = jaxoverlap.decisions()
  assert sorted(p.op for p in plans) == sorted([AG, RS, AR, "all_reduce"])
  assert all(p.reason("backend") == ONE_RANK for p in plans), [p.summary() for p in plans]


# ---------------------------------------------------------------------------- process models


def peer_facts(num_local=4, **kw):
  """One process driving num_local GPUs (the in-process runtime, transport "peer")."""
  return dataclasses_replace(facts(ranks_per_node=num_local, **kw), transport="peer")


def dataclasses_replace(f, **kw):
  import dataclasses
  return dataclasses.replace(f, **kw)


def peer_plan(request, shapes, mesh_shape=(4,), axes=("tp",), num_local=4, dtype=BF16):
  mesh = make_mesh(mesh_shape, axes)
  return dispatch.make_plan(request, [A(s, dtype) for s in shapes], mesh,
                            peer_facts(num_local))


def test_one_process_several_gpus_runs_the_kernels(one_process_per_device):
  """JAX's default process model: every op plans the CUDA kernels, transport peer."""
  p = peer_plan(Request("all_reduce", "tp"), [(4096,)])
  assert (p.backend, p.algorithm, p.transport, p.num_nodes) == ("cuda", "one_shot", "peer", 1)
  assert p.reason("transport") == "the runtime's transport"
  p = peer_plan(Request(AG, "tp", dim=0), [(16, 64), (64, 8)])
  assert (p.backend, p.algorithm, p.transport) == ("cuda", "fused", "copy_engine")
  with pytest.raises(ValueError, match="transport='nvshmem' needs the NVSHMEM runtime"):
    peer_plan(Request(RS, "tp", dim=0, transport="nvshmem"), [(16, 64), (64, 8)])
  with pytest.raises(ValueError, match="transport='nvshmem' was requested, but this runtime's "
                                       "transport is 'peer'"):
    peer_plan(Request("all_reduce", "tp", transport="nvshmem"), [(4096,)])


def test_groups_across_processes_with_the_in_process_runtime(one_process_per_device):
  """Two processes of 4 GPUs: the all-reduce across them joins the nodes with XLA's psum."""
  # auto: the cost model weighs the hierarchical algorithm against one psum, and says so.
  p = peer_plan(Request("all_reduce", ("dp", "tp")), [(4096,)], mesh_shape=(2, 4),
                axes=("dp", "tp"))
  assert p.backend == "xla" and p.reason("backend").startswith(
      "auto policy hands the call to lax.psum (NCCL): cost model: intra-node steps + psum of the "
      "fp32 shard over 2 processes")
  # Requested: the kernels' intra-node steps around XLA's all-reduce of the fp32 shard.
  p = peer_plan(Request("all_reduce", ("dp", "tp"), algorithm="hierarchical"), [(4096,)],
                mesh_shape=(2, 4), axes=("dp", "tp"))
  assert (p.backend, p.algorithm, p.protocol, p.transport, p.inter_node) == (
      "cuda", "hierarchical", "simple", "peer", "xla")
  assert (p.ranks_per_node, p.num_nodes) == (4, 2)
  assert p.node_groups == ((0, 4), (1, 5), (2, 6), (3, 7))  # mesh positions, same local rank
  assert p.pieces == ((0, 4096, 1024),)
  assert "same-local-rank GPUs" in p.reason("inter_node")
  assert "inter_node=xla" in p.summary()
  # Within a process nothing changes.
  p = peer_plan(Request("all_reduce", "tp"), [(4096,)], mesh_shape=(2, 4), axes=("dp", "tp"))
  assert p.backend == "cuda" and p.groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and p.inter_node is None
  # Choices the path does not have are refused before anything runs.
  with pytest.raises(ValueError, match="spans 2 processes; use 'hierarchical' or 'auto'"):
    peer_plan(Request("all_reduce", "dp", algorithm="one_shot"), [(4096,)], mesh_shape=(2, 4),
              axes=("dp", "tp"))
  with pytest.raises(ValueError, match="run the simple protocol only"):
    peer_plan(Request("all_reduce", "dp", algorithm="hierarchical", protocol="ll"), [(4096,)],
              mesh_shape=(2, 4), axes=("dp", "tp"))
  # The fused ops stay within a process; across processes auto runs XLA and says why.
  p = peer_plan(Request(RS, ("dp", "tp"), dim=0), [(16, 64), (64, 8)], mesh_shape=(2, 4),
                axes=("dp", "tp"))
  assert p.backend == "xla" and "spans 2 processes" in p.reason("backend")
  with pytest.raises(ValueError, match="spans 2 processes"):
    peer_plan(Request(AG, "dp", backend="cuda", dim=0), [(16, 64), (64, 8)], mesh_shape=(2, 4),
              axes=("dp", "tp"))


@pytest.mark.parametrize("axes", [("dp", "tp"), ("tp", "dp"), "dp"], ids=str)
def test_inter_node_all_reduce_sums_the_same_local_rank(monkeypatch, axes):
  """XLA's all-reduce over plan.node_groups: mesh positions, not device ids, of each node's
  GPU with one local rank (8 CPU devices in a shuffled mesh as 2 processes x 4 GPUs)."""
  from jax.sharding import Mesh, NamedSharding

  from jaxoverlap import _primitives

  devices = np.array(jax.devices()[:8])[np.random.default_rng().permutation(8)]
  mesh = Mesh(devices.reshape(2, 4), ("dp", "tp"))
  monkeypatch.setattr(runtime, "_pe_by_device_id",
                      {d.id: i for i, d in enumerate(mesh.devices.flat)})
  groups = runtime.node_groups_along_axis(mesh, axes, ranks_per_node=4)
  assert len(groups) == 8 // 2 and all(len(g) == 2 for g in groups)
  host = np.random.default_rng().standard_normal((8, 5)).astype(np.float32)
  spec = P(("dp", "tp"))
  f = jax.jit(jax.shard_map(
      lambda x: _primitives.node_psum_p.bind(x, node_groups=tuple(map(tuple, groups))),
      mesh=mesh, in_specs=spec, out_specs=spec))
  out = np.asarray(f(jax.device_put(host, NamedSharding(mesh, spec))))
  # Rank r of the mesh (row-major over dp, tp) gets the sum over the two processes (dp) of the
  # GPUs with its local rank: its own tp index.
  want = host.reshape(2, 4, 5).sum(0, keepdims=True).repeat(2, 0).reshape(8, 5)
  np.testing.assert_allclose(out, want, rtol=1e-6)


@pytest.mark.parametrize("n,local,itemsize,slot", [
    (4096, 4, 2, 1 << 20), (1, 2, 4, 1 << 20), (1000, 4, 2, 1 << 20), (10_000, 2, 4, 4096),
    (8193, 8, 2, 256), (0, 2, 2, 4096)])
def test_stage_pieces_match_the_kernels_layout(n, local, itemsize, slot):
  """Pieces tile the message; each shard is the two-shot shard (16-byte multiple) and fits."""
  pieces = dispatch.stage_pieces(n, local, itemsize, slot)
  vec = 16 // itemsize
  assert [p[0] for p in pieces] == list(np.cumsum([0] + [p[1] for p in pieces[:-1]]))[
      :len(pieces)]
  assert sum(p[1] for p in pieces) == n
  for start, length, shard in pieces:
    assert shard % vec == 0 and shard * local >= length > 0
    assert shard - vec < -(-length // local) <= shard
    assert shard * itemsize <= slot


def test_stage_pieces_refuse_a_slot_below_one_vector():
  with pytest.raises(ValueError, match="too small for one vector per rank"):
    dispatch.stage_pieces(100, 2, 4, 8)


def test_pe_of_device_in_process(monkeypatch):
  """The in-process runtime numbers PEs process by process, devices by id."""
  devices = jax.devices()[:8]
  monkeypatch.setattr(runtime, "_pe_by_device_id", {d.id: i for i, d in enumerate(devices)})
  mesh = make_mesh((2, 4), ("dp", "tp"))
  assert runtime.groups_along_axis(mesh, "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


# ---------------------------------------------------------------------------- log


def test_decisions_log_and_summary(caplog):
  mesh = make_mesh((4,), ("tp",))
  f = jax.jit(jax.shard_map(lambda x: jaxoverlap.all_reduce(x, "tp"), mesh=mesh,
                            in_specs=P("tp"), out_specs=P()))
  jaxoverlap.clear_decisions()
  with caplog.at_level(logging.INFO, logger="jaxoverlap"):
    f.lower(jnp.ones((8, 4), F32))
  (p,) = jaxoverlap.decisions()
  assert jaxoverlap.decisions("all_gather_matmul") == []
  assert p.summary().startswith("all_reduce [2, 4] float32 over 'tp' (4 ranks): xla collective")
  assert p.summary() in caplog.text
  json.dumps(p.as_dict())  # plain data
  jaxoverlap.clear_decisions()
  assert jaxoverlap.decisions() == []


def test_names_table_lists_every_protocol_of_the_cuda_all_reduce():
  """The module table of jaxoverlap.names agrees with its rules (names.protocols)."""
  doc = names.__doc__
  table = doc[doc.index("  all_reduce  "):doc.index("  all_gather_matmul  ")]
  for protocol in names.protocols():
    assert protocol in table, (protocol, table)
  only = [a for a in names.algorithms("all_reduce", "cuda")
          if names.LAMPORT in names.protocols(a)]
  assert only == ["one_shot", "two_shot"] and "lamport: one_shot and two_shot" in table, table


def test_decisions_come_from_compilations_not_calls():
  """As decisions() says (trial 44): a program from JAX's caches adds no plan, and
  jax.clear_caches() brings its plans back at the next call."""
  mesh = make_mesh((4,), ("tp",))
  fn = jax.jit(jax.shard_map(lambda x: jaxoverlap.all_reduce(x, "tp"), mesh=mesh,
                             in_specs=P("tp"), out_specs=P()))
  x = jnp.asarray(np.random.default_rng().standard_normal(8), jnp.float32)
  jaxoverlap.clear_decisions()
  fn(x)
  assert [p.op for p in jaxoverlap.decisions()] == ["all_reduce"]
  jaxoverlap.clear_decisions()
  fn(x)
  assert jaxoverlap.decisions() == []
  jax.clear_caches()
  fn(x)
  assert [p.op for p in jaxoverlap.decisions()] == ["all_reduce"]


def test_decisions_of_an_unknown_op_raise():
  """A misspelt op is an error naming the ops, not an empty list that reads as "nothing ran"."""
  for bad in ("all_gather_mamtul", "allreduce", "psum", ""):
    with pytest.raises(ValueError, match=re.escape(
        f"decisions: op={bad!r} is not an op; expected None or one of {names.OPS}")):
      jaxoverlap.decisions(bad)
  assert "all_reduce_rms_norm" in names.OPS
  for op in names.OPS:
    assert isinstance(jaxoverlap.decisions(op), list)


def test_plan_documents_every_field(one_process_per_device):
  """Each dataclass of the dispatcher names every field under Attributes (e.g. Plan.pieces)."""
  import dataclasses

  for cls in (dispatch.Request, dispatch.Geometry, dispatch.Plan):
    doc = cls.__doc__.split("Attributes:")[1]
    documented = set(re.findall(r"^    (\w+(?:, \w+)*):", doc, flags=re.M))
    names_ = {n for entry in documented for n in entry.split(", ")}
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in names_]
    assert not missing, f"{cls.__name__}: {missing} undocumented"
  nbytes = dispatch.Plan.__doc__.split("nbytes:")[1].split("num_ranks:")[0]
  assert "operand x" in nbytes and "geometry.payload_bytes" in nbytes, nbytes
  # As documented: x's bytes per rank, also for a fused op, whose slot need is the geometry's.
  p = plan(Request(AR, "tp", algorithm="fused"), [(256, 64), (64, 32)])
  assert p.nbytes == 256 * 64 * 2 and p.geometry.payload_bytes == 2 * 64 * 32 * 2


def test_decisions_log_is_bounded():
  mesh = make_mesh((2,), ("tp",))
  jaxoverlap.clear_decisions()
  for _ in range(3):
    dispatch._log.append(None)
  assert len(dispatch._log) == 3 and dispatch._log.maxlen == 1000


# ---------------------------------------------------------------------------- lowerings


def _inner(fn, x_shape, w_shape, dtype=BF16):
  """Per-rank output avals of fn and the names of the primitives it binds."""
  found = {}

  def body(x, w):
    out = fn(x, w)
    found["aval"] = jax.typeof(out)
    return jnp.zeros((), jnp.float32)

  mesh = make_mesh((4,), ("tp",))
  args = (jax.ShapeDtypeStruct(x_shape, dtype), jax.ShapeDtypeStruct(w_shape, dtype))
  f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=True)
  jaxpr = jax.make_jaxpr(f)(*args)
  return found["aval"], _primitives(jaxpr.jaxpr)


def _primitives(jaxpr) -> set[str]:
  out = set()
  for eqn in jaxpr.eqns:
    out.add(eqn.primitive.name)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      out |= _primitives(sub)
  return out


CASES = [
    ("all_gather_matmul", lambda x, w: overlap.all_gather_matmul(x, w, "tp"),
     lambda x, w: reference.all_gather_matmul(x, w, "tp"), (6, 32), (32, 24)),
    ("all_gather_matmul dim 1",
     lambda x, w: overlap.all_gather_matmul(x, w, "tp", gather_dimension=1),
     lambda x, w: reference.all_gather_matmul(x, w, "tp", gather_dimension=1), (2, 3, 5, 32),
     (32, 24)),
    ("matmul_reduce_scatter", lambda x, w: overlap.matmul_reduce_scatter(x, w, "tp"),
     lambda x, w: reference.matmul_reduce_scatter(x, w, "tp"), (8, 32), (32, 24)),
    ("matmul_reduce_scatter dim 1",
     lambda x, w: overlap.matmul_reduce_scatter(x, w, "tp", scatter_dimension=1),
     lambda x, w: reference.matmul_reduce_scatter(x, w, "tp", scatter_dimension=1),
     (3, 12, 32), (32, 24)),
    ("matmul_all_reduce", lambda x, w: overlap.matmul_all_reduce(x, w, "tp"),
     lambda x, w: reference.matmul_all_reduce(x, w, "tp"), (8, 32), (32, 24)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_primitive_has_the_reference_type(case):
  name, ours, ref, x_shape, w_shape = case
  got, prims = _inner(ours, x_shape, w_shape)
  want, _ = _inner(ref, x_shape, w_shape)
  assert "jaxoverlap_" + name.split(" ")[0] in prims
  assert got.shape == want.shape and got.dtype == want.dtype
  assert got.manual_axis_type.varying == want.manual_axis_type.varying, (got, want)


@pytest.mark.parametrize("op,fwd,bwd,specs", [
    (AG, "jaxoverlap_all_gather_matmul", "jaxoverlap_matmul_reduce_scatter",
     (P("tp"), P(None, "tp"))),
    (RS, "jaxoverlap_matmul_reduce_scatter", "jaxoverlap_all_gather_matmul",
     (P(None, "tp"), P("tp", None))),
])
def test_gradient_binds_the_paired_op(op, fwd, bwd, specs):
  fn = getattr(overlap, op)

  def body(x, w):
    return jax.grad(lambda x, w: jnp.sum(fn(x, w, "tp").astype(F32)), argnums=(0, 1))(x, w)

  mesh = make_mesh((4,), ("tp",))
  args = (jax.ShapeDtypeStruct((8, 32), BF16), jax.ShapeDtypeStruct((32, 16), BF16))
  f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs)
  assert {fwd, bwd} <= _primitives(jax.make_jaxpr(f)(*args).jaxpr)


def _lowered_text(fn, x_shape, w_shape=None, specs=(P("tp"), P(None, "tp")), dtype=BF16):
  mesh = make_mesh((4,), ("tp",))
  shapes = [x_shape] + ([w_shape] if w_shape else [])
  args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
  f = jax.shard_map(fn, mesh=mesh, in_specs=specs[:len(args)], out_specs=P(),
                    check_vma=False)
  return jax.jit(f).lower(*args).as_text()


@needs_extension
def test_all_reduce_lowers_to_the_custom_call_of_its_plan(cuda_runtime):
  ext = _ffi.load()
  text = _lowered_text(lambda x: jaxoverlap.all_reduce(x, "tp", protocol="simple"),
                       (4 * 4096,))
  call = re.search(r"custom_call @jaxoverlap_all_reduce\(.*", text).group(0)
  assert f"algorithm = {ext.AllReduceAlgorithm.one_shot.value} : i32" in call
  assert f"protocol = {ext.Protocol.simple.value} : i32" in call
  assert "group_size = 4 : i64" in call and "groups = dense<[0, 1, 2, 3]>" in call
  assert jaxoverlap.decisions()[-1].protocol == "simple"


@needs_extension
def test_fused_ops_lower_to_their_custom_calls(cuda_runtime, monkeypatch):
  ext = _ffi.load()
  text = _lowered_text(lambda x, w: overlap.all_gather_matmul(x, w, "tp", transport="nvshmem",
                                                              chunks=3), (64, 32), (32, 16))
  call = re.search(r"custom_call @jaxoverlap_all_gather_matmul\(.*", text).group(0)
  for attr in (f"transport = {ext.Transport.nvshmem.value} : i32", "chunks = 3 : i64",
               f"precision = {ext.Precision['default'].value} : i32", "outer = 1 : i64",
               "rows = 16 : i64", "k = 32 : i64", "n = 4 : i64"):
    assert attr in call, (attr, call)
  monkeypatch.setenv("JAXOVERLAP_FUSED_CMD_BUFFER", "1")
  cuda_runtime["facts"] = facts(fused_command_buffer=True)
  text = _lowered_text(lambda x, w: overlap.matmul_reduce_scatter(x, w, "tp"), (64, 32),
                       (32, 16), specs=(P(None, "tp"), P("tp")))
  assert "custom_call @jaxoverlap_matmul_reduce_scatter_cmdbuf(" in text


@needs_extension
def test_unfused_matmul_all_reduce_lowers_to_gemm_then_all_reduce(cuda_runtime):
  text = _lowered_text(lambda x, w: overlap.matmul_all_reduce(x, w, "tp"), (16, 32), (32, 16),
                       specs=(P(None, "tp"), P("tp")))
  assert "jaxoverlap_all_reduce" in text and "jaxoverlap_matmul_all_reduce" not in text
  assert "stablehlo.dot_general" in text
  p = jaxoverlap.decisions()[-1]
  assert p.algorithm == "unfused" and p.all_reduce.algorithm == "one_shot"


@needs_extension
def test_unfused_matmul_all_reduce_with_an_xla_all_reduce_lowers_once(cuda_runtime, monkeypatch):
  # A policy that hands the all-reduce to lax.psum (as the measured table does from 64 MiB).
  # GEMM and psum lower as one function (two lowerings in one rule's context failed with
  # "Should only set `tokens_out` once").
  class ToPsum:
    def choose(self, nbytes, itemsize, ranks_per_node, num_nodes, transport=None,
               emulated_nodes=None):
      return policy.Choice(policy.PSUM, None, "a test's policy")

  monkeypatch.setattr(dispatch, "_tuning_policy", ToPsum)
  text = _lowered_text(lambda x, w: overlap.matmul_all_reduce(x, w, "tp", algorithm="unfused"),
                       (8192, 128), (128, 8192), specs=(P(None, "tp"), P("tp")))
  p = jaxoverlap.decisions()[-1]
  assert (p.algorithm, p.all_reduce.backend) == ("unfused", "xla"), p.summary()
  assert "custom_call @jaxoverlap" not in text
  assert "stablehlo.dot_general" in text and "stablehlo.all_reduce" in text


def test_xla_plan_lowers_to_the_xla_collective():
  text = _lowered_text(lambda x: jaxoverlap.all_reduce(x, "tp"), (16,))
  assert "jaxoverlap_all_reduce" not in text and "all_reduce" in text
  text = _lowered_text(lambda x, w: overlap.all_gather_matmul(x, w, "tp", algorithm="ppermute"),
                       (8, 32), (32, 16))
  assert "collective_permute" in text


# ---------------------------------------------------------------------------- layering


_PKG = pathlib.Path(jaxoverlap.__file__).parent


def _package_imports(path: pathlib.Path) -> set[str]:
  """Modules of the package that ``path`` imports at module level (not inside functions)."""
  tree = ast.parse(path.read_text())
  found = set()
  for node in tree.body:
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxoverlap"):
      if node.module == "jaxoverlap":
        found |= {f"jaxoverlap.{a.name}" for a in node.names}
      else:
        found.add(node.module)
    elif isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name.startswith("jaxoverlap")}
  return found


def test_no_import_cycles():
  modules = {}
  for path in _PKG.rglob("*.py"):
    rel = path.relative_to(_PKG.parent).with_suffix("")
    name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
    modules[name] = {m for m in _package_imports(path) if m != name}
  modules = {k: {m for m in v if m in modules} for k, v in modules.items()}
  # Depth-first search for a cycle.
  state = {}

  def visit(m, stack):
    state[m] = "open"
    for dep in sorted(modules[m]):
      if state.get(dep) == "open" and not m.startswith(dep + "."):
        raise AssertionError("import cycle: " + " -> ".join(stack + [dep]))
      if dep not in state:
        visit(dep, stack + [dep])
    state[m] = "done"

  for m in sorted(modules):
    if m not in state:
      visit(m, [m])
  assert "jaxoverlap.dispatch" not in modules["jaxoverlap.runtime"]


def test_nothing_outside_the_package_reads_private_globals():
  root = _PKG.parent
  pattern = re.compile(r"jaxoverlap\._\w+\.\w*decisions|sys\.modules\.get\(.jaxoverlap")
  offenders = [str(p.relative_to(root)) for d in ("benchmarks", "examples")
               for p in (root / d).rglob("*.py") if pattern.search(p.read_text())]
  assert not offenders, offenders


# ---------------------------------------------------------------------------- nested shard_map


NESTED = {  # op: (the body over tp, shapes of the global operands, inner in_specs, out_spec)
    "all_reduce": (lambda lib, x, **kw: lib.all_reduce(x, "tp", **kw), [(16, 4)], (P("tp"),),
                   P()),
    "all_gather_matmul": (lambda lib, x, w, **kw: lib.all_gather_matmul(x, w, "tp", **kw),
                          [(16, 4), (4, 3)], (P("tp"), P()), P("tp")),
    "matmul_reduce_scatter": (lambda lib, x, w, **kw: lib.matmul_reduce_scatter(x, w, "tp", **kw),
                              [(8, 8), (8, 3)], (P(None, "tp"), P("tp")), P("tp")),
    "matmul_all_reduce": (lambda lib, x, w, **kw: lib.matmul_all_reduce(x, w, "tp", **kw),
                          [(8, 8), (8, 3)], (P(None, "tp"), P("tp")), P()),
    "all_reduce_rms_norm": (lambda lib, p, r, w, **kw: lib.all_reduce_rms_norm(p, r, w, "tp",
                                                                               **kw),
                            [(16, 4), (4, 4), (4,)], (P("tp"), P(), P()), (P(), P())),
}


def _nested(op, lib, **kw):
  """An outer shard_map over dp (mesh given) around an inner one over tp (no mesh=)."""
  body, _, specs, out = NESTED[op]
  inner = jax.shard_map(lambda *a: body(lib, *a, **kw), in_specs=specs, out_specs=out,
                        axis_names={"tp"})
  outer_in = tuple(P("dp") for _ in specs)
  outer_out = jax.tree.map(lambda _: P("dp"), out, is_leaf=lambda s: isinstance(s, P))
  mesh = make_mesh((2, 4), ("dp", "tp"))
  return jax.jit(jax.shard_map(inner, mesh=mesh, in_specs=outer_in, out_specs=outer_out,
                               axis_names={"dp"}))


@pytest.mark.parametrize("backend", ["auto", "xla"])
@pytest.mark.parametrize("op", list(NESTED))
def test_nested_shard_map_runs_on_xla(rng, op, backend):
  """The inner shard_map lowers under an AbstractMesh: the ops run their XLA expression."""
  _, shapes, _, _ = NESTED[op]
  args = [jnp.asarray(rng.standard_normal((2 * s[0],) + s[1:]), F32) for s in shapes]
  jaxoverlap.clear_decisions()
  ours = _nested(op, jaxoverlap, backend=backend)(*args)
  ref = _nested(op, reference)(*args)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  (p,) = jaxoverlap.decisions(op)
  assert p.backend == "xla"


def test_nested_shard_map_names_the_abstract_mesh(cuda_runtime, caplog):
  """With the CUDA kernels usable, auto falls back and says why; backend "cuda" raises it."""
  x = jnp.ones((32, 4), F32)
  jaxoverlap.clear_decisions()
  with caplog.at_level(logging.WARNING, logger="jaxoverlap"):
    _nested("all_reduce", jaxoverlap).lower(x)
  (p,) = jaxoverlap.decisions("all_reduce")
  assert p.backend == "xla" and "has an AbstractMesh" in p.reason("backend")
  with pytest.raises(Exception, match="no concrete jax.sharding.Mesh"):
    _nested("all_reduce", jaxoverlap, backend="cuda").lower(x)


def test_policy_cache_holds_its_table(monkeypatch):
  """The policy cache was keyed by id(table): after finalize() and a new initialize(), a new
  table allocated at the freed table's address got the old policy. It keeps the table now, and
  a new table object (equal or not) gets its own policy."""
  monkeypatch.setattr(runtime, "tuning_table", lambda: ("t.json", None))
  none_policy = dispatch._tuning_policy()
  assert dispatch._tuning_policy() is none_policy  # cached while the table is the same object
  table = tuning.make_result(
      [{"op": "all_reduce", "impl": impl, "dtype": "bfloat16", "bytes": 8192, "shape": [4096],
        "world": 2, "ranks_per_node": 2, "time_us": us}
       for impl, us in (("xla:psum", 10.0), ("jaxoverlap:one_shot_ll", 5.0))],
      machine="test", command="pytest", method="fake")
  monkeypatch.setattr(runtime, "tuning_table", lambda: ("t.json", table))
  p = dispatch._tuning_policy()
  assert p is not none_policy and dispatch._policy_cache[0][1] is table
  assert p.choose(8192, 2, 2, 1).time_us == 5.0
  same_content = json.loads(json.dumps(table))
  monkeypatch.setattr(runtime, "tuning_table", lambda: ("t.json", same_content))
  assert dispatch._tuning_policy() is not p  # another object: another start-up's table


def _mesh_of(order, shape=(2, 4)):
  from jax.sharding import Mesh

  return Mesh(np.array(jax.devices())[list(order)].reshape(shape), ("dp", "tp"))


@pytest.mark.parametrize("op,shapes", [("all_reduce", [(4096,)]),
                                       ("all_gather_matmul", [(64, 64), (64, 64)])])
def test_a_group_with_uneven_nodes_falls_back_before_any_kernel(one_process_per_device, op,
                                                                 shapes):
  """tp groups (1, 2, 3, 4) and (5, 6, 7, 0) at 4 ranks per node hold 3 ranks on one node and 1
  on the other: planned as '2 nodes x 2' (len // nodes) and refused by the kernel when it ran."""
  mesh = _mesh_of([1, 2, 3, 4, 5, 6, 7, 0])
  f = facts(ranks_per_node=4, pe=1)
  p = dispatch.make_plan(Request(op, "tp", dim=0 if op != "all_reduce" else None),
                         [A(s, BF16) for s in shapes], mesh, f)
  assert p.backend == "xla"
  assert p.reason("backend") == (
      "auto: the group (1, 2, 3, 4) over 'tp' has 3 on node 0, 1 on node 1 (PEs of node k: "
      "k * 4 on); the kernels need as many ranks on each node of a group")
  with pytest.raises(ValueError, match=re.escape(
      f"{op}: backend='cuda' was requested, but the group (1, 2, 3, 4) over 'tp' has 3 on node "
      "0, 1 on node 1")):
    dispatch.make_plan(Request(op, "tp", backend="cuda", dim=0 if op != "all_reduce" else None),
                       [A(s, BF16) for s in shapes], mesh, f)


@pytest.mark.parametrize("pe", [0, 4])
def test_groups_of_different_shapes_fall_back_on_every_process(one_process_per_device, pe):
  """In-process runtime, 2 processes x 4 GPUs, tp groups (0, 1), (3, 4), (2, 5), (6, 7):
  process 0 planned a CUDA kernel from its group (0, 1) while process 1 planned XLA for group
  (3, 4), which spans both: two collectives for one group. Both now plan XLA, alike."""
  mesh = _mesh_of([0, 1, 3, 4, 2, 5, 6, 7], (4, 2))
  f = facts(ranks_per_node=4, pe=pe, transport="peer")
  for op, shapes in (("all_reduce", [(4096,)]), ("all_gather_matmul", [(64, 64), (64, 64)])):
    p = dispatch.make_plan(Request(op, "tp", dim=0 if op != "all_reduce" else None),
                           [A(s, BF16) for s in shapes], mesh, f)
    assert p.backend == "xla", (op, p.summary())
    assert p.reason("backend") == (
        "auto: the groups over 'tp' differ in shape ((0, 1): 2 on each of 1 node; (3, 4): 1 on "
        "each of 2 nodes); one plan serves every group of the call, so the kernels need every "
        "group to have as many ranks on as many nodes")

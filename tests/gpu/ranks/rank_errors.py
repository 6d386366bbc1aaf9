"""Rank side: failures are clear errors, never hangs (2 processes).

Run by tests/gpu/test_gpu_errors.py, each test in its own launch (see
conftest.py):

* heap: a symmetric heap too small for the PEs is refused with a message that
  names the sizes, before NVSHMEM starts (no process hangs). The runtime is not
  brought up beforehand, and cannot be in this process afterwards (the
  start-up keys are taken), so this test runs alone.
* timeout: rank 1 never joins the all-reduce; rank 0's device wait gives up
  after ``JAXOVERLAP_TIMEOUT_S`` (the outer test sets 2 s) and the recorded
  error names peer PE 1 and the step, in the terms of the protocol's wait (once
  for each protocol). The GPU context is lost after the trap,
  so the test is marked ``ends_process``: the conftest writes the report and
  ends the process with ``os._exit``.
* epoch knob at the flags' period end: every pair's call count starts 4 below
  2^32 (``JAXOVERLAP_TEST_PAIR_EPOCH``) and the one-shot LL kernels advance it at
  their start (``JAXOVERLAP_EPOCH_AT_START=1``, a measurement knob, both set by
  the outer test). Such a kernel cannot re-stamp the LL cells at the end of the
  32-bit flags' period, as the default kernels do (test_gpu_flag_wrap.py), so the
  first call, with flags 0xFFFFFFFD, is checked against the sum, and the second,
  the first of the period's end, stops the run with an error that says so. Once
  for the one-shot LL all-reduce, once for all_reduce_rms_norm at one row. The
  trap loses the GPU context, so these end their process too: without the mark,
  with two processes sharing one GPU, one whose second call never returned was
  seen to abort in the interpreter's exit after its test passed.
"""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def test_heap_too_small_is_refused(dist, ops):
  ops.require_cuda("the NVSHMEM heap")
  from jaxoverlap import runtime

  with pytest.raises(RuntimeError) as e:
    runtime.initialize(heap_bytes=1 << 20)
  msg = str(e.value)
  assert "too small" in msg and "bytes" in msg, f"unclear error for a 1 MiB heap: {msg}"
  assert not runtime.is_initialized()


def _rank0_waits_alone(compiled, args, rank, timeout_s):
  """Rank 0 runs ``compiled`` while rank 1 stays away; rank 0's call, device error, seconds."""
  import jaxoverlap

  if rank != 0:
    time.sleep(3 * timeout_s)  # longer than rank 0's device wait
    jax.distributed.shutdown()  # a barrier with rank 0: neither sees the other vanish
    return None, None, 0.0
  t0 = time.time()
  try:
    try:
      jax.block_until_ready(compiled(*args))
      raised = None
    except jax.errors.JaxRuntimeError as e:  # XLA reports the trapped kernel as a runtime error
      raised = e
    waited = time.time() - t0
    err = jaxoverlap.runtime_info()["device_error"]
  finally:  # rank 1 waits in its shutdown barrier, whatever happened here
    jax.distributed.shutdown()
  return raised, err, waited


def _timeout_s() -> float:
  import jaxoverlap

  timeout_s = float(jaxoverlap.runtime_info()["timeout_s"])
  assert timeout_s <= 3.0, f"run with JAXOVERLAP_TIMEOUT_S=2 (the device wait is {timeout_s} s)"
  return timeout_s


# What each protocol's wait reports besides op, peer and step (ffi/runtime.cu, WaitKind).
_WAIT_SAYS = {"ll": "(the call count's low 32 bits), flag seen",
              "simple": "signal seen",
              "lamport": "the Lamport slot still held no data"}


@pytest.mark.ends_process
@pytest.mark.parametrize("protocol", ["ll", "simple", "lamport"],
                         ids=["protocol_ll", "protocol_simple", "protocol_lamport"])
def test_device_wait_timeout_names_the_peer(runtime, topology, mesh, ops, rank, nproc, protocol):
  """Rank 0's all-reduce without rank 1: the wait times out and names op, peer and step.

  1 MiB a rank, so that every block of the grid times out at about the same time: the
  first report must be the one read, whole (trial 29: the record's code was published before
  its fields, and another block's trap could leave a report of "a jaxoverlap op", peer 0).
  """
  ops.require_cuda("the device-wait timeout")
  from jaxoverlap import names

  if nproc != 2:
    pytest.skip("2 processes: rank 1 stays away from rank 0's all-reduce")
  timeout_s = _timeout_s()
  algorithm = "one_shot" if topology.num_nodes == 1 else "hierarchical"
  if protocol not in names.protocols(algorithm):
    pytest.skip(f"{algorithm} has no {protocol} protocol")
  f = jax.jit(jax.shard_map(
      lambda x: jax.lax.pcast(ops.all_reduce(x, "x", algorithm=algorithm, protocol=protocol),
                              "x", to="varying"),
      mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  n = 1 << 18  # fp32: 1 MiB a rank
  x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")),
                                             np.ones(n, np.float32), (n * nproc,))
  raised, err, waited = _rank0_waits_alone(f.lower(x).compile(), (x,), rank, timeout_s)
  if rank != 0:
    return
  assert raised is not None, f"the call returned after {waited:.1f} s without peer PE 1"
  assert err is not None and "peer PE 1" in err and "step 0" in err, (
      f"device_error after {waited:.1f} s does not name peer PE 1 and step 0: {err!r}; "
      f"the call raised {type(raised).__name__}: {str(raised)[:500]}")
  assert "all_reduce timed out on PE 0" in err, f"the error names another op: {err!r}"
  assert _WAIT_SAYS[protocol] in err, f"a {protocol} wait reported as another kind: {err!r}"


@pytest.mark.ends_process
def test_norm_wait_timeout_names_the_op(runtime, topology, mesh, ops, rank, nproc):
  """The fused all-reduce + RMSNorm's timeout names all_reduce_rms_norm, not all_reduce."""
  ops.require_cuda("the device-wait timeout")
  import jaxoverlap

  if nproc != 2 or topology.num_nodes != 1:
    pytest.skip("2 processes on one node: rank 1 stays away from rank 0's call")
  timeout_s = _timeout_s()
  f = jax.jit(jax.shard_map(
      lambda p, r, w: jaxoverlap.all_reduce_rms_norm(p, r, w, "x", backend="cuda",
                                                     algorithm="one_shot"),
      mesh=mesh, in_specs=(P("x"), P(), P()), out_specs=(P(), P())))
  rows, hidden = 2, 1024
  p = jax.make_array_from_process_local_data(
      NamedSharding(mesh, P("x")), np.ones((rows, hidden), np.float32), (rows * nproc, hidden))
  rep = NamedSharding(mesh, P())  # no device_put: its cross-process check needs NCCL
  r = jax.make_array_from_process_local_data(rep, np.ones((rows, hidden), np.float32),
                                             (rows, hidden))
  w = jax.make_array_from_process_local_data(rep, np.ones(hidden, np.float32), (hidden,))
  raised, err, waited = _rank0_waits_alone(f.lower(p, r, w).compile(), (p, r, w), rank,
                                           timeout_s)
  if rank != 0:
    return
  assert raised is not None, f"the call returned after {waited:.1f} s without peer PE 1"
  assert err is not None and "all_reduce_rms_norm timed out on PE 0" in err and (
      "peer PE 1" in err), (
      f"device_error after {waited:.1f} s does not name the op and peer PE 1: {err!r}; "
      f"the call raised {type(raised).__name__}: {str(raised)[:1500]}")


@pytest.mark.ends_process
def test_mismatched_sizes_are_named(runtime, topology, mesh, ops, rank, nproc, kv):
  """A user's bug: the ranks all-reduce arrays of different sizes at the same time.

  The rank whose wait times out must say which op, rank, peer and step did not
  arrive, with a hint, in runtime_info()["device_error"] and on stderr (the
  watchdog's line; the outer test reads the output), not only XLA's
  CUDA_ERROR_LAUNCH_FAILED.
  """
  ops.require_cuda("the device-wait timeout")
  import jaxoverlap

  if nproc != 2 or topology.num_nodes != 1:
    pytest.skip("2 processes on one node")
  # 4 KiB on rank 0 (one LL block), 64 KiB on rank 1 (16 blocks): rank 1's blocks 1-15 wait
  # for lines rank 0 never sends.
  n = 1024 if rank == 0 else 16384
  f = jax.jit(jax.shard_map(
      lambda x: jax.lax.pcast(ops.all_reduce(x, "x", algorithm="one_shot", protocol="ll"), "x",
                              to="varying"),
      mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  # Each process builds its own program: the sizes differ, as in the user's bug.
  local_mesh_array = jax.make_array_from_process_local_data(
      NamedSharding(mesh, P("x")), np.ones(n, np.float32), (n * nproc,))
  try:
    f(local_mesh_array).block_until_ready()
    raised = None
  except jax.errors.JaxRuntimeError as e:  # XLA reports the trapped kernel as a runtime error
    raised = e
  time.sleep(1.0)  # the watchdog polls every 20 ms
  err = jaxoverlap.runtime_info()["device_error"]
  outcomes = kv.gather(f"{raised is not None}|{err or ''}")
  jax.distributed.shutdown()
  timed_out = [o for o in outcomes if o.split("|", 1)[1]]
  assert timed_out, f"no rank recorded a device-wait timeout: {outcomes}"
  for o in timed_out:
    msg = o.split("|", 1)[1]
    for part in ("all_reduce timed out on PE", "did not arrive at step", "Likely causes",
                 "different orders, with different sizes"):
      assert part in msg, f"{part!r} missing from the recorded error: {msg}"
  if err:
    assert raised is not None, "the rank that timed out returned from its call"


def _check_period_end_stops(f, args, want, first_of, op, nproc, kv):
  """Two calls of ``f`` from pair epoch 2^32 - 3: the first is right, the second stops loudly.

  ``first_of(result)``: this rank's float64 values to compare with ``want``;
  ``op``: the op the recorded error must name.
  """
  import os

  import jaxoverlap

  first = first_of(f(*args))  # epoch 2^32 - 3: flag 0xFFFFFFFD
  first_ok = bool(np.all(np.abs(first - want) <= 1e-5 * (np.abs(want) + 1)))
  # Epoch 2^32 - 2, the first call of the period's end: the kernel traps at its start. The
  # call runs on a thread, bounded: with two processes on one GPU, the second context's
  # call was seen not to return after both kernels trapped (the first raised at once).
  outcome = ["hung"]

  def second_call():
    try:
      jax.block_until_ready(f(*args))
      outcome[0] = "returned"
    except jax.errors.JaxRuntimeError:  # XLA reports the trapped kernel as a runtime error
      outcome[0] = "raised"
    except Exception as e:  # noqa: BLE001 - anything else fails the test below, by name
      outcome[0] = f"unexpected {type(e).__name__}"

  t = threading.Thread(target=second_call, daemon=True)
  t.start()
  t.join(30.0)
  time.sleep(1.0)  # the watchdog polls every 20 ms
  err = jaxoverlap.runtime_info()["device_error"]
  outcomes = kv.gather(f"{first_ok}|{outcome[0]}|{err or ''}")
  # A barrier with the other ranks (it does not touch the GPU, so a hung call's thread does not
  # hold it up): rank 0 hosts the coordination service and must not end before the others.
  jax.distributed.shutdown()
  for r, o in enumerate(outcomes):
    ok, call, msg = o.split("|", 2)
    assert ok == "True", f"rank {r}: the first call (flags 0xFFFFFFFD) summed wrongly"
    assert call in ("raised", "hung"), f"rank {r}: the call at the period's end {call}"
    for part in (f"{op} stopped on PE", "ends a period of the LL protocol's 32-bit flags",
                 "JAXOVERLAP_EPOCH_AT_START=1", "peer PE", "restart the processes"):
      assert part in msg, f"rank {r}: {part!r} missing from the recorded error: {msg!r}"
  calls = [o.split("|", 2)[1] for o in outcomes]
  if os.environ.get("JAXOVERLAP_NO_NCCL"):  # processes share one GPU
    assert "raised" in calls, f"no rank's call raised: {calls}"
  else:
    assert calls == ["raised"] * nproc, f"every rank's call must raise: {calls}"


def _skip_unless_knob_run(topology, nproc):
  import os

  if (os.environ.get("JAXOVERLAP_TEST_PAIR_EPOCH") != str(2**32 - 4)
      or os.environ.get("JAXOVERLAP_EPOCH_AT_START") != "1"):
    pytest.skip("run with JAXOVERLAP_TEST_PAIR_EPOCH=2**32 - 4 and JAXOVERLAP_EPOCH_AT_START=1 "
                "(tests/gpu/test_gpu_errors.py)")
  if nproc != 2 or topology.num_nodes != 1:
    pytest.skip("2 processes on one node")


@pytest.mark.ends_process
def test_all_reduce_period_end_stops_under_epoch_knob(runtime, topology, mesh, ops, rank, nproc,
                                                      kv):
  ops.require_cuda("the LL flags' period end")
  _skip_unless_knob_run(topology, nproc)
  f = jax.jit(jax.shard_map(
      lambda x: jax.lax.pcast(ops.all_reduce(x, "x", algorithm="one_shot", protocol="ll"), "x",
                              to="varying"),
      mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  mine = np.random.default_rng([7, rank]).standard_normal(4096).astype(np.float32)
  parts = [np.random.default_rng([7, r]).standard_normal(4096).astype(np.float32)
           for r in range(nproc)]
  want = np.sum(np.stack(parts).astype(np.float64), axis=0)
  x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), mine, (4096 * nproc,))
  _check_period_end_stops(f, (x,), want,
                          lambda out: np.asarray(out.addressable_data(0), np.float64),
                          "all_reduce", nproc, kv)


@pytest.mark.ends_process
def test_norm_period_end_stops_under_epoch_knob(runtime, topology, mesh, ops, rank, nproc, kv):
  """The fused norm at one row (under the knob its epochs advance at its start too)."""
  ops.require_cuda("the LL flags' period end")
  _skip_unless_knob_run(topology, nproc)
  import jaxoverlap

  f = jax.jit(jax.shard_map(
      lambda p, r, w: jaxoverlap.all_reduce_rms_norm(p, r, w, "x", backend="cuda",
                                                     algorithm="one_shot"),
      mesh=mesh, in_specs=(P("x"), P(), P()), out_specs=(P(), P())))
  hidden = 4096
  parts = [np.random.default_rng([8, r]).standard_normal((1, hidden)).astype(np.float32)
           for r in range(nproc)]
  res = np.random.default_rng(9).standard_normal((1, hidden)).astype(np.float32)
  weight = (1.0 + 0.1 * np.random.default_rng(10).standard_normal(hidden)).astype(np.float32)
  h = res.astype(np.float64) + np.sum(np.stack(parts).astype(np.float64), axis=0)
  y = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + 1e-6) * weight
  p = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), parts[rank],
                                             (nproc, hidden))
  rep = NamedSharding(mesh, P())  # no device_put: its cross-process check needs NCCL
  r = jax.make_array_from_process_local_data(rep, res, (1, hidden))
  w = jax.make_array_from_process_local_data(rep, weight, (hidden,))
  # Both outputs of the first call: h, and y from the one-cluster reduction.
  _check_period_end_stops(f, (p, r, w), np.concatenate([h, y]),
                          lambda out: np.concatenate(
                              [np.asarray(o.addressable_data(0), np.float64) for o in out]),
                          "all_reduce_rms_norm", nproc, kv)


@pytest.mark.ends_process
def test_finalize_then_initialize_runs_again(runtime, topology, mesh, ops, rank, nproc):
  """finalize(), then initialize() with another heap: an all-reduce jitted (and recorded into
  XLA's CUDA graphs) before runs again, right, with the new runtime; called between the two it
  raises that the runtime is not up. Trial 19: XLA replays a recorded graph without asking the
  op again, so the executable of before would have run on the freed heap."""
  ops.require_cuda("the runtime's finalize")
  import jaxoverlap
  from jaxoverlap import runtime as rt

  algorithm = "one_shot" if topology.num_nodes == 1 else "hierarchical"

  def body(x):  # three calls among elementwise work: enough commands for XLA's CUDA graphs
    total = sum(ops.all_reduce(x * scale, "x", algorithm=algorithm, protocol="ll")
                for scale in (1.0, 2.0, 3.0))
    return jax.lax.pcast(total / 6.0, "x", to="varying")

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  n = 4099

  def check(seed):
    xs = [np.random.default_rng([seed, r]).standard_normal(n).astype(np.float32)
          for r in range(nproc)]
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), xs[rank],
                                               (n * nproc,))
    got = np.asarray(f(x).addressable_shards[0].data)
    want = np.sum(np.asarray(xs, np.float64), axis=0)
    err = np.max(np.abs(got - want) / (np.abs(want) + 1.0))
    assert err <= 1e-5, f"call {seed}: max rel err {err:.3g} (got {got[:4]}, want {want[:4]})"

  for seed in range(3):  # XLA records its graph on the first calls and replays it
    check(seed)
  heap = rt.runtime_info()["heap_bytes"]
  jaxoverlap.finalize()
  assert not rt.is_initialized()
  with pytest.raises(Exception, match="initialize"):
    check(99)
  jaxoverlap.initialize(heap_bytes=heap // 2)
  assert rt.runtime_info()["heap_bytes"] == heap // 2
  for seed in range(3, 6):
    check(seed)
  jaxoverlap.finalize()

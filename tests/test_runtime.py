"""The runtime's start-up rules on CPU: bounded waits that name what did not arrive,
a second initialize() with other parameters, and SLURM's device placement.

The NVSHMEM start-up itself needs GPUs (tests/gpu); here its waits run against
a fake key-value store and a stuck function, and the parameter rules against a
runtime marked as started.
"""

import json
import math
import re
import threading
import time

import numpy as np
import pytest

from jaxoverlap import launch, runtime, tuning


class FakeStore:
  """The part of jax.distributed's key-value client the runtime uses."""

  def __init__(self, values=None):
    self.values = dict(values or {})

  def key_value_set(self, key, value):
    self.values[key] = value

  def blocking_key_value_get(self, key, timeout_ms):
    if key in self.values:
      return self.values[key]
    time.sleep(min(timeout_ms, 50) / 1000)
    raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")


def test_gather_names_the_ranks_that_did_not_arrive(monkeypatch):
  store = FakeStore({f"jaxoverlap/{runtime._generation}/host/0": "a",
                     f"jaxoverlap/{runtime._generation}/host/2": "a"})
  monkeypatch.setattr(runtime, "_kv_client", lambda: store)
  with pytest.raises(RuntimeError, match=r"jaxoverlap.initialize \(rank 0 of 4\): ranks \[1, 3\] "
                                         r"did not reach the start-up step 'host' within 0.1 s"):
    runtime._gather("host", "a", 0, 4, timeout_s=0.1)
  store.values[f"jaxoverlap/{runtime._generation}/host/1"] = "b"
  store.values[f"jaxoverlap/{runtime._generation}/host/3"] = "b"
  assert runtime._gather("host", "a", 0, 4, timeout_s=0.1) == ["a", "b", "a", "b"]


def test_exchange_names_rank_0(monkeypatch):
  monkeypatch.setattr(runtime, "_kv_client", lambda: FakeStore())
  with pytest.raises(RuntimeError, match=r"\(rank 1\): rank 0's 'k' did not arrive within 0.05 s"):
    runtime._exchange("k", None, 1, timeout_s=0.05)


def test_without_jax_distributed_several_processes_is_an_error(monkeypatch):
  monkeypatch.setattr(runtime, "_kv_client", lambda: None)
  with pytest.raises(RuntimeError, match="jax.distributed is not initialised"):
    runtime._gather("host", "a", 0, 2, timeout_s=1)


def test_run_bounded_names_the_stuck_step():
  release = threading.Event()
  with pytest.raises(RuntimeError, match=r"NVSHMEM's start-up did not finish within 0.2 s "
                                         r"\(stuck at: nvshmemi_init_thread\)"):
    runtime._run_bounded(lambda: release.wait(5), 0.2, "NVSHMEM's start-up",
                         lambda: "nvshmemi_init_thread")
  release.set()
  with pytest.raises(ValueError, match="boom"):
    runtime._run_bounded(lambda: (_ for _ in ()).throw(ValueError("boom")), 1, "x", str)
  runtime._run_bounded(lambda: None, 1, "x", str)


def test_start_up_errors_name_the_process_and_step():
  def fail():
    raise RuntimeError("cudaMalloc failed: out of memory")

  with pytest.raises(RuntimeError, match=re.escape(
      "jaxoverlap.initialize (process 0, GPUs [0, 1]): cudaMalloc failed: out of memory")):
    runtime._start_up(fail, 1, "process 0, GPUs [0, 1]", "the in-process runtime's start-up", str)
  release = threading.Event()
  with pytest.raises(RuntimeError, match=re.escape(
      "jaxoverlap.initialize (PE 1 of 2): NVSHMEM's start-up did not finish within 0.2 s "
      "(stuck at: bootstrap)")):
    runtime._start_up(lambda: release.wait(5), 0.2, "PE 1 of 2", "NVSHMEM's start-up",
                      lambda: "bootstrap")
  release.set()


# ---------------------------------------------------------------------------- parameters


def _refused(kw, match):
  """runtime._resolve with ``kw`` over all-None parameters raises ValueError matching ``match``."""
  args = dict(heap_bytes=None, overlap_heap_bytes=None, timeout_s=None, ranks_per_node=None,
              init_timeout_s=None)
  args.update(kw)
  with pytest.raises(ValueError, match=match):
    runtime._resolve(**args)


@pytest.mark.parametrize("kw,match", [
    (dict(timeout_s=-1), "timeout_s must be a positive number of seconds, got -1"),
    (dict(heap_bytes=0), "heap_bytes must be a positive int"),
    (dict(heap_bytes=1.5), "heap_bytes must be a positive int"),
    (dict(ranks_per_node=0), "ranks_per_node must be a positive int"),
    (dict(init_timeout_s=0), "init_timeout_s must be a positive number"),
])
def test_bad_parameters(kw, match):
  _refused(kw, match)


def test_parameters_from_the_environment(monkeypatch):
  monkeypatch.setenv("JAXOVERLAP_HEAP_BYTES", "512M")
  monkeypatch.setenv("JAXOVERLAP_TIMEOUT_S", "2.5")
  monkeypatch.setenv("JAXOVERLAP_RANKS_PER_NODE", "4")
  p = runtime._resolve(None, None, None, None, None)
  assert p == {"heap_bytes": 512 << 20, "overlap_heap_bytes": runtime.DEFAULT_OVERLAP_HEAP_BYTES,
               "timeout_s": 2.5, "ranks_per_node": 4,
               "init_timeout_s": runtime.DEFAULT_INIT_TIMEOUT_S}
  monkeypatch.setenv("JAXOVERLAP_RANKS_PER_NODE", "two")
  with pytest.raises(ValueError, match="JAXOVERLAP_RANKS_PER_NODE='two' is not a positive"):
    runtime._resolve(None, None, None, None, None)
  monkeypatch.setenv("JAXOVERLAP_RANKS_PER_NODE", "0")  # named its variable as the others do
  with pytest.raises(ValueError, match=re.escape(
      "ranks_per_node (JAXOVERLAP_RANKS_PER_NODE) must be a positive int, got 0")):
    runtime._resolve(None, None, None, None, None)


_PARAMETER_VARIABLES = ("JAXOVERLAP_HEAP_BYTES", "JAXOVERLAP_OVERLAP_HEAP_BYTES",
                        "JAXOVERLAP_TIMEOUT_S", "JAXOVERLAP_RANKS_PER_NODE",
                        "JAXOVERLAP_INIT_TIMEOUT_S")


@pytest.fixture
def started(monkeypatch):
  """The runtime as after initialize(): 1 GiB heap, 100 s timeout, 2 ranks per node."""
  for name in _PARAMETER_VARIABLES:
    monkeypatch.delenv(name, raising=False)
  params = runtime._resolve(1 << 30, None, 100.0, None, None)
  monkeypatch.setattr(runtime, "_initialized", True)
  monkeypatch.setattr(runtime, "_info", {"parameters": params, "ranks_per_node": 2, "pe": 0})
  monkeypatch.setattr(runtime, "runtime_info", lambda: {"initialized": True})


def test_second_initialize_with_other_parameters_raises(started):
  with pytest.raises(RuntimeError, match=r"already initialised with other parameters: "
                                         r"heap_bytes=536870912 \(active: 1073741824\)"):
    runtime.initialize(heap_bytes=512 << 20)
  with pytest.raises(RuntimeError, match=r"ranks_per_node=1 \(active: 2\)"):
    runtime.initialize(ranks_per_node=1)
  with pytest.raises(ValueError, match="timeout_s must be a positive number"):
    runtime.initialize(timeout_s=-1)  # checked even when already up


def test_second_initialize_with_the_same_or_no_parameters_returns_the_info(started):
  assert runtime.initialize() == {"initialized": True}
  assert runtime.DEFAULT_TIMEOUT_S == 100.0  # above the skew between processes (trial 29)
  assert runtime.initialize(heap_bytes=1 << 30, timeout_s=100, ranks_per_node=2) == {
      "initialized": True}


@pytest.mark.parametrize("kw,match", [
    (dict(timeout_s=math.inf), "timeout_s must be a finite number of seconds, got inf"),
    (dict(timeout_s=math.nan), "timeout_s must be a positive number of seconds, got nan"),
    (dict(init_timeout_s=math.inf), "init_timeout_s must be a finite number of seconds, got inf"),
    (dict(init_timeout_s=-math.inf), "init_timeout_s must be a positive number of seconds"),
    (dict(timeout_s=np.float64("inf")), "timeout_s must be a finite number of seconds"),
])
def test_non_finite_timeouts_are_refused(kw, match):
  """An unbounded wait is refused (inf overflowed the kernels' nanoseconds, nan never fired)."""
  args = dict(heap_bytes=None, overlap_heap_bytes=None, timeout_s=None, ranks_per_node=None,
              init_timeout_s=None)
  args.update(kw)
  with pytest.raises(ValueError, match=re.escape(match)):
    runtime._resolve(**args)


@pytest.mark.parametrize("name", ["JAXOVERLAP_TIMEOUT_S", "JAXOVERLAP_INIT_TIMEOUT_S"])
@pytest.mark.parametrize("text", ["inf", "nan", "-inf", "Infinity"])
def test_non_finite_timeouts_from_the_environment_are_refused(monkeypatch, name, text):
  monkeypatch.setenv(name, text)
  key = name.removeprefix("JAXOVERLAP_").lower()
  with pytest.raises(ValueError, match=rf"{key} \({name}\) must be a (positive|finite) number "
                                       "of seconds"):
    runtime._resolve(None, None, None, None, None)


def test_numpy_integers_are_taken_as_ints():
  p = runtime._resolve(np.int64(1 << 30), np.uint32(1 << 20), np.float32(2.5), np.int32(2),
                       np.float64(30.0))
  assert p == {"heap_bytes": 1 << 30, "overlap_heap_bytes": 1 << 20, "timeout_s": 2.5,
               "ranks_per_node": 2, "init_timeout_s": 30.0}
  for key in ("heap_bytes", "overlap_heap_bytes", "ranks_per_node"):
    assert type(p[key]) is int, key
  assert type(p["timeout_s"]) is float and type(p["init_timeout_s"]) is float
  for kw, match in ((dict(heap_bytes=True), "heap_bytes must be a positive int"),
                    (dict(heap_bytes=np.float64(1024)), "heap_bytes must be a positive int"),
                    (dict(overlap_heap_bytes=np.int8(-1)), "overlap_heap_bytes must be a"),
                    (dict(ranks_per_node=np.bool_(True)), "ranks_per_node must be a positive"),
                    (dict(ranks_per_node=True), "ranks_per_node must be a positive int"),
                    (dict(timeout_s=True), "timeout_s must be a positive number")):
    _refused(kw, match)


def test_the_runtime_is_named_as_either_kind(monkeypatch):
  """NVSHMEM or the in-process runtime (CUDA peer access): the texts name both."""
  from jaxoverlap import _ffi

  monkeypatch.setattr(runtime, "_platform", lambda: "gpu")
  monkeypatch.setattr(_ffi, "unavailable_reason", lambda: None)
  monkeypatch.setattr(runtime, "_initialized", False)
  reason = runtime.unavailable_reason()
  assert reason.startswith("jaxoverlap.initialize() has not been called in this process")
  assert "NVSHMEM or CUDA peer access in one process" in reason, reason
  for fn in (runtime.is_initialized, runtime.finalize, launch.initialize_from_env):
    doc = " ".join(fn.__doc__.split())
    assert "CUDA peer access in one process" in doc, fn.__name__


# ---------------------------------------------------------------------------- SLURM


@pytest.mark.parametrize("env,expected", [
    # srun --gpus-per-task=1: each task sees its own GPU, which JAX numbers 0.
    (dict(SLURM_NTASKS_PER_NODE="2", SLURM_LOCALID="1", CUDA_VISIBLE_DEVICES="1"), [0]),
    (dict(SLURM_TASKS_PER_NODE="4(x2)", SLURM_NODEID="1", SLURM_LOCALID="3",
          CUDA_VISIBLE_DEVICES="GPU-aa"), [0]),
    # Every task sees all the node's GPUs: the one at its local id.
    (dict(SLURM_NTASKS_PER_NODE="2", SLURM_LOCALID="1", CUDA_VISIBLE_DEVICES="0,1"), [1]),
    (dict(SLURM_NTASKS_PER_NODE="2", SLURM_LOCALID="1"), [1]),
    # One task per node drives all its GPUs, named (JAX would take only SLURM_LOCALID's).
    (dict(SLURM_NTASKS_PER_NODE="1", SLURM_LOCALID="0", CUDA_VISIBLE_DEVICES="0,1"), [0, 1]),
    (dict(SLURM_NTASKS_PER_NODE="1", SLURM_LOCALID="0", CUDA_VISIBLE_DEVICES="3,1,2"),
     [0, 1, 2]),
], ids=["one-gpu-per-task", "one-gpu-per-task-uneven-list", "all-visible", "unset",
        "task-per-node", "task-per-node-three"])
def test_slurm_local_devices(env, expected):
  assert launch.slurm_local_devices(env) == expected


def test_slurm_one_task_per_node_counts_the_gpus_it_sees(monkeypatch):
  """Without CUDA_VISIBLE_DEVICES the driver says how many GPUs the task sees."""
  env = dict(SLURM_TASKS_PER_NODE="1(x2)", SLURM_NODEID="1", SLURM_LOCALID="0")
  assert launch.slurm_local_devices(env, visible_gpus=4) == [0, 1, 2, 3]
  monkeypatch.setattr(launch, "_driver_gpu_count", lambda: 8)
  assert launch.slurm_local_devices(env) == list(range(8))
  monkeypatch.setattr(launch, "_driver_gpu_count", lambda: None)  # no driver: JAX's default
  assert launch.slurm_local_devices(env) is None


def test_slurm_placement_that_names_no_visible_gpu():
  env = dict(SLURM_NTASKS_PER_NODE="4", SLURM_LOCALID="3", CUDA_VISIBLE_DEVICES="0,1")
  with pytest.raises(RuntimeError, match=r"SLURM task 3 of 4 on this node sees 2 GPUs "
                                         r"\(CUDA_VISIBLE_DEVICES='0,1'\), so it cannot take GPU 3"):
    launch.slurm_local_devices(env)


class _FakeExtension:
  def __init__(self):
    self.finalized = 0
    self.sync_error = None  # what synchronize() and finalize() raise, if anything

  def device_error(self):
    return None

  def synchronize(self):
    if self.sync_error:
      raise RuntimeError(self.sync_error)

  def finalize(self):
    self.finalized += 1
    if self.sync_error:
      raise RuntimeError(self.sync_error + "; NVSHMEM's collective shutdown is skipped")


class _FakeCoordinator(FakeStore):
  """A key-value store with the coordination service's barrier, which passes or fails."""

  def __init__(self, passes: bool):
    super().__init__()
    self.passes, self.barriers = passes, []

  def wait_at_barrier(self, barrier_id, timeout_in_ms, process_ids=None):
    self.barriers.append((barrier_id, timeout_in_ms))
    if not self.passes:
      raise RuntimeError(f"DEADLINE_EXCEEDED: Barrier timed out. Id: {barrier_id}")


def _up_with_nvshmem(monkeypatch, client, pe=0, num_pes=2):
  from jaxoverlap import _ffi, names

  ext = _FakeExtension()
  monkeypatch.setattr(_ffi, "load", lambda: ext)
  monkeypatch.setattr(runtime, "_kv_client", lambda: client)
  params = runtime._resolve(1 << 30, None, 10.0, None, 0.2)
  monkeypatch.setattr(runtime, "_initialized", True)
  monkeypatch.setattr(runtime, "_info", {"parameters": params, "transport": names.NVSHMEM,
                                         "pe": pe, "num_pes": num_pes})
  return ext


def test_finalize_skips_nvshmem_when_not_every_process_arrives(monkeypatch, caplog):
  """Issue: a peer killed (e.g. for memory) left every other process hanging at exit."""
  client = _FakeCoordinator(passes=False)
  ext = _up_with_nvshmem(monkeypatch, client)
  with caplog.at_level("WARNING", logger=runtime.logger.name):
    runtime.finalize()
  assert ext.finalized == 0 and not runtime.is_initialized()
  assert client.barriers == [(f"jaxoverlap/{runtime._generation}/finalize",
                              int(runtime.FINALIZE_WAIT_S * 1000))]
  assert "skipping the runtime's finalize" in caplog.text, caplog.text
  assert "not every process reached it within 30 s" in caplog.text, caplog.text


def test_finalize_runs_nvshmem_when_every_process_arrives(monkeypatch):
  client = _FakeCoordinator(passes=True)
  ext = _up_with_nvshmem(monkeypatch, client)
  runtime.finalize()
  assert ext.finalized == 1 and not runtime.is_initialized() and len(client.barriers) == 1


def test_finalize_after_a_gpu_failed_keeps_every_process_out_of_nvshmem(monkeypatch, caplog):
  """Trial 50: a context lost by a fault outside jaxoverlap (no device error of ours) still
  took this process to the finalize barrier, and the others into NVSHMEM's shutdown barrier,
  which this process never joined. It now stays away, so the barrier fails for all."""
  client = _FakeCoordinator(passes=True)
  ext = _up_with_nvshmem(monkeypatch, client)
  ext.sync_error = ("cudaDeviceSynchronize (GPU 0, before finalize) failed: "
                    "cudaErrorIllegalAddress")
  with caplog.at_level("WARNING", logger=runtime.logger.name):
    with pytest.raises(RuntimeError, match="cudaErrorIllegalAddress; NVSHMEM's collective"):
      runtime.finalize()
  assert client.barriers == [] and ext.finalized == 1 and not runtime.is_initialized()
  assert "no process runs NVSHMEM's collective shutdown" in caplog.text, caplog.text


def test_finalize_without_jax_distributed_runs_nvshmem(monkeypatch):
  ext = _up_with_nvshmem(monkeypatch, None)  # jax.distributed shut down first: cannot check
  runtime.finalize()
  assert ext.finalized == 1


# ---------------------------------------------------------------------------- on a fake GPU


class _StrictStore(_FakeCoordinator):
  """jax.distributed's store: a key, once set, cannot be set again; every barrier passes.

  The other processes' settings (``runtime._check_same_on_every_process``) mirror
  this process's, each changed by ``peer_settings[rank]`` where given; their
  unreachable peers (``runtime._unreachable_pairs``) are ``peer_unreachable[rank]``
  (default none).
  """

  def __init__(self, peer_settings=None, peer_unreachable=None):
    super().__init__(passes=True)
    self.peer_settings = peer_settings or {}
    self.peer_unreachable = peer_unreachable or {}

  def key_value_set(self, key, value):
    if key in self.values:
      raise RuntimeError(f"ALREADY_EXISTS: {key}")
    super().key_value_set(key, value)

  def blocking_key_value_get(self, key, timeout_ms):
    prefix, _, rank = key.rpartition("/")
    if prefix.endswith("/settings") and key not in self.values:
      mine = [v for k, v in self.values.items() if k.startswith(prefix + "/")]
      if mine:
        return json.dumps({**json.loads(mine[0]), **self.peer_settings.get(int(rank), {})})
    if prefix.endswith("/unreachable") and key not in self.values:
      return json.dumps(self.peer_unreachable.get(int(rank), []))
    return super().blocking_key_value_get(key, timeout_ms)


class _FakeGPU:
  platform, id, process_index, local_hardware_id, device_kind = "gpu", 0, 0, 0, "FAKE_GPU"

  def __str__(self):
    return "cuda:0"


class _FakeRuntimeExtension(_FakeExtension):
  """What initialize() and runtime_info() call of the extension; records the start-ups."""

  def __init__(self):
    super().__init__()
    self.started = []
    self.unreachable_local_pes = []

  def get_unique_id(self):
    return b"uid"

  def initialize(self, *args):
    self.started.append(args)

  def init_stage(self):
    return "fake"

  def info(self):
    return dict(slot_bytes=1, ll_slot_bytes=1, lamport_slot_bytes=0, lamport_blocks_per_sm=2,
                overlap_slot_bytes=1, force_nvshmem_put=0, hierarchical_ll_kernel="v4",
                epochs_at_start=False, norm_blocks_per_row=0,
                unreachable_local_pes=list(self.unreachable_local_pes))

  def limits(self):
    return {"max_group_size": 8}


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
  """initialize()'s NVSHMEM path on a fake GPU, extension and key-value store.

  Returns ``start(rank, hosts)`` -> ``(ext, store)``: this process is ``rank``
  of ``len(hosts)`` (one GPU each), its peers' hosts already in the store for
  the next few start-up attempts. The runtime's state is restored afterwards.
  """
  import jax

  from jaxoverlap import _ffi

  for name in ("_initialized", "_generation", "_info", "_facts", "_pe_by_device_id", "_tuning",
               "_ranks_per_node_from_hosts"):
    monkeypatch.setattr(runtime, name, getattr(runtime, name, None), raising=False)
  for name in _PARAMETER_VARIABLES:
    monkeypatch.delenv(name, raising=False)
  for name in ("NVSHMEM_DISABLE_NVLS", "NVSHMEM_SYMMETRIC_SIZE",
               "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"):  # initialize() sets them by default
    monkeypatch.setenv(name, "test")
  monkeypatch.setenv("JAXOVERLAP_TUNING_FILE", str(tmp_path / "no-table.json"))
  monkeypatch.setattr(runtime.atexit, "register", lambda fn: fn)

  def start(rank, hosts, store=None):
    ext = _FakeRuntimeExtension()
    store = store if store is not None else _StrictStore()
    for generation in range(runtime._generation, runtime._generation + 4):
      for r, host in enumerate(hosts):
        if r != rank:
          store.values[f"jaxoverlap/{generation}/host/{r}"] = host
    monkeypatch.setattr(_ffi, "load", lambda: ext)
    monkeypatch.setattr(_ffi, "unavailable_reason", lambda: None)
    monkeypatch.setattr(runtime, "_platform", lambda: "gpu")
    monkeypatch.setattr(runtime, "_kv_client", lambda: store)
    monkeypatch.setattr(runtime.socket, "gethostname", lambda: hosts[rank])
    monkeypatch.setattr(jax, "local_devices", lambda: [_FakeGPU()])
    monkeypatch.setattr(jax, "process_index", lambda: rank)
    monkeypatch.setattr(jax, "process_count", lambda: len(hosts))
    return ext, store

  return start


@pytest.mark.parametrize("rpn,hosts", [(2, "a,b,a,b"), (1, "a,a,a,b"), (4, "a,a,b,b")],
                         ids=["round-robin", "uneven", "one-domain"])
def test_ranks_per_node_set_replaces_the_host_check(fake_gpu, monkeypatch, rpn, hosts):
  """Issue: the messages said to set JAXOVERLAP_RANKS_PER_NODE, and the check raised anyway."""
  ext, _ = fake_gpu(0, hosts.split(","))
  monkeypatch.setenv("JAXOVERLAP_RANKS_PER_NODE", str(rpn))
  info = runtime.initialize()
  assert (info["ranks_per_node"], info["num_nodes"]) == (rpn, 4 // rpn)
  assert ext.started[0][-1] == rpn  # the kernels' node = rank // ranks_per_node
  assert runtime.facts().ranks_per_node == rpn


def test_ranks_per_node_as_argument_replaces_the_host_check(fake_gpu):
  ext, _ = fake_gpu(0, ["a", "b", "a", "b"])
  assert runtime.initialize(ranks_per_node=1)["num_nodes"] == 4 and ext.started


@pytest.mark.parametrize("hosts,match", [
    ("a,b,a,b", r"process ranks are not grouped by node .*or set JAXOVERLAP_RANKS_PER_NODE=1 "
                r"for ranks placed round robin"),
    ("a,a,a,b", r"nodes hold different numbers of processes \{'a': 3, 'b': 1\}; set "
                r"JAXOVERLAP_RANKS_PER_NODE"),
])
def test_hosts_are_checked_without_ranks_per_node(fake_gpu, hosts, match):
  ext, _ = fake_gpu(0, hosts.split(","))
  with pytest.raises(RuntimeError, match=match):
    runtime.initialize()
  assert not ext.started and not runtime.is_initialized()


def test_ranks_per_node_set_must_divide_the_processes(fake_gpu):
  ext, _ = fake_gpu(0, ["a", "a", "a", "a"])
  with pytest.raises(ValueError, match="ranks_per_node=3 must divide the number of processes 4"):
    runtime.initialize(ranks_per_node=3)
  assert not ext.started


def _table_file(tmp_path, table, name="table.json"):
  path = tmp_path / name
  path.write_text(table if isinstance(table, str) else json.dumps(table))
  return str(path)


def _shipped_table():
  import jaxoverlap

  with open(f"{jaxoverlap.__path__[0]}/tuning_tables/all_reduce-NVIDIA_H200.json") as f:
    return json.load(f)


@pytest.mark.parametrize("table,match", [
    ({"not": "a table"}, "missing field 'benchmark'"),
    ("{", "is not valid JSON"),
    (dict(_shipped_table(), benchmark="decode"), "a results file of benchmark 'decode'"),
    (dict(_shipped_table(), records=[r for r in _shipped_table()["records"]
                                     if r["impl"] == "xla:psum"]),
     "no record times a CUDA all-reduce kernel"),
], ids=["not-a-table", "not-json", "another-benchmark", "psum-only"])
def test_a_bad_tuning_table_fails_before_anything_starts(fake_gpu, monkeypatch, tmp_path, table,
                                                         match):
  """Issue: the table was read after NVSHMEM started; the retry met 'already initialised'."""
  ext, _ = fake_gpu(0, ["a", "a"])
  monkeypatch.setenv("JAXOVERLAP_TUNING_FILE", _table_file(tmp_path, table))
  with pytest.raises(ValueError, match=match):
    runtime.initialize()
  assert not ext.started and not runtime.is_initialized()
  runtime.finalize()  # a no-op: nothing was started
  assert ext.finalized == 0
  # Fixed, the retry starts once (with new keys: the store refuses to set a key twice).
  good = _table_file(tmp_path, _shipped_table(), "good.json")
  monkeypatch.setenv("JAXOVERLAP_TUNING_FILE", good)
  runtime.initialize()
  assert len(ext.started) == 1 and runtime.is_initialized()
  assert runtime.tuning_table() == (good, _shipped_table())
  runtime.finalize()
  assert ext.finalized == 1 and not runtime.is_initialized()


def test_a_bad_tuning_table_fails_before_the_in_process_runtime_starts(fake_gpu, monkeypatch,
                                                                       tmp_path):
  import jax

  ext, _ = fake_gpu(0, ["a"])
  gpus = [_FakeGPU(), _FakeGPU()]
  gpus[1].id = gpus[1].local_hardware_id = 1
  monkeypatch.setattr(jax, "local_devices", lambda: gpus)
  monkeypatch.setattr(jax, "devices", lambda: gpus)
  ext.initialize_peer = lambda *args: ext.started.append(args)
  monkeypatch.setenv("JAXOVERLAP_TUNING_FILE", _table_file(tmp_path, {"not": "a table"}))
  with pytest.raises(ValueError, match="missing field 'benchmark'"):
    runtime.initialize()
  assert not ext.started and not runtime.is_initialized()
  monkeypatch.setenv("JAXOVERLAP_TUNING_FILE", _table_file(tmp_path, _shipped_table(), "ok.json"))
  assert runtime.initialize()["transport"] == "peer" and len(ext.started) == 1
  assert runtime.pe_of_device(gpus[1]) == 1


def test_every_rank_refuses_rank_0s_bad_table_before_starting(fake_gpu):
  """Rank 0's table reaches the others through the store; they check it before starting."""
  import base64

  ext, store = fake_gpu(1, ["a", "a"])
  gen = runtime._generation
  store.values[f"jaxoverlap/{gen}/nvshmem_uid"] = base64.b64encode(b"uid").decode()
  store.values[f"jaxoverlap/{gen}/tuning"] = base64.b64encode(
      b"/rank0/table.json\n" + json.dumps({"benchmark": "all_reduce"}).encode()).decode()
  with pytest.raises(ValueError, match=r"tuning table /rank0/table.json: missing field 'machine'"):
    runtime.initialize()
  assert not ext.started and not runtime.is_initialized()


def test_rank_0_shares_its_table_before_starting(fake_gpu, monkeypatch, tmp_path):
  import base64

  ext, store = fake_gpu(0, ["a", "a"])
  path = _table_file(tmp_path, {"not": "a table"})
  monkeypatch.setenv("JAXOVERLAP_TUNING_FILE", path)
  with pytest.raises(ValueError, match="missing field 'benchmark'"):
    runtime.initialize()
  # Shared although bad, so that rank 1 raises the same error instead of waiting.
  shared = base64.b64decode(store.values[f"jaxoverlap/{runtime._generation - 1}/tuning"])
  assert shared == path.encode() + b"\n" + b'{"not": "a table"}'
  assert not ext.started


def test_the_tuning_table_wait_is_init_timeout_s(fake_gpu):
  """Issue: rank 0's table was awaited 120 s whatever JAXOVERLAP_INIT_TIMEOUT_S said."""
  import base64

  ext, store = fake_gpu(1, ["a", "a"])
  store.values[f"jaxoverlap/{runtime._generation}/nvshmem_uid"] = base64.b64encode(b"u").decode()
  t0 = time.monotonic()
  with pytest.raises(RuntimeError, match=re.escape(
      f"rank 0's 'jaxoverlap/{runtime._generation}/tuning' did not arrive within 0.2 s "
      "(init_timeout_s, JAXOVERLAP_INIT_TIMEOUT_S)")):
    runtime.initialize(init_timeout_s=0.2)
  assert time.monotonic() - t0 < 5 and not ext.started


def test_without_a_gpu_the_message_says_so_not_the_build(monkeypatch):
  """Issue: on a CPU, initialize() said to rebuild the extension with nvcc."""
  import jax

  from jaxoverlap import _ffi

  def not_built():
    raise RuntimeError("the CUDA extension jaxoverlap._jaxoverlap_cuda is not built; reinstall "
                       "with nvcc on PATH")

  monkeypatch.setattr(runtime, "_initialized", False)
  monkeypatch.setattr(runtime, "_generation", runtime._generation)
  monkeypatch.setattr(_ffi, "load", not_built)
  cpus = jax.devices("cpu")[:1]
  monkeypatch.setattr(jax, "local_devices", lambda: cpus)
  with pytest.raises(RuntimeError, match=re.escape(
      f"the CUDA backend needs NVIDIA GPUs; this process sees {[str(d) for d in cpus]}")):
    runtime.initialize()


def test_a_second_initialize_compares_the_environment_too(fake_gpu, monkeypatch):
  """Issue: a changed JAXOVERLAP_HEAP_BYTES on the second call was silently dropped."""
  ext, _ = fake_gpu(0, ["a"])
  monkeypatch.setenv("JAXOVERLAP_HEAP_BYTES", "512M")
  assert runtime.initialize()["heap_bytes"] == 512 << 20
  monkeypatch.setenv("JAXOVERLAP_HEAP_BYTES", "2G")
  with pytest.raises(RuntimeError, match=re.escape(
      "already initialised with other parameters: heap_bytes=2147483648 (from "
      "JAXOVERLAP_HEAP_BYTES='2G') (active: 536870912)")):
    runtime.initialize()
  monkeypatch.setenv("JAXOVERLAP_HEAP_BYTES", "512M")
  assert runtime.initialize(init_timeout_s=5.0)["heap_bytes"] == 512 << 20  # not compared
  assert runtime.initialize(heap_bytes=512 << 20)["heap_bytes"] == 512 << 20
  monkeypatch.delenv("JAXOVERLAP_HEAP_BYTES")
  with pytest.raises(RuntimeError, match=re.escape(
      "heap_bytes=1073741824 (the default) (active: 536870912)")):
    runtime.initialize()
  assert len(ext.started) == 1


@pytest.mark.parametrize("var,text,match", [
    ("JAXOVERLAP_OVERLAP_HEAP_BYTES", "1G",
     "overlap_heap_bytes=1073741824 (from JAXOVERLAP_OVERLAP_HEAP_BYTES='1G') (active: "
     "2147483648)"),
    ("JAXOVERLAP_TIMEOUT_S", "20",
     "timeout_s=20.0 (from JAXOVERLAP_TIMEOUT_S='20') (active: 100.0)"),
    ("JAXOVERLAP_RANKS_PER_NODE", "1",
     "ranks_per_node=1 (from JAXOVERLAP_RANKS_PER_NODE='1') (active: 2)"),
])
def test_a_second_initialize_compares_each_variable(started, monkeypatch, var, text, match):
  monkeypatch.setenv(var, text)
  with pytest.raises(RuntimeError, match=re.escape(match)):
    runtime.initialize()
  monkeypatch.setenv("JAXOVERLAP_INIT_TIMEOUT_S", "5")  # bounds one call's waits: not compared
  monkeypatch.delenv(var)
  assert runtime.initialize() == {"initialized": True}


def test_a_second_initialize_without_the_first_calls_ranks_per_node(fake_gpu):
  """Set at the first call, unset at the second: the hosts' value is compared."""
  fake_gpu(0, ["a", "a", "b", "b"])
  runtime.initialize(ranks_per_node=1)
  with pytest.raises(RuntimeError, match=re.escape(
      "ranks_per_node=2 (from the hosts) (active: 1)")):
    runtime.initialize()
  assert runtime.initialize(ranks_per_node=1)["ranks_per_node"] == 1


@pytest.mark.parametrize("peer,what", [
    ({"heap_bytes": 2 << 30},
     r"heap_bytes: 1073741824 on ranks \[0, 2, 3\]; 2147483648 on ranks \[1\]"),
    ({"ranks_per_node": 2}, r"ranks_per_node: 4 on ranks \[0, 2, 3\]; 2 on ranks \[1\]"),
    ({"JAXOVERLAP_HIERARCHICAL_LL": "v3"},
     r"JAXOVERLAP_HIERARCHICAL_LL: None on ranks \[0, 2, 3\]; 'v3' on ranks \[1\]"),
    # A cost-model override steers auto: ranks that chose differently would hang.
    ({"JAXOVERLAP_NET_ALPHA_US": "9"},
     r"JAXOVERLAP_NET_ALPHA_US: None on ranks \[0, 2, 3\]; '9' on ranks \[1\]"),
    ({"JAXOVERLAP_LAMPORT_BLOCK_BYTES": "8192"},
     r"JAXOVERLAP_LAMPORT_BLOCK_BYTES: None on ranks \[0, 2, 3\]; '8192' on ranks \[1\]"),
], ids=["heap", "ranks-per-node", "knob", "cost-model", "lamport-grid"])
def test_settings_that_differ_between_processes_are_refused(fake_gpu, peer, what):
  """Trial 19: another heap size on one process put its payloads into a peer's accumulator."""
  ext, _ = fake_gpu(0, ["a"] * 4, store=_StrictStore(peer_settings={1: peer}))
  with pytest.raises(RuntimeError, match=r"the processes resolved different settings.*" + what):
    runtime.initialize()
  assert not ext.started and not runtime.is_initialized()


def test_unreachable_pairs_are_gathered_from_every_process(fake_gpu):
  """Without peer access between two GPUs of a node, the kernels failed when they ran, even
  under backend="auto". Each process reports the peers of its node it cannot reach; every
  process gets them all (so every rank of a group plans alike)."""
  ext, store = fake_gpu(0, ["a"] * 4, store=_StrictStore(peer_unreachable={2: [1, 3], 3: [0]}))
  ext.unreachable_local_pes = [3]
  runtime.initialize()
  want = ((0, 3), (2, 1), (2, 3), (3, 0))
  assert runtime.facts().unreachable_pairs == want
  assert runtime.runtime_info()["unreachable_pairs"] == want
  assert store.values[f"jaxoverlap/{runtime._generation - 1}/unreachable/0"] == "[3]"


def test_a_failed_gather_of_unreachable_pairs_leaves_nvshmem_to_the_exit(fake_gpu, monkeypatch):
  """A rank that never arrives: no native shutdown (a barrier it would never join), no hang."""
  ext, _ = fake_gpu(0, ["a"] * 2)
  real = runtime._gather

  def gather(what, *args):
    if what == "unreachable":
      raise RuntimeError("jaxoverlap.initialize (rank 0 of 2): ranks [1] did not reach ...")
    return real(what, *args)

  monkeypatch.setattr(runtime, "_gather", gather)
  with pytest.raises(RuntimeError, match=r"ranks \[1\] did not reach .*NVSHMEM started on this "
                     r"process and is left to its exit"):
    runtime.initialize()
  assert ext.started and ext.finalized == 0 and not runtime.is_initialized()


def test_the_unreachable_pairs_step_ends_with_a_barrier_every_rank_passes_or_fails(fake_gpu):
  """Trial 49: a rank whose gather timed out as the last value arrived failed while the others
  came up. The step now ends with the coordination service's barrier, which fails for all."""
  store = _StrictStore()
  ext, _ = fake_gpu(0, ["a"] * 2, store=store)
  runtime.initialize()
  assert (f"jaxoverlap/{runtime._generation - 1}/unreachable/done",
          int(runtime.DEFAULT_INIT_TIMEOUT_S * 1000)) in store.barriers

  store = _StrictStore()
  store.passes = False
  runtime.finalize()
  ext, _ = fake_gpu(0, ["a"] * 2, store=store)
  with pytest.raises(RuntimeError, match=r"rank 0 of 2\): not every process finished the start-up "
                     r"step 'unreachable' within .*DEADLINE_EXCEEDED: Barrier timed out.*"
                     r"NVSHMEM started on this process and is left to its exit"):
    runtime.initialize()
  assert ext.started and ext.finalized == 0 and not runtime.is_initialized()


def test_settings_compared_are_the_resolved_ones(fake_gpu, monkeypatch):
  ext, store = fake_gpu(0, ["a", "a"])
  monkeypatch.setenv("JAXOVERLAP_EPOCH_AT_START", "1")
  runtime.initialize(heap_bytes=512 << 20)
  mine = json.loads(store.values[f"jaxoverlap/{runtime._generation - 1}/settings/0"])
  unset = {k: None for k in ("JAXOVERLAP_HIERARCHICAL_LL", "JAXOVERLAP_NORM_CLUSTER",
                              "JAXOVERLAP_TEST_PAIR_EPOCH", "JAXOVERLAP_TEST_LL_STALE",
                              "JAXOVERLAP_LAMPORT_BLOCKS_PER_SM",
                              "JAXOVERLAP_LAMPORT_BLOCK_BYTES", "JAXOVERLAP_LAMPORT_MAX_BLOCKS",
                              "JAXOVERLAP_LAMPORT_POLL_NS")}
  unset.update({f"JAXOVERLAP_{k.upper()}": None for k in tuning.PARAM_KEYS})
  assert mine == {"heap_bytes": 512 << 20, "overlap_heap_bytes": runtime.DEFAULT_OVERLAP_HEAP_BYTES,
                  "ranks_per_node": 2, **unset, "JAXOVERLAP_EPOCH_AT_START": "1"}
  assert ext.started


@pytest.mark.parametrize("kwargs,match", [
    ({"heap_bytes": (1 << 30) + 4}, r"heap_bytes must be a multiple of 256 bytes, got 1073741828 "
                                    r"\(e.g. 1073742080\)"),
    ({"overlap_heap_bytes": 1000}, "overlap_heap_bytes must be a multiple of 256 bytes"),
    ({"timeout_s": 1e-10}, r"timeout_s must be from 0.001 to 1e\+09 seconds, got 1e-10"),
    ({"timeout_s": 1e12}, r"timeout_s must be from 0.001 to 1e\+09 seconds"),
], ids=["heap-not-aligned", "overlap-not-aligned", "timeout-too-small", "timeout-too-large"])
def test_sizes_and_timeouts_out_of_range_are_refused(kwargs, match):
  """Trial 19: an unaligned heap misaligned the fused ops' 64-bit flags; a timeout of 0 ns
  trapped every wait, one past 2^64 ns failed in the binding."""
  with pytest.raises(ValueError, match=match):
    runtime._resolve(kwargs.get("heap_bytes"), kwargs.get("overlap_heap_bytes"),
                     kwargs.get("timeout_s"), None, None)


@pytest.mark.parametrize("var,value,match", [
    ("JAXOVERLAP_HEAP_BYTES", "1000000001",
     r"heap_bytes \(JAXOVERLAP_HEAP_BYTES\) must be a multiple of 256 bytes"),
    ("JAXOVERLAP_TIMEOUT_S", "1e-10", r"timeout_s \(JAXOVERLAP_TIMEOUT_S\) must be from 0.001"),
    ("JAXOVERLAP_INIT_TIMEOUT_S", "1e10",
     r"init_timeout_s \(JAXOVERLAP_INIT_TIMEOUT_S\) must be at most 1e\+09 seconds"),
])
def test_a_refused_value_names_the_variable_it_came_from(monkeypatch, var, value, match):
  """Trial 22: the messages named the parameter, not the variable that set it; and an
  init_timeout_s past threading's limit overflowed after the native start-up had run."""
  for name in _PARAMETER_VARIABLES:
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv(var, value)
  with pytest.raises(ValueError, match=match):
    runtime._resolve(None, None, None, None, None)


@pytest.mark.parametrize("var,value,expected", [
    ("JAXOVERLAP_LAMPORT_BLOCKS_PER_SM", "3", "1, 2 or 4"),
    ("JAXOVERLAP_LAMPORT_BLOCK_BYTES", "8", "at least 16"),
    ("JAXOVERLAP_LAMPORT_MAX_BLOCKS", "-1", "a non-negative integer"),
    ("JAXOVERLAP_LAMPORT_POLL_NS", str(2**32), "from 0 to 2\\*\\*32 - 1"),
    ("JAXOVERLAP_NORM_CLUSTER", "16", "from 0 to 8"),
    ("JAXOVERLAP_NORM_CLUSTER", "four", "from 0 to 8"),
])
def test_measurement_knobs_out_of_range_are_refused(monkeypatch, var, value, expected):
  """Trial 50: the kernels changed such values silently (3 blocks an SM ran as 2, a cluster
  of 16 as 8, -1 maximum blocks as 2**64 - 1), under a label that named the value set."""
  for name in _PARAMETER_VARIABLES:
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv(var, value)
  with pytest.raises(ValueError, match=rf"{var}=.{value}.: expected .*{expected}"):
    runtime._resolve(None, None, None, None, None)
  monkeypatch.setenv(var, "4" if var != "JAXOVERLAP_LAMPORT_BLOCK_BYTES" else "4096")
  runtime._resolve(None, None, None, None, None)  # an accepted value


def test_finalize_clears_the_compilation_caches(fake_gpu, monkeypatch):
  """Trial 19: XLA replays a recorded CUDA graph without asking the op again, so an executable
  compiled before finalize() would run on the freed heap: finalize() makes jit compile anew."""
  import jax

  ext, _ = fake_gpu(0, ["a"])
  runtime.initialize()
  traces = []
  f = jax.jit(lambda x: traces.append(1) or x + 1)
  f(1.0)
  f(2.0)
  assert len(traces) == 1
  runtime.finalize()
  assert ext.finalized == 1 and not runtime.is_initialized()
  f(3.0)
  assert len(traces) == 2, "finalize() left the executable compiled with the old runtime"
  runtime.initialize()
  runtime._finalize_at_exit()  # at exit: nothing runs again, the caches stay
  f(4.0)
  assert len(traces) == 2 and ext.finalized == 2


@pytest.mark.parametrize("hosts,num_nodes,emulated", [
    (["a", "a"], 1, False),                       # one node: nothing to emulate
    (["a", "a"], 2, True),                        # JAXOVERLAP_RANKS_PER_NODE=1 on one host
    (["a", "b"], 2, False),                       # a process per node, on their own hosts
    (["a", "a", "b", "b"], 2, False),             # two GPUs per node
    (["a", "a", "a", "a"], 2, True),              # 2 x 2 emulated on one host
    (["a", "b", "c", "d"], 2, False),             # nodes of two hosts (one NVLink domain)
    (["a", "b", "a", "b"], 2, True),              # nodes 0 and 1 both start on host a
    (["a"], 2, True),                             # one process driving both "nodes"
])
def test_nodes_are_emulated(hosts, num_nodes, emulated):
  """Nodes sharing a host run the inter-node steps over NVLink; the policy keeps their timings
  from real nodes (tuning.Policy.choose)."""
  assert runtime.nodes_are_emulated(hosts, num_nodes) is emulated


def test_stale_ll_cells_need_the_pair_epoch_knob(fake_gpu, monkeypatch):
  """Trial 29 C4: JAXOVERLAP_TEST_LL_STALE=1 alone made the first calls read the stale cells
  (flags 0 and 1, NaN data) as their data: NaN results, no error."""
  ext, _ = fake_gpu(0, ["a", "a"])
  monkeypatch.setenv("JAXOVERLAP_TEST_LL_STALE", "1")
  with pytest.raises(ValueError, match="JAXOVERLAP_TEST_LL_STALE=1 needs "
                                       "JAXOVERLAP_TEST_PAIR_EPOCH.*got None"):
    runtime.initialize()
  # Trial 32: a count of 0 (or 2**32 - 2, 2**32 - 1) reaches flag 1 (or 0) before a re-stamp.
  for start in (0, 2**32 - 2, 2**32 - 1, 2**33):
    monkeypatch.setenv("JAXOVERLAP_TEST_PAIR_EPOCH", str(start))
    with pytest.raises(ValueError, match=f"got '{start}'"):
      runtime.initialize()
  assert not ext.started
  monkeypatch.setenv("JAXOVERLAP_TEST_PAIR_EPOCH", str(2**32 - 3))
  runtime.initialize()
  assert ext.started

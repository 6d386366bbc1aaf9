"""GPU checks that failures are clear errors, never hangs (2 processes).

  python -m jaxoverlap.launch --nproc 2 tests/multiprocess/check_errors.py heap
  python -m jaxoverlap.launch --nproc 2 tests/multiprocess/check_errors.py timeout

heap:    a symmetric heap too small for the PEs is refused with a message that
         names the sizes, before NVSHMEM starts (no process hangs).
timeout: rank 1 never joins the all-reduce; rank 0's device wait gives up
         after JAXOVERLAP_TIMEOUT_S=2 and the recorded error names rank 0,
         peer PE 1 and the step. The GPU context is lost after the trap, so the
         process ends with os._exit.
Prints "1 passed, 0 failed" per rank on success.
"""

from __future__ import annotations

import os
import sys
import time


def main(argv) -> int:
  mode = argv[1]
  from jaxoverlap import launch, runtime

  if mode == "heap":
    launch.initialize_from_env(nvshmem=False)
    try:
      runtime.initialize(heap_bytes=1 << 20)
    except RuntimeError as e:
      ok = "too small" in str(e) and "bytes" in str(e)
      print(f"heap error: {e}\n{int(ok)} passed, {int(not ok)} failed", flush=True)
      return 0 if ok else 1
    print("0 passed, 1 failed (no error for a 1 MiB heap)", flush=True)
    return 1

  os.environ["JAXOVERLAP_TIMEOUT_S"] = "2"
  info = launch.initialize_from_env(nvshmem=True)
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxoverlap

  rank, nproc = info["process_id"], info["num_processes"]
  mesh = jax.make_mesh((nproc,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  f = jax.jit(jax.shard_map(
      lambda x: jax.lax.pcast(jaxoverlap.all_reduce(x, "x", backend="cuda", algorithm="one_shot_ll"),
                                 "x", to="varying"),
      mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")),
                                             np.ones(1024, np.float32), (1024 * nproc,))
  if rank != 0:
    time.sleep(6)  # longer than rank 0's 2 s device timeout
    print("rank 1: stayed away; 1 passed, 0 failed", flush=True)
    jax.distributed.shutdown()  # a barrier with rank 0, so neither sees the other vanish
    os._exit(0)
  t0 = time.time()
  try:
    f(x).block_until_ready()
    raised = None
  except Exception as e:  # XLA reports the trapped kernel as a runtime error
    raised = e
  waited = time.time() - t0
  err = jaxoverlap.runtime_info()["device_error"]
  print(f"rank 0: call raised {type(raised).__name__ if raised else None} after {waited:.1f} s; "
        f"device_error: {err}", flush=True)
  ok = raised is not None and err is not None and "peer PE 1" in err and "step 0" in err
  print(f"rank 0: {int(ok)} passed, {int(not ok)} failed", flush=True)
  jax.distributed.shutdown()
  os._exit(0 if ok else 1)


if __name__ == "__main__":
  sys.exit(main(sys.argv))

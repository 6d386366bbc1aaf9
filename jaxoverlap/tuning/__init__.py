"""Measurements and models behind ``auto``, in six parts.

* ``jaxoverlap.tuning.cost_model``: the alpha-beta model of the all-reduce
  algorithms and of ``lax.psum`` (NCCL's ring and tree across nodes), for
  topologies no measurement covers.
* ``jaxoverlap.tuning.cluster``: presets of machines for that model (H200 +
  InfiniBand NDR, Perlmutter, Vista), its predictions on 1-64 nodes and their
  comparison with NVRAR's published figures (docs/cluster_model.md).
* ``jaxoverlap.tuning.policy``: what ``auto`` picks: the all-reduce ``Policy``
  (measured table first, then the cost model), the protocol rule, and the
  fused ops' chunk and fusion rules.
* ``jaxoverlap.tuning.results``: the results format that benchmarks and tuning
  tables share (load, save, validate).
* ``jaxoverlap.tuning.timing``: the timing harness of the tuner
  (``python -m jaxoverlap.tune``) and the benchmarks.
* ``jaxoverlap.tuning.check``: the correctness check they run before timing an
  all-reduce (against a float32 psum, single calls and calls back to back).

The names below are re-exported for convenience; ``jaxoverlap.dispatch`` is
the only caller of the policy inside the package.
"""

from jaxoverlap.tuning.cost_model import (
    ALGORITHMS,
    DEFAULT_PARAMS,
    PARAM_KEYS,
    PROTOCOLS,
    PSUM,
    CostParams,
    LinkParams,
    params_from_env,
    predict_us,
)
from jaxoverlap.tuning.policy import Choice, Policy, protocol_for
from jaxoverlap.tuning.results import (
    check_all_reduce_records,
    check_kernel_measured,
    default_tuning_path,
    impl_name,
    load_result,
    make_result,
    package_versions,
    parse_impl,
    save_result,
    validate_result,
    validate_tuning_table,
)
from jaxoverlap.tuning.timing import (
    chain_time_s,
    run_tuning,
    spread_us,
    time_chain_us,
    time_chains_stats_us,
    time_chains_us,
    time_interleaved,
)

__all__ = [
    "ALGORITHMS", "PROTOCOLS", "PSUM", "PARAM_KEYS", "LinkParams", "CostParams", "DEFAULT_PARAMS",
    "params_from_env", "predict_us", "Choice", "Policy", "protocol_for", "default_tuning_path",
    "impl_name", "parse_impl", "package_versions", "make_result", "validate_result",
    "validate_tuning_table", "check_all_reduce_records", "check_kernel_measured", "load_result",
    "save_result", "run_tuning", "chain_time_s", "time_chain_us", "time_chains_us",
    "time_chains_stats_us", "time_interleaved", "spread_us",
]

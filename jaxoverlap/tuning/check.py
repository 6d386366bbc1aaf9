"""The correctness check that the tuner and ``benchmarks/all_reduce.py`` run before timing.

Problem:
  A wrong but fast all-reduce must never win a comparison. A kernel can be right
  when called once and wrong when called again (a stale slot, an epoch that did
  not advance), and right between Python calls but wrong when several calls run
  back to back inside one program, as the timed chain runs them.

Algorithm:
  ``all_reduce_mismatch`` compares the op with a float32 ``lax.psum`` of the same
  input, on every element of every rank: first one call per input of ``calls``
  (pass at least three, so that each of the kernels' double-buffered slots is used
  twice), then ``links`` calls back to back in one jit against the same chain of
  float32 psums. A sum accumulated in float32 and rounded once into the dtype
  (as jaxoverlap's kernels sum) is within ``eps`` (the dtype's) plus float32
  reordering error of the reference's float32 sum, relative to
  ``sum_r |x_r|``: two orders of P float32 additions differ by at most
  ``2 (P - 1) * 2**-24``, allowed as ``2 P * 2**-24``. One that rounds into
  the dtype at each of ``k`` steps (a ring that adds in the dtype at every
  hop, as NCCL's bf16 psum may) is within ``k * eps`` plus the same. A chain of L links multiplies the values by P at
  every link after the first, and each link adds its own rounding, so the
  chain's bound is ``(L + 1)`` times one call's, relative to
  ``P**(L - 1) * sum_r |x_r|``. The verdict is computed on the devices over the
  global arrays, so every process gets the same answer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["all_reduce_mismatch", "element_bound", "roundings_of"]


def element_bound(dtype: Any, num_ranks: int, links: int = 1, roundings: int = 1) -> float:
  """The largest allowed ``|op - psum|`` per element, relative to ``P**(links-1) sum_r |x_r|``.

  ``links`` is the number of calls chained back to back (1: a single call);
  ``roundings`` how many times one call rounds into the dtype (1: float32 sums
  rounded once).
  """
  import jax.numpy as jnp

  one = roundings * float(jnp.finfo(dtype).eps) + 2 * num_ranks * 2.0**-24
  return one if links == 1 else (links + 1) * one


def roundings_of(op: Callable[[Any], Any], x: Any, *, mesh: Any, axis_name: str) -> int:
  """How many times one call of ``op`` may round into x's dtype, from the plans it makes.

  ``op`` (per shard, inside ``jax.shard_map`` over ``axis_name``) is lowered once
  on ``x`` and the all-reduce plans that lowering logs (``jaxoverlap.decisions()``)
  are read: 1 when every plan runs a jaxoverlap kernel (backend "cuda") or the
  xla ring ("ppermute"), which carry float32 and round once; ``P - 1`` (at least
  1) when one runs XLA's collective (``lax.psum``, which may round at every hop
  of NCCL's ring), or when ``op`` makes no plan (it is not a jaxoverlap op, or its
  program came from JAX's cache). So ``algorithm="auto"`` is checked by what it
  chose, not by what it might have chosen. Only jaxoverlap's plans are seen: a
  ``lax.psum`` of its own inside an op that also makes a kernel's plan is
  counted as the kernel (stricter than it needs). The plans are those logged
  while ``op`` is lowered: another thread lowering at the same time would add
  its own.
  """
  import jax
  from jax.sharding import PartitionSpec as P

  from jaxoverlap import dispatch, names

  mark = dispatch._decision_mark()  # pylint: disable=protected-access
  jax.jit(jax.shard_map(op, mesh=mesh, in_specs=P(axis_name), out_specs=P(axis_name))).lower(x)
  plans = [p for p in dispatch._plans_since(mark)  # pylint: disable=protected-access
           if p.op == names.ALL_REDUCE]
  once = plans and all(p.backend == names.CUDA or p.algorithm == names.PPERMUTE for p in plans)
  return 1 if once else max(mesh.shape[axis_name] - 1, 1)


@functools.cache
def _verdict_fn():
  import jax
  import jax.numpy as jnp

  @jax.jit
  def verdict(got, want, scale, bound):
    got = got.reshape(-1).astype(jnp.float32)
    want, scale = want.reshape(-1), scale.reshape(-1)
    bad = ~(jnp.abs(got - want) <= bound * scale)  # a NaN is bad
    first = jnp.argmax(bad)
    return jnp.sum(bad), first, got[first], want[first]

  return verdict


def _first_difference(what: str, num_ranks: int, got, want, scale, bound: float) -> str | None:
  """None when every element is within ``bound * scale`` of ``want``, else the first that is not.

  ``got`` is ``[P * n]``, rank r's ``n`` elements at ``r * n``.
  """
  import numpy as np

  count, first, g, w = (np.asarray(v).item() for v in _verdict_fn()(got, want, scale, bound))
  if not count:
    return None
  rank, index = divmod(int(first), max(got.size // num_ranks, 1))
  return (f"{what}: {count} of {got.size} elements differ from a float32 psum, first on rank "
          f"{rank} at element {index}: {g!r} vs {w!r}")


def all_reduce_mismatch(op: Callable[[Any], Any], calls: Sequence[Any], chain_input: Any, *,
                        mesh: Any, axis_name: str, links: int,
                        roundings: int | None = 1) -> str | None:
  """None when ``op`` sums as a float32 ``lax.psum`` does, else the first difference.

  Args:
    op: the all-reduce of one rank's shard, called inside ``jax.shard_map`` over
      ``axis_name`` (e.g. ``lambda y: jaxoverlap.all_reduce(y, "x", algorithm=...)``).
    calls: global arrays ``[P * n]`` sharded ``P(axis_name)`` (each rank's ``[n]``
      shard is its operand), float32, bfloat16 or float16; ``op`` is called once on
      each, in order.
    chain_input: one more such array, the input of ``links`` calls of ``op`` back to
      back in one jit. Keep ``max |x| * P**links`` inside the dtype's range.
    mesh: the mesh of the arrays; ``axis_name`` its axis, of P ranks.
    links: calls in the chain, at least 1.
    roundings: how many times one call may round into the dtype: 1 (the default)
      for jaxoverlap's kernels, which sum in float32 and round once; P - 1 for
      an implementation that may add in the dtype at every hop of a ring
      (``lax.psum``); None: from the plan ``op``'s lowering makes for each
      input's shape and dtype (``roundings_of``, for ``algorithm="auto"`` and
      any op whose path is not known in advance).

  Returns:
    None, or which call or chain differed, how many elements, and the first
    (rank, element, value, reference).

  Raises:
    Whatever ``op`` raises when it is traced, lowered or run (callers record it).

  Every process of the job must call it with the same arguments: the op and the
  verdict are collectives.
  """
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  from jaxoverlap import _xla

  if links < 1 or (roundings is not None and roundings < 1):
    raise ValueError(f"links and roundings must be at least 1, got {links} and {roundings}")
  num_ranks = mesh.shape[axis_name]
  planned: dict[tuple, int] = {}

  def rounds(x) -> int:  # roundings=None: the plan's, per shape and dtype (auto's choice varies)
    if roundings is not None:
      return roundings
    key = (x.shape, x.dtype)
    if key not in planned:
      planned[key] = roundings_of(op, x, mesh=mesh, axis_name=axis_name)
    return planned[key]
  varying = lambda y: _xla.to_varying(y, axis_name)  # noqa: E731  (as the timed chain's links)

  def single(y):
    y32 = y.astype(jnp.float32)
    return (varying(op(y)), varying(jax.lax.psum(y32, axis_name)),
            varying(jax.lax.psum(jnp.abs(y32), axis_name)))

  def chain(y):
    got, want = y, y.astype(jnp.float32)
    for _ in range(links):
      got, want = varying(op(got)), varying(jax.lax.psum(want, axis_name))
    scale = jax.lax.psum(jnp.abs(y.astype(jnp.float32)), axis_name)
    return got, want, varying(scale * float(num_ranks) ** (links - 1))

  specs = dict(mesh=mesh, in_specs=P(axis_name), out_specs=(P(axis_name),) * 3)
  single_fn = jax.jit(jax.shard_map(single, **specs))
  chain_fn = jax.jit(jax.shard_map(chain, **specs))
  # Every call runs on every process whatever an earlier one found: each is a collective,
  # and a process that skipped one would leave its peers waiting.
  reasons = [_first_difference(f"call {k + 1} of {len(calls)}", num_ranks, *single_fn(x),
                               element_bound(x.dtype, num_ranks, 1, rounds(x)))
             for k, x in enumerate(calls)]
  reasons.append(_first_difference(f"{links} calls back to back in one jit", num_ranks,
                                   *chain_fn(chain_input),
                                   element_bound(chain_input.dtype, num_ranks, links,
                                                 rounds(chain_input))))
  return next((r for r in reasons if r), None)

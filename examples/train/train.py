"""Trains the byte-level GPT of ``model.py`` on the Python standard library.

``train_and_evaluate(config, workdir)`` is the whole job: build a (dp x tp)
mesh, initialize the model and AdamW state sharded under ``jit`` (parameters
placed by their logical-axis metadata), resume from the latest checkpoint in
``workdir`` if there is one, train with a progress bar, evaluate on fixed
validation batches, checkpoint, and write ``metrics.json``, ``history.json``
and ``loss.png`` to ``workdir``.

``build(config)`` is the part before the loop (mesh, sharded initial state,
jit'd train and eval steps), for callers that drive the steps themselves
(``benchmarks/profile_step.py``).

The data order is a pure function of ``(seed, step)``, so a resumed run sees
the same batches as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import time
from typing import Any

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import tqdm
from flax import nnx

import jaxoverlap
from jaxoverlap import nnx as jnnx

import data as data_lib
from config import Config, ConfigError
from model import GPT

METRICS_FILE = "metrics.json"
# What a call that only evaluates (nothing left to train) carries over from the
# metrics.json of the call that trained the checkpoint.
TRAINING_FIELDS = ("start_step", "tokens_per_s", "step_time_ms", "first_step_s", "backend")
HISTORY_FILE = "history.json"
PLOT_FILE = "loss.png"
CHECKPOINT_DIR = "checkpoints"
CONFIG_FILE = "config.json"  # the run's config, written with its first checkpoint
# Config fields a resumed run may change: how it runs and how long, not what it trains.
RESUMABLE_CHANGES = ("steps", "mesh", "sequence_parallel", "backend", "algorithm", "log_every",
                     "eval_every", "ckpt_every", "eval_batches")


def _check_writable(workdir: str) -> None:
  """Creates ``workdir/checkpoints`` and writes a file there, or raises naming the folder.

  Checked before anything trains: a folder that exists but cannot be written trained first,
  then failed at its first checkpoint and hung in orbax for 5 minutes.
  """
  folder = os.path.join(workdir, CHECKPOINT_DIR)
  probe = os.path.join(folder, f".write-test-{jax.process_index()}")
  try:
    os.makedirs(folder, exist_ok=True)
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise ConfigError(f"--workdir {workdir}: cannot write there ({e.strerror}: {e.filename}); "
                      "choose a folder this process can write") from None


def _check_same_run(workdir: str, config: Config) -> None:
  """Refuses to resume a checkpoint with a config that trains something else.

  Only ``RESUMABLE_CHANGES`` may differ from the config saved with the checkpoint
  (``config.json``); a new learning rate, seed, model or data split would continue another
  run's optimizer state on other terms, or mix two validation sets in one curve.
  """
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    return  # a checkpoint written before config.json was: nothing to compare
  with open(path) as f:
    saved = json.load(f)
  now = json.loads(json.dumps(dataclasses.asdict(config)))  # tuples as lists, as saved
  differ = {k: (saved.get(k), now.get(k)) for k in sorted(set(saved) | set(now))
            if k not in RESUMABLE_CHANGES and saved.get(k) != now.get(k)}
  if differ:
    said = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in differ.items())
    raise ConfigError(f"--workdir {workdir} holds a run with another config ({said}); only "
                      f"{', '.join(RESUMABLE_CHANGES)} may change on resume. Use a new "
                      "--workdir for another run.")


def make_mesh(shape: tuple[int, int]) -> jax.sharding.Mesh:
  """A (dp, tp) mesh of Auto axes over all devices; one -1 takes the rest.

  Raises:
    ValueError: the shape does not match the number of devices.
  """
  num_devices = jax.device_count()
  dp, tp = shape
  if dp == -1 and tp > 0 and num_devices % tp == 0:
    dp = num_devices // tp
  elif tp == -1 and dp > 0 and num_devices % dp == 0:
    tp = num_devices // dp
  if dp < 1 or tp < 1 or dp * tp != num_devices:
    raise ConfigError(
        f"mesh (dp, tp)={tuple(shape)} does not fit the {num_devices} devices "
        f"({jax.devices()[0].platform}); dp * tp must equal the device count")
  return jax.make_mesh((dp, tp), ("dp", "tp"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def learning_rate(config: Config) -> optax.Schedule:
  """Linear warm-up from 0 to ``config.lr``, then cosine decay to ``lr * min_lr_ratio``.

  The warm-up is ``config.warmup`` steps, or a tenth of ``config.steps`` where that is fewer,
  so that a short run reaches the peak rate and decays too.
  """
  warmup = min(config.warmup, config.steps // 10)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.lr, warmup_steps=warmup,
      decay_steps=max(config.steps, warmup + 1), end_value=config.lr * config.min_lr_ratio)


def make_optimizer(config: Config) -> optax.GradientTransformation:
  """AdamW on ``learning_rate(config)``, with global-norm clipping."""
  schedule = learning_rate(config)
  # Decay matrices only, not norm scales, biases or embeddings.
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim == 2, params)
  return optax.chain(
      optax.clip_by_global_norm(config.grad_clip),
      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=config.weight_decay,
                  mask=decay_mask))


def cross_entropy(logits_bsv: jax.Array, targets_bs: jax.Array) -> jax.Array:
  """Mean next-byte cross-entropy in nats."""
  return optax.softmax_cross_entropy_with_integer_labels(logits_bsv, targets_bs).mean()


def _ran_backends(config: Config) -> dict[str, Any]:
  """Which backend each jaxoverlap op ran on, from the plans made when the step compiled."""
  ran: dict[str, set[str]] = {}
  algorithms: dict[str, set[str]] = {}
  for plan in jaxoverlap.decisions():
    ran.setdefault(plan.op, set()).add(plan.backend)
    algorithms.setdefault(plan.op, set()).add(plan.algorithm)
  return {"requested": config.backend, "algorithm": config.algorithm,
          "resolved": {op: "+".join(sorted(b)) for op, b in sorted(ran.items())},
          "resolved_algorithms": {op: "+".join(sorted(a)) for op, a in sorted(algorithms.items())},
          "runtime": jaxoverlap.runtime_info()}


def _to_global(batch: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
  """Places a host batch (identical on every process) as a global sharded array."""
  return {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
          for k, v in batch.items()}


def _save_plot(path: str, history: dict[str, list], unigram: float, title: str):
  """Train/validation loss curves with the unigram baseline (Agg, no global state)."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  fig = Figure(figsize=(7, 4.5))
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  if history["train"]:
    steps, losses = zip(*history["train"])
    ax.plot(steps, losses, label="train", alpha=0.8)
  if history["val"]:
    steps, losses = zip(*history["val"])
    ax.plot(steps, losses, "o-", label="validation")
  ax.axhline(unigram, color="gray", linestyle="--", label=f"unigram baseline ({unigram:.2f})")
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats/byte)")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def _read_json(path: str) -> dict[str, Any] | None:
  """The JSON object in ``path``; None where there is no such file or it does not parse."""
  try:
    with open(path) as f:
      obj = json.load(f)
  except (OSError, ValueError):
    return None
  return obj if isinstance(obj, dict) else None


def _write_json(path: str, obj: Any):
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2)
  os.replace(tmp, path)


@dataclasses.dataclass
class Setup:
  """A training run's mesh, initial state and jit'd steps (what ``build`` returns).

  Attributes:
    config: the run's configuration.
    mesh: the (dp, tp) mesh.
    parallel: the jaxoverlap layout of the model's layers.
    batch_sharding: the sharding of a global ``[b, s]`` batch.
    graphdef: the NNX graph of ``(model, optimizer)``.
    state: their initial state, sharded (donated by ``train_step``).
    state_sharding: the sharding of ``state``.
    train_step: ``(state, batch) -> (state, loss)``, jit'd, donates ``state``.
    eval_step: ``(state, batch) -> loss``, jit'd.
    num_params: number of model parameters.
  """

  config: Config
  mesh: jax.sharding.Mesh
  parallel: jnnx.ParallelConfig
  batch_sharding: jax.sharding.NamedSharding
  graphdef: Any
  state: Any
  state_sharding: Any
  train_step: Any
  eval_step: Any
  num_params: int

  def train_batch(self, corpus: data_lib.Corpus, step: int) -> dict[str, jax.Array]:
    """The global, sharded training batch of ``step`` (a pure function of seed and step)."""
    c = self.config
    return _to_global(data_lib.train_batch(corpus, step, c.batch_size, c.seq_len, c.seed),
                      self.batch_sharding)


def build(config: Config) -> Setup:
  """Builds the mesh, the model and AdamW state (initialized sharded under jit) and the steps.

  Raises:
    ConfigError: the mesh does not fit the devices, or the batch, heads, hidden size or
      (SP) sequence do not divide over it.
  """
  mesh = make_mesh(config.mesh)
  dp, tp = int(mesh.shape["dp"]), int(mesh.shape["tp"])
  for what, size, by, axis in (("batch_size", config.batch_size, dp, "dp"),
                               ("n_heads", config.n_heads, tp, "tp"),
                               ("d_ff", config.d_ff, tp, "tp"),
                               *((("seq_len", config.seq_len, tp, "tp"),)
                                 if config.sequence_parallel else ())):
    if size % by:
      raise ConfigError(f"{what}={size} does not divide over {axis}={by} (mesh dp={dp} x "
                        f"tp={tp}); choose another --mesh")
  parallel = jnnx.ParallelConfig(
      mesh=mesh, dp_axis="dp", tp_axis="tp", sequence_parallel=config.sequence_parallel,
      backend=config.backend, algorithm=config.algorithm)
  batch_sharding = jax.sharding.NamedSharding(mesh, parallel.spec("batch", None))
  tx = make_optimizer(config)

  def init():
    model = GPT(config, parallel, rngs=nnx.Rngs(config.seed))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  graphdef, abstract_state = nnx.split(nnx.eval_shape(init))
  state_sharding = nnx.get_named_sharding(abstract_state, mesh)
  state = jax.jit(lambda: nnx.split(init())[1], out_shardings=state_sharding)()
  num_params = sum(
      x.size for x in jax.tree.leaves(nnx.state(nnx.merge(graphdef, abstract_state)[0],
                                                nnx.Param)))

  @jax.jit
  def eval_step(state, batch):
    model, _ = nnx.merge(graphdef, state)
    return cross_entropy(model(batch["inputs"]), batch["targets"])

  def train_step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss_fn = lambda model: cross_entropy(model(batch["inputs"]), batch["targets"])
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  train_step = jax.jit(train_step, donate_argnums=0, out_shardings=(state_sharding, None))
  return Setup(config=config, mesh=mesh, parallel=parallel, batch_sharding=batch_sharding,
               graphdef=graphdef, state=state, state_sharding=state_sharding,
               train_step=train_step, eval_step=eval_step, num_params=int(num_params))


def _save_interrupted(manager: ocp.CheckpointManager, checkpoint, graphdef, state) -> None:
  """Saves the steps trained since the last checkpoint when a run is interrupted, and says so.

  One process only: the processes of a multi-process run stop at different steps, and orbax
  writes (and finishes) a checkpoint with all of them together, so they keep the last one
  written. A state whose buffers the interrupted step had already taken cannot be saved.
  """
  if jax.process_count() > 1:
    if jax.process_index() == 0:
      print("\ninterrupted: several processes stop at steps of their own, so none saves; "
            "run the same command to train on from the last checkpoint", file=sys.stderr,
            flush=True)
    return
  failed = ""
  try:
    manager.wait_until_finished()  # a checkpoint in flight completes first
  except Exception as e:  # noqa: BLE001  (reported below; the interrupt goes on)
    failed = f"; the checkpoint in flight failed: {e}"
  saved = manager.latest_step() or 0
  if any(leaf.is_deleted() for leaf in jax.tree.leaves(state) if isinstance(leaf, jax.Array)):
    said = "interrupted inside a step, which had taken the state: nothing new to save"
  else:
    trained = int(jax.device_get(nnx.merge(graphdef, state)[1].step[...]))  # not the loop's
    said = f"interrupted after step {trained}"
    if trained > saved:
      try:
        checkpoint(trained, state)
        manager.wait_until_finished()
        saved = trained
        said += ", saved it"
      except Exception as e:  # noqa: BLE001
        failed += f"; saving step {trained} failed: {e}"
  manager.close()
  resume = (f"the last checkpoint is step {saved}; run the same command to train on from it"
            if saved else "no checkpoint was written")
  print(f"\n{said}{failed}: {resume}", file=sys.stderr, flush=True)


class Terminated(KeyboardInterrupt):
  """SIGTERM (kill, SLURM's time limit), raised as Ctrl-C raises KeyboardInterrupt."""


class StopRequest:
  """Ctrl-C and SIGTERM for ``train_and_evaluate``: held while a step is in flight.

  A signal raised at once can land inside ``train_step`` after it took (donated) the
  state and before it handed back the new one: then no state is left to save. Installed
  as the signals' handler (``handle``; examples/train/main.py), this holds a first signal
  while the training loop of a one-process run is going (``in_loop``) and raises it
  between steps (``check``), where the state is whole. A second signal, a signal outside
  the loop, or any signal in a run of several processes (which could stop at different
  steps and wait on each other) raises at once.
  """

  def __init__(self):
    self.signum: int | None = None
    self.in_loop = False
    self.trained = False  # the training loop ended (main.py's message on a later interrupt)

  def handle(self, signum, frame) -> None:
    del frame
    if self.in_loop and self.signum is None:
      self.signum = signum
      return
    raise _interrupt(signum)

  def check(self) -> None:
    """Raises the held signal's KeyboardInterrupt (``Terminated`` for SIGTERM), if any."""
    if self.signum is not None:
      signum, self.signum = self.signum, None
      raise _interrupt(signum)


def _interrupt(signum: int) -> KeyboardInterrupt:
  return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def train_and_evaluate(config: Config, workdir: str,
                       stop: StopRequest | None = None) -> dict[str, Any]:
  """Trains ``config``'s model, resuming from ``workdir`` if it holds a checkpoint.

  Args:
    config: the run's configuration.
    workdir: output directory: checkpoints, ``metrics.json``,
      ``history.json`` and ``loss.png``.
    stop: the handler of Ctrl-C and SIGTERM, if the caller installed one: a
      one-process run then stops between steps (``StopRequest``).

  Returns:
    The metrics written to ``metrics.json``: ``val_loss`` and ``unigram_loss``
    (nats/byte), ``train_loss``, ``steps``, ``tokens_per_s``,
    ``step_time_ms``, ``config``, ``backend``, ``mesh`` and more. Where the
    checkpoint is already at ``config.steps``, the call only evaluates it
    (``evaluation_only``: true) and keeps the ``TRAINING_FIELDS`` that the
    ``metrics.json`` of the training call recorded (null if there is none).
  """
  wall_start = time.perf_counter()
  workdir = os.path.abspath(workdir)
  is_main = jax.process_index() == 0

  # Mesh, layout, model, optimizer and the jit'd steps (bad layouts fail here, before the
  # run's folder exists).
  setup = build(config)
  _check_writable(workdir)  # every process: each writes its checkpoint shards there
  _check_same_run(workdir, config)
  mesh, graphdef, state = setup.mesh, setup.graphdef, setup.state
  setup.state = None  # the loop donates it
  eval_step, train_step, num_params = setup.eval_step, setup.train_step, setup.num_params
  batch_sharding = setup.batch_sharding
  corpus = data_lib.load_corpus(val_percent=config.val_percent)
  unigram = data_lib.unigram_loss(corpus)
  val_batches = [
      _to_global(b, batch_sharding) for b in data_lib.validation_batches(
          corpus, config.eval_batches, config.batch_size, config.seq_len)]
  tokens_per_step = config.batch_size * config.seq_len

  def evaluate(state) -> float:
    return float(np.mean([jax.device_get(eval_step(state, b)) for b in val_batches]))

  # Resume.
  manager = ocp.CheckpointManager(
      os.path.join(workdir, CHECKPOINT_DIR),
      options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
  # train/val: (step, loss); step_ms: (step, ms per step of the window of timed steps ending
  # there), whose steps make metrics' step_time_ms (this call's; a resumed run keeps the
  # windows of the calls before it too).
  history: dict[str, list] = {"train": [], "val": [], "step_ms": []}
  start_step = 0
  latest = manager.latest_step()
  if latest is not None:
    state = manager.restore(latest, args=ocp.args.StandardRestore(state))
    start_step = int(jax.device_get(nnx.merge(graphdef, state)[1].step[...]))
    if start_step != latest:
      raise RuntimeError(f"checkpoint {latest} holds optimizer step {start_step}")
    history_path = os.path.join(workdir, HISTORY_FILE)
    if os.path.exists(history_path):
      with open(history_path) as f:
        saved = json.load(f)
      history = {k: [p for p in saved.get(k, []) if p[0] <= start_step] for k in history}

  def checkpoint(step: int, state):
    manager.save(step, args=ocp.args.StandardSave(state))
    if is_main:
      _write_json(os.path.join(workdir, HISTORY_FILE), history)
      if not os.path.exists(os.path.join(workdir, CONFIG_FILE)):
        _write_json(os.path.join(workdir, CONFIG_FILE), dataclasses.asdict(config))

  mesh_info = {"dp": int(mesh.shape["dp"]), "tp": int(mesh.shape["tp"]),
               "devices": jax.device_count(), "platform": jax.devices()[0].platform,
               "processes": jax.process_count()}
  if is_main:
    print(f"corpus: {len(corpus.train):,} train bytes ({corpus.num_train_files} files), "
          f"{len(corpus.val):,} validation bytes ({corpus.num_val_files} files) from "
          f"{corpus.root}; unigram baseline {unigram:.3f} nats/byte")
    print(f"model: {num_params:,} parameters; mesh dp={mesh_info['dp']} x tp={mesh_info['tp']} "
          f"on {mesh_info['devices']} {mesh_info['platform']} devices; "
          f"sequence_parallel={config.sequence_parallel}; backend {config.backend!r}")
    if start_step:
      print(f"resumed from {manager.directory} at step {start_step}")
    if start_step >= config.steps:
      print(f"WARNING: {workdir} already holds a checkpoint at step {start_step}, and this "
            f"run asks for {config.steps} steps: nothing to train; this run only evaluates "
            "it. Use a new --workdir for a fresh run, or more --steps to train on.", flush=True)

  if start_step == 0:
    history["val"].append((0, evaluate(state)))

  # Train. The bar starts after the first step: its compilation logs a warning per op that
  # runs on XLA (and why), which would break into the bar's line.
  bar = None
  if is_main and start_step < config.steps:
    print(f"step {start_step + 1}: compiling the train step and running it", flush=True)
  pending: list[jax.Array] = []
  train_loss = val_loss = math.nan
  train_time = 0.0   # seconds of train steps after the first (compiling) one
  timed_steps = 0
  window_steps = 0
  first_step_s = None
  tick = time.perf_counter()
  jaxoverlap.clear_decisions()
  backends = _ran_backends(config)
  if stop is not None:
    stop.in_loop = jax.process_count() == 1
  try:
    for step in range(start_step, config.steps):
      batch = setup.train_batch(corpus, step)
      state, loss = train_step(state, batch)
      if stop is not None:
        stop.check()  # a signal held during the step: the new state is whole
      pending.append(loss)
      done = step + 1
      if first_step_s is None:  # includes compilation: timed apart
        loss.block_until_ready()
        first_step_s = time.perf_counter() - tick
        backends = _ran_backends(config)  # the step's plans, made when it compiled
        if is_main:
          print(f"first step (compilation included) {first_step_s:.1f} s; ops ran on: "
                f"{backends['resolved']} (jaxoverlap.decisions() has each call's plan)",
                flush=True)
        bar = tqdm.tqdm(total=config.steps, initial=step, disable=not is_main,
                        dynamic_ncols=True, desc="train")
        tick = time.perf_counter()  # the timed steps start here
      else:
        window_steps += 1
      boundary = (done % config.log_every == 0 or done % config.eval_every == 0
                  or done % config.ckpt_every == 0 or done == config.steps)
      bar.update(1)
      if not boundary:
        continue
      losses = [float(x) for x in jax.device_get(pending)]  # waits for the steps
      window_s = time.perf_counter() - tick
      if window_steps:  # not the fetch right after the compiling step: no timed step in it
        train_time += window_s
        history["step_ms"].append((done, window_s * 1e3 / window_steps))
      timed_steps += window_steps
      window_steps = 0
      pending = []
      train_loss = float(np.mean(losses))
      history["train"].append((done, train_loss))
      postfix = {"loss": f"{train_loss:.3f}"}
      if train_time > 0 and timed_steps > 0:
        postfix["tok/s"] = f"{timed_steps * tokens_per_step / train_time:,.0f}"
      if done % config.eval_every == 0 or done == config.steps:
        val_loss = evaluate(state)
        history["val"].append((done, val_loss))
      if not math.isnan(val_loss):
        postfix["val"] = f"{val_loss:.3f}"
      bar.set_postfix(postfix)
      if done % config.ckpt_every == 0 or done == config.steps:
        checkpoint(done, state)
      tick = time.perf_counter()
  except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM as main.py turns it into one
    if bar is not None:
      bar.close()
    _save_interrupted(manager, checkpoint, graphdef, state)
    e.reported = True  # main.py: said what was saved
    raise
  finally:
    if stop is not None:
      stop.in_loop = False
  if stop is not None:
    stop.trained = True
    if stop.signum is not None:  # came with the last step: it is saved
      print("\na stop was asked for as the last step ended: the run is complete",
            file=sys.stderr, flush=True)
      stop.signum = None
  if bar is not None:
    bar.close()
  manager.wait_until_finished()

  if math.isnan(val_loss):  # nothing trained in this call (already at config.steps)
    val_loss = evaluate(state)
    if history["train"]:
      train_loss = history["train"][-1][1]
  if timed_steps and train_time > 0:
    step_time_s = train_time / timed_steps
  else:
    step_time_s = first_step_s  # None when this call trained no step
  metrics = {
      "val_loss": val_loss,
      "unigram_loss": unigram,
      "train_loss": train_loss,
      "steps": int(jax.device_get(nnx.merge(graphdef, state)[1].step[...])),
      "start_step": start_step,
      # None (JSON null) when this call trained no step (already at config.steps).
      "tokens_per_s": tokens_per_step / step_time_s if step_time_s else None,
      "step_time_ms": step_time_s * 1e3 if step_time_s else None,
      "first_step_s": first_step_s,
      "wall_s": time.perf_counter() - wall_start,
      "num_params": int(num_params),
      "tokens_per_step": tokens_per_step,
      "config": dataclasses.asdict(config),
      "backend": backends,
      "mesh": mesh_info,
      "corpus": {"root": corpus.root, "train_bytes": int(len(corpus.train)),
                 "val_bytes": int(len(corpus.val)), "train_files": corpus.num_train_files,
                 "val_files": corpus.num_val_files},
  }
  metrics["evaluation_only"] = first_step_s is None
  if metrics["evaluation_only"]:
    # Nothing trained in this call: keep what the call that trained the checkpoint
    # recorded (its speed, the backend each op ran on), rather than overwrite it with nulls.
    # An evaluation-only file carries those fields on from the training call, so they are
    # kept from it too.
    previous = _read_json(os.path.join(workdir, METRICS_FILE))
    if previous:
      for key in TRAINING_FIELDS:
        if key in previous:
          metrics[key] = previous[key]
  if is_main:
    _write_json(os.path.join(workdir, METRICS_FILE), metrics)
    _save_plot(os.path.join(workdir, PLOT_FILE), history, unigram,
               f"byte-level GPT on the Python stdlib, dp={mesh_info['dp']} x tp={mesh_info['tp']}")
    speed = (f"{metrics['tokens_per_s']:,.0f} tokens/s ({metrics['step_time_ms']:.1f} ms/step)"
             if step_time_s else f"no step left to train (already at step {metrics['steps']})")
    print(f"step {metrics['steps']}: val_loss {val_loss:.3f} vs unigram {unigram:.3f} "
          f"nats/byte; {speed}; wrote {workdir}")
  manager.close()
  return metrics

"""The examples run: the numbered ones, and the training job with its checkpoints.

conftest.py forces 8 simulated CPU devices; the "tiny" preset keeps each
training call to seconds (mostly compilation).
"""

import dataclasses
import importlib.util
import json
import math
import os
import re
import shutil
import sys

import pytest

_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, os.path.join(_EXAMPLES, "train"))  # the example's flat imports, as main.py

import config as config_lib  # noqa: E402  (examples/train/config.py)
import jax  # noqa: E402
import train  # noqa: E402  (examples/train/train.py)

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")


def _load_example(filename):
  spec = importlib.util.spec_from_file_location(filename[:-3], os.path.join(_EXAMPLES, filename))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _read_metrics(workdir):
  with open(os.path.join(workdir, train.METRICS_FILE)) as f:
    return json.load(f)


def _checkpoint_steps(workdir):
  names = os.listdir(os.path.join(workdir, train.CHECKPOINT_DIR))
  return sorted(int(n) for n in names if n.isdigit())


def test_01_all_reduce():
  assert _load_example("01_all_reduce.py").main() == 0.0


def test_02_tp_mlp():
  out_err, grad_err = _load_example("02_tp_mlp.py").main()
  assert out_err < 1e-4 and grad_err < 1e-4


@pytest.mark.parametrize("filename,runs", [("01_all_reduce.py", "all_reduce of"),
                                           ("02_tp_mlp.py", "ParallelMLP d=")])
def test_numbered_examples_print_usage_on_help(filename, runs):
  """--help prints the usage and the docstring and exits 0 without running the example."""
  import subprocess

  root = os.path.dirname(_EXAMPLES)
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root)
  path = os.path.join(_EXAMPLES, filename)
  out = subprocess.run([sys.executable, path, "--help"], capture_output=True, text=True,
                       env=env, timeout=120)
  assert out.returncode == 0, out.stdout + out.stderr
  assert out.stdout.startswith(f"usage: {filename} [-h]"), out.stdout
  first_line = _load_example(filename).__doc__.splitlines()[0]
  assert first_line in out.stdout and runs not in out.stdout
  out = subprocess.run([sys.executable, path, "--rows", "3"], capture_output=True, text=True,
                       env=env, timeout=120)
  assert out.returncode == 2 and "unrecognized arguments: --rows 3" in out.stderr, out.stderr
  assert runs not in out.stdout


def test_train_writes_outputs_and_resumes(tmp_path, capsys):
  workdir = str(tmp_path / "run")
  tiny = config_lib.get_config("tiny")  # 4 steps, checkpoints every 2
  assert tiny.mesh == (4, 2)

  first = train.train_and_evaluate(tiny, workdir)
  metrics = _read_metrics(workdir)
  assert metrics["steps"] == tiny.steps and metrics["start_step"] == 0
  assert math.isfinite(metrics["val_loss"]) and math.isfinite(metrics["unigram_loss"])
  assert 2.0 < metrics["unigram_loss"] < 4.0  # bytes of Python source
  for key in ("train_loss", "tokens_per_s", "step_time_ms", "config", "backend", "mesh"):
    assert key in metrics, key
  assert metrics["mesh"]["dp"] == 4 and metrics["mesh"]["tp"] == 2
  assert metrics["val_loss"] == pytest.approx(first["val_loss"])
  assert os.path.getsize(os.path.join(workdir, train.PLOT_FILE)) > 0
  assert _checkpoint_steps(workdir)[-1] == tiny.steps

  # More steps: resumes at step 4 (optimizer state and step restored).
  longer = dataclasses.replace(tiny, steps=8)
  second = train.train_and_evaluate(longer, workdir)
  assert second["start_step"] == tiny.steps and second["steps"] == 8
  assert _checkpoint_steps(workdir)[-1] == 8
  with open(os.path.join(workdir, train.HISTORY_FILE)) as f:
    history = json.load(f)
  assert [s for s, _ in history["train"]] == list(range(1, 9))

  # Resume is exact: drop the last checkpoint, redo steps 7-8 from step 6.
  shutil.rmtree(os.path.join(workdir, train.CHECKPOINT_DIR, "8"))
  again = train.train_and_evaluate(longer, workdir)
  assert again["start_step"] == 6 and again["steps"] == 8
  assert again["val_loss"] == second["val_loss"]
  assert again["train_loss"] == second["train_loss"]

  # Nothing left to train: it evaluates the checkpoint and says so.
  capsys.readouterr()
  done = train.train_and_evaluate(longer, workdir)
  assert done["evaluation_only"] and not again["evaluation_only"]
  # The training call's record survives (it trained steps 7-8 from step 6).
  for key in train.TRAINING_FIELDS:
    assert done[key] == again[key], key
  assert done["start_step"] == 6 and done["step_time_ms"] > 0 and done["backend"]
  with open(os.path.join(workdir, train.METRICS_FILE)) as f:
    assert json.load(f)["step_time_ms"] == again["step_time_ms"]
  assert done["val_loss"] == pytest.approx(second["val_loss"])
  # A second evaluation-only call keeps them as well (from the first one's file).
  twice = train.train_and_evaluate(longer, workdir)
  assert twice["evaluation_only"]
  for key in train.TRAINING_FIELDS:
    assert twice[key] == again[key], key
  assert ("already holds a checkpoint at step 8, and this run asks for 8 steps: nothing to train"
          in capsys.readouterr().out)


def test_train_refuses_to_resume_another_config_and_an_unwritable_folder(tmp_path):
  """Trial 28: a resume with another learning rate, seed or data split went ahead silently
  (mixing two validation sets in one curve); another model size failed deep in orbax; and a
  folder that could not be written trained, then hung in orbax for 5 minutes."""
  workdir = str(tmp_path / "run")
  tiny = dataclasses.replace(config_lib.get_config("tiny"), steps=2)
  first = train.train_and_evaluate(tiny, workdir)
  with open(os.path.join(workdir, train.CONFIG_FILE)) as f:
    assert json.load(f)["lr"] == tiny.lr
  for change, says in ((dict(lr=0.03), "lr: 0.001 -> 0.03"), (dict(seed=7), "seed: 0 -> 7"),
                       (dict(d_model=64), "d_model: 32 -> 64")):
    with pytest.raises(config_lib.ConfigError, match=re.escape(says)):
      train.train_and_evaluate(dataclasses.replace(tiny, steps=4, **change), workdir)
    assert _checkpoint_steps(workdir)[-1] == 2  # nothing trained or written
  # What may change on resume: steps and the layout.
  again = train.train_and_evaluate(dataclasses.replace(tiny, steps=4, mesh=(2, 4)), workdir)
  assert again["start_step"] == 2 and first["steps"] == 2
  # A folder that cannot be written: refused before anything trains.
  if os.geteuid() != 0:  # root writes anywhere
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    with pytest.raises(config_lib.ConfigError, match="cannot write there"):
      train.train_and_evaluate(tiny, str(ro / "run"))
  blocked = tmp_path / "file"
  blocked.write_text("not a folder")
  with pytest.raises(config_lib.ConfigError, match="cannot write there"):
    train.train_and_evaluate(tiny, str(blocked / "run"))


@pytest.mark.parametrize("change,says", [
    (dict(mesh=(8, 1), batch_size=12), "batch_size=12 does not divide over dp=8"),
    (dict(mesh=(1, 8)), "n_heads=4 does not divide over tp=8"),
    (dict(mesh=(3, 3)), "mesh (dp, tp)=(3, 3) does not fit the 8 devices"),
])
def test_train_refuses_layouts_that_do_not_divide_before_its_folder_exists(tmp_path, change,
                                                                           says):
  workdir = tmp_path / "run"
  with pytest.raises(config_lib.ConfigError, match=re.escape(says)):
    train.train_and_evaluate(dataclasses.replace(config_lib.get_config("tiny"), **change),
                             str(workdir))
  assert not workdir.exists()


def test_train_main_prints_a_config_error_in_one_line(tmp_path):
  import subprocess

  main = os.path.join(_EXAMPLES, "train", "main.py")
  done = subprocess.run([sys.executable, main, "--workdir", str(tmp_path / "r"), "--config",
                         "tiny", "--steps", "-5"], capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert done.returncode == 2, done.stderr
  assert done.stderr.strip().splitlines()[-1] == "main.py: error: steps must be >= 1, got -5"
  assert "Traceback" not in done.stderr
  stray = subprocess.run([sys.executable, main, "--workdir", str(tmp_path / "r"), "stray"],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert stray.returncode != 0 and "unexpected arguments ['stray']" in stray.stderr
  assert not (tmp_path / "r").exists()


def test_train_short_runs_reach_the_peak_learning_rate():
  """Trial 28: with --steps below the warm-up (50 steps), a run never reached its peak rate."""
  default = config_lib.get_config("default")  # 800 steps: its own 50 steps of warm-up
  lr = lambda step: float(train.learning_rate(default)(step))  # float32  # noqa: E731
  assert lr(25) == pytest.approx(default.lr / 2) and lr(50) == pytest.approx(default.lr)
  assert lr(800) == pytest.approx(default.lr * default.min_lr_ratio)
  short = dataclasses.replace(default, steps=30)  # a tenth of the run: 3 steps
  lr = lambda step: float(train.learning_rate(short)(step))  # noqa: E731
  assert lr(2) < 0.9 * short.lr and lr(3) == pytest.approx(short.lr)
  assert lr(30) == pytest.approx(short.lr * short.min_lr_ratio)


def _start_training(workdir, *flags):
  """main.py in a process of its own, from its "first step" line on (compiled, training)."""
  import subprocess

  main = os.path.join(_EXAMPLES, "train", "main.py")
  proc = subprocess.Popen(
      [sys.executable, main, "--workdir", workdir, "--config", "tiny", "--steps", "100000",
       "--ckpt_every", "100000", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  for line in proc.stdout:
    if line.startswith("first step"):
      return proc
  proc.kill()
  raise AssertionError(f"main.py ended before its first step: {proc.stderr.read()}")


def test_a_stop_signal_inside_a_step_is_held_to_its_end(tmp_path, capsys, monkeypatch):
  """CI saw SIGTERM land inside train_step, after it had taken (donated) the state: nothing
  was left to save, and the steps since the last checkpoint were lost. train.StopRequest
  holds a first signal during the loop of a one-process run and raises it between steps."""
  import signal

  stop = train.StopRequest()
  real_build = train.build

  def build(config):  # SIGTERM arrives inside step 3, after the state was donated
    setup = real_build(config)
    real_step, calls = setup.train_step, []

    def train_step(state, batch):
      out = real_step(state, batch)
      calls.append(1)
      if len(calls) == 3:
        stop.handle(signal.SIGTERM, None)
      return out
    setup.train_step = train_step
    return setup

  monkeypatch.setattr(train, "build", build)
  tiny = dataclasses.replace(config_lib.get_config("tiny"), steps=10, ckpt_every=100)
  with pytest.raises(train.Terminated):
    train.train_and_evaluate(tiny, str(tmp_path / "run"), stop)
  err = capsys.readouterr().err
  assert "interrupted after step 3, saved it: the last checkpoint is step 3" in err, err
  assert not stop.in_loop and stop.signum is None
  # Outside the loop, and a second signal inside it, raise at once.
  with pytest.raises(KeyboardInterrupt):
    stop.handle(signal.SIGINT, None)
  stop.in_loop = True
  stop.handle(signal.SIGINT, None)
  with pytest.raises(train.Terminated):
    stop.handle(signal.SIGTERM, None)
  with pytest.raises(KeyboardInterrupt) as held:
    stop.check()
  assert not isinstance(held.value, train.Terminated)


def test_train_stopped_before_its_first_step_says_so(tmp_path):
  """Trial 28: a run stopped before its training loop (setup, first evaluation) exited 143
  without a word. It now says that nothing new was saved, with no traceback."""
  import signal
  import subprocess

  main = os.path.join(_EXAMPLES, "train", "main.py")
  proc = subprocess.Popen(
      [sys.executable, main, "--workdir", str(tmp_path / "run"), "--config", "tiny"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  for line in proc.stdout:  # printed after setup, before the first evaluation compiles
    if line.startswith("corpus:"):
      proc.send_signal(signal.SIGTERM)
      break
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 143, err
  assert err.endswith("interrupted before training began: nothing new to save; run the same "
                      "command to start again\n"), err
  assert "Traceback" not in err, err


@pytest.mark.parametrize("sig,rc", [("SIGTERM", 143), ("SIGINT", 130)])
def test_train_saves_the_steps_since_its_last_checkpoint_when_stopped(tmp_path, sig, rc):
  """Trial 28: Ctrl-C left orbax tracebacks and a temporary folder, and lost every step since
  the last checkpoint. Stopped by SIGINT or SIGTERM, a run of one process saves its state,
  says so in one line, exits 128 + the signal, and a run of the same command resumes there."""
  import signal
  import time

  workdir = str(tmp_path / "run")
  proc = _start_training(workdir)
  time.sleep(3)  # a few steps past the first, none of them checkpointed (--ckpt_every)
  proc.send_signal(getattr(signal, sig))
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == rc, err
  said = re.search(r"interrupted after step (\d+), saved it: the last checkpoint is step (\d+); "
                   r"run the same command to train on from it\n$", err)
  assert said and said[1] == said[2], err
  assert "Traceback" not in err, err
  step = int(said[1])
  assert step >= 2 and _checkpoint_steps(workdir) == [step]
  assert not [n for n in os.listdir(os.path.join(workdir, train.CHECKPOINT_DIR))
              if "tmp" in n]
  # Resumes with one step left, now sequence parallel (a layout: it may change on resume).
  proc = _start_training(workdir, "--steps", str(step + 1), "--sequence_parallel")
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err
  assert _checkpoint_steps(workdir) == [step, step + 1]
  metrics = _read_metrics(workdir)
  assert metrics["start_step"] == step and metrics["config"]["sequence_parallel"]
  assert sorted(metrics["backend"]["resolved"]) == ["all_gather_matmul", "matmul_reduce_scatter"]

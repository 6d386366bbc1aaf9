"""benchmarks/all_reduce_floors.py: the floors of the all-reduce kernels from a results file."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import all_reduce_floors as fl  # noqa: E402

MIB = 1 << 20
LINKS = fl.Links(alpha_us=1.0, beta_gbps=100.0, hbm_gbps=1000.0)


def test_one_shot_floor_parts():
  # 2 ranks, 1 MiB, LL: 2 MiB sent at 100 GB/s; HBM 2 MiB + 2 x 2 MiB of cells at 1000 GB/s.
  f = fl.kernel_floor_us("jaxoverlap:one_shot_ll", MIB, 2, 2.0, LINKS)
  assert f["signal"] == 1.0
  assert f["wire"] == pytest.approx(2 * MIB / 100e3)
  assert f["hbm"] == pytest.approx(6 * MIB / 1000e3)
  assert f["floor"] == pytest.approx(2.0 + 1.0 + f["wire"])
  simple = fl.kernel_floor_us("jaxoverlap:one_shot_simple", MIB, 2, 2.0, LINKS)
  assert simple["wire"] == pytest.approx(f["wire"] / 2)


def test_two_shot_floor_parts_and_hbm_bound():
  # 4 ranks: each sends 2 * 3/4 M over two dependent phases.
  f = fl.kernel_floor_us("jaxoverlap:two_shot", MIB, 4, 1.0, LINKS)
  assert f["signal"] == 2.0 and f["wire"] == pytest.approx(1.5 * MIB / 100e3)
  # A slow HBM makes the floor HBM-bound.
  slow = fl.kernel_floor_us("jaxoverlap:two_shot_simple", MIB, 4, 1.0,
                            fl.Links(1.0, 1000.0, 10.0))
  assert slow["hbm"] > slow["wire"] and slow["floor"] == pytest.approx(3.0 + slow["hbm"])


@pytest.mark.parametrize("impl", ["xla:psum", "jaxoverlap:auto", "floor:launch",
                                  "jaxoverlap:hierarchical_ll", "jaxoverlap:one_shot_xx"])
def test_not_a_kernel_of_one_node(impl):
  assert fl.kernel_floor_us(impl, MIB, 2, 1.0) is None


def _result(with_launch=True):
  recs = [{"impl": "jaxoverlap:one_shot_ll", "bytes": 8192, "time_us": 5.0},
          {"impl": "jaxoverlap:two_shot", "bytes": 8192, "time_us": 9.0},
          {"impl": "xla:psum", "bytes": 8192, "time_us": 12.0},
          {"impl": "jaxoverlap:one_shot_ll", "bytes": MIB, "time_us": 14.0},
          {"impl": "jaxoverlap:two_shot", "bytes": MIB, "time_us": 11.0}]
  if with_launch:
    recs += [{"impl": "floor:launch", "bytes": MIB, "time_us": 3.0},
             {"impl": "floor:launch", "bytes": 8192, "time_us": 1.5}]
  for r in recs:
    r["ranks_per_node"] = 2
  return {"records": recs, "machine": "test"}


def test_floors_table_marks_the_best_and_uses_the_smallest_launch():
  rows = fl.floors_table(_result(), LINKS)
  assert [(r["bytes"], r["impl"], r["best"]) for r in rows] == [
      (8192, "jaxoverlap:one_shot_ll", True), (8192, "jaxoverlap:two_shot", False),
      (MIB, "jaxoverlap:one_shot_ll", False), (MIB, "jaxoverlap:two_shot", True)]
  assert all(r["launch"] == 1.5 for r in rows)
  r = rows[3]
  assert r["above_floor_us"] == pytest.approx(11.0 - r["floor"], abs=0.01)
  assert rows[0]["psum_us"] == 12.0 and rows[3]["psum_us"] is None
  table = fl.markdown(rows)
  assert table.count("\n") == 3 and "| 1 MiB | two_shot | 11.0 |" in table
  with pytest.raises(ValueError, match="no floor:launch record"):
    fl.floors_table(_result(with_launch=False))


def test_plot_writes_a_png(tmp_path):
  rows = fl.floors_table(_result(), LINKS)
  path = tmp_path / "floors.png"
  fl.plot(rows, str(path), "test")
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

"""The timeline picture: lanes, kinds of work, labels, visible collectives, the budget."""

import json

import pytest

from autodist.timeline import Interval, Timeline, kind_of, lanes, to_chrome_trace, to_png

pytest.importorskip("matplotlib")

STEP = [
    Interval("compute", "forward", 0.0, 0.001),
    Interval("compute", "fwd layers.0", 0.001, 0.2),
    Interval("compute", "loss", 0.2, 0.21),
    Interval("compute", "loss backward", 0.21, 0.22),
    Interval("compute", "bwd layers.0", 0.22, 0.45),
    Interval("compute", "bucket copy-in", 0.45, 0.451),
    Interval("compute", "optimizer", 0.46, 0.5),
    Interval("comm", "all_gather gather layers.0", 0.1, 0.10005),  # 50 us in a 500 ms step
    Interval("comm", "reduce_scatter bucket0", 0.451, 0.452),
    Interval("comm", "all_gather refresh layers.0", 0.49, 0.491),
    Interval("copy", "copy_back layers.0.weight/exp_avg", 0.3, 0.31),
]


def test_lanes_split_compute_at_the_start_of_backward_and_keep_streams_apart():
    rows = dict(lanes(Timeline(intervals=STEP)))
    assert list(rows) == ["compute: forward", "compute: backward", "comm", "copy"]
    assert [i.name for i in rows["compute: forward"]] == ["forward", "fwd layers.0", "loss"]
    assert [i.name for i in rows["compute: backward"]][-1] == "optimizer"


def test_each_kind_of_work_is_told_apart():
    kinds = [kind_of(i) for i in STEP]
    assert kinds == [
        "runtime", "forward", "loss", "loss", "backward", "runtime", "optimizer",
        "all_gather", "reduce_scatter", "refresh", "copy_back",
    ]


def test_a_50_microsecond_collective_is_drawn_at_least_three_pixels_wide(tmp_path):
    import matplotlib.image

    png = tmp_path / "step.png"
    to_png(Timeline(intervals=STEP, memory=[(0.0, 1 << 20), (0.3, 3 << 20)], budget_bytes=4 << 20), png, width_px=800, height_px=400)
    pixels = (matplotlib.image.imread(png)[..., :3] * 255).round().astype(int)
    plot_area = pixels[:, : int(0.6 * pixels.shape[1])]  # left of the legend, which has a patch of this colour
    all_gather = abs(plot_area - [0xDD, 0x84, 0x52]).sum(axis=-1) < 60  # the bar's colour, give or take antialiasing
    assert all_gather.sum(axis=1).max() >= 3


def test_the_chrome_trace_carries_the_budget_with_the_memory_curve(tmp_path):
    out = tmp_path / "step.json"
    to_chrome_trace(Timeline(intervals=STEP, memory=[(0.0, 1 << 20)], budget_bytes=4 << 20), out)
    counters = [e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "C"]
    assert counters[0]["args"] == {"MiB": 1.0, "budget MiB": 4.0}

"""Metrics logging (JSONL + TensorBoard events), resume truncation, and learning-curve plots."""

import json
import math
import struct

import numpy as np
import pytest
from PIL import Image
from tensorboardX.proto.event_pb2 import Event

from areal_jax.cli import main as cli_main
from areal_jax.metrics import EVAL_CURVE_FILE, METRICS_FILE, TENSORBOARD_DIR, MetricsLogger
from areal_jax.plotting import DPI, PANEL_SIZE_IN, PlotError, plot_run, read_series


def _events(run_dir) -> list[Event]:
    """Every event of every TFRecord event file under RUN_DIR/tensorboard, in file order."""
    events = []
    for path in sorted((run_dir / TENSORBOARD_DIR).glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            pos += 12  # length + its masked CRC
            events.append(Event.FromString(data[pos : pos + length]))
            pos += length + 4  # payload + its masked CRC
    return events


def _scalars(run_dir) -> list[tuple[int, str, float]]:
    return [
        (e.step, v.tag, v.simple_value)
        for e in _events(run_dir)
        if e.HasField("summary")
        for v in e.summary.value
    ]


def _lines(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]


def test_log_writes_jsonl_and_tensorboard(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(0, {"loss": 1.5, "reward/mean": np.float32(0.25), "count": 3})
        logger.log(1, {"loss": float("nan"), "grad_norm": float("inf")})
        logger.log(1, {"eval/accuracy": True})
    lines = _lines(tmp_path)
    assert [r["step"] for r in lines] == [0, 1, 1]
    assert lines[0]["loss"] == 1.5 and lines[0]["reward/mean"] == 0.25 and lines[0]["count"] == 3.0
    assert lines[1]["loss"] is None and lines[1]["grad_norm"] is None
    assert lines[2]["eval/accuracy"] == 1.0
    assert all(isinstance(r["wall_time"], float) for r in lines)
    scalars = _scalars(tmp_path)
    assert (0, "loss", 1.5) in scalars and (0, "reward/mean", 0.25) in scalars
    assert (1, "eval/accuracy", 1.0) in scalars
    nan_loss = [v for s, t, v in scalars if t == "loss" and s == 1]
    assert len(nan_loss) == 1 and math.isnan(nan_loss[0])


def test_bad_metrics_are_rejected(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(5, {"loss": 1.0})
        with pytest.raises(ValueError, match="before the last logged step 5"):
            logger.log(4, {"loss": 1.0})
        logger.log(3, {"eval/accuracy": 0.5}, late=True)  # an evaluation that ran beside 4, 5
        with pytest.raises(ValueError, match="before the last logged step 5"):
            logger.log(4, {"loss": 1.0})  # the late row did not move the last step back
        with pytest.raises(ValueError, match="metric 'note' is not a number"):
            logger.log(6, {"note": "hello"})
        with pytest.raises(ValueError, match="reserved"):
            logger.log(6, {"step": 1.0})
        with pytest.raises(ValueError, match="non-negative integer"):
            logger.log(-1, {})
    assert [r["step"] for r in _lines(tmp_path)] == [5, 3]


def test_resume_drops_steps_at_or_after_the_resume_step(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        for step in range(6):
            logger.log(step, {"loss": float(step)})
    with (tmp_path / METRICS_FILE).open("a") as f:
        f.write('{"step": 6, "lo')  # torn by a crash
    with MetricsLogger(tmp_path, resume_from_step=4) as logger:
        assert logger.last_step == 3
        logger.log(4, {"loss": 40.0})
        logger.log(5, {"loss": 50.0})
    lines = _lines(tmp_path)
    assert [(r["step"], r["loss"]) for r in lines] == [
        (0, 0.0),
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
        (5, 50.0),
    ]
    # TensorBoard keeps both runs' files; the resumed one starts by purging steps >= 4.
    assert len(list((tmp_path / TENSORBOARD_DIR).glob("events.out.tfevents.*"))) == 2
    assert [s for s, _, _ in _scalars(tmp_path)][:6] == [0, 1, 2, 3, 4, 5]
    events = _events(tmp_path)
    purge = [e for e in events if e.HasField("session_log")]
    assert purge and purge[0].step == 4
    assert [(s, v) for s, _, v in _scalars(tmp_path) if s >= 4][-2:] == [(4, 40.0), (5, 50.0)]


def test_reopening_without_resume_keeps_everything(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(2, {"loss": 1.0})
    with MetricsLogger(tmp_path) as logger:
        with pytest.raises(ValueError, match="pass resume_from_step"):
            logger.log(0, {"loss": 1.0})
        logger.log(3, {"loss": 2.0})
    assert [r["step"] for r in _lines(tmp_path)] == [2, 3]


def _synthetic_run(run_dir, keys):
    with MetricsLogger(run_dir) as logger:
        for step in range(20):
            logger.log(step, {k: math.sin(step + i) for i, k in enumerate(keys)})


def test_plot_writes_a_png_grid_of_the_known_metrics(tmp_path):
    keys = [
        "reward/mean",
        "eval/accuracy",
        "response_length/mean",
        "response_length/max",
        "staleness/mean",
        "staleness/max",
        "throughput/tokens_per_s",
        "loss",
        "grad_norm",
        "other",
    ]
    _synthetic_run(tmp_path, keys)
    out = plot_run(tmp_path)
    assert out == tmp_path / "curves.png" and out.stat().st_size > 0
    with Image.open(out) as image:  # 7 panels -> 3 columns x 3 rows
        assert image.size == (3 * PANEL_SIZE_IN[0] * DPI, 3 * PANEL_SIZE_IN[1] * DPI)


def test_plot_command_with_few_metrics_and_custom_output(tmp_path, capsys):
    _synthetic_run(tmp_path / "run", ["loss", "reward/mean"])
    out = tmp_path / "figs" / "curves.png"
    assert cli_main(["plot", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    with Image.open(out) as image:
        assert image.size == (2 * PANEL_SIZE_IN[0] * DPI, PANEL_SIZE_IN[1] * DPI)


def test_plot_errors_are_clear(tmp_path, capsys):
    assert cli_main(["plot", str(tmp_path / "missing")]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err
    _synthetic_run(tmp_path, ["something_else"])
    with pytest.raises(PlotError, match="none of the plotted metrics"):
        plot_run(tmp_path)
    _synthetic_run(tmp_path / "ok", ["loss"])
    (tmp_path / "a_file").write_text("where a directory is needed")
    assert cli_main(["plot", str(tmp_path / "ok"), "--out", str(tmp_path / "c.webp")]) == 0
    for out, message in ((tmp_path, "not an image file name"),  # a directory
                         (tmp_path / "x.xyz", "not an image file name"),
                         (tmp_path / "a_file" / "x.png", "cannot be written")):
        assert cli_main(["plot", str(tmp_path / "ok"), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    (tmp_path / METRICS_FILE).write_text('{"no_step": 1}\n')
    with pytest.raises(PlotError, match="none of the plotted metrics"):
        plot_run(tmp_path)


CRASHED_TAILS = {  # what a crash (or a damaged disk) can leave at the end of metrics.jsonl
    "torn": b'{"step": 3, "wall_time": 3.0, "lo',
    "undecodable": b"\xff\xfe\x80garbage",
    "overflowing": b'{"step": 1e999}\n',
}


@pytest.mark.parametrize("tail", CRASHED_TAILS)
def test_a_crashed_runs_metrics_plot_and_resume(tmp_path, tail, caplog):
    good = b'{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.0}\n'
    (tmp_path / METRICS_FILE).write_bytes(good + CRASHED_TAILS[tail])
    assert read_series(tmp_path / METRICS_FILE) == {"loss": ([1, 2], [2.0, 1.0])}
    assert "skipped 1 lines that are not metrics records (line 3)" in caplog.text
    with MetricsLogger(tmp_path, resume_from_step=3) as logger:
        logger.log(3, {"loss": 0.5})
    assert [r["step"] for r in _lines(tmp_path)] == [1, 2, 3]


def test_a_last_record_without_its_newline_is_kept_apart_from_the_next(tmp_path):
    # A crash between a record and its newline: the record is whole and must stay, on its own
    # line, through this resume and the next (appending merged it with the next record, and the
    # resume after that dropped both).
    (tmp_path / METRICS_FILE).write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.0}')
    with MetricsLogger(tmp_path, resume_from_step=3) as logger:
        logger.log(3, {"loss": 0.5})
    with MetricsLogger(tmp_path, resume_from_step=4) as logger:
        logger.log(4, {"loss": 0.25})
    assert [r["step"] for r in _lines(tmp_path)] == [1, 2, 3, 4]


def test_read_series_skips_nulls(tmp_path):
    (tmp_path / METRICS_FILE).write_text(
        '{"step": 0, "wall_time": 1.0, "loss": 2.0}\n{"step": 1, "wall_time": 2.0, "loss": null}\n'
        '{"step": 2, "wall_time": 3.0, "loss": 1.0}\n'
    )
    assert read_series(tmp_path / METRICS_FILE) == {"loss": ([0, 2], [2.0, 1.0])}


def test_plot_adds_the_accuracy_curve_measured_after_the_run(tmp_path):
    _synthetic_run(tmp_path, ["loss"])
    with Image.open(plot_run(tmp_path)) as image:  # one panel
        assert image.size == (PANEL_SIZE_IN[0] * DPI, PANEL_SIZE_IN[1] * DPI)
    (tmp_path / EVAL_CURVE_FILE).write_text(
        "".join(json.dumps({"step": v, "eval/accuracy": a}) + "\n"
                for v, a in ((0, 0.5), (10, 0.25), (20, 0.75))))
    with Image.open(plot_run(tmp_path)) as image:  # and the eval accuracy panel
        assert image.size == (2 * PANEL_SIZE_IN[0] * DPI, PANEL_SIZE_IN[1] * DPI)

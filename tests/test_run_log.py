"""The run's own log file (``<run_dir>/logs/train.log``): what goes there, what stays off the
console, and what a refused run leaves behind."""

import io
import logging

import pytest

from areal_jax.controller.run import run_log


@pytest.fixture
def console():
    """A console handler on the root logger at warnings, as ``areal-jax train`` sets up."""
    root, stream = logging.getLogger(), io.StringIO()
    handler, level = logging.StreamHandler(stream), root.level
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    yield stream
    root.removeHandler(handler)
    root.setLevel(level)


def test_the_run_log_keeps_info_the_console_leaves_out_and_the_error_that_stopped_the_run(
        tmp_path, console):
    path = tmp_path / "run" / "logs" / "train.log"
    log = logging.getLogger("areal_jax.trainer.ahead")
    with pytest.raises(RuntimeError, match="boom"), run_log(path) as accept:
        log.info("compiled ('train', (8, 128)) ahead in 0.5 s")  # held until accepted
        assert not path.exists()
        accept()
        log.warning("a server left")
        raise RuntimeError("boom")
    text = path.read_text()
    assert "INFO areal_jax.trainer.ahead [MainThread] compiled ('train', (8, 128))" in text
    assert "WARNING" in text and "a server left" in text
    assert "ERROR areal_jax [MainThread] the run stopped: RuntimeError: boom" in text
    assert "Traceback" in text
    assert console.getvalue() == "a server left\n"  # the console: warnings only, as before
    log.info("after the run")  # levels are as they were: nothing more goes anywhere
    assert "after the run" not in path.read_text() + console.getvalue()


def test_a_run_refused_before_it_was_accepted_writes_nothing(tmp_path, console):
    """A config the checks refuse, or a run directory another process trains: what it logged
    (here a warning) goes to the console, not into a file of its own or of the running run."""
    with pytest.raises(ValueError), run_log(tmp_path / "run" / "logs" / "train.log"):
        logging.getLogger("areal_jax.controller.sft_phase").warning("the tokenizer's end token")
        raise ValueError("run_dir is in use")
    assert not (tmp_path / "run").exists()
    assert console.getvalue() == "the tokenizer's end token\n"


def test_progress_off_a_terminal_prints_a_bounded_number_of_lines(capsys):
    # SFT printed a line per step (250 lines); a loss near 1e-3 printed as 0.000 or -0.000.
    from areal_jax.controller.progress import TrainingProgress, summary

    assert summary({"loss": -0.000412, "reward/mean": 0.5}) == "loss -0.000412  reward 0.500"
    with TrainingProgress() as progress:  # stdout captured: not a terminal
        sft = progress.start_phase("SFT warm start", 250)
        for _ in range(250):
            progress.advance(sft, {"loss": 0.25})
        progress.end_phase(sft)
        held_out = progress.start_phase("evaluating version 0", 40, lines=10)
        for _ in range(40):
            progress.advance(held_out)
        progress.end_phase(held_out)
        progress.advance(held_out)  # an answer after its evaluation was given up: nothing
    lines = capsys.readouterr().out.splitlines()
    steps = [line.split()[3] for line in lines if line.startswith("  SFT warm start")]
    assert steps == [f"{k}/250" for k in [*range(3, 250, 3), 250]]
    assert [line for line in lines if line.startswith("  evaluating")] == [
        f"  evaluating version 0 {k}/40" for k in range(4, 41, 4)]

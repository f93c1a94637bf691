"""Bad numbers and awkward files on the command line: one clear line and exit status 2,
before anything runs; JSON output that other tools can read."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from pipeblocks import Costs, Schedule, ScheduleError, schedules
from pipeblocks.cli.common import json_text
from pipeblocks.cli.main import main
from pipeblocks.core.cost.costs import parse_costs


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _strict_json(text: str):
    def refuse(constant):
        raise AssertionError(f"JSON holds {constant}, which JSON does not have")

    return json.loads(text, parse_constant=refuse)


# ---- numbers ------------------------------------------------------------------------------
SCHEDULE_COMMANDS = ("show", "simulate", "compare", "plot", "export")


@pytest.mark.parametrize("command", SCHEDULE_COMMANDS)
@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--costs", "nan,1,1", "must be finite"),
        ("--costs", "1,1,1,nan", "must be finite"),
        ("--costs", "inf,1,1", "must be finite"),
        ("--memory-limit", "nan", "finite number"),
        ("--memory-limit", "0", "> 0"),
        ("--mem-w-ratio", "nan", "finite number"),
        ("--mem-w-ratio", "1.5", "in [0, 1]"),
        ("-p", "0", ">= 1"),
        ("-m", "-3", ">= 1"),
        ("-v", "0", ">= 1"),
        ("--group-size", "0", ">= 1"),
        ("--seq-chunks", "0", ">= 1"),
        ("--set", "memory_limit=nan", "must be a finite number"),
        ("--set", "memory_limit=inf", "must be a finite number"),
        # the data-parallel options are checked by the request (core), before anything runs
        ("--dp", "0", "dp must be an integer >= 1"),
        ("--dp-bandwidth", "nan", "--dp-bandwidth must be a finite number > 0"),
        ("--dp-latency", "inf", "--dp-latency must be a finite number >= 0"),
        ("--gpu-memory", "nan", "--gpu-memory must be a finite number > 0"),
    ],
)
def test_every_numeric_schedule_option_rejects_bad_numbers(capsys, tmp_path, command, option, value, message):
    name = [] if command == "compare" else ["zb"]
    extra = ["-o", str(tmp_path / "x.png")] if command == "plot" else []
    code, out, err = run_cli(capsys, command, *name, option, value, *extra)
    assert code == 2, (out, err)
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert out == ""


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--lr", "nan", "argument --lr: expected a finite number"),
        ("--lr", "-1", "argument --lr: expected a number > 0"),
        ("--lr", "inf", "argument --lr: expected a finite number"),
        ("--timeout", "nan", "argument --timeout: expected a finite number"),
        ("--timeout", "0", "argument --timeout: expected a number > 0"),
        ("--memory-limit", "inf", "argument --memory-limit"),
        ("--emulate", "nan,1,1", "three milliseconds"),
        ("--emulate", "1,inf,1", "three milliseconds"),
        ("--steps", "0", "argument --steps"),
        ("--save-every", "-1", "argument --save-every"),
        ("--microbatch-size", "0", "argument --microbatch-size"),
        ("--layers", "0", "argument --layers"),
        ("--hidden", "0", "argument --hidden"),
        ("--heads", "0", "argument --heads"),
        ("--seq", "0", "argument --seq"),
        ("--seed", "-1", "argument --seed"),
        ("--plot", "run.bmp", "use a .png, .svg, .pdf suffix"),
    ],
)
def test_every_numeric_train_option_is_checked_before_launch(capsys, option, value, message):
    code, out, err = run_cli(capsys, "train", option, value)
    assert code == 2
    assert message in err and "Traceback" not in err
    assert "training" not in out  # nothing was launched


def test_bad_plot_suffix_is_caught_before_the_work(capsys, tmp_path):
    code, out, err = run_cli(capsys, "compare", "--plot", str(tmp_path / "c.bmp"))
    assert code == 2 and "argument --plot" in err and out == ""  # no table: nothing was simulated
    code, out, err = run_cli(capsys, "plot", "1f1b", "-o", str(tmp_path / "c.jpg"))
    assert code == 2 and "argument -o/--output" in err


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("field", ["t_f", "t_b", "t_w", "t_comm", "mem_b", "mem_w_ratio"])
def test_costs_reject_non_finite_values_in_the_python_api(field, bad):
    with pytest.raises(ScheduleError, match=f"cost {field} must be >= 0 and finite"):
        Costs(**{field: bad})
    with pytest.raises(ScheduleError, match=f"cost {field} must be >= 0 and finite"):
        Costs(**{field: (1.0, bad)})


def test_parse_costs_and_sequence_shares_reject_non_finite_values():
    for text in ("nan,1,1", "1,1,1,nan", "1,inf,1", "1,1,-inf"):
        with pytest.raises(ScheduleError, match="finite"):
            parse_costs(text)
    with pytest.raises(ScheduleError, match="seq_time must be finite"):
        Costs(seq_time=(0.5, math.nan))


def test_train_config_rejects_non_finite_learning_rate_and_timeout():
    from pipeblocks.train.config import ModelChoice, ScheduleSpec, TrainConfig

    schedule = ScheduleSpec(schedules.get("1f1b")(p=2, m=2))
    for field in ("lr", "timeout_s"):
        for bad in (math.nan, math.inf, 0.0):
            with pytest.raises(ValueError, match=f"{field} must be a finite number > 0"):
                TrainConfig(schedule=schedule, model=ModelChoice(), **{field: bad})


def test_json_output_never_holds_nan_or_infinity(capsys):
    assert _strict_json(json_text({"a": math.nan, "b": [math.inf, 1.5], "c": (-math.inf,)})) == {
        "a": None, "b": [None, 1.5], "c": [None]}
    code, out, _ = run_cli(capsys, "compare", "-p", "2", "-m", "4", "--costs", "0,0,0", "--json")
    assert code == 0
    rows = _strict_json(out)["schedules"]
    assert all(r["bubble_ratio"] is None or math.isfinite(r["bubble_ratio"]) for r in rows)


# ---- schedule files ------------------------------------------------------------------------
def test_file_replaces_the_schedule_name(capsys, tmp_path):
    saved = tmp_path / "s.json"
    assert run_cli(capsys, "show", "1f1b", "-p", "3", "-m", "4", "-o", str(saved))[0] == 0
    code, out, err = run_cli(capsys, "show", "--file", str(saved))
    assert code == 0 and "rank 2" in out, err
    code, out, err = run_cli(capsys, "simulate", "--file", str(saved), "--json")
    assert code == 0 and json.loads(out)["peak_activation"] == [3, 2, 1], err
    code, out, err = run_cli(capsys, "show")
    assert code == 2 and "needs a schedule name or a file" in err and "--file F" in err


def _good_json() -> dict:
    return schedules.get("1f1b")(p=2, m=2).to_json()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"p": 2.7}, "'p' must be a whole number, got 2.7"),
        ({"m": "two"}, "'m' must be a whole number"),
        ({"p": True}, "'p' must be a whole number"),
        ({"p": None}, "'p' must be a whole number"),
        ({"seq_chunks": 1.0}, "'seq_chunks' must be a whole number"),
        ({"placement": [0, 1]}, "placement must be an object"),
        ({"placement": {"stage_to_rank": [0, 1.5]}}, "list of whole rank numbers"),
        ({"placement": {"stage_to_rank": 3}}, "list of whole rank numbers"),
        ({"ranks": [1, 2]}, '"ranks" must be a list of strings'),
        ({"ranks": [["0F0"], ["1F0"]]}, '"ranks" must be a list of strings'),
        ({"ranks": 5}, '"ranks" must be a list of strings'),
        ({"options": "abc"}, '"options" must be an object'),
        ({"options": [1]}, '"options" must be an object'),
        ({"name": {"a": 1}}, '"name" must be a string'),
        ({"p": None, "m": None, "drop": "p"}, "missing field(s) 'p'"),
    ],
)
def test_malformed_json_schedule_files_are_one_line_errors(capsys, tmp_path, change, message):
    data = {**_good_json(), **change}
    data.pop(data.pop("drop", None), None)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    code, _, err = run_cli(capsys, "simulate", "--file", str(path))
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("suffix", [".json", ".txt", ".csv"])
@pytest.mark.parametrize("bom, newline", [(True, "\n"), (False, "\r\n"), (True, "\r\n")], ids=["bom", "crlf", "bom-crlf"])
def test_schedule_files_with_a_byte_order_mark_or_crlf_load(capsys, tmp_path, suffix, bom, newline):
    plain = tmp_path / f"plain{suffix}"
    assert run_cli(capsys, "export", "zb-v", "-p", "2", "-m", "2", "-o", str(plain))[0] == 0
    text = plain.read_text().replace("\n", newline)
    odd = tmp_path / f"odd{suffix}"
    odd.write_bytes(("\ufeff" if bom else "").encode() + text.encode())
    code, out, err = run_cli(capsys, "simulate", "--file", str(odd), "--json")
    assert code == 0, err
    assert json.loads(out)["makespan"] == json.loads(run_cli(capsys, "simulate", "zb-v", "-p", "2", "-m", "2",
                                                             "--json")[1])["makespan"]


def test_a_file_that_is_not_text_is_a_clear_error(capsys, tmp_path):
    path = tmp_path / "s.txt"
    path.write_bytes(b"\xff\xfe\x00garbage")
    code, _, err = run_cli(capsys, "simulate", "--file", str(path))
    assert code == 2 and "is not UTF-8 text" in err


def test_text_header_with_a_non_integer_is_a_clear_error():
    text = schedules.get("1f1b")(p=2, m=2).to_text().replace("m=2", "m=2.5")
    with pytest.raises(ScheduleError, match="m=2.5: expected whole numbers"):
        Schedule.from_text(text)


# ---- the command line as a program ---------------------------------------------------------
@pytest.mark.spawn
def test_output_cut_short_by_its_reader_ends_quietly():
    proc = subprocess.Popen([sys.executable, "-m", "pipeblocks.cli.main", "show", "1f1b", "-p", "8", "-m", "3000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()  # as `| head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141  # 128 + SIGPIPE, as other tools end
    assert err == ""


def test_version(capsys):
    from pipeblocks import __version__

    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out.strip() == f"pipeblocks {__version__}"


def test_compare_with_an_option_its_reference_cannot_take_is_a_clear_error(capsys):
    code, _, err = run_cli(capsys, "compare", "--set", "memory_limit=3")
    assert code == 2 and "compare measures memory against 1f1b" in err and "Traceback" not in err


@pytest.mark.parametrize("field", ["flops", "efficiency", "bandwidth", "latency"])
def test_hardware_profiles_reject_non_finite_numbers(field):
    from pipeblocks.sim.analytic import HARDWARE

    values = {"flops": 312e12, "efficiency": 0.5, "bandwidth": 25e9, "latency": 1e-5, field: math.nan}
    with pytest.raises(ScheduleError, match="need finite"):
        type(HARDWARE["a100"])("x", **values)


def test_long_builds_report_progress_on_stderr(capsys):
    """A generator build past its threshold logs its steps; the CLI shows them on stderr only."""
    import logging

    from pipeblocks.cli.main import _show_progress
    from pipeblocks.schedules._progress import Progress

    _show_progress()
    progress = Progress("v-half", after=0.0)
    progress.step("compacting the block")
    err = capsys.readouterr()
    logger = logging.getLogger("pipeblocks")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    assert "v-half: compacting the block" in err.err
    assert err.out == ""

"""The `pipeblocks` command line: output, JSON fields, and user errors without tracebacks."""
import json
import subprocess
import sys

import pytest

from pipeblocks.cli.main import main


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_list(capsys):
    code, out, _ = run_cli(capsys, "list")
    assert code == 0 and "1f1b" in out and "gpipe" in out
    code, out, _ = run_cli(capsys, "list", "--json")
    assert {"name": "bfs"}.items() <= next(r for r in json.loads(out) if r["name"] == "bfs").items()


def test_simulate_json_fields(capsys):
    code, out, _ = run_cli(capsys, "simulate", "1f1b", "-p", "4", "-m", "8", "--json")
    data = json.loads(out)
    assert code == 0
    assert data["schedule"] == "1f1b" and data["p"] == 4 and data["m"] == 8
    assert data["bubble_ratio"] == pytest.approx(3 / 11) and data["makespan"] == 33
    assert data["peak_activation"] == [4, 3, 2, 1]


def test_simulate_with_costs_and_v(capsys):
    code, out, _ = run_cli(capsys, "simulate", "interleaved-1f1b", "-p", "4", "-m", "8", "-v", "4",
                           "--costs", "1,1,1,0", "--json")
    assert code == 0 and json.loads(out)["bubble_ratio"] == pytest.approx(3 / 35)


def test_show_and_actions(capsys):
    code, out, _ = run_cli(capsys, "show", "1f1b", "-p", "2", "-m", "2")
    assert code == 0 and "rank 0" in out and "BW0" in out
    code, out, _ = run_cli(capsys, "show", "gpipe", "-p", "2", "-m", "2", "--actions")
    assert out.splitlines()[1] == "0: 0F0 0F1 0BW0 0BW1"


def test_compare_table_json_and_plot(capsys, tmp_path):
    plot = tmp_path / "cmp.png"
    code, out, _ = run_cli(capsys, "compare", "-p", "4", "-m", "8", "--json", "--plot", str(plot))
    data = json.loads(out)
    rows = {r["schedule"]: r for r in data["schedules"]}
    assert rows["1f1b"]["peak_vs_1f1b"] == 1 and rows["gpipe"]["peak_vs_1f1b"] == 2
    assert plot.stat().st_size > 1000
    code, out, _ = run_cli(capsys, "compare", "-p", "4", "-m", "8", "--schedules", "gpipe,interleaved-1f1b")
    assert code == 0 and "interleaved-1f1b" in out and "vs 1F1B" in out


def test_plot_and_saved_schedule_round_trip(capsys, tmp_path):
    saved = tmp_path / "s.json"
    run_cli(capsys, "show", "1f1b", "-p", "3", "-m", "4", "-o", str(saved))
    code, out, _ = run_cli(capsys, "simulate", "custom", "--file", str(saved), "--json")
    assert code == 0 and json.loads(out)["peak_activation"] == [3, 2, 1]
    code, out, _ = run_cli(capsys, "plot", "1f1b", "-p", "3", "-m", "4", "-o", str(tmp_path / "t.svg"))
    assert code == 0 and (tmp_path / "t.svg").exists()


def test_model_costs(capsys):
    code, out, _ = run_cli(capsys, "simulate", "1f1b", "-p", "4", "-m", "8", "--model", "8,512,8,256", "--json")
    data = json.loads(out)
    assert code == 0 and data["peak_activation"][0] > 1e6  # bytes


@pytest.mark.parametrize(
    "argv, message",
    [
        (["simulate", "nope"], "unknown schedule 'nope'; choose one of"),
        (["simulate", "1f1b", "-p", "0"], "argument -p: expected a whole number >= 1, got '0'"),
        (["simulate", "1f1b", "-m", "0"], "argument -m: expected a whole number >= 1, got '0'"),
        (["simulate", "1f1b", "--costs", "1,-1,1"], "costs must be >= 0"),
        (["simulate", "1f1b", "-v", "2"], "does not take -v"),
        (["simulate", "x", "--file", "/nonexistent/s.json"], "cannot read schedule file"),
        (["plot", "1f1b", "-o", "out.bmp"], "suffix"),
        (["simulate", "1f1b", "--model", "1.5b", "--costs", "1,1,1"], "not both"),
    ],
)
def test_user_errors_exit_2_with_message(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert message in err and "Traceback" not in err


@pytest.mark.spawn
def test_malformed_schedule_file_subprocess(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("0: 0F0 0QQ1\n")
    proc = subprocess.run([sys.executable, "-m", "pipeblocks.cli.main", "simulate", "x", "--file", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "cannot parse action '0QQ1'" in proc.stderr and "Traceback" not in proc.stderr


def test_export_torch_csv_round_trip(capsys, tmp_path):
    path = tmp_path / "zbv.csv"
    code, _, err = run_cli(capsys, "export", "zb-v", "-p", "4", "-m", "8", "-o", str(path))
    assert code == 0 and "wrote" in err
    first = path.read_text().splitlines()[0].split(",")
    assert first[:3] == ["0F0", "0F1", "0F2"] and "7I0" in first  # our B is torch's I
    code, out, _ = run_cli(capsys, "simulate", "x", "--file", str(path), "--json")
    data = json.loads(out)
    code2, out2, _ = run_cli(capsys, "simulate", "zb-v", "-p", "4", "-m", "8", "--json")
    assert code == 0 and data["makespan"] == json.loads(out2)["makespan"]
    assert data["peak_activation"] == json.loads(out2)["peak_activation"]


def test_export_text_to_stdout(capsys):
    code, out, _ = run_cli(capsys, "export", "1f1b", "-p", "2", "-m", "2")
    assert code == 0 and out.splitlines()[1] == "0: 0F0 0F1 0BW0 0BW1"


def test_set_passes_generator_options(capsys):
    code, out, _ = run_cli(capsys, "simulate", "zb-v", "-p", "4", "-m", "8", "--set", "cost_aware=true",
                           "--costs", "3,4,2", "--json")
    assert code == 0 and json.loads(out)["schedule"] == "zb-v"
    code, _, err = run_cli(capsys, "simulate", "zb-v", "--set", "bogus=1")
    assert code == 2 and "has no option 'bogus'" in err
    code, _, err = run_cli(capsys, "simulate", "zb-v", "--set", "cost_aware")
    assert code == 2 and "expected KEY=VALUE" in err


def test_sequence_chunks_on_the_command_line(capsys):
    code, out, _ = run_cli(capsys, "simulate", "zb-h1", "-p", "4", "-m", "8", "--seq-chunks", "2", "--json")
    data = json.loads(out)
    assert code == 0 and data["seq_chunks"] == 2 and data["peak_activation"][0] == 2.5
    code, out, _ = run_cli(capsys, "simulate", "seq1f1b", "-p", "4", "-m", "8", "--seq-chunks", "4",
                           "--model", "8,512,8,4096", "--seq-split", "even", "--json")
    assert code == 0 and json.loads(out)["seq_chunks"] == 4
    code, _, err = run_cli(capsys, "simulate", "seq1f1b", "--seq-chunks", "8", "--model", "4,64,4,4")
    assert code == 2 and "cannot split a sequence of 4 tokens into 8 chunks" in err


def test_compare_says_which_bubble_to_compare_with_the_papers(capsys):
    code, out, _ = run_cli(capsys, "compare", "-p", "2", "-m", "4", "--schedules", "zb-h2")
    assert code == 0 and "bubble_ratio_span, over each rank's own span - the figure to compare with the papers" in out


def test_costs_on_the_command_line_make_v_half_cost_aware(capsys):
    spans = {}
    for extra in ((), ("--set", "cost_aware=false")):
        code, out, _ = run_cli(capsys, "simulate", "v-half", "-p", "4", "-m", "8", "--costs", "3,4,2", "--json", *extra)
        assert code == 0
        spans[extra] = json.loads(out)["bubble_ratio_span"]
    assert spans[()] < spans[("--set", "cost_aware=false")]

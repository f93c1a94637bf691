"""README.md shows what its commands print (scripts/readme_outputs.py)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    if "readme_outputs" not in sys.modules:
        spec = importlib.util.spec_from_file_location("readme_outputs", ROOT / "scripts" / "readme_outputs.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclass looks its module up by name
        spec.loader.exec_module(module)
    return sys.modules["readme_outputs"]


def test_readme_and_docs_outputs_agree_with_their_commands():
    """README (plan, its schedule table) and the docs pages (list, show, simulate --json, compare,
    the Python API lines); train blocks need --train."""
    script = _script()
    kinds = {}
    for page in script.PAGES:
        text = (ROOT / page).read_text()
        kinds[page] = {b.command.split()[1] for b in script.find_blocks(text) if b.command}
        _, problems = script.check(text)
        assert problems == [], page
        assert script.check_schedule_table(text) == [], page
    assert {"train", "plan"} <= kinds["README.md"]
    assert {"list", "show", "simulate", "compare"} <= kinds["docs/cli.md"]


def test_readme_starts_short():
    """Under 150 lines; the two set-up commands, a train and a plan come first, then the
    schedule table, then links."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 150
    order = [text.index(s) for s in ("bash scripts/main.sh", "bash scripts/test.sh", "$ pipeblocks train",
                                     "$ pipeblocks plan", "| schedule | memory vs 1F1B", "## Documentation")]
    assert order == sorted(order)
    script = _script()
    assert len(script.find_blocks(text)) == 3  # set-up, train and plan: nothing else to read before the links


def test_a_wrong_schedule_table_figure_is_found():
    script = _script()
    table = "| `v-half` | 0.750 | 0.0943 | 0.0943 | ok |\n| `1f1b` | 1.000 | 0.2700 | 0.2727 | wrong |\n"
    problems = script.check_schedule_table(table)
    assert len(problems) == 1 and "`1f1b` shows 1.000 0.2700 0.2727" in problems[0]


def test_a_wrong_output_is_found_and_rewritten(tmp_path):
    script = _script()
    text = "intro\n```text\n$ pipeblocks show gpipe -p 2 -m 1 --actions\n# wrong\n0: 0F0 0BW0\n```\n" \
           "```python\nimport pipeblocks as pb\nprint(pb.simulate(pb.schedules.get('1f1b')(p=2, m=2)).makespan)\n# 99\n```\n"
    fixed, problems = script.check(text, write=True, root=tmp_path)
    assert len(problems) == 2
    assert "0: 0F0 0BW0\n1: 1F0 1BW0\n" in fixed and "# 9.0\n" in fixed and fixed.startswith("intro\n")
    assert script.check(fixed, root=tmp_path)[1] == []


def test_train_blocks_compare_losses_and_memory_but_not_times():
    script = _script()
    shown = ("$ pipeblocks train -p 2\ntraining 2-layer GPT: schedule 1f1b\nstep     1/3  loss 5.5457 ...\n"
             "step     3/3  loss 3.4022      3,568 tokens/s    573.9 ms\n"
             "iteration time  measured    704.9 ms   simulated    209.3 ms\n"
             "   0  0,7                        6.4 MiB     6.4 MiB                1.000\n")
    block = script.find_blocks(f"```text\n{shown}```\n")[0]
    run = ("training 2-layer GPT: schedule 1f1b\nstep     1/3  loss 5.5457      1,000 tokens/s    1.0 ms\n"
           "step     2/3  loss 4.0000      1,000 tokens/s    1.0 ms\nstep     3/3  loss 3.4022      9,999 tokens/s    9.9 ms\n"
           "iteration time  measured    1.0 ms   simulated    2.0 ms\n"
           "   0  0,7                        6.4 MiB     6.4 MiB                1.000\n")
    assert script._same(block, run)
    assert not script._same(block, run.replace("3.4022", "3.4023"))
    assert not script._same(block, run.replace("6.4 MiB     6.4", "6.5 MiB     6.4"))
    assert script._train_block(run).splitlines()[1:3] == ["step     1/3  loss 5.5457 ...",
                                                          "step     3/3  loss 3.4022      9,999 tokens/s    9.9 ms"]


def test_train_blocks_leave_out_the_eval_lines_the_cut_leaves_out():
    # README cuts a run after its first step's loss up to its last step: the held-out losses
    # evaluated in between are not shown, the last one is and must agree
    script = _script()
    shown = ("$ pipeblocks train -p 2 --steps 4 --eval-every 2\ntraining 2-layer GPT\nstep     1/4  loss 5.5457 ...\n"
             "step     4/4  loss 3.4022      3,568 tokens/s    573.9 ms\neval     4/4  held-out loss 3.1000\n")
    block = script.find_blocks(f"```text\n{shown}```\n")[0]
    run = ("training 2-layer GPT\nstep     1/4  loss 5.5457      1,000 tokens/s    1.0 ms\n"
           "step     2/4  loss 4.0000      1,000 tokens/s    1.0 ms\neval     2/4  held-out loss 3.9000\n"
           "step     3/4  loss 3.7000      1,000 tokens/s    1.0 ms\n"
           "step     4/4  loss 3.4022      9,999 tokens/s    9.9 ms\neval     4/4  held-out loss 3.1000\n")
    assert script._same(block, run)
    assert not script._same(block, run.replace("loss 3.1000", "loss 3.1001"))

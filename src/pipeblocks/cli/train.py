"""`pipeblocks train`: train a model with a schedule, one process per rank (local, or torchrun's).

    pipeblocks train                                         # 8-layer GPT, v-half, p=2, m=4, 40 steps
    pipeblocks train --model-family llama --kv-heads 2 --precision bf16-mixed   # Llama-style, bf16 compute
    pipeblocks train --model-family hf-llama --schedule zb-v -p 2 -m 4          # transformers' LlamaForCausalLM
    torchrun --nproc-per-node 4 -m pipeblocks train --schedule v-half -p 4       # one process per GPU
    pipeblocks train --schedule 1f1b -p 4 -m 8 --steps 20 --report run.json   # + run.png
    pipeblocks train --schedule zb-h1 -p 2 -m 4 --dtype float64 --verify      # one step vs one process
    pipeblocks train --schedule 1f1b -p 2 -m 4 --emulate 5,5,3 --steps 5   # sleep 5/5/3 ms per layer
    pipeblocks train --schedule seq1f1b -p 2 -m 4 --seq 256 --seq-chunks 4 --seq-split balanced
    pipeblocks train --schedule zb-h1 --seq-chunks 2 --dtype float64 --verify   # any schedule, split by sequence
    pipeblocks train --data notes.txt --seq 128 --layers 8 --hidden 128 --heads 8
    pipeblocks train --checkpoint ckpt --steps 20 --lr-decay-steps 40   # then, to continue to step 40:
    pipeblocks train --checkpoint ckpt --steps 40 --resume
    pipeblocks train --clip-grad 1.0                         # global-norm clipping, no barrier before the step
    pipeblocks train --eval-every 10 --metrics run.jsonl     # held-out loss every 10 steps; one JSON line per step
    pipeblocks train --schedule zb-v -p 4 -m 8 --layers 8 --dry-run   # predicted memory and time, no launch
    pipeblocks train --schedule zb-v -p 2 -m 4 --dp 2 --sharding zero3 --dtype float64 --verify   # 2 x 2 mesh
    pipeblocks train --model-family llama -p 2 --tp 2 --precision bf16-mixed   # 2 pipeline x 2 tensor-parallel
    pipeblocks train --hf models/qwen2 --data notes.jsonl --seq 256 --save-hf out/   # a checkpoint, fine-tuned
    pipeblocks train --model my_model.py:SPEC --dp 2 --precision bf16-mixed   # your own ModelSpec
    pipeblocks train --model-family llama --tokenizer tok/ --vocab 32000 --data corpus.bin --data-dtype uint16

`--model-family` picks a built-in model: gpt (the reference GPT), llama (the built-in
Llama-style model: RMSNorm, rotary positions, SwiGLU, grouped-query attention with
--kv-heads), or hf-llama (Hugging Face transformers' LlamaForCausalLM of the same size,
random weights; needs `pip install -e .[hf]`), sized by --layers, --hidden, --heads,
--kv-heads, --seq and --vocab. `--hf DIR` trains the model of a Hugging Face directory
(config.json, safetensors weights, tokenizer files) from its own weights, with its own
tokenizer (docs/fine-tune.md); `--model FILE.py:NAME` (or package.module:NAME, or a name
given to `register_model`) trains your own `ModelSpec` (docs/your-model.md). With either,
the sizes come from the model and only --seq is the run's.

`--data` takes a text file, a JSONL file (documents in the "text" field, or
`--data-field`), a pre-tokenized token file or a directory of them (little-endian
`--data-dtype` uint16 or uint32, as nanoGPT writes them), or a `datasets` directory
saved with save_to_disk. Text is tokenized once with `--tokenizer` (a directory or a
tokenizer.json; default the --hf directory's, else UTF-8 bytes) into a memory-mapped
token file cached beside it; no rank reads the corpus into memory. `--save-hf DIR` writes
the trained model as a Hugging Face directory at the end (config.json, safetensors,
tokenizer files), which `transformers.AutoModelForCausalLM.from_pretrained` loads.

`--precision` is fp32 (default), fp64, or bf16-mixed: bfloat16 compute and activations,
float32 master weights, AdamW state, gradient accumulation and reduction, and loss
(`--dtype float32|float64` is the older name of fp32|fp64). `--device auto` (default)
trains on CUDA when there is a GPU for every local rank, else on the CPU; `--device cuda`
with fewer GPUs than ranks is refused before anything starts.

Under torchrun (`torchrun --nnodes N --nproc-per-node G -m pipeblocks train ...`, the
environment rendezvous detected) each process is one rank, p x dp x tp must equal the world
size, the rank holding the last stage prints the progress and global rank 0 writes the
report; the options are those of a local run.

Each step prints `step, loss, tokens/s`. At the end it prints, per rank, the measured peak
saved-activation bytes beside the simulator's prediction, and the measured iteration time
and bubble beside the simulated ones, with costs profiled from this run (report.py in
pipeblocks.train). `--report FILE` writes that as JSON and `--plot FILE` (default: the
report's name with .png) draws the measured timeline under the simulated one.

`--verify` runs one step and compares the loss and every gradient with one process
training the whole model in the same precision: it prints the largest relative difference
and exits 1 beyond the tolerance (fp64 1e-10, fp32 1e-5, bf16-mixed 1e-2: see
pipeblocks.train.reference.TOLERANCE for why).

`--clip-grad X` clips the gradients by their global norm over all ranks; with or without
it, a step whose gradient is non-finite on any rank is skipped on every rank. Neither adds
a barrier before the optimizer step: each rank steps at once and undoes the step if the
global check, which completes alongside, says so (post-validation, Zero Bubble section 4).
With `--verify` and `--clip-grad` the clipped step is taken and the clipped gradients and
updated weights are compared with synchronous clipping in one process.

The learning rate warms up linearly over `--warmup-steps` (default a tenth of the run),
then follows `--lr-schedule` (default cosine from --lr down to `--min-lr`, --lr/10); a
checkpoint carries the schedule and a resumed run continues it exactly. `--held-out F`
(default 0.05) keeps the last share F of the data out of training; `--eval-every N`
prints and reports the loss on it every N steps. `--metrics FILE.jsonl` writes one JSON
line per step (loss, lr, tokens/s, step time, eval loss, memory) as the run goes.

Checkpoints are verified (size and sha256) before a resume: a damaged newest checkpoint
is reported and the newest step intact on every rank is used. A new run refuses a
`--checkpoint` directory that holds checkpoints unless given `--overwrite`.

`--seq-chunks K` cuts every microbatch into K sequence chunks (Seq1F1B, Sun et al. 2024):
seq1f1b and seq1f1b-i take it directly (default 2), any other schedule is composed with
`split_sequence`. `--seq-split` chooses equal-FLOP ("balanced", the default) or equal-token
chunks; the report's predicted memory uses each chunk's measured share.

`--dry-run` prints the schedule as a text timeline, the predicted activation memory and
static memory (parameters, gradients and AdamW state: 16 bytes per float32 parameter, 28 with the
optimistic step's spare copies; 16 with --step-barrier; with --dp or --sharding, what the
sharding policies hold at the step's peak) per rank and the predicted iteration time, then
exits without starting a process.

`--dp D` runs D replicas of the pipeline (p x D processes on a ("pp", "dp") device mesh;
a step trains on D x m microbatches) and `--sharding` shards each chunk over them:
replicate, zero1, zero2, zero3, or one policy per chunk (docs/mesh.md).

`--tp T` splits every stage over T processes with torch's tensor parallelism (DTensor:
column- and row-wise projections, sequence parallelism between them; p x dp x T processes
on a ("pp", "dp", "tp") mesh, tp innermost). T must divide the heads, KV heads, MLP width,
vocabulary and sequence length; with --dp, sharding is zero2 or zero3 (docs/tensor-parallel.md).

`--async MODE` (pipedream, naive, pipemare, nesterov) trains with 1F1B's asynchronous
form: no flush, each stage steps its optimizer once its m backwards of a step are done;
`--steps` counts optimizer steps, `--sync-warmup-steps W` runs the first W synchronously,
`--lr-warmup-steps K` and `--discrepancy-decay D` are pipemare's T1 and T2 (D also sets
nesterov's look-ahead). It prints the
loss per step, each stage's delays and tokens/s, and the steady state measured beside the
simulated one (`--report FILE` writes it); `--checkpoint DIR [--save-every N]` drains the
pipeline at each save point, on SIGTERM/SIGINT/SIGHUP too, and saves every stage's weights,
optimizer and mode state, which `--resume` continues; `--verify` compares every loss, rate
and weight with the one-process replay of the same run (docs/pipemare.md).

The schedule options are those of `pipeblocks simulate` (-v, --group-size, --memory-limit,
--seq-chunks, --set, --file); the run itself lives in `pipeblocks.train.run`.

Bad input (unknown schedule, m the schedule cannot take, layers < stages, a sequence
longer than the data, more sequence chunks than tokens) is reported before any process
starts, with exit status 2.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from ..core.cost.hf_config import read_hf_config
from ..core.cost.precision import PRECISION_NAMES, precision_policy
from ..resolve.request import CostSpec
from ..models.config import GPTConfig
from ..models.family import FAMILIES, family_names
from ..models.spec import portable_reference
from ..train import run as training
from ..train.config import DataSpec, TrainConfig
from ..train.model_choice import HF_PREFIX, ModelChoice
from ..train.run import DEFAULT_P, DEFAULT_SCHEDULE, FALLBACK_SCHEDULE, default_schedule
from .argtypes import nonneg_float, nonneg_int, plot_file, positive_float, positive_int
from ..train.lr_schedule import DEFAULT_LR, DEFAULT_LR_WIDTH, DEFAULT_WARMUP_CAP, LR_SCHEDULES, default_lr
from ..train.loop_options import DEFAULT_HELD_OUT
from ..schedules.asynchronous import ASYNC_FORMS
from .async_sim import add_mode_options, mode_from_args
from .common import add_generator_options, request_from_args
from ..sim.hardware_profile import check_hardware_text

__all__ = ["register", "run", "prepare_from_args", "DEFAULT_SCHEDULE"]

ASYNC_DEFAULT_SCHEDULE = next(iter(ASYNC_FORMS))
DEFAULT_OTHER_SEQ = 256
"""--seq's default with --hf and --model (at most the model's context)"""


def register(sub) -> None:
    parser = sub.add_parser(
        "train", help="train a model (GPT, Llama, Hugging Face Llama) with a schedule; report measured vs simulated",
        description=__doc__.split("\n\n")[0],
    )
    add_generator_options(parser, name="option", p=DEFAULT_P, m=4,
                          name_help=f"schedule name (default {DEFAULT_SCHEDULE}, or {FALLBACK_SCHEDULE} if absent)")
    _add_model_options(parser.add_argument_group("model and data"))
    _add_training_options(parser.add_argument_group("training"))
    _add_output_options(parser, parser.add_argument_group("checks and output"))
    parser.set_defaults(run=run)


def _add_model_options(model: argparse._ArgumentGroup) -> None:
    which = model.add_mutually_exclusive_group()
    which.add_argument("--model-family", default=None, choices=family_names(),
                       help="a built-in model: gpt (the reference GPT, default), llama (built-in Llama-style), hf-llama "
                       "(transformers' LlamaForCausalLM; pip install -e .[hf])")
    which.add_argument("--hf", default=None, metavar="DIR",
                       help="a Hugging Face model directory (config.json, safetensors, tokenizer files): train it from "
                       "its own weights (docs/fine-tune.md)")
    which.add_argument("--model", default=None, metavar="FILE.py:NAME",
                       help="your own ModelSpec: FILE.py:NAME, package.module:NAME or a registered name "
                       "(docs/your-model.md)")
    # defaults come from GPTConfig and TrainConfig, the one place they are set; None marks "not given"
    model.add_argument("--layers", type=positive_int, default=None,
                       help=f"transformer blocks (default {GPTConfig.layers}: enough for V schedules up to p=4)")
    model.add_argument("--hidden", type=positive_int, default=None, help=f"model width (default {GPTConfig.hidden})")
    model.add_argument("--heads", type=positive_int, default=None, help=f"attention heads (default {GPTConfig.heads})")
    model.add_argument("--kv-heads", type=positive_int, default=None,
                       help="key/value heads of grouped-query attention (llama, hf-llama; default: --heads)")
    model.add_argument("--vocab", type=positive_int, default=None,
                       help="the built-in model's vocabulary (default: the tokenizer's; 256 for bytes)")
    model.add_argument("--seq", type=positive_int, default=None,
                       help=f"tokens per sequence (default {GPTConfig.seq}; with --hf or --model, the smaller of "
                       f"{DEFAULT_OTHER_SEQ} and the model's context)")
    model.add_argument("--precision", default=None, choices=PRECISION_NAMES,
                       help="fp32 (default), fp64, or bf16-mixed (bfloat16 compute, float32 weights, optimizer "
                       "state, gradient sums and loss)")
    model.add_argument("--dtype", default=None, choices=("float32", "float64"),
                       help="the older name of --precision fp32 / fp64")
    model.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                       help="auto (default: CUDA when there is a GPU for every local rank, else the CPU), cpu, cuda")
    model.add_argument("--data", default=None, metavar="PATH",
                       help="a text or JSONL file, a token file (.bin) or a directory of them, or a datasets directory "
                       "(default: Python's own pydoc topics, no download)")
    model.add_argument("--tokenizer", default=None, metavar="DIR|tokenizer.json",
                       help="tokenize text with this tokenizer (default: the --hf directory's, else UTF-8 bytes)")
    model.add_argument("--data-field", default="text", metavar="NAME",
                       help="the JSONL (or datasets) field holding each document (default text)")
    model.add_argument("--data-dtype", default="uint16", choices=("uint16", "uint32"),
                       help="the element type of a pre-tokenized token file (default uint16)")


def _add_training_options(train: argparse._ArgumentGroup) -> None:
    train.add_argument("--microbatch-size", type=positive_int, default=TrainConfig.microbatch_size,
                       help=f"sequences per microbatch (default {TrainConfig.microbatch_size})")
    train.add_argument("--steps", type=positive_int, default=TrainConfig.steps,
                       help=f"optimizer steps in all (default {TrainConfig.steps})")
    train.add_argument("--lr", type=positive_float, default=None,
                       help=f"AdamW's peak learning rate (default {DEFAULT_LR:g} up to hidden {DEFAULT_LR_WIDTH}, then "
                       f"{DEFAULT_LR:g} x {DEFAULT_LR_WIDTH} / hidden: {default_lr(1024):.3g} at hidden 1024)")
    train.add_argument("--lr-schedule", default=None, choices=LR_SCHEDULES,
                       help="after the warm-up: constant, cosine or linear decay to --min-lr (default cosine; a "
                       "resumed run continues its checkpoint's schedule)")
    train.add_argument("--warmup-steps", type=nonneg_int, default=None, metavar="N",
                       help=f"linear warm-up to --lr over the first N steps (default: a tenth of --steps, at most "
                       f"{DEFAULT_WARMUP_CAP}; N < --steps)")
    train.add_argument("--min-lr", type=nonneg_float, default=None, metavar="X",
                       help="where cosine and linear decay end (default --lr / 10)")
    train.add_argument("--lr-decay-steps", type=positive_int, default=None, metavar="N",
                       help="the steps the schedule is made for (default --steps): the whole length, when this "
                       "run is to be continued with --resume and a larger --steps")
    train.add_argument("--held-out", type=nonneg_float, default=None, metavar="F",
                       help=f"the share of the data, at its end, that never trains (default {DEFAULT_HELD_OUT:g})")
    train.add_argument("--eval-every", type=nonneg_int, default=0, metavar="N",
                       help="the loss on the held-out windows every N steps and after the last (default 0: never)")
    train.add_argument("--metrics", default=None, metavar="FILE.jsonl",
                       help="one JSON line per step: loss, lr, tokens/s, step time, eval loss, memory "
                       "(pandas.read_json(FILE, lines=True))")
    train.add_argument("--seed", type=nonneg_int, default=TrainConfig.seed, help="weights and data order (default 0)")
    train.add_argument("--checkpoint", default=None, metavar="DIR", help="save per-rank checkpoints here")
    train.add_argument("--save-every", type=nonneg_int, default=0, metavar="N", help="also save every N steps")
    train.add_argument("--resume", action="store_true",
                       help="continue from the newest checkpoint intact on every rank in --checkpoint")
    train.add_argument("--overwrite", action="store_true",
                       help="a new run replaces the checkpoints already in --checkpoint (without it, it refuses)")
    train.add_argument("--clip-grad", type=positive_float, default=None, metavar="X",
                       help="clip gradients to global norm X over all ranks (default: no clipping; "
                       "non-finite steps are skipped either way)")
    train.add_argument("--step-barrier", action="store_true",
                       help="wait for the global norm check before the optimizer step instead of stepping "
                       "optimistically (no spare copy of the parameters and AdamW moments)")
    train.add_argument("--inject-nonfinite", type=int, default=None, metavar="STEP", help=argparse.SUPPRESS)
    train.add_argument("--timeout", type=positive_float, default=300.0, metavar="S",
                       help="stop the run when a wait makes no progress for S seconds: a receive, a collective, "
                       "or one step of a rank (start-up gets at least 60 s); a run that keeps completing steps "
                       "is never stopped (default 300). SIGTERM, SIGINT or SIGHUP stop every rank after one "
                       "common step, and any stop saves a checkpoint when --checkpoint is given")
    train.add_argument("--quiet", action="store_true", help="no per-step lines")


def _add_output_options(parser: argparse.ArgumentParser, out: argparse._ArgumentGroup) -> None:
    """The checks and outputs, and the asynchronous group (its own, before --plot in the help)."""
    out.add_argument("--verify", action="store_true",
                     help="run one step; compare loss and every gradient with one process; exit 1 beyond tolerance")
    out.add_argument("--dry-run", action="store_true",
                     help="print the schedule, predicted memory per rank (activations, static) and predicted time; "
                     "launch nothing")
    out.add_argument("--hardware", default=None, type=check_hardware_text, metavar="NAME|PROFILE.json",
                     help="--dry-run: predict pass times from this hardware (a `pipeblocks calibrate` profile, or a "
                     "preset) instead of timing them here; --emulate with --dp: its DP link (default a100's)")
    out.add_argument("--emulate", default=None, type=_emulate_arg, metavar="F_MS,B_MS,W_MS",
                     help="sleep F/B/W milliseconds per layer and microbatch instead of computing (times only)")
    out.add_argument("--report", default=None, metavar="FILE", help="write the measured-vs-simulated report as JSON")
    out.add_argument("--save-hf", default=None, metavar="DIR",
                     help="after the last step, write the trained model as a Hugging Face directory (config.json, "
                     "safetensors, tokenizer files) that transformers loads")
    add_mode_options(parser.add_argument_group("asynchronous (PipeDream, PipeMare)"),
                     what="--steps counts optimizer steps, --verify compares the run with "
                     "its one-process replay")
    out.add_argument("--plot", default=None, type=plot_file, metavar="FILE",
                     help="timeline plot, .png or .svg (default: beside --report, same name, .png)")


def run(args: argparse.Namespace) -> int:
    cfg, corpus = prepare_from_args(args)
    return training.execute(cfg, corpus, dry=args.dry_run, report=args.report, plot=args.plot, hardware=args.hardware)


def prepare_from_args(args: argparse.Namespace):
    """The run the options describe: (TrainConfig, training windows), every default resolved
    as `pipeblocks train` resolves it (benchmarks replay exactly what a user gets)."""
    # the runtime places the vocabulary passes by the run's own model (train.vocab_setup.vocab_costs);
    # the request's costs are unit costs, which know no vocabulary
    vocab_parallel = bool(getattr(args, "vocab_parallel", False))
    args = argparse.Namespace(**{**vars(args), "vocab_parallel": False})
    emulate = args.emulate
    async_mode = mode_from_args(args)
    precision = _precision(args.precision, args.dtype)
    # cost-aware generators see the emulated ratios (unit costs otherwise)
    costs = CostSpec(times=None if emulate is None else ",".join(map(str, emulate)), seq_split=args.seq_split,
                     hardware=args.hardware or CostSpec.hardware)
    # the asynchronous form exists for 1F1B (composition.REFUSALS names the ones that have one)
    default = ASYNC_DEFAULT_SCHEDULE if async_mode is not None else default_schedule()
    request = request_from_args(args, name=args.name or default, costs=costs)
    data = DataSpec(args.data, tokenizer=args.tokenizer, field=args.data_field, dtype=args.data_dtype)
    return training.prepare(
        request, model=model_from_args(args, precision), precision=precision, device=args.device, emulate=emulate,
        data=data, sizes=given_sizes(args), dry_run=args.dry_run, vocab_parallel=vocab_parallel,
        microbatch_size=args.microbatch_size, steps=args.steps, lr=args.lr, seed=args.seed,
        checkpoint=args.checkpoint, resume=args.resume, save_every=args.save_every, verify=args.verify,
        timeout_s=args.timeout, quiet=args.quiet, overwrite=args.overwrite, clip_grad=args.clip_grad,
        inject_nonfinite=args.inject_nonfinite, optimistic_step=not args.step_barrier, async_mode=async_mode,
        lr_schedule=args.lr_schedule, warmup_steps=args.warmup_steps, min_lr=args.min_lr,
        lr_decay_steps=args.lr_decay_steps, held_out=args.held_out,
        eval_every=args.eval_every, metrics=args.metrics, save_hf=args.save_hf,
    )


# the size options of the built-in models, by flag (argparse dest)
_SIZES = {"--layers": "layers", "--hidden": "hidden", "--heads": "heads", "--kv-heads": "kv_heads",
          "--vocab": "vocab"}


def given_sizes(args: argparse.Namespace) -> tuple[str, ...]:
    """The size options given on the command line (refused with --hf and --model)."""
    return tuple(flag for flag, dest in _SIZES.items() if getattr(args, dest) is not None)


def model_from_args(args: argparse.Namespace, precision: str):
    """The run's `ModelChoice`: a built-in family sized by the options, an --hf directory, or --model."""
    dtype = "float64" if precision == "fp64" else "float32"  # the weights' (bf16-mixed keeps float32 masters)
    if args.hf is not None or args.model is not None:
        if given_sizes(args):  # refused, with the fix, by the composition table: build nothing first
            return ModelChoice(HF_PREFIX + args.hf if args.hf else args.model, None, seq=args.seq or 1, dtype=dtype)
        return _other_model(args, dtype)
    family = FAMILIES[args.model_family or "gpt"]
    vocab = args.vocab if args.vocab is not None else _tokenizer_vocab(args.tokenizer)
    config = family.config(layers=args.layers or GPTConfig.layers, hidden=args.hidden or GPTConfig.hidden,
                           heads=args.heads or GPTConfig.heads, kv_heads=args.kv_heads, seq=args.seq or GPTConfig.seq,
                           vocab=vocab, dtype=dtype)
    return ModelChoice(family.name, config)


def _other_model(args: argparse.Namespace, dtype: str):
    weights = True
    if args.hf is not None:
        config = read_hf_config(Path(args.hf).expanduser().resolve())  # a bad directory fails here, in one line
        directory, context = config.directory, config.shape.context
        source = HF_PREFIX + directory
        # a prediction needs no weights: a config.json alone (or a directory without them) is priced as is
        weights = not args.dry_run or _has_weights(directory)
    else:
        source = portable_reference(args.model)
        context = ModelChoice(source, None, seq=1, dtype=dtype).shape.context
    seq = args.seq or min(DEFAULT_OTHER_SEQ, context or DEFAULT_OTHER_SEQ)
    return ModelChoice(source, None, seq=seq, dtype=dtype, weights=weights)


def _has_weights(directory: str) -> bool:
    from ..models.hf.weights import find_weights  # torch: the CLI's other commands must not import it

    try:
        find_weights(directory)
    except ValueError:
        return False
    return True


def _tokenizer_vocab(tokenizer: str | None) -> int:
    """A built-in model's default vocabulary: the tokenizer's (256 for bytes)."""
    if tokenizer is None:  # the data package imports torch: only `train` needs it
        from ..data import ByteTokenizer

        return ByteTokenizer.vocab_size
    from ..data.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer).vocab_size


def _precision(precision: str | None, dtype: str | None) -> str:
    """--precision, or its older name --dtype (not both, unless they agree); default fp32."""
    if dtype is not None and precision is not None and precision_policy(dtype).name != precision:
        raise ValueError(f"--dtype {dtype} and --precision {precision} disagree: give --precision alone")
    return precision or (precision_policy(dtype).name if dtype is not None else "fp32")


def _emulate_arg(text: str) -> tuple[float, float, float]:
    """--emulate F_MS,B_MS,W_MS: three finite milliseconds >= 0, parsed once, at parse time."""
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        values = []
    if len(values) != 3 or any(not math.isfinite(v) or v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected three milliseconds F_MS,B_MS,W_MS >= 0, e.g. 20,20,10")
    return (values[0], values[1], values[2])

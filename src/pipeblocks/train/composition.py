"""What composes with what in `pipeblocks train`: one table, checked before anything starts.

    >>> check_composition(Draft(async_mode="pipemare", tp=2))
    ValueError: --tp 2 with --async is not supported: asynchronous training runs without tensor parallelism; drop --tp (or --async)

A `Draft` is what the command asked for, before any model, schedule or process is built:
plain facts (numbers, names, flags). Each row of `REFUSALS` names the features it refuses
together and the sentence that says why and what to change, written from the draft's own
numbers; `check_composition` raises the first row whose features are all present. A new
option adds its feature to `Draft.features` and its rows here, and nowhere else.

The features (`Draft.features`):

    async       --async MODE                 tp          --tp > 1
    sharded     --dp > 1 or a sharding other than replicate
    seq-chunks  sequences cut into chunks (--seq-chunks, seq1f1b)
    mixed       --precision bf16-mixed       recompute   --recompute (or 1f1b-r)
    clip        --clip-grad                  verify      --verify
    emulate     --emulate                    checkpoint  --checkpoint
    resume      --resume                     save-every  --save-every > 0
    eval        --eval-every > 0             no-held-out --held-out 0
    dry-run     --dry-run                    save-hf     --save-hf
    sizes       --layers/--hidden/... given  hf          --hf DIR
    user-model  --model FILE.py:NAME (or a registered name)
    no-chunk-model  the model's adapter takes no sequence chunks
    no-tp-plan  the model has no tensor-parallel plan
    not-fsdp    a sharding policy FSDP2 does not run (replicate, zero1) with data parallelism
    no-async-form   the schedule has no asynchronous form
    tied        the model ties its head to its embedding
    no-export   the model has no Hugging Face form (its spec has no export)
    copies      --schedule dualpipe (two copies of every model stage)
    split       --split given (counts or auto)
    vocab       --vocab-parallel (the embedding and head split by vocabulary rows)
    no-vocab-model  a model whose vocabulary rows train does not split yet (all but the built-in Llama and --hf)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["Draft", "REFUSALS", "Refusal", "check_composition"]


@dataclass(frozen=True)
class Draft:
    """What a `pipeblocks train` command asked for (names and numbers, nothing built)."""

    async_mode: str | None = None
    schedule: str = ""
    tp: int = 1
    dp: int = 1
    sharding: tuple[str, ...] = ("replicate",)
    seq_chunks: int = 1
    precision: str = "fp32"
    recompute: bool = False
    clip_grad: float | None = None
    verify: bool = False
    emulate: bool = False
    checkpoint: bool = False
    resume: bool = False
    save_every: int = 0
    eval_every: int = 0
    held_out: float | None = None
    dry_run: bool = False
    save_hf: bool = False
    sizes: tuple[str, ...] = ()
    """the size options given (--layers, --hidden, ...), by their flags"""
    model: str = "gpt"
    """the model's source: a family name, hf:DIR, or a user's reference"""
    model_takes_chunks: bool = True
    model_has_tp_plan: bool = True
    model_tied: bool = False
    model_exports: bool = True
    """the model has a Hugging Face form (its spec's export)"""
    async_forms: tuple[str, ...] = ()
    """the schedules that have an asynchronous form"""
    fsdp_policies: tuple[str, ...] = ("zero2", "zero3")
    split: bool = False
    """--split given (counts or auto)"""
    vocab_parallel: bool = False
    """--vocab-parallel given"""

    @property
    def features(self) -> frozenset[str]:
        sharded = self.dp > 1 or any(p != "replicate" for p in self.sharding)
        flags = {
            "async": self.async_mode is not None, "tp": self.tp > 1, "sharded": sharded,
            "seq-chunks": self.seq_chunks > 1, "mixed": self.precision == "bf16-mixed", "recompute": self.recompute,
            "clip": self.clip_grad is not None, "verify": self.verify, "emulate": self.emulate,
            "checkpoint": self.checkpoint, "resume": self.resume, "save-every": self.save_every > 0,
            "eval": self.eval_every > 0, "no-held-out": self.held_out == 0, "dry-run": self.dry_run,
            "save-hf": self.save_hf, "sizes": bool(self.sizes), "hf": self.model.startswith("hf:"),
            "user-model": self.model not in ("gpt", "llama", "hf-llama") and not self.model.startswith("hf:"),
            "no-chunk-model": not self.model_takes_chunks, "no-tp-plan": not self.model_has_tp_plan,
            "not-fsdp": sharded and not set(self.sharding) <= set(self.fsdp_policies),
            "no-async-form": self.async_mode is not None and self.schedule not in self.async_forms,
            "tied": self.model_tied, "no-export": not self.model_exports,
            "copies": self.schedule == "dualpipe", "split": self.split,
            "vocab": self.vocab_parallel, "no-vocab-model": self.model != "llama" and not self.model.startswith("hf:"),
        }
        return frozenset(name for name, on in flags.items() if on)


@dataclass(frozen=True)
class Refusal:
    """Features that do not run together (`needs`: a feature that requires a missing one is
    written as ("x", "-y"): x present and y absent), and what to say."""

    features: tuple[str, ...]
    says: Callable[[Draft], str]

    def applies(self, present: frozenset[str]) -> bool:
        return all((f[1:] not in present) if f.startswith("-") else (f in present) for f in self.features)


def _sharding(d: Draft) -> str:
    return ",".join(sorted(set(d.sharding)))


REFUSALS: tuple[Refusal, ...] = (
    # ---- schedules ----------------------------------------------------------------------
    # DualPipe: each model stage is built twice (once per direction), its copies' gradients summed
    Refusal(("copies", "sharded"),
            lambda d: f"--schedule dualpipe with --dp {d.dp} --sharding {_sharding(d)} is not supported: its "
            "stage copies sum gradients over the pipeline's ranks only; use --dp 1 --sharding replicate, or "
            "--schedule dualpipev (no copies) with data parallelism"),
    Refusal(("copies", "tp"),
            lambda d: f"--schedule dualpipe with --tp {d.tp} is not supported: drop --tp, or use --schedule dualpipev"),
    Refusal(("copies", "async"),
            lambda d: "--schedule dualpipe with --async is not supported: its two directions step together; drop "
            "--async"),
    Refusal(("copies", "tied"),
            lambda d: f"--schedule dualpipe with model {d.model}, whose head is tied to its embedding, is not "
            "supported (each rank would hold the tied weight's two copies of two directions); use --schedule "
            "dualpipev, or a model without tied embeddings"),
    Refusal(("copies", "split"),
            lambda d: "--split with --schedule dualpipe is not supported: both directions cut the model by the even "
            "rule (docs/schedules.md, DualPipe); drop --split"),
    Refusal(("copies", "seq-chunks"),
            lambda d: f"--schedule dualpipe with --seq-chunks {d.seq_chunks} is not supported: drop --seq-chunks"),
    Refusal(("copies", "clip"),
            lambda d: "--clip-grad with --schedule dualpipe is not supported yet (the global norm would count both "
            "copies of every stage): drop --clip-grad"),
    Refusal(("copies", "emulate"),
            lambda d: "--emulate with --schedule dualpipe is not supported yet (emulated compute has one loss stage, "
            "DualPipe one per direction): drop --emulate, or emulate --schedule dualpipev"),
    Refusal(("copies", "checkpoint"),
            lambda d: "--checkpoint with --schedule dualpipe is not supported yet (a checkpoint would hold every "
            "model stage twice): drop --checkpoint/--resume, or train with --schedule dualpipev"),
    Refusal(("copies", "save-hf"),
            lambda d: "--save-hf with --schedule dualpipe is not supported yet: drop --save-hf, or train with "
            "--schedule dualpipev"),
    # ---- vocabulary parallelism: the runtime runs it with these, not yet with the others --
    Refusal(("vocab", "no-vocab-model"),
            lambda d: f"--vocab-parallel trains the built-in Llama and --hf models for now (one embedding before the "
            f"blocks, a norm then the head after them); model {d.model} is not split by vocabulary yet: use "
            "--model-family llama or --hf DIR, or drop --vocab-parallel"),
    Refusal(("vocab", "copies"),
            lambda d: "--vocab-parallel with --schedule dualpipe is not supported: its two directions have two first "
            "and two last stages; use --schedule dualpipev, zb-v or v-half"),
    Refusal(("vocab", "tp"),
            lambda d: f"--vocab-parallel with --tp {d.tp} is not supported: the rows are split over the pipeline ranks "
            "only; drop --tp or --vocab-parallel"),
    Refusal(("vocab", "async"),
            lambda d: "--vocab-parallel with --async is not supported: the vocabulary passes run inside a flushed "
            "step; drop --async or --vocab-parallel"),
    Refusal(("vocab", "seq-chunks"),
            lambda d: f"--vocab-parallel runs whole microbatches: drop --seq-chunks {d.seq_chunks} (or use a "
            "schedule without sequence chunks)"),
    Refusal(("vocab", "checkpoint"),
            lambda d: "--vocab-parallel with --checkpoint/--resume is not supported yet (a checkpoint would not hold "
            "the ranks' vocabulary rows): drop --checkpoint"),
    Refusal(("vocab", "save-hf"),
            lambda d: "--vocab-parallel with --save-hf is not supported yet (the export would not gather the "
            "vocabulary rows): drop --save-hf"),
    Refusal(("vocab", "eval"),
            lambda d: f"--vocab-parallel with --eval-every {d.eval_every} is not supported yet (evaluation runs "
            "stages that end in the head): drop --eval-every"),
    Refusal(("vocab", "dry-run"),
            lambda d: "--vocab-parallel with --dry-run is not supported yet (the dry run profiles stages with the "
            "embedding and head): use simulate --vocab-parallel --model ... to predict the step"),
    # ---- options that need another ----------------------------------------------------
    Refusal(("resume", "-checkpoint"), lambda d: "--resume needs --checkpoint DIR: the directory to resume from"),
    Refusal(("save-every", "-checkpoint"),
            lambda d: f"--save-every {d.save_every} needs --checkpoint DIR: where to save"),
    Refusal(("eval", "no-held-out"),
            lambda d: f"--eval-every {d.eval_every} with --held-out 0: no data is held out to evaluate on; give "
            "--held-out 0.05, say"),
    Refusal(("hf", "sizes"),
            lambda d: f"{', '.join(d.sizes)} with --hf: the model's sizes come from its config.json; drop "
            f"{', '.join(d.sizes)} (--seq and --microbatch-size set the run's shape)"),
    Refusal(("user-model", "sizes"),
            lambda d: f"{', '.join(d.sizes)} with --model {d.model}: the spec's shape sets the model's sizes; drop "
            f"{', '.join(d.sizes)} (--seq sets the run's sequence)"),
    # ---- asynchronous training ---------------------------------------------------------
    Refusal(("async", "dry-run"),
            lambda d: "--async with --dry-run is not supported yet: drop --dry-run (simulate 1f1b --async predicts "
            "the asynchronous steady state)"),
    Refusal(("async", "no-async-form"),
            lambda d: f"--async {d.async_mode}: schedule {d.schedule!r} has no asynchronous form; the schedules that "
            f"have one are {', '.join(d.async_forms)}: use --schedule {d.async_forms[0] if d.async_forms else '1f1b'}"),
    Refusal(("async", "mixed"),
            lambda d: f"--async with --precision {d.precision} is not supported yet (the modes' weight stashes and "
            "corrections are kept in the weights' own dtype): use --precision fp32 or fp64"),
    Refusal(("async", "sharded"),
            lambda d: f"--async with --dp {d.dp} or --sharding is not supported yet: use --dp 1 --sharding replicate"),
    Refusal(("async", "tp"),
            lambda d: f"--tp {d.tp} with --async is not supported: asynchronous training runs without tensor "
            "parallelism; drop --tp (or --async)"),
    Refusal(("async", "seq-chunks"), lambda d: "--async with sequence chunks is not supported: drop --seq-chunks"),
    Refusal(("async", "recompute"),
            lambda d: "--async with --recompute: the asynchronous backward recomputes its forward already (at the "
            "mode's weights); drop --recompute"),
    Refusal(("async", "clip"), lambda d: "--async with --clip-grad is not supported yet: drop --clip-grad"),
    Refusal(("async", "tied"),
            lambda d: "--async with a model whose head is tied to its embedding is not supported yet (each stage "
            "steps on its own, and the two copies of the tied weight would drift apart): train it synchronously"),
    Refusal(("async", "save-hf"),
            lambda d: "--async with --save-hf is not supported yet: save with --checkpoint, then export it with "
            "pipeblocks export --hf CHECKPOINT_DIR OUT_DIR"),
    # ---- one real step against one process ---------------------------------------------
    Refusal(("verify", "emulate"), lambda d: "--verify compares real training: drop --emulate"),
    Refusal(("verify", "checkpoint"),
            lambda d: "--verify runs one real step from the seed: drop --checkpoint and --resume"),
    Refusal(("verify", "mixed", "seq-chunks"),
            # measured: 3e-2 on a gradient (llama, zb-v, 2 chunks): another rounding, not an error
            lambda d: f"--verify under {d.precision} with --seq-chunks {d.seq_chunks}: chunks attend over the cached "
            "K/V of earlier chunks and sum their K/V gradients in bfloat16, a different rounding from one process on "
            "whole sequences, beyond bf16-mixed's tolerance; verify the chunked schedule in --precision fp64 (exact "
            "to 1e-10), or bf16-mixed without --seq-chunks"),
    # ---- sequence chunks ---------------------------------------------------------------
    Refusal(("seq-chunks", "emulate"),
            lambda d: f"--emulate does not run sequence chunks (schedule {d.schedule!r} has {d.seq_chunks}): drop "
            "--emulate or --seq-chunks"),
    Refusal(("seq-chunks", "no-chunk-model"),
            lambda d: f"model {d.model} cannot run sequence chunks (schedule {d.schedule!r} cuts sequences into "
            f"{d.seq_chunks}): its attention takes no K/V of earlier chunks; use --model-family llama or gpt, or drop "
            "--seq-chunks"),
    Refusal(("seq-chunks", "recompute"),
            lambda d: f"the runtime does not recompute sequence chunks (schedule {d.schedule!r} cuts sequences into "
            f"{d.seq_chunks}): a chunk's recomputation would append its K/V twice; drop --recompute (or use 1f1b "
            "instead of 1f1b-r) or --seq-chunks"),
    # ---- tensor parallelism ------------------------------------------------------------
    Refusal(("tp", "no-tp-plan"),
            lambda d: f"--tp {d.tp}: model {d.model} has no tensor-parallel plan (its ModelSpec.tp_plan is None): "
            "drop --tp, or give the spec a tp_plan (docs/your-model.md)"),
    Refusal(("tp", "seq-chunks"),
            lambda d: f"--tp {d.tp} with --seq-chunks {d.seq_chunks} is not supported: under tensor parallelism a "
            "stage's tokens are already split over the tp ranks (sequence parallelism); drop --seq-chunks (or --tp)"),
    Refusal(("tp", "clip"),
            lambda d: f"--clip-grad is not supported with --tp {d.tp} yet (the global norm over tensor-parallel "
            "shards): drop --clip-grad, or use --tp 1"),
    Refusal(("tp", "not-fsdp"),
            lambda d: f"--tp {d.tp} with --dp {d.dp} and sharding {_sharding(d)}: data parallelism over "
            "tensor-parallel stages runs through FSDP2; use --sharding zero2 or zero3 (or --dp 1 with replicate)"),
    # ---- data parallelism --------------------------------------------------------------
    Refusal(("sharded", "clip"),
            lambda d: "--clip-grad is not supported with data parallelism or sharding yet (the global norm over "
            "sharded and replicated gradients): drop --clip-grad, or use --dp 1 --sharding replicate"),
    # ---- exports -----------------------------------------------------------------------
    Refusal(("save-hf", "no-export"),
            lambda d: f"--save-hf: model {d.model} has no Hugging Face form (its ModelSpec has no export); --save-hf "
            "writes --hf models, hf-llama and llama (as LlamaForCausalLM): drop --save-hf, or give the spec an export"),
    Refusal(("save-hf", "emulate"),
            lambda d: "--save-hf with --emulate: emulated passes compute no gradients, so the weights written would "
            "be the starting ones; drop one of them"),
    Refusal(("save-hf", "verify"),
            lambda d: "--save-hf with --verify: a verification step is not kept; drop --save-hf"),
    Refusal(("eval", "emulate"),
            lambda d: f"--eval-every {d.eval_every} with --emulate: emulated compute learns nothing to evaluate; drop "
            "one of them"),
)


def check_composition(draft: Draft) -> None:
    """Raise ValueError with the first refusal of `REFUSALS` that the draft's features meet."""
    present = draft.features
    for refusal in REFUSALS:
        if refusal.applies(present):
            raise ValueError(refusal.says(draft))

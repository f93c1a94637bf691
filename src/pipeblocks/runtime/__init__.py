"""The runtime: runs a schedule's lowered Program on `torch.distributed`, one process per rank.

Stage module contract (what `PipelineRunner` expects of the modules it is given):

* A stage is an `nn.Module` that takes **one tensor** and returns **one tensor**.
* Stage 0 takes the token ids, `LongTensor[b, s]`; every other stage takes the previous
  stage's output (a floating tensor; it is given `requires_grad=True` by the runtime).
* The last stage returns logits `[b, s, V]`; `loss_fn(output, target) -> scalar tensor`
  turns them into the microbatch loss (a mean, so that the step loss, the mean over the m
  microbatch losses, matches one process on the whole batch).
* A stage's output must depend on its input (its input gradient is sent upstream), and
  shapes and dtypes must stay those of the first step (the shape pass fixes them).
* Modules must not keep tensors from one call to the next, and the runtime may call
  their forward on the "meta" device once to infer output shapes.

Sequence chunks (a schedule with `seq_chunks` = k > 1: seq1f1b, seq1f1b-i,
`split_sequence(name, ...)`; Seq1F1B, Sun et al. 2024):

* The runner cuts every microbatch's inputs and targets along dim 1 into k chunks of
  `seq_lengths` tokens (a runner argument: k lengths >= 1 summing to the sequence; default
  an even split). Tensors that cross between stages are [b, tokens, ...], cut the same way.
* It calls each stage once per (microbatch, chunk) as `module(x, chunk=c)`, where `c` is a
  `sequence.SequenceChunk`: `c.microbatch`, `c.index` (0..k-1), `c.count` (k), `c.offset`
  and `c.length` (x holds tokens [offset, offset+length)), `c.total` (tokens of the whole
  sequence), `c.stage`. Chunks of a microbatch go forward in order 0..k-1 and backward in
  reverse order, on every stage.
* Positions start at `c.offset`. Every attention layer gets its keys and values over
  positions 0..offset+length-1, and the causal mask for them, from
  `k_all, v_all, mask = c.kv(layer_name).extend(k, v)`, and attends with
  `scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)`. The keys and values
  are a view of one buffer per (stage, microbatch, layer), in reversed position order.
  The runner's K/V cache hands each earlier chunk's K/V gradient back to it when it runs
  its backward (fused BW, or B with W any time later), and frees a (stage, microbatch)'s
  cache when its chunk 0 has run its backward. A stage whose forward has no `chunk` keyword (no attention over earlier
  chunks) is refused when the runner is built, with a ValueError.
* `loss_fn` still returns the mean over the tokens it is given (one chunk); the runner
  weights it by length/total, then by 1/m, so the step's loss and gradients are those of
  training on whole sequences. The reported microbatch loss is the sum over its chunks.

Entry points:

    PipelineRunner(schedule, stages, loss_fn, *, rank=None, group=None, device=None,
                   timeout_s=300.0, optimizer=None, record_timeline=False, compute=None,
                   seq_lengths=None, data_parallel=None, program=None)
        .step(inputs, targets) -> StepResult
        # program=: a Program with OPTIMIZER_STEP ops (asynchronous training); its steps go to
        # compute.optimizer_step(stage, step) and one .step runs all of them
    mesh.init_mesh(pp, dp, device) -> PipelineMesh                     # ("pp", "dp") device mesh
    data_parallel.DataParallel(stages, policies, mesh.dp_mesh)           # per-chunk sharding, DP ops
        .optimizer(torch.optim.AdamW, lr=...)                           # one optimizer per chunk
    static_memory.predict_static_peak(program, rank, shapes, policies, ...)  # static bytes at the peak
    launch.spawn(fn, nprocs, *, args=(), timeout_s=600.0, ...) -> list   # fn(ctx, *args)
    launch.init_from_env(*, timeout_s=300.0, stop_signals=False) -> DistContext   # under torchrun
    ctx.control.step_done(k) -> bool      # after each step: True on every rank when the run is to stop
    emulate.EmulatedCompute(costs, ...)                                 # sleep instead of compute
    emulated_link.EmulatedLink(dp_model, stage_params)                 # DataParallel(link=...): modelled link times
    profile.profile_stage_memory(stages, inputs, loss_fn, target)       # M_B, M_W per stage
    profile.profile_stage_times(stages, inputs, loss_fn, target)        # F, B, W seconds per stage
"""
from .comm import PeerTimeoutError
from .executor import ActionError
from .launch import DistContext, RankFailedError, RunStoppedError, check_world, init_from_env, spawn
from .lifecycle import Interrupted
from .memory import SavedTensorTracker, StageMemory
from .profile import profile_chunk_memory, profile_stage_memory, profile_stage_times
from .runner import PipelineRunner, StepResult
from .sequence import KVCache, SequenceChunk
from .shapes import SpecMismatchError, TensorSpec

__all__ = [
    "ActionError", "DistContext", "Interrupted", "KVCache", "PeerTimeoutError", "PipelineRunner", "RankFailedError",
    "RunStoppedError", "SavedTensorTracker", "SequenceChunk", "SpecMismatchError", "StageMemory", "StepResult",
    "TensorSpec", "check_world", "init_from_env", "profile_chunk_memory", "profile_stage_memory", "profile_stage_times",
    "spawn",
]

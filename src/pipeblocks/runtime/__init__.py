"""The runtime: runs a schedule's lowered Program on `torch.distributed`, one process per rank.

Stage module contract (what `PipelineRunner` expects of the modules it is given):

* A stage is an `nn.Module`. What it returns, its *activation*, is a tensor, a tuple of
  tensors or a dict (str keys) of tensors (nesting allowed); the next stage receives the
  same structure: a tensor as its one argument, a tuple as positional arguments, a dict as
  keyword arguments. For example

      class Embed(nn.Module):                     # stage 0
          def forward(self, ids, *, mask):        # ids: the step inputs' microbatch
              return self.embed(ids) * mask[..., None], ids            # (float, int64)

      class Block(nn.Module):                     # a middle stage
          def forward(self, hidden, ids, *, mask):
              return self.layer(hidden, ids, mask), ids

      class Head(nn.Module):                      # the last stage
          def forward(self, hidden, ids, *, mask):
              return self.out(hidden)             # logits [b, s, V]

  (a stage returning `{"hidden": h, "keep": keep}` is called as `forward(hidden=h,
  keep=keep, mask=...)`). Every leaf crosses to the next rank as its own message.
* Stage 0 takes the step's inputs (`step(inputs, ...)`): a tensor (such as the token ids,
  `LongTensor[b, s]`) or a dict of tensors, split into m microbatches along dim 0, or a
  list of m microbatches, each a tensor, a tuple or a dict.
* Side inputs: `step(inputs, targets, side_inputs={"mask": mask, ...})` gives every stage's
  forward, on every rank, its microbatch's slice of each (split along dim 0, or a list of
  m) as keyword arguments. They are not sent between ranks: every rank must pass the same
  side inputs (each from its own data loader). A dict activation's keys must not be the
  names of side inputs, nor `chunk`.
* Gradients: only floating leaves carry one. The runtime gives every floating leaf of a
  stage's input (stages > 0) `requires_grad=True` and sends its gradient back (zeros if
  the stage's output does not depend on it); integer and boolean leaves (ids, masks) take
  none. A stage's backward starts from all its floating outputs that require grad, each
  with the gradient received for it.
* The last stage's output goes to `loss_fn(output, target) -> scalar tensor`, the
  microbatch loss (a mean, so that the step loss, the mean over the m microbatch losses,
  matches one process on the whole batch).
* A stage's output must depend on its floating inputs (their gradient is sent upstream),
  and the structure, shapes and dtypes of every activation must stay those of the first
  step: the shape pass fixes them (on the first microbatches of the first step), and an
  output that differs later is a SpecMismatchError on its rank, before it is sent, naming
  the stage, the microbatch and the leaf (`output[1]`, `output['mask']`). Pad to one shape.
* Modules must not keep tensors from one call to the next, and the runtime may call
  their forward on the "meta" device once to infer output shapes.

Sequence chunks (a schedule with `seq_chunks` = k > 1: seq1f1b, seq1f1b-i,
`split_sequence(name, ...)`; Seq1F1B, Sun et al. 2024):

* The runner cuts every microbatch's inputs and targets along dim 1 into k chunks of
  `seq_lengths` tokens (a runner argument: k lengths >= 1 summing to the sequence; default
  an even split); every tensor of a tuple or dict input is cut so. Tensors that cross
  between stages are [b, tokens, ...], cut the same way (the chunk lengths are read from
  dim 1 of an activation's first leaf). Side inputs are not cut: every chunk of a
  microbatch gets its whole side inputs (slice them with `c.offset` and `c.length`).
* It calls each stage once per (microbatch, chunk) as `module(x, chunk=c)` (with a tuple
  or dict activation and side inputs, as above, plus `chunk=c`), where `c` is a
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
        .step(inputs, targets, side_inputs=None) -> StepResult
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

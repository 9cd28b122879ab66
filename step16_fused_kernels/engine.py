"""The engine: ``LLMEngine`` takes requests and advances them one step at a time (vLLM's names).

Continuous batching over a paged KV cache: every ``step`` asks the ``Scheduler`` which requests run (from
the prompt blocks found in the prefix cache; n choices share one prefill), the ``ModelRunner`` runs them as
one flat batch (drafts verified: ``propose``), finished requests retire; ``step`` returns ids (engine_core).
Tensor parallelism: the engine is rank 0, its workers (worker.py) run every pass on the other shards.
Async scheduling (vLLM's ``async_scheduling``, SGLang's overlap scheduler): ``step`` N launches step N, then
processes step N-1's tokens while the GPU runs step N. A sequence of step N-1 counts its token in flight (a
placeholder) that its decode lane takes on the device; no position past its max_tokens-th token is scheduled,
one that a stop ends at N-1 may get one (its token dropped). A step after a penalised one waits for it.
"""

from __future__ import annotations

import contextlib
import sys
import weakref

from common.tokenizer import Tokenizer

from .block_manager import BlockManager
from .config import DEFAULT_TOKEN_BUDGET, EngineArgs
from .draft_model import DraftModelProposer
from .kv_cache import PagedKVCache
from .messages import EngineCoreOutput, SchedulerStats
from .model import GPT, kernels
from .model_runner import AsyncModelRunnerOutput, ModelRunner
from .ngram_proposer import NgramProposer
from .parallel_sampling import ParentRequest
from .parallel_state import SINGLE, backend, store_address, time_all_reduce
from .processor import Processor
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence
from .worker import Workers


class LLMEngine:
    """The generation engine, driven one step at a time.

    attention_backend: "triton" or "torch", as ``EngineArgs`` resolved it; the Triton kernels are compiled
    here, on a CUDA device, before the first request. Then, on a CUDA device and unless ``enforce_eager``,
    the decode step is captured in CUDA graphs (``ModelRunner.capture_cudagraphs``), with speculation the
    uniform verification step and a draft model's decode passes too (draft_model.py), with chunked prefill
    and the Triton kernel the mixed steps (prompts or chunks beside decodes) at token counts; on stderr.
    enable_prefix_caching: full blocks of computed tokens stay in the cache for later requests with the
    same prefix (block_manager.py); off, every prompt is computed whole.

    async_scheduling: overlap the host's work with the GPU's (the module's docstring): True, False, or None
    (on for a CUDA device); with False every step waits for its own tokens, as in step 7.
    speculative_config: drafts verified in one pass (spec_decode.py, rejection_sampler.py); a step that
    may speculate needs the accepted tokens of the step before, so it runs serially (async scheduling
    resumes while ``disable_by_batch_size`` turns drafting off).

    A request whose prompt and max_tokens do not fit in max_model_len (the context window, or the pool's
    tokens if fewer) is refused when it is made (``Processor.check_length``), as one that would pass the
    window is.

    The arguments are those of ``EngineArgs`` (config.py), by name or in its order, or one ``EngineArgs``
    already made (the command line's); it checks them before any weights load:
    raises ValueError on a bad argument; ConnectionError if a Hub model cannot be fetched. Raises
    ValueError, once the weights are loaded, if the KV-cache pool does not fit in the free memory.
    tensor_parallel_size t > 1: t - 1 worker processes are started (``Workers``) and must load their
    shards (else ValueError, with a worker's error); ``shutdown`` stops them (also at garbage collection).
    """

    def __init__(self, *engine_args, **kwargs):
        self.args = args = EngineArgs.make(*engine_args, **kwargs)
        self.async_scheduling = args.async_scheduling
        self.speculative = args.speculative  # a SpeculativeConfig, or None: off
        self.device, self.dtype = args.torch_device, args.torch_dtype
        self.attention_backend = args.attention_backend
        self.tokenizer = Tokenizer(args.folder)
        self.workers, tp = None, SINGLE
        if args.tensor_parallel_size > 1:  # the workers load their shards while this process loads its own
            self.workers = workers = Workers(args, *store_address())
            self._finalizer = weakref.finalize(self, workers.shutdown)
            workers.start()
            tp = workers.tp
        self.model = GPT.from_pretrained(str(args.folder), device=self.device, dtype=self.dtype, tp=tp)
        if self.workers is not None:
            self.workers.wait_loaded()
            self.workers.join()
        self.config = self.model.config
        self.proposer = None
        if self.speculative is not None and self.speculative.method == "ngram":
            self.proposer = NgramProposer(self.speculative)
        elif self.speculative is not None:  # "draft_model": its own pool, as many blocks as the target's
            self.proposer = DraftModelProposer(
                args.draft_folder,
                self.device,
                self.dtype,
                self.attention_backend,
                args.block_size,
                args.num_kv_blocks,
                args.max_num_seqs,
            )
        self.max_model_len = args.max_model_len  # tokens one request can reach, prompt included
        window, vocab = self.config.n_positions, self.config.vocab_size
        self.processor = Processor(self.tokenizer, vocab, window, self.max_model_len, args.max_num_seqs)
        # one block more than the block manager hands out: the scratch block, which padding lanes write to
        self.kv_cache = PagedKVCache(
            tp.heads_config(self.config),  # this rank's heads
            args.num_kv_blocks + 1,
            args.block_size,
            self.device,
            self.dtype,
            args.kv_cache_dtype,
            self.attention_backend,
        )
        self.block_manager = BlockManager(args.num_kv_blocks, args.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            args.max_num_seqs,
            args.max_num_batched_tokens,
            args.enable_chunked_prefill,
            args.long_prefill_token_threshold,
        )
        self.model_runner = ModelRunner(
            self.model,
            self.tokenizer,
            self.device,
            self.kv_cache,
            self.block_manager,
            self.attention_backend,
            args.max_num_seqs,
            args.max_num_batched_tokens,
            scratch_block=args.num_kv_blocks,
            num_speculative_tokens=self.speculative.num_speculative_tokens if self.speculative else 0,
            enable_chunked_prefill=args.enable_chunked_prefill,
            tp=tp,
            fused_max_batch=args.fused_max_batch,
        )
        draft = self.proposer if isinstance(self.proposer, DraftModelProposer) else None
        if self.attention_backend == "triton" and self.device.type == "cuda":  # compile before any request
            for config, pool in [(tp.heads_config(self.config), self.kv_cache)] + (
                [(draft.model.config, draft.kv_cache)] if draft else []
            ):
                kernels.warm_up(
                    config.n_head, config.head_dim, args.block_size, self.dtype, self.device, pool.cache_dtype
                )
        if self.workers is not None:  # what each of a step's all-reduces costs (the workers time them too)
            C, B, layers = self.config.n_embd, args.max_num_seqs, self.config.n_layer
            one, most = (time_all_reduce(tp, rows, C, self.dtype, self.device) for rows in (1, B))
            print(
                f"tensor parallel: {tp.world_size} ranks over {backend(self.device)}; an all-reduce of "
                f"[1, {C}] takes {one:.0f} us, of [{B}, {C}] {most:.0f} us; {2 * layers + 1} a step",
                file=sys.stderr,
            )
        # the decode step (and the uniform verification, the draft's decode passes) in CUDA graphs, after
        # the warm-up: no compiling in a capture
        if self.device.type == "cuda" and not args.enforce_eager:
            captured = self.model_runner.capture_cudagraphs()
            if draft:
                captured.append(("draft model, batch sizes", draft.capture_cudagraphs()))
            for what, stats in captured:
                print(
                    f"captured {len(stats.sizes)} CUDA graphs ({what} {', '.join(map(str, stats.sizes))}) "
                    f"in {stats.seconds:.2f} s, {stats.memory_bytes / 2**20:.0f} MiB of GPU memory",
                    file=sys.stderr,
                )
        print(f"scheduler: {describe_token_budget(args)}", file=sys.stderr)
        self.requests: dict[str, Sequence] = {}  # unfinished sequences by id (each choice of n > 1 has one)
        self.parents: dict[str, ParentRequest] = {}  # requests of n > 1 choices, until all have finished
        self.aborted: list[EngineCoreOutput] = []  # final outputs of aborted requests, for the next step
        self.in_flight: AsyncModelRunnerOutput | None = None  # the step launched, its tokens not yet read

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (``Workers.shutdown``); the engine is unusable after."""
        if self.workers is not None:
            self._finalizer()

    def add_request(
        self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams | None = None
    ) -> None:
        """Queue a request; ``prompt`` is a text or a list of token ids. Raises ValueError (see
        ``make_sequence``) before the request enters the queue."""
        self.add_sequence(self.make_sequence(request_id, prompt, sampling_params))

    def make_sequence(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        checked: bool = False,
    ) -> Sequence:
        """Tokenize and check one request (the core's own word: the frontend checked it first, with the
        same ``Processor``); queues nothing. checked: the token ids and parameters were made by that
        ``Processor`` in this process, with these limits (``InprocClient``): not checked again.

        Raises ValueError if the id is in use, or what ``Processor.process`` raises.
        """
        if not isinstance(request_id, str) or request_id in self.requests or request_id in self.parents:
            raise ValueError(f"request_id={request_id!r}: must be a string not used by an unfinished request")
        if checked:
            text, ids, params = None, prompt, sampling_params
        else:
            text, ids, params = self.processor.process(prompt, sampling_params)
        if any(f"{i}_{request_id}" in self.requests for i in range(1, params.n)):
            raise ValueError(f"request_id={request_id!r}: the ids of its choices are in use")
        return Sequence(request_id, text, ids, params, self.tokenizer, self.max_model_len, self.device)

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a sequence made by ``make_sequence`` (its other choices wait inside it)."""
        for choice in [seq, *seq.forks]:
            self.requests[choice.request_id] = choice
        if seq.parent is not None:
            self.parents[seq.request_id] = seq.parent
        self.scheduler.add(seq)

    def abort_request(self, request_id: str, index: int | None = None) -> None:
        """Drop a request (every unfinished choice, or only choice ``index``), waiting or running, and free
        its blocks at once; unknown or finished ids are ignored. Its final output (finish_reason "abort")
        comes out of the next ``step``; a token of it still in flight is dropped."""
        if request_id in self.parents:
            seqs = [
                seq
                for seq in self.parents[request_id].choices
                if not seq.finished and index in (None, seq.index)
            ]
        elif request_id in self.requests:
            seqs = [self.requests[request_id]]
        else:
            return
        for seq in seqs:
            self.scheduler.abort(seq)
            seq.finish("abort")
            self.retire(seq)
            self.aborted.append(seq.output())

    def retire(self, seq: Sequence) -> None:
        """Forget a finished sequence (and its request, once every choice has finished)."""
        del self.requests[seq.request_id]
        if self.proposer is not None:
            self.proposer.release(seq.request_id)
        if seq.parent is not None and seq.parent.finished:
            del self.parents[seq.parent.request_id]

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running (an aborted one's last output may still be due), or a
        step is in flight (the next ``step`` reads its tokens)."""
        return bool(self.requests or self.aborted) or self.in_flight is not None

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def stats(self) -> SchedulerStats:
        """Requests running and waiting, KV-cache blocks in use, preemptions, tokens in the last step."""
        return self.scheduler.make_stats()

    def step(self) -> list[EngineCoreOutput]:
        """``_step``; with tensor parallelism, a collective that failed because a worker died raises
        RuntimeError naming that worker, and so does every step after it (or after ``shutdown``)."""
        if self.workers is None:
            return self._step()
        if self.workers.failure is not None:
            raise RuntimeError(self.workers.failure)
        self.workers.busy = True
        try:
            return self._step()
        except RuntimeError as e:
            if (dead := self.workers.dead()) is not None:
                raise RuntimeError(dead) from e
            raise
        finally:
            self.workers.busy = False

    def _step(self) -> list[EngineCoreOutput]:
        """One iteration: schedule, launch one forward pass over the mixed batch and its sampling, then
        process the tokens of the step before (async scheduling) or of this one (serial): append them,
        retire the finished.

        Returns the outputs due (``Sequence.output``: one per sequence that got a token or was aborted, but
        for FINAL_ONLY requests that have not finished): with async scheduling, those of the step launched
        by the previous call; a call with nothing to schedule only reads the step in flight.
        """
        outputs, self.aborted = self.aborted, []
        speculating = self.speculating()
        if self.in_flight is not None and (
            speculating or any(uses_penalty(seq.params) for seq in self.in_flight.seqs)
        ):  # drafts (and a penalty) need every token on the host
            outputs += self.process_outputs(self.in_flight)
            self.in_flight = None
        if speculating:
            self.propose()
        with self.placeholders():  # the in-flight tokens count in their sequences' lengths
            scheduled = self.scheduler.schedule(drafted=speculating)
            # copy-on-write: a shared block is copied before this step writes into it
            self.kv_cache.copy_blocks(list(scheduled.blocks_to_copy.values()))
            launched = self.model_runner.launch(scheduled) if scheduled.seqs else None
            if scheduled.verifies and not launched.replayed:  # not a uniform step, or no graphs
                self.scheduler.spec.num_eager_verify_steps += 1
            if launched is not None:  # a step with prefills or chunks (or no graphs) runs eagerly
                self.scheduler.num_steps += 1
                self.scheduler.num_eager_steps += not launched.replayed
        previous, self.in_flight = self.in_flight, launched
        if previous is not None:  # the GPU runs the step just launched meanwhile
            outputs += self.process_outputs(previous)
        if (not self.async_scheduling or speculating) and self.in_flight is not None:  # serial: wait for them
            outputs += self.process_outputs(self.in_flight)
            self.in_flight = None
        return outputs

    def speculating(self) -> bool:
        """Whether this step drafts: speculation is on and the batch it would run (running, part-way and
        waiting requests, up to max_num_seqs: drafts take the token budget that admits the waiting) is below
        ``disable_by_batch_size``."""
        spec, scheduler = self.speculative, self.scheduler
        if spec is None:
            return False
        batch = len(scheduler.running) + len(scheduler.prefilling) + len(scheduler.waiting)
        batch = min(batch, scheduler.max_num_seqs)
        return spec.disable_by_batch_size is None or batch < spec.disable_by_batch_size

    def propose(self) -> None:
        """Draft the next tokens of every running sequence that may speculate (ngram_proposer.py,
        draft_model.py): k, or fewer where the window (max_model_len) leaves less room (the verification
        emits up to k + 1). Not cut at a sequence's max_tokens: what passes it is verified and dropped
        (``Sequence.append`` ends the sequence there), so that a step near the end of a request stays
        uniform (a CUDA graph)."""
        spec, running = self.speculative, self.scheduler.running
        seqs = [seq for seq in running if seq.params.logprobs is None and not uses_penalty(seq.params)]
        ks = [min(spec.num_speculative_tokens, self.max_model_len - len(seq) - 1) for seq in seqs]
        self.proposer.propose_all(seqs, ks)

    @contextlib.contextmanager
    def placeholders(self):
        """While scheduling and preparing a step: each unfinished sequence of the step in flight holds a
        placeholder (-1) for its token in flight at the end of ``token_ids``, so that its length, hence its
        position, slot and blocks, include that token. Only decodes hold one (a sequence preempted in this
        step is not readmitted in it), and a decode's input id is gathered on the device (input_batch.py):
        the placeholder's value is never read (an id of -1 would fail the embedding, loudly)."""
        seqs = [] if self.in_flight is None else [s for s in self.in_flight.seqs if not s.finished]
        for seq in seqs:
            seq.token_ids.append(PLACEHOLDER_TOKEN_ID)
        try:
            yield
        finally:
            for seq in seqs:
                seq.token_ids.pop()

    def process_outputs(self, launched: AsyncModelRunnerOutput) -> list[EngineCoreOutput]:
        """Wait for a launched step's tokens, append them to their sequences, retire the finished ones;
        returns the outputs due (``Sequence.output``). A sequence that finished (or was aborted) after that
        step was launched gets nothing: its token is one position past its end. A verified sequence appends
        its accepted drafts and the token after them, up to the first that finishes it (nothing after that
        one is kept, nor counted as accepted); its blocks past its new length, which held only rejected
        drafts, go back."""
        outputs = []
        for seq, token_id, token_logprobs in zip(launched.seqs, *launched.get_output()):
            if seq.finished:
                continue
            seq.append(token_id, token_logprobs)
            if (out := seq.output()) is not None:
                outputs.append(out)
            if seq.finished:  # leaves the batch now; its blocks are free for the next step
                # Its blocks may still be written by the step in flight; a later step that reuses them is
                # queued behind it on the same stream, so it reads and writes them only after that one.
                self.scheduler.finish(seq)
                self.retire(seq)
        for seq, (accepted, token_id) in zip(launched.verifies, launched.get_verified()):
            drafts, seq.spec_token_ids, seq.spec_probs = seq.spec_token_ids, [], None
            if seq.finished:
                continue
            for kept, new_id in enumerate(drafts[:accepted] + [token_id], 1):
                seq.append(new_id)
                if seq.finished:
                    break
            self.scheduler.spec.observe(len(drafts), min(kept, accepted))  # the drafts it keeps
            if not seq.finished:  # the blocks that held only rejected drafts go back
                self.block_manager.trim(seq.request_id, len(seq))
                self.model_runner.input_batch.trim(seq.request_id, self.block_manager.blocks_for(len(seq)))
                self.proposer.rollback(seq.request_id, len(seq) - 1)  # and the draft's rejected keys
            if (out := seq.output()) is not None:
                outputs.append(out)
            if seq.finished:
                self.scheduler.finish(seq)
                self.retire(seq)
        return outputs


def describe_token_budget(args: EngineArgs) -> str:
    """The step's token budget in words, as ``EngineArgs`` resolved it (printed at start-up)."""
    budget = f"max_num_batched_tokens {args.max_num_batched_tokens}"
    if not args.enable_chunked_prefill:
        return f"chunked prefill off, {budget} (a prompt is computed whole in the step that admits it)"
    kind, threshold = args.torch_device.type, args.long_prefill_token_threshold
    return (
        f"chunked prefill on, {budget} (the {kind} default is {DEFAULT_TOKEN_BUDGET[kind]}), "
        f"long_prefill_token_threshold {threshold or 'none'}"
    )


PLACEHOLDER_TOKEN_ID = -1  # a token in flight, in ``Sequence.token_ids`` while a step is scheduled


def uses_penalty(params: SamplingParams) -> bool:
    """Whether the sampler reads the request's output ids (a repetition, presence or frequency penalty)."""
    return (
        params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
    )

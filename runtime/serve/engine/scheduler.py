"""Continuous batching: which rows the next step of a BatchBackend (runtime/batch.py) carries.

At every step the scheduler
  1. admits waiting requests, oldest first, while the batch has room (``max_batch`` sequences) and
     the free KV pages can hold the front request's context (no overtaking: FIFO, so nobody starves);
     the backend's prefix cache may already hold the context's first pages (another request's
     identical system prompt, or this one's own pages from before it was preempted): those are
     mapped, not prefilled, and pages open sequences already hold cost nothing;
  2. builds one step: a decode row for every running sequence whose next token is known, then
     prefill chunks of the oldest admitted-but-unprefilled prompts, ``prefill_chunk`` tokens in all,
     within ``max_rows``. The chunk size is the knob between time to first token (a big chunk
     prefills a new prompt in fewer steps) and inter-token latency (every running sequence waits
     for the whole step, chunk included);
  3. asks the backend's KV manager for the step's slots (``KVManager.plan``: the plain BatchStep
     value, or None when the pages are not free); on None preempts the youngest running sequence
     (closes it, puts it back at the front of the queue; it recomputes prompt + generated tokens
     when readmitted) and plans again, so nobody fails for lack of pages and the oldest always
     progresses; then the backend runs the value;
  4. samples each row from its logits with its own parameters (greedy: argmax, lowest index on
     ties, the kernel's own rule, so a greedy row gives the tokens it gives alone; temperature /
     top_p / seed with its own seeded generator; top_k, penalties and logprobs through a
     sampling.RowSampler, only for the rows that ask), emits the token, retires rows that hit a
     stop token or max_tokens and closes their sequence at once. A row with a grammar (constrained
     decoding, constraints.py) picks from its logits with the tokens its llguidance matcher does not
     allow at -inf (the masks of the step's constrained rows computed together), advances the
     matcher with the token, and ends when the grammar is complete (COMPLETE); the other rows of the
     step do none of this.

The host cost of all this per step (everything but backend.step) is measured: ``stats``.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from zlc.reference.sampling import generator, sample
from zlc.runtime.batch import BatchBackend, pages_for
from zlc.runtime.kv_manager import BatchStep

from ..constraints import GrammarError, Grammars, masked
from ..protocol import EngineError, RequestFlag, ResultFlag
from ..rings import Request
from .sampling import MAX_TOP_LOGPROBS, RowSampler

Emit = Callable[..., None]  # (request_id, token, flags[, logprob])


@dataclass(eq=False)
class Job:
    """One request from admission to its LAST result."""

    request: Request
    order: int  # arrival order: the oldest has the smallest
    context: list[int]  # prompt + generated tokens
    prompt_len: int
    max_tokens: int
    temperature: float
    top_p: float
    generator: Any = None  # numpy Generator when sampled (zlc.reference.sampling.generator)
    sampler: RowSampler | None = None  # top_k, penalties, logprobs (None: none of them)
    prompt_logprobs: bool = False  # PROMPT_LOGPROBS: prompt rows of one token, each with its logits
    prompt_done: int = 0  # prompt positions whose PROMPT result is out (a preempted job does not repeat them)
    matcher: Any = None  # llguidance.LLMatcher of a GRAMMAR request: what it generated so far consumed
    seq: int | None = None  # the backend's sequence while admitted
    fed: int = 0  # context tokens in the sequence's KV cache

    @property
    def rid(self) -> int:
        return self.request.request_id

    @property
    def produced(self) -> int:
        return len(self.context) - self.prompt_len


@dataclass
class SchedulerStats:
    """Counters since start. host_ns: time in step() outside backend.step (admission, row building,
    sampling, results); backend_ns: time inside it."""

    steps: int = 0
    rows: int = 0
    host_ns: int = 0
    backend_ns: int = 0
    preemptions: int = 0
    prefix_hits: int = 0  # sequences opened with positions already in the prefix cache
    prefix_tokens: int = 0  # context tokens those hits did not prefill
    last_host_ns: int = 0
    last_backend_ns: int = 0


class Scheduler:
    def __init__(self, backend: BatchBackend, emit: Emit, *, eos: frozenset[int], vocab: int, max_batch: int = 8,
                 prefill_chunk: int = 64, log: Callable[[str], None] = lambda msg: None,
                 grammars: Grammars | None = None):
        """`grammars`: the model's tokenizer for llguidance (None: GRAMMAR requests are refused)."""
        self.backend, self.emit, self.eos, self.vocab, self.log = backend, emit, eos, vocab, log
        self.grammars = grammars
        self.max_batch = max(1, min(max_batch, getattr(backend, "max_seqs", max_batch)))
        self.prefill_chunk = max(1, min(prefill_chunk, backend.max_rows))
        self.budget_tokens = backend.pages_total * backend.page_size
        self.waiting: collections.deque[Job] = collections.deque()
        self.running: list[Job] = []  # admission order
        self.stats = SchedulerStats()
        self._order = 0
        self.served = 0

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # -- requests

    def submit(self, r: Request) -> None:
        """Queues `r`, or answers it at once when it cannot run (a one-line reason goes to the log)."""
        prompt = [int(t) for t in r.tokens]
        n, max_seq = len(prompt), self.backend.max_seq
        code, why = None, ""
        if not prompt:
            code, why = EngineError.BAD_REQUEST, "empty prompt"
        elif any(not 0 <= t < self.vocab for t in prompt):
            bad = next(t for t in prompt if not 0 <= t < self.vocab)
            code, why = EngineError.BAD_REQUEST, f"token id {bad} is outside the vocabulary (0..{self.vocab - 1})"
        elif n + max(r.max_tokens, 1) - 1 > max_seq:
            code, why = EngineError.BAD_REQUEST, (f"prompt ({n}) + max_tokens ({r.max_tokens}) exceed the bundle's "
                                                  f"max_seq={max_seq}")
        elif pages_for(n, self.backend.page_size) > self.backend.pages_total:
            code, why = EngineError.KV_BUDGET, (f"prompt ({n} tokens) exceeds the whole KV budget "
                                                f"({self.backend.pages_total} pages of {self.backend.page_size})")
        matcher = None
        if code is None and r.grammar is not None:
            try:
                if self.grammars is None:
                    raise GrammarError("this engine cannot constrain output (no tokenizer in the bundle, or no "
                                       "llguidance installed)")
                matcher = self.grammars.matcher(r.grammar)
            except GrammarError as e:
                code, why = EngineError.GRAMMAR, f"grammar: {e}"
        if code is not None:
            self.log(f"request {r.request_id}: {why}")
            self.emit(r.request_id, int(code), ResultFlag.ERROR | ResultFlag.LAST)
            return
        if r.max_tokens < 1:
            self.emit(r.request_id, 0, ResultFlag.LAST)
            return
        # The whole budget must hold the request alone (the last token needs no cache row): clip
        # max_tokens like the ingress clips it to max_seq; the reply ends as at max_tokens.
        max_tokens = min(r.max_tokens, self.budget_tokens - n + 1)
        # top_p 0 keeps only the most likely token: greedy (a nucleus of no mass would be empty).
        temperature = r.temperature if r.top_p > 0.0 else 0.0
        gen = None
        if temperature > 0.0:
            gen = generator(int(r.seed))
        prompt_lp = bool(r.flags & RequestFlag.PROMPT_LOGPROBS)
        sampler = RowSampler.of(int(r.top_k), float(r.frequency_penalty), float(r.presence_penalty),
                                bool(r.flags & RequestFlag.LOGPROBS) or prompt_lp,
                                min(int(r.top_logprobs), MAX_TOP_LOGPROBS))
        self._order += 1
        self.waiting.append(Job(r, self._order, prompt, n, max_tokens, temperature, r.top_p, gen, sampler,
                                prompt_lp, matcher=matcher))

    def cancel(self, request_id: int) -> bool:
        """Stops the request (its sequence and pages are freed now); False if it is not here."""
        for job in self.running:
            if job.rid == request_id:
                self._retire(job)
                self.emit(request_id, int(EngineError.CANCELLED), ResultFlag.ERROR | ResultFlag.LAST)
                return True
        for job in self.waiting:
            if job.rid == request_id:
                self.waiting.remove(job)
                self.emit(request_id, int(EngineError.CANCELLED), ResultFlag.ERROR | ResultFlag.LAST)
                return True
        return False

    # -- one step

    def step(self) -> bool:
        """One batched step; False when there was nothing to run."""
        t0 = time.perf_counter_ns()
        self._admit()
        rows, jobs, want = self._build()
        if not rows:
            return False
        kv = self.backend.kv_manager
        try:
            plan: BatchStep | None = kv.plan(rows, want)
            while plan is None:
                if len(self.running) == 1:  # cannot happen with max_tokens clipped to the budget
                    self._fail(self.running[0], EngineError.INTERNAL, f"out of KV pages while alone: "
                               f"{kv.shortage(rows)}")
                    return True
                self._preempt(max(self.running, key=lambda j: j.order))
                rows, jobs, want = self._build()
                if not rows:
                    return True
                plan = kv.plan(rows, want)
            tb = time.perf_counter_ns()
            logits = self.backend.run(plan)
            backend_ns = time.perf_counter_ns() - tb
        except Exception as e:  # a malformed step or an executor failure: these rows' requests end
            for job in jobs:
                self._fail(job, EngineError.INTERNAL, f"{type(e).__name__}: {e}")
            return True
        out = []
        for job, (_, ids), lg in zip(jobs, rows, logits, strict=True):
            job.fed += len(ids)
            if lg is not None:
                out.append((job, lg))
        constrained = [job for job, _ in out if job.matcher is not None and job.fed == len(job.context)]
        try:
            allowed = self._masks(constrained)
        except Exception as e:  # llguidance failed: those rows' requests end, the others go on
            for job in constrained:
                self._fail(job, EngineError.GRAMMAR, f"grammar: computing the mask failed: {type(e).__name__}: {e}")
            allowed, out = {}, [(job, lg) for job, lg in out if job not in constrained]
        for job, lg in out:
            self._produce(job, lg, allowed.get(job))
        st = self.stats
        st.steps += 1
        st.rows += sum(len(ids) for _, ids in rows)
        st.last_backend_ns = backend_ns
        st.last_host_ns = time.perf_counter_ns() - t0 - backend_ns
        st.backend_ns += backend_ns
        st.host_ns += st.last_host_ns
        return True

    def _admit(self) -> None:
        b = self.backend
        while self.waiting and len(self.running) < self.max_batch:
            job = self.waiting[0]
            if self.running:
                # Pages the running sequences still need for the context they already have, plus
                # the front request's: admitting beyond that would only be preempted again.
                # Pages of the front request's prefix that open sequences hold are shared for free;
                # cached ones leave pages_free as a computed page would.
                kv = b.kv_manager
                owed = sum(kv.slots_needed(j.seq, len(j.context) - j.fed) for j in self.running if j.seq is not None)
                _, shared = b.lookup(job.context)
                if owed + pages_for(len(job.context), b.page_size) - shared > b.pages_free():
                    return
            self.waiting.popleft()
            # prompt logprobs need every prompt position's logits: nothing from the prefix cache
            job.seq = b.open(job.context[:1] if job.prompt_logprobs else job.context)
            job.fed = b.length(job.seq)
            if job.fed:
                self.stats.prefix_hits += 1
                self.stats.prefix_tokens += job.fed
            self.running.append(job)

    def _build(self) -> tuple[list[tuple[int, list[int]]], list[Job], list[bool]]:
        rows: list[tuple[int, list[int]]] = []
        jobs: list[Job] = []
        want: list[bool] = []
        room = self.backend.max_rows
        for job in self.running:  # decode rows first: every running sequence moves each step
            if job.produced > 0 and job.fed == len(job.context) - 1 and room > 0:
                assert job.seq is not None
                rows.append((job.seq, [job.context[-1]]))
                jobs.append(job)
                want.append(True)
                room -= 1
        chunk = min(self.prefill_chunk, room)
        for job in sorted(self.running, key=lambda j: j.order):
            if chunk <= 0:
                break
            if job.produced > 0 and job.fed >= len(job.context) - 1:
                continue  # decoding
            assert job.seq is not None
            if job.prompt_logprobs and job.fed < job.prompt_len - 1:  # one prompt token, its logits
                rows.append((job.seq, job.context[job.fed:job.fed + 1]))
                jobs.append(job)
                want.append(True)
                chunk -= 1
                continue
            ids = job.context[job.fed:job.fed + chunk]
            rows.append((job.seq, ids))
            jobs.append(job)
            want.append(job.fed + len(ids) == len(job.context))
            chunk -= len(ids)
        return rows, jobs, want

    def _masks(self, jobs: list[Job]) -> dict[Job, np.ndarray]:
        """The tokens each constrained job's grammar allows next ([vocab] bool), in one call."""
        if not jobs:
            return {}
        assert self.grammars is not None  # a job has a matcher only when there are grammars
        return dict(zip(jobs, self.grammars.masks([j.matcher for j in jobs]), strict=True))

    def _produce(self, job: Job, logits: np.ndarray, allowed: np.ndarray | None = None) -> None:
        if job.fed < len(job.context):  # a prompt row of a PROMPT_LOGPROBS job: the next prompt token's logprob
            if job.fed > job.prompt_done and job.sampler is not None:
                lp, alternatives = job.sampler.logprobs_of(logits, job.context[job.fed])
                for alt, alt_lp in alternatives:
                    self.emit(job.rid, alt, ResultFlag.TOP, alt_lp)
                self.emit(job.rid, job.context[job.fed], ResultFlag.PROMPT, lp)
                job.prompt_done = job.fed
            return
        pick_from = logits
        if allowed is not None:  # constrained: the grammar's tokens only
            if not allowed[:logits.shape[0]].any():
                self._fail(job, EngineError.GRAMMAR, "grammar: no token of the model's vocabulary is allowed next")
                return
            pick_from = masked(logits, allowed)
        if job.sampler is not None:
            self._produce_with(job, job.sampler, logits, pick_from)
            return
        if job.generator is None:
            tok = int(np.argmax(pick_from))  # the first maximum: the lowest id on ties
        else:
            tok = sample(pick_from, job.temperature, job.top_p, job.generator)
        done = self._advance(job, tok)
        if done is not None:
            self.emit(job.rid, tok, self._append(job, tok, done))

    def _produce_with(self, job: Job, sampler: RowSampler, logits: np.ndarray, pick_from: np.ndarray) -> None:
        """_produce for a row with options: its token from the adjusted logits, and with logprobs
        the alternatives (TOP results) before the token's own result, which carries its logprob
        (both of the model's own logits, before any grammar mask)."""
        tok = sampler.pick(pick_from, job.temperature, job.top_p, job.generator)
        done = self._advance(job, tok)
        if done is None:
            return
        if not sampler.logprobs:
            self.emit(job.rid, tok, self._append(job, tok, done))
            return
        lp, alternatives = sampler.logprobs_of(logits, tok)
        for alt, alt_lp in alternatives:
            self.emit(job.rid, alt, ResultFlag.TOP, alt_lp)
        self.emit(job.rid, tok, self._append(job, tok, done), lp)

    def _advance(self, job: Job, tok: int) -> int | None:
        """Feeds `tok` to the job's matcher: COMPLETE when the grammar is then complete, 0 when it
        goes on (or the job has none), None when the matcher failed (the job has ended with an error)."""
        m = job.matcher
        if m is None:
            return 0
        if not m.consume_token(tok):
            self._fail(job, EngineError.GRAMMAR, f"grammar: the matcher refused token {tok}: {m.get_error()}")
            return None
        return ResultFlag.COMPLETE if m.is_stopped() and tok not in self.eos else 0

    def _append(self, job: Job, tok: int, flags: int = 0) -> int:
        """Adds `tok` to the job's context; its result's flags (the job retired when LAST)."""
        job.context.append(tok)
        if tok in self.eos:
            flags |= ResultFlag.EOS
        if flags or job.produced >= job.max_tokens:
            flags |= ResultFlag.LAST
            self._retire(job)
            self.served += 1
        return flags

    def _retire(self, job: Job) -> None:
        self.running.remove(job)
        if job.seq is not None:
            self.backend.close(job.seq)
            job.seq = None

    def _preempt(self, job: Job) -> None:
        """Frees `job`'s pages; it goes back to the front of the queue and recomputes its context."""
        self._retire(job)
        job.fed = 0
        self.waiting.appendleft(job)
        self.stats.preemptions += 1

    def _fail(self, job: Job, code: EngineError, why: str) -> None:
        self.log(f"request {job.rid}: {why}")
        self._retire(job)
        self.emit(job.rid, int(code), ResultFlag.ERROR | ResultFlag.LAST)

    def close(self) -> None:
        """Ends every sequence (the engine is stopping)."""
        for job in list(self.running):
            self._retire(job)
